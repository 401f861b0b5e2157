import os
import subprocess
import sys
import textwrap

import pytest

import pinstream

#: CPython 3.11.7 and earlier: a fork made while another thread makes or ends its thread state
#: can leave the interpreter's lock of thread states held in the child, which then hangs in
#: ``PyOS_AfterFork_Child`` (python/cpython#112275, fixed in later releases). Seen here once in
#: 30 to 150 runs of test_process.py's concurrent forks on 3.11.7: gdb in the hung helper showed
#: ``_PyThreadState_DeleteExcept`` waiting for that lock, before any pinstream code ran.
FORK_HEAD_LOCK_BUG = sys.version_info[:3] < (3, 11, 8)


def _gpu_reason():
    try:
        if pinstream.device_count() > 0:
            return None
        return "no CUDA device"
    except pinstream.NoDeviceError as e:
        return f"no CUDA device: {e}"


GPU_REASON = _gpu_reason()

needs_gpu = pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")


def make_jpegs(folder, n, seed=0, side=(96, 400), subsampling=None):
    """``n`` JPEGs in ``folder`` of sizes drawn from ``side``, random blocks of colour with
    noise (not flat, not zeros): ``[(path, index)]``. ``subsampling``: Pillow's (0: 4:4:4, 2:
    4:2:0, its default for ``None``)."""
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
        extra = {} if subsampling is None else {"subsampling": subsampling}
        Image.fromarray(img).save(path, quality=90, **extra)
        items.append((path, i))
    return items


@pytest.fixture(autouse=True)
def _no_kept_ring():
    """Each test starts without a ring kept from an earlier test's DataLoader
    (``worker_ring.KEEP_RING``): which of its batches come in a slot is its own."""
    wr = sys.modules.get("pinstream.worker_ring")
    if wr is not None:
        wr.release_kept()
    yield


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


def spawn(src, timeout):
    """Runs ``src`` in a fresh interpreter with this one's module path and unbuffered output (a
    deadlock, a signal handler or a GIL state there cannot touch the test run). A hang fails the
    test with what the child printed, after ``timeout`` seconds. Returns the
    ``CompletedProcess``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), PYTHONUNBUFFERED="1")
    try:
        return subprocess.run([sys.executable, "-c", src], capture_output=True, text=True,
                              timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"HUNG: no exit within {timeout} s\nstdout: {out[-2000:]}\nstderr: {err[-2000:]}")


def run_child(code, timeout=60, prelude=""):
    """``prelude`` and ``code`` (dedented) in :func:`spawn`. Fails on a crash (a signal), a
    non-zero exit, or a child that did not print ``ok`` at its end; a ``skip: why`` line makes
    the test skip."""
    r = spawn(prelude + textwrap.dedent(code), timeout)
    for line in r.stdout.splitlines():
        if line.startswith("skip:"):
            pytest.skip(line[5:].strip())
    if r.returncode != 0 or "ok" not in r.stdout.split():
        how = f"signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
        pytest.fail(f"child failed ({how})\nstdout: {r.stdout[-3000:]}\nstderr: {r.stderr[-3000:]}")
    return r
