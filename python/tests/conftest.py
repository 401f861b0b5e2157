import pytest

import pinstream


def _gpu_reason():
    try:
        if pinstream.device_count() > 0:
            return None
        return "no CUDA device"
    except pinstream.NoDeviceError as e:
        return f"no CUDA device: {e}"


GPU_REASON = _gpu_reason()

needs_gpu = pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")


def make_jpegs(folder, n, seed=0, side=(96, 400)):
    """``n`` JPEGs in ``folder`` of sizes drawn from ``side``, random blocks of colour with
    noise (not flat, not zeros): ``[(path, index)]``."""
    import os

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    items = []
    for i in range(n):
        h, w = int(rng.integers(*side)), int(rng.integers(*side))
        small = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)
        img = np.kron(small, np.ones((8, 8, 1), np.uint8))[:h, :w]
        img = np.clip(img.astype(np.int16) + rng.integers(-20, 21, img.shape), 0, 255).astype(np.uint8)
        path = os.path.join(str(folder), f"img{i:04d}.jpg")
        Image.fromarray(img).save(path, quality=90)
        items.append((path, i))
    return items


@pytest.fixture(autouse=True, scope="session")
def _sigint_raises_keyboard_interrupt():
    """The Ctrl-C tests send a real SIGINT and expect ``KeyboardInterrupt``. A process started
    with SIGINT ignored (a background job of a non-interactive shell, ``nohup``, some CI
    runners) keeps it ignored, and Python installs no handler: the signal did nothing, a
    schedule waited for it until its watchdog ended the whole run, and the report was lost. The
    session installs Python's handler where none is, and puts the old disposition back."""
    import signal

    old = signal.getsignal(signal.SIGINT)
    if old is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if old is not signal.default_int_handler and old is not None:
            signal.signal(signal.SIGINT, old)
