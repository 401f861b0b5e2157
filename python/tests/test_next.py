"""`Prefetcher.__next__` with a batch that has already arrived takes it without letting the GIL
go (letting it go hands it to a loader thread waiting for it, and taking it back waits for that
thread's turn, in a training loop at the moment its GPU has the least queued); while it waits,
it lets the GIL go as before. Dry runs: no GPU needed, the same `__next__`."""

import itertools
import threading
import time

import numpy as np
import pytest

import pinstream

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
