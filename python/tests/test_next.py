"""`Prefetcher.__next__` with a batch that has already arrived takes it without letting the GIL
go (letting it go hands it to a loader thread waiting for it, and taking it back waits for that
thread's turn, in a training loop at the moment its GPU has the least queued); while it waits,
it lets the GIL go as before. Dry runs: no GPU needed, the same `__next__`."""

import itertools
import textwrap
import threading
import time

import numpy as np
import pytest

import pinstream
from conftest import spawn

RNG = np.random.default_rng()
MEAN, STD = pinstream.IMAGENET


def items(n, seen=None):
    out = [(RNG.integers(0, 256, (2, 3, 5, 7), dtype=np.uint8), np.arange(2, dtype=np.int64) + 10 * i)
           for i in range(n)]

    def gen():
        for i, it in enumerate(out):
            if seen is not None:
                seen.append(i)
            yield it

    return out, gen()


def reference(px):
    x = px.astype(np.float64).transpose(0, 2, 3, 1)
    return ((x - np.array(MEAN)) / np.array(STD)).transpose(0, 3, 1, 2)


class Spinner:
    """A thread that stamps the time whenever it holds the GIL, giving it back after each stamp,
    so it runs whenever another thread lets the GIL go. Waiting longer than the switch interval,
    it asks the holder for the GIL; a holder that lets it go then waits until this thread has
    taken it (CPython's forced switching), so a release is never missed."""

    def __init__(self):
        self.stamps = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stop.is_set():
            self.stamps.append(time.perf_counter())
            time.sleep(0)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()

    def ran_during_next(self, it):
        """Whether this thread ran while ``next(it)`` ran, and the item. Everything happens in
        one call into C, with no Python bytecode (where a switch request is honoured) in it: a
        20-million-step skip (``islice`` over ``repeat``: this thread's request is pending by its
        end), the time, ``it.__next__`` (pinstream's, native), the time again. This thread can
        run between the two times only if ``it.__next__`` lets the GIL go."""
        self.stamps.clear()
        now = itertools.starmap(time.perf_counter, [()])
        then = itertools.starmap(time.perf_counter, [()])
        n = 20_000_000
        t0, item, t1 = list(itertools.islice(
            itertools.chain(itertools.repeat(None, n), now, itertools.islice(it, 1), then), n, None))
        return any(t0 < s < t1 for s in list(self.stamps)), item


def test_a_batch_that_has_arrived_is_taken_holding_the_gil():
    n = 8
    want, gen = items(n)
    p = pinstream.prefetch(gen, dry_run=True, normalize=pinstream.IMAGENET, loader_threads=2, depth=2)
    kept = 0
    with Spinner() as s:
        for i in range(n):
            # Time for the loaders (the sleep lets the GIL go): the next batch arrives meanwhile.
            time.sleep(0.2)
            ran, (px, lb) = s.ran_during_next(p)
            kept += not ran
            np.testing.assert_allclose(px, reference(want[i][0]), rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(lb, want[i][1])
        with pytest.raises(StopIteration):
            next(p)
        with pytest.raises(StopIteration):
            next(p)
    # Every call should keep it; a batch late on a loaded machine is waited for the old way.
    assert kept >= n - 2, f"{kept} of {n} calls kept the GIL"


def test_a_batch_not_there_yet_is_waited_for_with_the_gil_let_go():
    """The same check the other way round (it sees a release): the loader holds the second
    item back until the main thread waits for it."""
    release = threading.Event()

    def slow():
        yield np.zeros((1, 3, 2, 2), np.uint8) + 1, np.arange(1)
        release.wait(60)  # the GIL let go here
        yield np.zeros((1, 3, 2, 2), np.uint8) + 2, np.arange(1)

    p = pinstream.prefetch(slow(), dry_run=True, dtype="uint8", loader_threads=1, depth=1)
    with Spinner() as s:
        assert next(p)[0].ravel()[0] == 1
        threading.Timer(0.3, release.set).start()
        ran, item = s.ran_during_next(p)
        assert item[0].ravel()[0] == 2
        assert ran, "the wait held the GIL"
        assert list(p) == []


def test_close_from_another_thread_while_batches_are_ready():
    n = 50
    want, gen = items(n)
    p = pinstream.prefetch(gen, dry_run=True, dtype="uint8", loader_threads=2, depth=2)
    got = []
    closer = None
    for i, (px, _) in enumerate(p):
        np.testing.assert_array_equal(px, want[i][0])
        got.append(i)
        if i == 5:
            closer = threading.Thread(target=p.close)
            closer.start()
            closer.join(60)
        time.sleep(0.01)
    assert not closer.is_alive()
    assert got == list(range(len(got))) and 6 <= len(got) <= n
    with pytest.raises(StopIteration):
        next(p)


def _child(code, timeout=90):
    """Runs ``code`` in a fresh interpreter (what it does to signals, threads or the GIL stays
    there); a hang is a failure, not a hung test run."""
    r = spawn(textwrap.dedent(code), timeout)
    return r.returncode, r.stdout + r.stderr


def test_ctrl_c_reaches_a_consumer_written_in_c():
    """``list(p)`` of an endless source never runs bytecode between batches, which are always
    there: ``next()`` itself looks for a pending signal before it takes one."""
    rc, out = _child("""
        import os, signal, threading, time
        import numpy as np
        import pinstream

        def endless():
            i = 0
            while True:
                yield np.full((1, 3, 2, 2), i % 251, np.uint8), np.arange(1)
                i += 1

        p = pinstream.prefetch(endless(), dry_run=True, dtype="uint8", loader_threads=2, depth=2)
        next(p)
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            import collections
            collections.deque(p, maxlen=0)
        except KeyboardInterrupt:
            p.close()
            print("INTERRUPTED")
    """)
    assert rc == 0 and "INTERRUPTED" in out, out


@pytest.mark.parametrize("call", ["next", "close"])
def test_an_errors_str_that_calls_next_or_close_does_not_hang(call):
    """The text of the iterable's exception is made on the loader thread: its ``__str__`` is the
    iterable's code, where ``next()`` and ``close()`` are refused rather than waited for."""
    rc, out = _child(f"""
        import numpy as np
        import pinstream

        holder = {{}}

        class Boom(Exception):
            def __str__(self):
                try:
                    {"next(holder['p'])" if call == "next" else "holder['p'].close()"}
                except Exception as e:
                    return "boom, and " + type(e).__name__
                return "boom"

        def src():
            for i in range(6):
                if i == 3:
                    raise Boom()
                yield np.full((1, 3, 2, 2), i, np.uint8), np.arange(1)

        p = pinstream.prefetch(src(), dry_run=True, dtype="uint8", loader_threads=1, depth=1)
        holder["p"] = p
        n = 0
        try:
            for _ in p:
                n += 1
        except pinstream.LoaderError as e:
            print("LOADER_ERROR", e.batch, n, isinstance(e.__cause__, Boom))
        p.close()
    """)
    assert rc == 0 and "LOADER_ERROR 3 3 True" in out, out


def test_the_end_of_the_data_waits_for_nothing_holding_the_gil():
    """At the end of the data the feeder has stopped, and a spare slot an export hands back is
    refused: its drop waits for its last users on the GPU. That drop must not happen in
    ``next()``, which holds the GIL: a host function queued on torch's stream that needs the GIL
    (what CuPy's ``launch_host_func`` does) would then never run (a deadlock)."""
    from conftest import GPU_REASON

    if GPU_REASON is not None:
        pytest.skip(GPU_REASON)
    pytest.importorskip("torch")
    rc, out = _child("""
        import ctypes, time
        import numpy as np
        import torch
        import pinstream.torch as pt

        n = 12
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); torch.cuda._sleep(int(2e7)); b.record(); b.synchronize()
        long = int(2e7 / (a.elapsed_time(b) / 1e3))  # about 1 s of GPU time
        cuda = ctypes.CDLL("libcuda.so.1")
        HOSTFN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
        ran = []
        cb = HOSTFN(lambda _: ran.append(1))  # ctypes takes the GIL to run it
        cuda.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, HOSTFN, ctypes.c_void_p]
        data = [(np.full((4, 3, 32, 32), i, np.uint8), np.arange(4) + 10 * i) for i in range(n)]
        for back in (2, 3, 4, 5):
            it = iter(pt.prefetch(iter(data), dtype=torch.uint8))
            x, y = next(it)
            sums = []
            for i in range(1, n):
                if i - 1 == n - back:
                    torch.cuda._sleep(long)
                    assert cuda.cuLaunchHostFunc(torch.cuda.current_stream().cuda_stream, cb, None) == 0
                sums.append(x.float().sum())
                time.sleep(0.3 if i == n - 1 else 0.02)  # the last batch there: the fast path
                x, y = next(it)
            sums.append(x.float().sum())
            assert list(it) == []
            torch.cuda.synchronize()
            assert [int(s.item()) for s in sums] == [k * 4 * 3 * 32 * 32 for k in range(n)]
        assert len(ran) == 4
        print("NO_DEADLOCK")
    """, timeout=120)
    assert rc == 0 and "NO_DEADLOCK" in out, out


def test_every_slot_kept_is_an_error_that_does_not_end_the_iteration():
    """Keeping more batches than the prefetcher's slots (depth + export spares) is refused with
    an error that says to release one and call ``next()`` again; doing so goes on with the next
    batch, nothing lost (before, the error closed the prefetcher and the rest was gone)."""
    from conftest import GPU_REASON

    if GPU_REASON is not None:
        pytest.skip(GPU_REASON)
    torch = pytest.importorskip("torch")
    import gc

    import pinstream.torch as pt

    data = [(RNG.integers(0, 256, (2, 3, 8, 8), dtype=np.uint8), np.arange(2) + 10 * i) for i in range(12)]
    p = pt.prefetch(iter(data), dtype=torch.uint8, depth=2)
    kept, seen = [], []
    refused = 0
    while len(seen) < len(data):
        try:
            x, y = next(p)
        except pinstream.InvalidArgumentError as e:
            assert "release one" in str(e)
            refused += 1
            assert refused < 100
            del kept[0]  # one batch released: its slot goes back
            gc.collect()
            continue
        except StopIteration:
            break
        i = len(seen)
        assert torch.equal(x.cpu(), torch.from_numpy(data[i][0])), i
        assert torch.equal(y.cpu(), torch.from_numpy(data[i][1])), i
        seen.append(i)
        kept.append((x, y))
    assert seen == list(range(len(data))) and refused > 0
    assert list(p) == []
