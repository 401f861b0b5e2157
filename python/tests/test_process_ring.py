"""``pinstream.prefetch(loader, process=True)`` with the workers' ring: the DataLoader is
iterated in a helper process whose workers write the training process's ring; only their small
messages pass through the helper.

Checked here: order and content (tuples, samples stacked into the ring), how many batches came
in the ring, the default choice of this mode, a worker's error, an ``iter()`` that raises (from
``prefetch()`` itself), the random state after each epoch's ``iter()`` (the same order, worker
seeds and later draws as an iteration in this process, for both ``process=True`` modes), a
helper killed, closing early and from another thread (nothing left behind). Dry runs (CPU) and,
where there is one, a GPU. No test measures time; waits that could hang run in a child process
with a limit.
"""

import gc
import multiprocessing
import time

import numpy as np
import pytest

import pinstream

from test_dataloader import host, labels, pixels
from test_hostile import run_child

torch = pytest.importorskip("torch")

import pinstream.worker_ring as wr  # noqa: E402
from test_worker_ring import (  # noqa: E402
    MODES,
    Batches,
    Samples,
    _fds,
    _maps_ring,
    loader,
    readers,  # noqa: F401 - a fixture
    sample_loader,
    stack_small,  # noqa: F401 - a fixture
)

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def children_gone(limit=30.0):
    """Waits (a watchdog, not a speed bound) until this process has no child left."""
    deadline = time.monotonic() + limit
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not multiprocessing.active_children()


@pytest.mark.parametrize("dry", MODES)
@pytest.mark.parametrize("threads,slow", [(1, False), (3, True)])
def test_process_ring_keeps_order_and_content(dry, threads, slow, readers):
    n = 40
    p = pinstream.prefetch(loader(Batches(n, extra=True)), dtype="uint8", process=True,
                           loader_threads=threads, dry_run=dry)
    got = 0
    for i, (x, y, tag, extra) in enumerate(p):
        if slow and i % 5 == 0:
            time.sleep(0.05)  # the workers fill every free slot meanwhile
        assert np.array_equal(host(x), pixels(i)), i
        assert np.array_equal(host(y), labels(i)), i
        assert tag == f"b{i}"
        assert isinstance(extra, torch.Tensor) and extra.tolist() == [i, i]
        got += 1
    assert got == n
    (r,) = readers
    assert r._process is True  # noqa: SLF001 - the mode chosen by default
    # Every batch came in a slot: those the workers made before the ring existed were copied
    # into one by the helper (none comes whole but one that waited 2 s for a slot).
    assert r.in_ring >= n - 1, (r.in_ring, r.usual)
    assert r.in_ring + r.usual == n
    if not dry:
        st = p.stats()
        assert st["direct"] == n and st["copied_after"] == 0
    p.close()
    assert children_gone()


@pytest.mark.parametrize("dry", MODES)
@pytest.mark.parametrize("form", ["tuple", "dict", "item"])
def test_process_ring_stacks_samples_as_the_loader_collates(dry, form, readers, stack_small):
    n = 3 * 14 + 1
    want = list(sample_loader(Samples(n, form)))
    p = pinstream.prefetch(sample_loader(Samples(n, form)), dtype="uint8", process=True,
                           dry_run=dry)
    got = 0
    for i, a in enumerate(p):
        b = want[i]
        got += 1
        if form == "item":
            a, b = [a], [b]
        elif form == "dict":
            assert list(a) == list(b) == ["label", "image", "name"], i
            a, b = [a["image"], a["label"], a["name"]], [b["image"], b["label"], b["name"]]
        assert np.array_equal(host(a[0]), b[0].numpy()), i
        for u, v in zip(a[1:], b[1:]):
            if isinstance(v, torch.Tensor):
                u = u.numpy() if isinstance(u, torch.Tensor) else host(u)
                assert np.array_equal(u, v.numpy()), i
            else:
                assert u == v, i
    assert got == len(want) == 15
    r = readers[0]
    assert r.in_ring >= 14 and r.stacked >= 3, (r.in_ring, r.stacked, r.usual)
    p.close()


def test_process_ring_is_the_default_for_a_plain_dataloader_and_can_be_turned_off(readers):
    p = pinstream.prefetch(loader(Batches(6)), dtype="uint8", process=True, dry_run=True)
    assert sum(1 for _ in p) == 6
    p.close()
    assert len(readers) == 1 and readers[0]._process is True  # noqa: SLF001
    # worker_ring=False: the helper copies the batches into its own ring, as before.
    p = pinstream.prefetch(loader(Batches(6)), dtype="uint8", process=True, worker_ring=False,
                           dry_run=True)
    for i, (x, _) in enumerate(p):
        assert np.array_equal(host(x), pixels(i))
    p.close()
    assert len(readers) == 1
    # A subclass stays with the helper's own ring (its __iter__ may change the batches).
    class Sub(torch.utils.data.DataLoader):
        pass

    p = pinstream.prefetch(Sub(Batches(6), batch_size=None, num_workers=2), dtype="uint8",
                           process=True, dry_run=True)
    assert sum(1 for _ in p) == 6
    p.close()
    assert len(readers) == 1
    assert children_gone()


@pytest.mark.parametrize("dry", MODES)
def test_process_ring_worker_error_is_a_loader_error(dry):
    p = pinstream.prefetch(loader(Batches(20, fail_at=12)), dtype="uint8", process=True,
                           dry_run=dry)
    got = 0
    with pytest.raises(pinstream.LoaderError) as e:
        for i, (x, _) in enumerate(p):
            assert np.array_equal(host(x), pixels(i)), i
            got += 1
    assert got == 12
    assert "no sample 12" in str(e.value) + str(e.value.__cause__)
    p.close()
    assert children_gone()


class RefusingSampler(torch.utils.data.Sampler):
    def __init__(self):
        pass

    def __len__(self):
        return 4

    def __iter__(self):
        raise ValueError("this sampler refuses")


@pytest.mark.parametrize("ring", [None, False], ids=["worker_ring", "own_ring"])
def test_process_iter_error_is_raised_by_prefetch(ring):
    # As iter() of the loader in this process would: from prefetch() itself, and no helper
    # is left behind.
    dl = torch.utils.data.DataLoader(Batches(4), batch_size=None, num_workers=2,
                                     sampler=RefusingSampler())
    with pytest.raises(ValueError, match="this sampler refuses"):
        pinstream.prefetch(dl, dtype="uint8", process=True, worker_ring=ring, dry_run=True)
    gc.collect()
    assert children_gone()


class Indexed(torch.utils.data.Dataset):
    """Sample ``i``: an image of ``i``, ``i`` and a draw of torch's RNG in the worker (seeded
    from the loader's base seed, drawn at ``iter()``)."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.full((3, 4, 4), i, dtype=torch.uint8), i, int(torch.randint(1 << 30, ()))


def _epochs(process, ring, generator=False, epochs=3):
    torch.manual_seed(7)
    g = None
    if generator:
        g = torch.Generator()
        g.manual_seed(11)
    dl = torch.utils.data.DataLoader(Indexed(), batch_size=4, num_workers=2, shuffle=True,
                                     generator=g)
    out = []
    for _ in range(epochs):
        p = pinstream.prefetch(dl, dtype="uint8", process=process, worker_ring=ring,
                               dry_run=True)
        out.append([(int(a), int(b)) for _, y, d in p for a, b in zip(np.asarray(y), d)])
        p.close()
    after = float(torch.rand(()))
    gen_after = None if g is None else float(torch.rand((), generator=g))
    return out, after, gen_after


@pytest.mark.parametrize("generator", [False, True], ids=["global", "loader_generator"])
@pytest.mark.parametrize("ring", [None, False], ids=["worker_ring", "own_ring"])
def test_process_draws_as_an_iteration_here(ring, generator):
    """Each epoch's helper is a new fork of this process: without the states its iter()
    changed set here, every epoch repeated the first one's order and worker seeds."""
    here = _epochs(False, False, generator)
    there = _epochs(True, ring, generator)
    orders = [[s[0] for s in e] for e in here[0]]
    assert orders[0] != orders[1] != orders[2]  # the reference shuffles anew each epoch
    assert there == here


@pytest.mark.parametrize("dry", [True, False], ids=["dry_run", "device"])
def test_process_ring_helper_killed_is_a_loader_error_not_a_hang(dry):
    if not dry:
        pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("no GPU")
    run_child(
        f"""
        import multiprocessing, signal, torch
        class Endless(torch.utils.data.Dataset):
            def __len__(self): return 1 << 20
            def __getitem__(self, i):
                return torch.full((2, 3, 4, 4), i % 251, dtype=torch.uint8), torch.arange(2)
        dl = torch.utils.data.DataLoader(Endless(), batch_size=None, num_workers=2)
        p = pinstream.prefetch(dl, dtype="uint8", process=True, dry_run={dry!r})
        next(p)
        (helper,) = [c for c in multiprocessing.active_children() if c.name == "pinstream-helper"]
        os.kill(helper.pid, signal.SIGKILL)
        try:
            for _ in range(100_000):
                next(p)
            raise SystemExit("no error")
        except pinstream.LoaderError as e:
            assert "helper process" in str(e.__cause__), e.__cause__
        p.close()
        print("ok")
        """,
        timeout=120,
    )


@pytest.mark.parametrize("dry", MODES)
def test_process_ring_early_exit_leaves_nothing_behind(dry):
    before = _fds()
    for _ in range(3):
        p = pinstream.prefetch(loader(Batches(50)), dtype="uint8", process=True, dry_run=dry)
        for i, (x, _) in enumerate(p):
            assert np.array_equal(host(x), pixels(i))
            if i == 15:
                break
        p.close()
        del p, x
        gc.collect()
    assert children_gone()
    for _ in range(500):  # a watchdog: the views' finalizers
        gc.collect()
        if _fds() <= before and _maps_ring() == 0:
            break
        time.sleep(0.02)
    assert _fds() <= before
    assert _maps_ring() == 0


def test_process_ring_close_while_a_worker_is_stuck_does_not_hang():
    run_child(
        """
        import multiprocessing, threading, time, torch
        class Slow(torch.utils.data.Dataset):
            def __len__(self): return 400
            def __getitem__(self, j):
                if j >= 40:
                    time.sleep(3600)
                return torch.full((3, 160, 160), j % 256, dtype=torch.uint8), j
        dl = torch.utils.data.DataLoader(Slow(), batch_size=4, num_workers=2)
        p = pinstream.prefetch(dl, dtype="uint8", process=True, dry_run=True)
        it = iter(p)
        for i in range(10):
            x, y = next(it)
            assert int(y[0]) == 4 * i
        threading.Timer(1.0, p.close).start()
        try:
            next(it)
            raise AssertionError("a batch after close")
        except StopIteration:
            pass
        deadline = time.monotonic() + 30
        while multiprocessing.active_children() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not multiprocessing.active_children(), multiprocessing.active_children()
        print("ok")
        """,
        timeout=120,
    )


def test_process_ring_pin_memory_loader_is_taken(readers):
    # pin_memory needs CUDA, which the helper (a fork) cannot use: it is turned off there, and
    # the loader here keeps it.
    dl = loader(Batches(8), pin_memory=True)
    p = pinstream.prefetch(dl, dtype="uint8", process=True, dry_run=True)
    for i, (x, _) in enumerate(p):
        assert np.array_equal(host(x), pixels(i))
    p.close()
    assert dl.pin_memory is True
    assert readers[0]._process is True  # noqa: SLF001
    assert children_gone()
