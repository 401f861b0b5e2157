"""Issue 29, findings 1 and 7, from Python: how pinstream gives back device memory a consumer
releases.

- A consumer that lent its own stream for the handover (``__dlpack__(stream=S)``), queued a read
  there, destroyed S and made new streams (the driver hands S's handle out again) before
  releasing: the memory must not be reused before the read has run.
- A release with no stream (``stream=-1``) must not wait for the device in the deleter, which
  runs holding the GIL: it stalled behind other streams' work, and deadlocked against a queued
  host callback that needs the GIL.

Skipped without a GPU or without CuPy (the consumer here)."""

import textwrap

import numpy as np
import pytest

import pinstream

from conftest import spawn, needs_gpu

pytestmark = needs_gpu

RNG = np.random.default_rng()

# A kernel that holds its stream for about `cycles` clock cycles (one thread), and the same
# with a matrix-multiply chain where CuPy cannot compile kernels.
SPIN = r"""
import cupy as cp
import numpy as np

def hold(cycles):
    try:
        k = cp.RawKernel('''
        extern "C" __global__ void spin(long long cycles) {
            long long t0 = clock64();
            while (clock64() - t0 < cycles) { }
        }''', 'spin')
        k((1,), (1,), (np.int64(cycles),))
    except Exception:
        a = cp.random.random((4096, 4096), dtype=cp.float32)
        for _ in range(max(1, cycles // 5_000_000)):
            a = a @ a
            a /= cp.linalg.norm(a)
"""


def _child(code, timeout=300):
    """Runs `code` in a fresh interpreter (a deadlock there cannot hang pytest)."""
    r = spawn(SPIN + "\n" + textwrap.dedent(code), timeout)
    if r.returncode == 77:
        pytest.skip(r.stdout.strip() or "child skipped")
    assert r.returncode == 0, f"child failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r.stdout


def test_lent_stream_destroyed_before_release_does_not_free_early():
    pytest.importorskip("cupy")
    out = _child(
        """
        import gc
        import pinstream
        n = 16 * 2**20
        rng = np.random.default_rng()
        x = rng.integers(1, 2**32 - 1, n, dtype=np.uint32)
        t = pinstream.upload(x, 0)
        s = cp.cuda.Stream(non_blocking=True)
        handle = s.ptr
        with s:
            a = cp.from_dlpack(t)        # __dlpack__(stream=s.ptr)
            hold(600_000_000)            # ~0.3 s on the consumer's stream, then
            got = a.copy()               # the read, queued behind it
        del s                            # destroyed with the read still queued
        gc.collect()
        fresh = [cp.cuda.Stream(non_blocking=True) for _ in range(16)]
        reused = any(f.ptr == handle for f in fresh)
        del a                            # the release
        gc.collect()
        poison = np.full(n, 0x5A5A5A5A, np.uint32)
        keep = [pinstream.upload(poison, 0) for _ in range(4)]
        cp.cuda.Device(0).synchronize()
        bad = int((cp.asnumpy(got) != x).sum())
        print("reused", reused, "bad", bad)
        assert bad == 0, f"{bad} of {n} elements read wrong (handle reused: {reused})"
        """
    )
    assert "bad 0" in out


def test_no_stream_release_does_not_wait_under_the_gil():
    pytest.importorskip("cupy")
    _child(
        """
        import threading
        import pinstream
        rng = np.random.default_rng()
        x = rng.standard_normal(1 << 20).astype(np.float32)
        t = pinstream.upload(x, 0)

        class NoStream:
            # A consumer that synchronises itself: asks for the tensor with stream=-1.
            def __init__(self, t):
                self.t = t
            def __dlpack__(self, stream=None, **kw):
                return self.t.__dlpack__(stream=-1, **kw)
            def __dlpack_device__(self):
                return self.t.__dlpack_device__()

        a = cp.from_dlpack(NoStream(t))
        assert bool((cp.asnumpy(a) == x).all())
        ran = threading.Event()
        other = cp.cuda.Stream(non_blocking=True)
        with other:
            hold(2_000_000_000)          # ~1 s of other work on the device, then
        # a host callback that needs the GIL (Python code).
        other.launch_host_func(lambda _: ran.set(), None)
        del a                            # the release, on this thread, holding the GIL
        assert not ran.is_set(), "the deleter waited for the device's other work"
        assert ran.wait(120), "the host callback never ran"
        """
    )
