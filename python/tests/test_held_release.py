"""Held arrays of recycled batches (``zero_copy``, a ``pin_memory`` DataLoader's page-locked
tensors, ring views) are released in the next turn, which holds the GIL already, rather than
by a loader thread taking the GIL once more a batch; Python code that a release runs on a
loader thread (a finalizer) cannot wait for its own prefetcher."""

import weakref

import numpy as np
import pytest

import pinstream

from conftest import needs_gpu
from test_hostile import run_child

MODES = [
    pytest.param(True, id="dry_run"),
    pytest.param(False, id="device", marks=needs_gpu),
]

N = 40


def host(x):
    return x if isinstance(x, np.ndarray) else pinstream.download(x)


def arrays(seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (2, 3, 6, 5), dtype=np.uint8) for _ in range(N)]


@pytest.mark.parametrize("dry", MODES)
def test_held_arrays_are_released_and_none_is_lost(dry):
    """Every batch comes through intact, the held arrays stay bounded while the prefetcher
    runs, they are released in the turns (``stats()["released"]``), not where the batch is
    refilled, and all are let go once it is closed."""
    data = arrays(None)
    alive = []
    most = 0

    def gen():
        nonlocal most
        for a in data:
            b = a.copy()  # a fresh array each item, referenced by nobody else
            alive.append(weakref.ref(b))
            most = max(most, pinstream.memory_stats()["held_arrays"])
            yield b

    depth, loaders = 2, 2
    pf = pinstream.prefetch(gen(), dtype="uint8", zero_copy=True, depth=depth,
                            loader_threads=loaders, dry_run=dry)
    got = [host(x) for x in pf]
    assert len(got) == N
    for i, (g, d) in enumerate(zip(got, data)):
        assert np.array_equal(g, d), f"batch {i} differs"
    st = pf.stats()
    # Bounded by the batches in flight and those put aside for a turn, never by the count.
    assert most <= 2 * (depth + loaders) + 4, most
    assert st["released"] >= N - 2 * (depth + loaders) - 4, st
    pf.close()
    del pf
    assert pinstream.memory_stats()["held_arrays"] == 0
    assert sum(r() is not None for r in alive) == 0, "arrays still held after close"


@needs_gpu
def test_page_locked_tensors_are_released_after_their_dma():
    """A ``pin_memory`` DataLoader's page-locked tensors go with one DMA each; put aside only
    once that DMA has finished, each is released with its contents intact until then."""
    torch = pytest.importorskip("torch")
    data = arrays(None)

    def gen():
        for a in data:
            yield torch.from_numpy(a.copy()).pin_memory()

    pf = pinstream.prefetch(gen(), dtype="uint8", zero_copy=True, depth=2, loader_threads=2)
    got = [host(x) for x in pf]
    assert len(got) == N and all(np.array_equal(g, d) for g, d in zip(got, data))
    st = pf.stats()
    assert st["direct"] == N, st
    assert st["released"] > 0, st
    pf.close()
    del pf
    assert pinstream.memory_stats()["held_arrays"] == 0


@pytest.mark.parametrize("dry", MODES)
@pytest.mark.parametrize("how", ["zero_copy", "fresh"])
def test_a_finalizer_run_by_the_release_may_not_wait_for_the_prefetcher(dry, how):
    """A held array's release runs its finalizer on a loader thread: in the next turn
    (``zero_copy``), or after the copy (``fresh``). One that calls ``next()`` or ``close()`` on
    the prefetcher is refused (an ``InvalidArgumentError``), as from the iterable's own code,
    and the iteration goes on. Before, such a call waited for the very loader thread that ran
    it (a hang), or made that thread join itself (a panic, "Resource deadlock avoided")."""
    run_child(
        f"""
        import weakref
        errors = []
        holder = {{}}

        def finalizer():
            pf = holder.get("pf")
            if pf is None:
                return
            for call in (lambda: next(pf), pf.close):
                try:
                    call()
                    errors.append("returned")
                except Exception as e:
                    errors.append(type(e).__name__)

        def make(i):
            a = np.full((2, 3, 4, 4), i, np.uint8)
            if i == 3:
                weakref.finalize(a, finalizer)
            return a

        def gen():
            for i in range(30):
                yield make(i)  # no reference left here: the prefetcher's is the last

        pf = pinstream.prefetch(gen(), dtype="uint8", {how}=True, depth=1, loader_threads=1,
                                dry_run={dry!r})
        holder["pf"] = pf
        got = []
        for x in pf:
            got.append(int((x if isinstance(x, np.ndarray) else pinstream.download(x))[0, 0, 0, 0]))
        assert got == list(range(30)), got
        assert errors == ["InvalidArgumentError"] * 2, errors
        holder.clear()
        print("ok")
        """,
        timeout=90,
    )
