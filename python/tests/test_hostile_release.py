"""Hostile review of the reworked DLPack releases (issue 29 findings 1, 7, 8) from Python.

Each trial runs in a fresh interpreter with a watchdog (a hang there cannot hang pytest):

- a training loop whose consumer (CuPy on its own stream: the stream is lent, so every release
  is deferred to the reaper) releases every prefetched batch before asking for the next must
  never be told that the batches were not released;
- the interpreter exits with releases still queued in the reaper (mid device wait);
- a forked child (DataLoader workers fork by default on Linux) releases a tensor it inherited
  while a parent thread hammers the release path.

Skipped without a GPU or without CuPy."""

import textwrap

import pytest

from conftest import spawn, needs_gpu

pytestmark = needs_gpu


def _child(code, timeout=180):
    return spawn(textwrap.dedent(code), timeout)


def test_prefetch_loop_with_lent_stream_consumer_never_told_unreleased():
    pytest.importorskip("cupy")
    r = _child(
        """
        import numpy as np, cupy as cp, pinstream
        rng = np.random.default_rng(0)
        data = [(rng.integers(0, 256, (4, 3, 32, 32), dtype=np.uint8),
                 np.arange(4, dtype=np.int64)) for _ in range(300)]
        s = cp.cuda.Stream(non_blocking=True)
        n = 0
        with s:
            for x, y in pinstream.prefetch(data, depth=1):
                a = cp.from_dlpack(x)      # __dlpack__(stream=s.ptr): lent, release deferred
                b = cp.from_dlpack(y)
                c = (a * 2).sum()          # the step
                del a, b, c                # released before next()
                n += 1
        print("batches", n)
        """
    )
    assert r.returncode == 0 and "batches 300" in r.stdout, (
        f"BROKE ({r.returncode}):\n{r.stdout}\n{r.stderr[-3000:]}"
    )


def test_interpreter_exit_with_queued_releases():
    pytest.importorskip("cupy")
    for _ in range(4):
        r = _child(
            """
            import numpy as np, cupy as cp, pinstream
            k = cp.RawKernel('''extern "C" __global__ void spin(long long c) {
                long long t0 = clock64(); while (clock64() - t0 < c) {} }''', 'spin')
            other = cp.cuda.Stream(non_blocking=True)
            with other:
                k((1,), (1,), (np.int64(1_000_000_000),))
            x = np.arange(1 << 16, dtype=np.float32)
            keep = [pinstream.upload(x, 0) for _ in range(200)]
            class NoStream:
                def __init__(self, t): self.t = t
                def __dlpack__(self, stream=None, **kw): return self.t.__dlpack__(stream=-1, **kw)
                def __dlpack_device__(self): return self.t.__dlpack_device__()
            arrs = [cp.from_dlpack(NoStream(t)) for t in keep]
            del arrs                     # 200 releases queued behind ~0.5 s of other work
            print("exiting")
            """
        )
        assert r.returncode == 0 and "exiting" in r.stdout, (
            f"BROKE ({r.returncode}):\n{r.stdout}\n{r.stderr[-3000:]}"
        )


def test_forked_child_releases_inherited_tensor():
    pytest.importorskip("cupy")
    r = _child(
        """
        import os, signal, threading, time
        import numpy as np, cupy as cp, pinstream
        x = np.arange(1 << 12, dtype=np.float32)
        class NoStream:
            def __init__(self, t): self.t = t
            def __dlpack__(self, stream=None, **kw): return self.t.__dlpack__(stream=-1, **kw)
            def __dlpack_device__(self): return self.t.__dlpack_device__()
        stop = False
        def hammer():
            while not stop:
                a = cp.from_dlpack(NoStream(pinstream.upload(x, 0)))
                del a
        th = threading.Thread(target=hammer, daemon=True)
        th.start()
        hung = crashed = 0
        for _ in range(60):
            a = cp.from_dlpack(NoStream(pinstream.upload(x, 0)))
            pid = os.fork()
            if pid == 0:
                signal.alarm(10)
                del a                    # the child's release (no reaper thread here)
                os._exit(0)
            del a
            _, st = os.waitpid(pid, 0)
            if os.WIFSIGNALED(st):
                if os.WTERMSIG(st) == signal.SIGALRM:
                    hung += 1
                else:
                    crashed += 1
        stop = True
        print("hung", hung, "crashed", crashed)
        """,
        timeout=300,
    )
    assert r.returncode == 0 and "hung 0 crashed 0" in r.stdout, (
        f"BROKE ({r.returncode}):\n{r.stdout}\n{r.stderr[-3000:]}"
    )
