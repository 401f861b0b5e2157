"""Hostile trials of issue 30 (a restructuring that must not change behaviour) from Python: the
deferred releases became boxed closures run by a background thread (``src/deferred.rs``), and
the page-locked pool's blocks compute their requested bytes from their length
(``memory/pool/block.rs``). A download is a page-locked pool block handed to numpy through
DLPack with no stream (a host consumer): its release is deferred. Arrays released from many
threads at once must all give their blocks back (``empty_cache`` waits for the deferred
releases first), with the data intact until then.

GPU tests are skipped without a device; the CPU one runs everywhere."""

import gc
import threading

import numpy as np
import pytest

import pinstream
from conftest import GPU_REASON, needs_gpu


def test_hostile30_empty_cache_and_stats_without_a_gpu_are_typed_or_quiet():
    """Without a device the helpers that wait for deferred releases either work (nothing to
    wait for) or raise pinstream's typed errors: never hang, never a foreign exception."""
    if GPU_REASON is None:
        pytest.skip("a GPU is present: covered by the GPU test below")
    for f in (lambda: pinstream.empty_cache(0), lambda: pinstream.memory_stats(0)):
        try:
            f()
        except pinstream.PinstreamError:
            pass


@needs_gpu
def test_hostile30_downloads_released_from_threads_give_every_block_back():
    n = 1 << 18
    src = np.arange(n, dtype=np.float32)
    x = pinstream.upload(src)
    pinstream.empty_cache(0)
    base = pinstream.memory_stats(0).get("pinned_in_use_bytes", 0)
    # A pinstream.Tensor is handed over once (its memory moves to the consumer): each download
    # takes a fresh upload (a second download of the same one is refused: checked at the end).
    arrays = [pinstream.download(x)] + [pinstream.download(pinstream.upload(src)) for _ in range(47)]
    for a in arrays:
        assert np.array_equal(a, src)
    del a  # the loop's variable would keep the last array (and its block) alive
    held = pinstream.memory_stats(0)["pinned_in_use_bytes"]
    assert held >= base + 48 * n * 4, (base, held)
    chunks = [arrays[i::8] for i in range(8)]
    del arrays
    barrier = threading.Barrier(8)
    errors = []

    def drop(chunk):
        try:
            barrier.wait(30)
            # Read once more, then release: the data must be intact until the release.
            for a in chunk:
                assert np.array_equal(a, src)
            chunk.clear()
            gc.collect()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=drop, args=(c,)) for c in chunks]
    del chunks
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    gc.collect()
    # Waits for the deferred releases, then trims.
    pinstream.empty_cache(0)
    after = pinstream.memory_stats(0)["pinned_in_use_bytes"]
    assert after == base, f"pinned bytes still in use after every download was released: {after} (base {base})"
    # And the pool serves again with the right data.
    assert np.array_equal(pinstream.download(pinstream.upload(src)), src)
    # A second download of a tensor already handed over is refused, typed.
    with pytest.raises(pinstream.InvalidArgumentError, match="already handed"):
        pinstream.download(x)
