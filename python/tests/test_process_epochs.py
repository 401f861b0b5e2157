"""``pinstream.prefetch(loader, process=True)`` across epochs: each epoch's helper is a new
fork of the training process, iterating a copy of the loader.

Checked here:
- the random state after each epoch: its order, its workers' seeds, and the training process's
  later draws, with torch's global generator, the loader's own and Python's ``random``, as an
  iteration in this process gives them (before, every epoch repeated the first one's order);
- epochs cut short not replayed; a generator drawn from here keeping its own draws; one
  imported in the helper only left alone;
- an ``iter()`` that raises (from ``prefetch()`` itself);
- a consumer slower than the source getting every batch;
- the helper's workers not outliving it (stuck in the dataset, or the helper killed inside
  ``iter()``), a child forked from another helper thread living on, and ``close()`` ending
  the helper where a process forked here holds its slot pipe.

Dry runs; waits that could hang run in a child process with a limit. No test measures time.
"""

import gc
import multiprocessing
import threading
import time

import numpy as np
import pytest

import pinstream

from test_hostile import run_child

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def children_gone(limit=30.0):
    """Waits (a watchdog, not a speed bound) until this process has no child left."""
    deadline = time.monotonic() + limit
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not multiprocessing.active_children()


class Indexed(torch.utils.data.Dataset):
    """Sample ``i``: an image of ``i``, ``i``, and a draw of torch's generator in the worker
    (seeded from the loader's base seed, drawn at ``iter()``)."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.full((3, 4, 4), i, dtype=torch.uint8), i, int(torch.randint(1 << 30, ()))


def _epochs(process, generator, epochs=3):
    """Each epoch's (index, worker draw) pairs, then a draw of torch's generator and of the
    loader's own."""
    torch.manual_seed(7)
    g = None
    if generator:
        g = torch.Generator()
        g.manual_seed(11)
    dl = torch.utils.data.DataLoader(Indexed(), batch_size=4, num_workers=2, shuffle=True,
                                     generator=g)
    out = []
    for _ in range(epochs):
        p = pinstream.prefetch(dl, dtype="uint8", process=process, worker_ring=False,
                               dry_run=True)
        out.append([(int(a), int(b)) for _, y, d in p for a, b in zip(np.asarray(y), d)])
        p.close()
    after = float(torch.rand(()))
    gen_after = None if g is None else float(torch.rand((), generator=g))
    return out, after, gen_after


@pytest.mark.parametrize("generator", [False, True], ids=["global", "loader_generator"])
def test_process_draws_as_an_iteration_here(generator):
    here = _epochs(False, generator)
    there = _epochs(True, generator)
    orders = [[s[0] for s in e] for e in here[0]]
    assert orders[0] != orders[1] != orders[2]  # the reference shuffles anew each epoch
    assert there == here


class RefusingSampler(torch.utils.data.Sampler):
    def __init__(self):
        pass

    def __len__(self):
        return 4

    def __iter__(self):
        raise ValueError("this sampler refuses")


def test_process_iter_error_is_raised_by_prefetch():
    # As iter() of the loader in this process would: from prefetch() itself, no helper left.
    dl = torch.utils.data.DataLoader(Indexed(), batch_size=4, num_workers=2,
                                     sampler=RefusingSampler())
    with pytest.raises(ValueError, match="this sampler refuses"):
        pinstream.prefetch(dl, dtype="uint8", process=True, dry_run=True)
    gc.collect()
    assert children_gone()


def test_process_close_with_a_worker_stuck_leaves_no_worker(tmp_path):
    # The helper's DataLoader workers are the helper's children: one stuck in the dataset
    # outlived the helper (killed after 5 s), for as long as the dataset slept.
    run_child(
        f"""
        import multiprocessing, threading, time, torch
        marks = {str(tmp_path)!r}
        class Slow(torch.utils.data.Dataset):
            def __len__(self): return 400
            def __getitem__(self, j):
                if j >= 40:
                    open(os.path.join(marks, str(os.getpid())), "w").close()
                    time.sleep(3600)
                return torch.full((3, 16, 16), j % 256, dtype=torch.uint8), j
        dl = torch.utils.data.DataLoader(Slow(), batch_size=4, num_workers=2)
        p = pinstream.prefetch(dl, dtype="uint8", process=True, dry_run=True)
        it = iter(p)
        for i in range(10):
            x, y = next(it)
            assert int(y[0]) == 4 * i
        deadline = time.monotonic() + 60
        while not os.listdir(marks) and time.monotonic() < deadline:
            time.sleep(0.05)
        stuck = [int(n) for n in os.listdir(marks)]
        assert stuck
        p.close()
        del it, p
        def alive(pid):
            try:
                with open(f"/proc/{{pid}}/stat") as f:
                    return f.read().split(")")[-1].split()[0] != "Z"
            except OSError:
                return False
        deadline = time.monotonic() + 60
        while any(alive(s) for s in stuck) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(s) for s in stuck), stuck
        print("ok")
        """,
        timeout=150,
    )


def test_process_generators_imported_in_the_helper_only_are_left_alone():
    # An iterable that imports torch in its __iter__ (in the helper only): the training
    # process has no torch generator to set, and says nothing (it warned that it could not).
    run_child(
        """
        import warnings
        assert "torch" not in sys.modules
        class LateTorch:
            def __iter__(self):
                import torch
                torch.rand(1)
                return iter([(np.full((2, 3, 4, 4), 7, np.uint8), np.arange(2))])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            p = pinstream.prefetch(LateTorch(), dtype="uint8", process=True, dry_run=True)
            assert len(list(p)) == 1
            p.close()
        assert "torch" not in sys.modules
        print("ok")
        """,
        timeout=120,
    )


@pytest.mark.parametrize("loader", [False, True], ids=["generator", "dataloader"])
def test_process_consumer_slower_than_the_source_gets_every_batch(loader):
    # The source ends while the helper waits for the training process to free a slot: it
    # took that end for a close and dropped the batches still queued (and the end itself).
    n = 12
    if loader:
        src = torch.utils.data.DataLoader(Indexed(), batch_size=2, num_workers=2)
    else:
        src = ((np.full((2, 3, 4, 4), i, np.uint8), np.arange(2) + 2 * i) for i in range(n))
    # (`fresh`: the helper pulls ahead of the copies, as it does for a DataLoader.)
    p = pinstream.prefetch(src, dtype="uint8", process=True, loader_threads=1, depth=1,
                           fresh=True, dry_run=True)
    got = []
    for x, y, *_ in p:
        got.append(int(np.asarray(y)[0]))
        time.sleep(0.1)  # a training step slower than the source
    assert got == [2 * i for i in range(n)]
    p.close()
    assert children_gone()


@pytest.mark.parametrize("default", [False, True], ids=["own_generator", "default_generator"])
def test_process_generator_drawn_here_during_the_epoch_keeps_its_draws(default):
    # The loader's generator is also the training loop's: the state the helper sends with the
    # end would set it back to before this process's draws, which the next epoch repeated.
    g = torch.default_generator if default else torch.Generator()
    g.manual_seed(5)
    dl = torch.utils.data.DataLoader(Indexed(), batch_size=4, num_workers=2, shuffle=True,
                                     generator=g)
    draws = []
    for _ in range(2):
        p = pinstream.prefetch(dl, dtype="uint8", process=True, dry_run=True)
        epoch = []
        for _batch in p:
            epoch += torch.rand(50, generator=g).tolist()  # the training step's noise
        p.close()
        draws.append(epoch)
    assert len(draws[0]) == 300
    assert not set(draws[0]) & set(draws[1])


def test_process_helper_killed_inside_iter_leaves_no_worker(tmp_path):
    # The helper dies in the loader's iter(), after it forked the workers: torch's workers
    # check that their parent lives only if it was alive when their check began, so one that
    # began after the helper died outlived it.
    run_child(
        f"""
        import signal, time, torch
        marks = {str(tmp_path)!r}
        class DS(torch.utils.data.Dataset):
            def __len__(self): return 8
            def __getitem__(self, j): return torch.full((3, 8, 8), j, dtype=torch.uint8), j
        class Die(torch.utils.data.Sampler):
            def __init__(self): pass
            def __len__(self): return 8
            def __iter__(self):
                deadline = time.monotonic() + 30
                while len(os.listdir(marks)) < 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
                os.kill(os.getpid(), signal.SIGKILL)
                yield 0
        def mark(_):
            # Torch's worker takes its parent's pid for its check after this returns: here,
            # once the helper is gone (the race where a worker starts as the helper dies).
            helper = os.getppid()
            open(os.path.join(marks, str(os.getpid())), "w").close()
            deadline = time.monotonic() + 30
            while os.getppid() == helper and time.monotonic() < deadline:
                time.sleep(0.01)
        dl = torch.utils.data.DataLoader(DS(), batch_size=4, sampler=Die(), num_workers=2,
                                         worker_init_fn=mark)
        try:
            pinstream.prefetch(dl, dtype="uint8", process=True, dry_run=True)
            raise SystemExit("no error")
        except pinstream.LoaderError as e:
            assert "exit code -9" in str(e), e
        workers = [int(n) for n in os.listdir(marks)]
        assert len(workers) == 2, workers
        def alive(pid):
            try:
                with open(f"/proc/{{pid}}/stat") as f:
                    return f.read().split(")")[-1].split()[0] != "Z"
            except OSError:
                return False
        deadline = time.monotonic() + 45
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(w) for w in workers), workers
        print("ok")
        """,
        timeout=120,
    )


class Wide(torch.utils.data.Dataset):
    """Sample ``i``: a small image and ``i``, for ``i`` below a million."""

    def __len__(self):
        return 1_000_000

    def __getitem__(self, i):
        return torch.full((3, 2, 2), i % 251, dtype=torch.uint8), i


@pytest.mark.parametrize("workers", [0, 2])
def test_process_epochs_cut_short_do_not_replay(workers):
    # A fixed number of steps an epoch (a break) over a sampler that draws lazily from the
    # loader's generator (32 indices at a time with replacement): its states came back only
    # with the end, so the next epoch replayed most of this one.
    g = torch.Generator()
    g.manual_seed(3)
    sampler = torch.utils.data.RandomSampler(Wide(), replacement=True, num_samples=10_000,
                                             generator=g)
    dl = torch.utils.data.DataLoader(Wide(), batch_size=4, num_workers=workers, sampler=sampler)
    epochs = []
    for _ in range(3):
        p = pinstream.prefetch(dl, dtype="uint8", process=True, dry_run=True)
        seen = []
        for _, y in p:
            seen += np.asarray(y).tolist()
            if len(seen) >= 200:
                break
        p.close()
        epochs.append(seen)
    for a, b in zip(epochs, epochs[1:]):
        assert len(set(a) & set(b)) <= 2, len(set(a) & set(b))


class ShufflingSampler(torch.utils.data.Sampler):
    """Shuffles with Python's ``random`` in its ``__iter__``."""

    def __init__(self):
        pass

    def __len__(self):
        return 24

    def __iter__(self):
        import random

        order = list(range(24))
        random.shuffle(order)
        return iter(order)


def test_process_python_random_draws_as_here():
    # CPython reseeds `random` in a forked child: the helper shuffled with a state of its own
    # (a new order on every run), and that state came back to the training process.
    import random

    def epochs(process):
        random.seed(0)
        dl = torch.utils.data.DataLoader(Indexed(), batch_size=4, num_workers=2,
                                         sampler=ShufflingSampler())
        out = []
        for _ in range(2):
            p = pinstream.prefetch(dl, dtype="uint8", process=process, worker_ring=False,
                                   dry_run=True)
            out.append([int(a) for _, y, _ in p for a in np.asarray(y)])
            p.close()
        return out, random.random()

    assert epochs(True) == epochs(False)


def test_process_a_child_forked_by_a_helper_thread_lives_on(tmp_path):
    # The helper's children die with it (PR_SET_PDEATHSIG), which comes when the forking
    # *thread* ends: a process forked from another thread of the helper was killed with it.
    mark = tmp_path / "done"

    def child():
        time.sleep(0.5)
        mark.write_text("done")

    class Source:
        def __iter__(self):
            def start():
                multiprocessing.get_context("fork").Process(target=child).start()
                time.sleep(0.3)  # the thread works on a while (the child has started), then ends

            t = threading.Thread(target=start)
            t.start()
            t.join()  # the thread that forked it has ended
            for i in range(10):
                time.sleep(0.1)
                yield np.full((2, 3, 4, 4), i, np.uint8), np.arange(2)

    p = pinstream.prefetch(Source(), dtype="uint8", process=True, dry_run=True)
    assert sum(1 for _ in p) == 10
    p.close()
    assert children_gone()
    assert mark.exists()


def test_process_close_with_the_slot_pipe_held_elsewhere_ends_the_helper_itself():
    # The source ended while the helper waits for slots, and a process forked here meanwhile
    # holds the free-slot pipe (a Pool): close() got no end of that pipe, and the helper,
    # ignoring SIGTERM, was killed 5 s later. It now stops at SIGTERM.
    def src():
        for i in range(13):
            yield np.full((2, 3, 4, 4), i, np.uint8), np.arange(2)

    p = pinstream.prefetch(src(), dtype="uint8", process=True, fresh=True, dry_run=True)
    it = iter(p)
    next(it)
    (helper,) = [c for c in multiprocessing.active_children() if c.name == "pinstream-helper"]
    for _ in range(200):  # a watchdog: the source has ended, the helper waits for slots
        if helper.exitcode is None and p.stats().get("items", 0) >= 1:
            break
        time.sleep(0.01)
    time.sleep(0.5)
    pool = multiprocessing.get_context("fork").Pool(1)
    try:
        p.close()
        assert helper.exitcode == 0, helper.exitcode
    finally:
        pool.terminate()
        pool.join()


def test_process_a_generator_drawn_here_once_is_left_alone_for_the_iteration():
    # Drawn from here once, then a later state from the helper (a sampler's lazy draws) came
    # with no draw here in between: it was set, and this process's draws were lost.
    import pinstream.process as pp

    g = torch.Generator()
    g.manual_seed(1)
    r = pp.HelperReader.__new__(pp.HelperReader)
    r._generators = {("generator",): g}
    r._generators_set = pp._generator_states(r._generators)
    r._drawn_here = set()
    helper = torch.Generator()
    helper.manual_seed(2)
    torch.rand(3, generator=g)  # this process draws
    mine = g.get_state().clone()
    for _ in range(2):
        torch.rand(3, generator=helper)  # the helper's sampler draws
        r._take_news({("loader", "generator"): bytes(helper.get_state().numpy())})
        assert torch.equal(g.get_state(), mine)
