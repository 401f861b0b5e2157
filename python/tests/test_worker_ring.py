"""``pinstream.prefetch(loader, worker_ring=True)``: a DataLoader's workers copy each batch's
images into a ring of shared slots (page-locked on a GPU, one DMA each).

Checked here: order and content with one and several loader threads and a slow consumer (a slot
written again while still in use would show another batch's bytes), how many batches came in the
ring, the rest of a batch (tuples, dicts, torch tensors small and large) as it was, batches that
do not fit the ring or have no uint8 images (the usual way, the usual errors), a worker's error,
the loaders refused, the loader's ``collate_fn`` left as it was, a forged slot, closing early
(no worker, descriptor or ring left behind). Every test runs as a dry run (CPU) and, where there
is one, on a GPU. No test measures time; waits that could hang run in a child process with a
limit.
"""

import gc
import os
import select
import signal
import time

import numpy as np
import pytest

import pinstream

from conftest import FORK_HEAD_LOCK_BUG, needs_gpu
from test_dataloader import host, labels, pixels
from test_hostile import run_child

torch = pytest.importorskip("torch")

import pinstream.forklock as forklock  # noqa: E402
import pinstream.worker_ring as wr  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

MODES = [
    pytest.param(True, id="dry_run"),
    pytest.param(False, id="device", marks=needs_gpu),
]


class Batches(torch.utils.data.Dataset):
    """Batch ``i`` (``batch_size=None``): its pixels and labels as torch tensors; ``big`` makes
    batch ``big`` twice as many images, ``fail_at`` raises there."""

    def __init__(self, n, big=None, fail_at=None, extra=False, dict_items=False):
        self.n, self.big, self.fail_at, self.extra, self.dict_items = n, big, fail_at, extra, dict_items

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.fail_at:
            raise KeyError(f"no sample {i}")
        x = torch.from_numpy(pixels(i, n=6 if i == self.big else 3))
        y = torch.from_numpy(labels(i, n=6 if i == self.big else 3))
        if self.dict_items:
            return {"image": x, "label": y, "name": f"b{i}", "mask": torch.full((300, 300), i % 256, dtype=torch.uint8)}
        return (x, y, f"b{i}", torch.full((2,), i)) if self.extra else (x, y)


def loader(ds, workers=2, **kw):
    return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, **kw)


@pytest.fixture
def readers(monkeypatch):
    """Every ``WorkerRingReader`` made during the test, to count its batches."""
    made = []
    init = wr.WorkerRingReader.__init__

    def record(self, *a, **k):
        init(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(wr.WorkerRingReader, "__init__", record)
    return made


def workers_alive():
    import multiprocessing

    return [p for p in multiprocessing.active_children() if "Worker" in type(p).__name__ or p.name.startswith("Process")]


@pytest.mark.parametrize("dry", MODES)
@pytest.mark.parametrize("threads,slow", [(1, False), (3, False), (3, True)])
def test_worker_ring_keeps_order_and_content(dry, threads, slow, readers):
    n = 40
    p = pinstream.prefetch(loader(Batches(n, extra=True)), dtype="uint8", worker_ring=True,
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
    st = p.stats()
    assert st["fresh"] is True and st["items"] == n
    (r,) = readers
    # The first batches were made before the ring (sized from the first one); after that,
    # every batch came in a slot.
    assert r.in_ring >= n - 10, (r.in_ring, r.usual)
    assert r.in_ring + r.usual == n
    if not dry:
        assert st["direct"] == n and st["copied_after"] == 0
    p.close()


@pytest.mark.parametrize("dry", MODES)
def test_worker_ring_dict_batches_keep_their_rest(dry, readers):
    n = 16
    p = pinstream.prefetch(loader(Batches(n, dict_items=True)), dtype="uint8", worker_ring=True,
                           dry_run=dry)
    for i, b in enumerate(p):
        assert set(b) == {"image", "label", "name", "mask"}
        assert np.array_equal(host(b["image"]), pixels(i)), i
        assert b["name"] == f"b{i}"
        # A rest tensor too large to travel by value comes as the worker made it.
        assert isinstance(b["mask"], torch.Tensor) and b["mask"].shape == (300, 300)
        assert int(b["mask"][7, 9]) == i % 256
    assert readers[0].in_ring >= n - 10
    p.close()


@pytest.mark.parametrize("dry", MODES)
def test_worker_ring_batch_bigger_than_the_slots_comes_the_usual_way(dry, readers):
    n = 24
    p = pinstream.prefetch(loader(Batches(n, big=17)), dtype="uint8", worker_ring=True, dry_run=dry)
    for i, (x, y) in enumerate(p):
        assert np.array_equal(host(x), pixels(i, n=6 if i == 17 else 3)), i
        assert np.array_equal(host(y), labels(i, n=6 if i == 17 else 3)), i
    r = readers[0]
    assert r.in_ring + r.usual == n and r.usual >= 1
    p.close()


class Samples(torch.utils.data.Dataset):
    """One image a sample (``DataLoader(batch_size=...)``, torch's ``default_collate``):
    sample ``j`` is image ``j % 3`` of ``pixels(j // 3)`` and its label; ``form``: ``"tuple"``
    (image, label, name), ``"list"``, ``"dict"``, ``"numpy"`` (a tuple, the image a numpy
    array), ``"item"`` (the image alone); ``odd``: that sample's image another shape."""

    def __init__(self, n, form="tuple", odd=None):
        self.n, self.form, self.odd = n, form, odd

    def __len__(self):
        return self.n

    def __getitem__(self, j):
        b, k = divmod(j, 3)
        x = pixels(b)[k] if j != self.odd else pixels(b, h=6)[k]
        if self.form == "item":
            return torch.from_numpy(x.copy())
        if self.form == "numpy":
            return x.copy(), j
        x = torch.from_numpy(x.copy())
        if self.form == "dict":
            return {"label": j, "image": x, "name": f"s{j}"}
        if self.form == "list":
            return [x, j, f"s{j}"]
        return x, j, f"s{j}"


def sample_loader(ds, **kw):
    return torch.utils.data.DataLoader(ds, batch_size=3, num_workers=2, **kw)


@pytest.fixture
def stack_small(monkeypatch):
    """The tests' small images stacked too (``STACK_MIN_BYTES`` is read at ``iter()``)."""
    monkeypatch.setattr(wr, "STACK_MIN_BYTES", 0)


@pytest.mark.parametrize("dry", MODES)
@pytest.mark.parametrize("form", ["tuple", "list", "dict", "numpy", "item"])
def test_worker_ring_stacks_samples_straight_into_the_ring(dry, form, readers, stack_small):
    # A partial last batch (one sample) too; every batch as the loader itself collates it.
    n = 3 * 14 + 1
    want = list(sample_loader(Samples(n, form)))
    p = pinstream.prefetch(sample_loader(Samples(n, form)), dtype="uint8", worker_ring=True,
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
        assert len(a) == len(b), i
        for u, v in zip(a[1:], b[1:]):
            if isinstance(v, torch.Tensor):
                # Labels as the prefetcher hands them (uploaded, or a tensor as it was).
                u = u.numpy() if isinstance(u, torch.Tensor) else host(u)
                assert u.dtype == v.numpy().dtype and np.array_equal(u, v.numpy()), i
            else:
                assert u == v, i
    assert got == len(want) == 15
    r = readers[0]
    assert r.in_ring + r.usual == 15
    assert r.in_ring >= 5, (r.in_ring, r.usual)
    # The batches that came in a slot were stacked there, bar one whose worker found no slot
    # free as it began (it collates, then finds one) now and then.
    assert r.stacked >= max(5, r.in_ring - 3), (r.stacked, r.in_ring)
    p.close()


def test_worker_ring_unstacked_control_still_copies(readers, monkeypatch):
    monkeypatch.setattr(wr, "STACK_SAMPLES", False)
    n = 3 * 12
    p = pinstream.prefetch(sample_loader(Samples(n)), dtype="uint8", worker_ring=True, dry_run=True)
    for i, (x, y, names) in enumerate(p):
        assert np.array_equal(host(x), pixels(i)), i
        assert y.tolist() == [3 * i, 3 * i + 1, 3 * i + 2]
    r = readers[0]
    assert r.in_ring >= 2 and r.stacked == 0
    p.close()


def test_worker_ring_samples_of_other_shapes_get_the_loaders_error(readers, stack_small):
    # default_collate's own error, from the usual collate: the stacking adds none of its own.
    p = pinstream.prefetch(sample_loader(Samples(3 * 12, odd=3 * 9 + 1)), dtype="uint8",
                           worker_ring=True, dry_run=True)
    got = 0
    with pytest.raises(pinstream.LoaderError) as e:
        for i, (x, _, _) in enumerate(p):
            assert np.array_equal(host(x), pixels(i)), i
            got += 1
    assert got == 9
    assert "stack expects each tensor to be equal size" in str(e.value) + str(e.value.__cause__)
    p.close()


def test_worker_ring_samples_of_mixed_types_come_the_usual_way(readers, stack_small):
    # Samples whose images are a tensor in one and a numpy array in another: default_collate's
    # outcome (here its error), never a batch stacked from both.
    class Mixed(Samples):
        def __getitem__(self, j):
            x, y, name = super().__getitem__(j)
            return (x.numpy() if j % 3 == 1 else x), y, name

    p = pinstream.prefetch(sample_loader(Mixed(3 * 8)), dtype="uint8", worker_ring=True,
                           dry_run=True)
    with pytest.raises(pinstream.LoaderError):
        list(p)
    assert readers[0].stacked == 0
    p.close()


def test_worker_ring_non_uint8_images_get_the_usual_error(readers):
    class Floats(Batches):
        def __getitem__(self, i):
            return torch.rand(3, 3, 5, 7), torch.from_numpy(labels(i))

    p = pinstream.prefetch(loader(Floats(6)), worker_ring=True, dry_run=True)
    with pytest.raises(pinstream.LoaderError, match="uint8") as e:
        next(iter(p))
    assert isinstance(e.value.__cause__, pinstream.InvalidArgumentError)
    p.close()
    assert readers[0].in_ring == 0


@pytest.mark.parametrize("dry", MODES)
def test_worker_ring_worker_error_is_a_loader_error(dry):
    p = pinstream.prefetch(loader(Batches(20, fail_at=12)), dtype="uint8", worker_ring=True,
                           dry_run=dry)
    got = 0
    with pytest.raises(pinstream.LoaderError) as e:
        for i, (x, _) in enumerate(p):
            assert np.array_equal(host(x), pixels(i)), i
            got += 1
    assert got == 12
    assert "no sample 12" in str(e.value) + str(e.value.__cause__)
    p.close()


def test_worker_ring_arguments_refused():
    ds = Batches(4)
    with pytest.raises(pinstream.InvalidArgumentError, match="DataLoader"):
        pinstream.prefetch(iter([]), worker_ring=True, dry_run=True)
    with pytest.raises(pinstream.InvalidArgumentError, match="num_workers=0"):
        pinstream.prefetch(loader(ds, workers=0), worker_ring=True, dry_run=True)
    with pytest.raises(pinstream.InvalidArgumentError, match="persistent_workers"):
        pinstream.prefetch(loader(ds, persistent_workers=True), worker_ring=True, dry_run=True)
    with pytest.raises(pinstream.InvalidArgumentError, match="forked"):
        pinstream.prefetch(loader(ds, multiprocessing_context="spawn"), worker_ring=True, dry_run=True)
    with pytest.raises(pinstream.InvalidArgumentError, match="choose one"):
        pinstream.prefetch(loader(ds), worker_ring=True, process=True, dry_run=True)
    with pytest.raises(pinstream.InvalidArgumentError, match="True, False or None"):
        pinstream.prefetch(loader(ds), worker_ring="yes", dry_run=True)
    with pytest.raises(pinstream.InvalidArgumentError, match="DataLoader"):
        pinstream.prefetch(iter(loader(ds)), worker_ring=True, dry_run=True)


def test_worker_ring_leaves_the_loaders_collate_fn_and_the_loader_reusable():
    def collate(b):
        return b

    dl = loader(Batches(8), collate_fn=collate)
    for _ in range(2):
        p = pinstream.prefetch(dl, dtype="uint8", worker_ring=True, dry_run=True)
        assert dl.collate_fn is collate
        for i, (x, _) in enumerate(p):
            assert np.array_equal(host(x), pixels(i))
        p.close()
        assert dl.collate_fn is collate
    # The loader itself, iterated as usual afterwards: no ring.
    for i, (x, _) in enumerate(dl):
        assert isinstance(x, torch.Tensor) and np.array_equal(x.numpy(), pixels(i))


def test_worker_ring_forged_slot_is_a_loader_error():
    class Forged(Batches):
        def __getitem__(self, i):
            if i == 9:
                return wr.InRing(12345, 999, (3, 3, 5, 7), ("seq", 0), (None, labels(i)))
            return super().__getitem__(i)

    p = pinstream.prefetch(loader(Forged(12)), dtype="uint8", worker_ring=True, dry_run=True)
    got = 0
    with pytest.raises(pinstream.LoaderError, match="does not lie in the ring"):
        for i, (x, _) in enumerate(p):
            assert np.array_equal(host(x), pixels(i))
            got += 1
    assert got == 9
    p.close()


def _fds():
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("dry", MODES)
def test_worker_ring_early_exit_leaves_nothing_behind(dry):
    before = _fds()
    for _ in range(3):
        p = pinstream.prefetch(loader(Batches(50)), dtype="uint8", worker_ring=True, dry_run=dry)
        for i, (x, _) in enumerate(p):
            assert np.array_equal(host(x), pixels(i))
            if i == 15:
                break
        p.close()
        del p, x
        gc.collect()
    deadline = time.monotonic() + 30
    while workers_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not workers_alive()
    # The last iteration's ring is kept for the next one (its descriptor), until given back.
    assert _fds() <= before + 1
    wr.release_kept()
    assert _fds() <= before


def test_worker_ring_close_while_a_worker_is_slow_does_not_hang():
    run_child(
        """
        import time, torch, numpy as np
        class Slow(torch.utils.data.Dataset):
            def __len__(self): return 100
            def __getitem__(self, i):
                if i >= 6:
                    time.sleep(3600)
                return torch.full((3, 3, 5, 7), i, dtype=torch.uint8), torch.arange(3)
        dl = torch.utils.data.DataLoader(Slow(), batch_size=None, num_workers=2)
        p = pinstream.prefetch(dl, dtype="uint8", worker_ring=True, dry_run=True)
        it = iter(p)
        for i in range(6):
            x, _ = next(it)
            assert int(x[0, 0, 0, 0]) == i
        p.close()
        del it, p
        print("ok")
        """,
        timeout=120,
    )


def test_worker_ring_close_from_another_thread_ends_a_waiting_next():
    # next() waits for a worker stuck in the dataset; close() from another thread ends that
    # wait as the end of the iteration (StopIteration), not as the loader's failure.
    run_child(
        """
        import threading, time, torch, multiprocessing
        class Slow(torch.utils.data.Dataset):
            def __len__(self): return 400
            def __getitem__(self, j):
                if j >= 40:
                    time.sleep(3600)
                return torch.full((3, 160, 160), j % 256, dtype=torch.uint8), j
        dl = torch.utils.data.DataLoader(Slow(), batch_size=4, num_workers=2)
        p = pinstream.prefetch(dl, dtype="uint8", dry_run=True)
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
        time.sleep(0.5)
        assert not multiprocessing.active_children(), multiprocessing.active_children()
        print("ok")
        """,
        timeout=120,
    )


def _ring_fds_in_child():
    """The ring descriptors a process forked now holds (it reports through a pipe); ``None``
    for a child that hung in the fork itself, on a CPython with that bug."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            names = []
            for fd in os.listdir("/proc/self/fd"):
                try:
                    names.append(os.readlink(f"/proc/self/fd/{fd}"))
                except OSError:
                    pass
            os.write(w, str(sum("pinstream-worker-ring" in n for n in names)).encode())
        finally:
            os._exit(0)
    os.close(w)
    try:
        # A watchdog: on CPython 3.11.7 and earlier a child forked while another thread makes
        # its thread state can hang in the fork itself (conftest.FORK_HEAD_LOCK_BUG).
        ready, _, _ = select.select([r], [], [], 60)
        got = os.read(r, 100) if ready else b""
    finally:
        os.close(r)
    if not got:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        if FORK_HEAD_LOCK_BUG:
            return None  # hung before it could look (CPython's bug, not a ring kept)
        pytest.fail("HUNG: a forked child did not report its descriptors")
    os.waitpid(pid, 0)
    return int(got)


def test_worker_ring_other_forks_keep_no_ring():
    p = pinstream.prefetch(loader(Batches(30)), dtype="uint8", worker_ring=True, dry_run=True)
    it = iter(p)
    for i in range(12):
        x, _ = next(it)
        assert np.array_equal(host(x), pixels(i))
    # This process holds the ring; a process forked now (another loader's worker, a helper)
    # holds none of it, while the ring's own workers kept theirs (the batches above).
    here = [n for n in (os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                        if os.path.exists(f"/proc/self/fd/{fd}")) if "pinstream-worker-ring" in n]
    assert here
    assert _ring_fds_in_child() in (0, None)
    for i, (x, _) in enumerate(it, 12):
        assert np.array_equal(host(x), pixels(i))
    p.close()


# Findings of the hostile review (2026-11-27, seventh session), each fixed.


def test_finding_prefetchers_started_at_once_leave_the_collate_fn_as_it_was():
    """Two threads starting prefetchers on one loader at once: the second used to wrap the
    first's wrapper and put it back for good, so that later workers wrote into another ring."""
    import threading

    class SlowSampler(torch.utils.data.Sampler):
        def __init__(self, n):
            self.n, self.calls = n, 0

        def __len__(self):
            return self.n

        def __iter__(self):
            self.calls += 1
            time.sleep(0.3 if self.calls == 1 else 0.6 if self.calls == 2 else 0)
            return iter(range(self.n))

    def collate(b):
        return b

    dl = loader(Batches(12), sampler=SlowSampler(12), collate_fn=collate)
    failed = []

    def run():
        try:
            q = pinstream.prefetch(dl, dtype="uint8", worker_ring=True, dry_run=True)
            for i, (x, _) in enumerate(q):
                assert np.array_equal(host(x), pixels(i))
            q.close()
        except BaseException as e:  # noqa: BLE001
            failed.append(e)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.1)
    run()
    t.join()
    assert not failed, failed
    assert dl.collate_fn is collate
    run()  # a later prefetcher's workers write its own ring
    assert not failed, failed


def _maps_ring(pid="self"):
    with open(f"/proc/{pid}/maps") as f:
        return sum("pinstream-worker-ring" in line for line in f)


def test_finding_a_fork_while_a_slot_is_in_use_keeps_no_ring():
    """A process forked while a view of a slot was alive kept the whole ring mapped."""
    r = wr.WorkerRingReader(loader(Batches(30)), None, 12, None)
    it = iter(r)
    held = [next(it) for _ in range(15)]  # the later ones are views of their slots
    assert r.in_ring > 0
    assert _maps_ring() >= 1
    rd, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(w, str(_maps_ring()).encode())
        finally:
            os._exit(0)
    os.close(w)
    got = int(os.read(rd, 100))
    os.close(rd)
    os.waitpid(pid, 0)
    assert got == 0
    for i, (x, _) in enumerate(held):
        assert np.array_equal(np.asarray(x), pixels(i))
    r.close()
    del held, it, r, x, _
    gc.collect()
    # Once the last view is gone the ring is kept for the next iteration, and unmapped when
    # given back.
    assert _maps_ring() <= 1
    wr.release_kept()
    assert _maps_ring() == 0


def test_finding_cleanup_inside_the_locks_does_not_deadlock():
    """A collection that frees a reader (or a slot's view) while this thread holds the table's
    or the free list's lock runs that cleanup on this thread: the locks are reentrant."""
    run_child(
        """
        import torch, pinstream.worker_ring as wr, pinstream.forklock as forklock
        class B(torch.utils.data.Dataset):
            def __len__(self): return 20
            def __getitem__(self, i):
                return torch.full((3, 3, 5, 7), i, dtype=torch.uint8), torch.arange(3)
        r = wr.WorkerRingReader(torch.utils.data.DataLoader(B(), batch_size=None, num_workers=2),
                                None, 8, None)
        it = iter(r)
        held = [next(it) for _ in range(12)]
        assert r.in_ring > 0
        free = r._slots
        with free._lock:
            del held  # the views' finalizers give their slots back on this thread
            gc.collect()
        r.close()
        with forklock.LOCK:
            del it, r  # the reader's cleanup closes its descriptors on this thread
            gc.collect()
        print("ok")
        """,
        timeout=120,
    )


class Tagged(torch.Tensor):
    """A tensor subclass in a batch's rest (as torchvision's ``tv_tensors`` are)."""


def test_finding_tensor_subclasses_in_the_rest_keep_their_type():
    class WithTagged(Batches):
        def __getitem__(self, i):
            x, y = super().__getitem__(i)
            return x, y, torch.full((2,), i).as_subclass(Tagged)

    p = pinstream.prefetch(loader(WithTagged(16)), dtype="uint8", worker_ring=True, dry_run=True)
    for i, (x, _, t) in enumerate(p):
        assert type(t) is Tagged and t.tolist() == [i, i], i
    p.close()


@pytest.mark.parametrize("dry", MODES)
@pytest.mark.parametrize("threads", [None, 3])
def test_worker_ring_large_batches_copied_in_parts(dry, threads, readers, monkeypatch):
    """Batches above a megabyte: each worker copies them into the slot on several threads."""
    monkeypatch.setattr(wr, "WORKER_COPY_THREADS", threads)

    class Large(Batches):
        def __getitem__(self, i):
            return torch.from_numpy(pixels(i, n=20000)), torch.from_numpy(labels(i, n=20000))

    n = 12
    p = pinstream.prefetch(loader(Large(n)), dtype="uint8", worker_ring=True, dry_run=dry)
    for i, (x, y) in enumerate(p):
        assert np.array_equal(host(x), pixels(i, n=20000)), i
        assert np.array_equal(host(y), labels(i, n=20000)), i
    assert readers[0].in_ring >= n - 6
    p.close()


# Findings of the second hostile review (the first review's fixes attacked), each fixed.


def test_finding_a_second_ctrl_c_during_close_does_not_hang_it():
    run_child(
        """
        import signal, torch
        class Stuck(torch.utils.data.Dataset):
            def __len__(self): return 100
            def __getitem__(self, i):
                if i >= 6:
                    time.sleep(3600)
                return torch.full((3, 3, 5, 7), i, dtype=torch.uint8), torch.arange(3)
        dl = torch.utils.data.DataLoader(Stuck(), batch_size=None, num_workers=2)
        p = pinstream.prefetch(dl, dtype="uint8", worker_ring=True, dry_run=True)
        it = iter(p)
        for i in range(6):
            next(it)
        # Ctrl-C while close() waits for the loader thread stuck in the loader's next().
        threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        try:
            p.close()
        except KeyboardInterrupt:
            pass
        print("ok")
        """,
        timeout=60,
    )


def test_finding_forks_from_another_thread_never_keep_a_new_ring():
    import threading

    stop = threading.Event()
    kept = []

    def forker():
        while not stop.is_set():
            kept.append(_ring_fds_in_child())

    t = threading.Thread(target=forker)
    t.start()
    try:
        for _ in range(25):
            p = pinstream.prefetch(loader(Batches(3)), dtype="uint8", worker_ring=True, dry_run=True)
            for _b in p:
                pass
            p.close()
            del p
            gc.collect()
    finally:
        stop.set()
        t.join()
    looked = [k for k in kept if k is not None]
    assert looked and max(looked) == 0, max(looked)


def test_finding_the_two_tables_share_one_lock_no_deadlock():
    """A cleanup of a process=True prefetcher run while this thread holds the fork lock (a
    collection inside it), while another thread forks a helper: one reentrant lock, no cycle."""
    run_child(
        """
        import pinstream.forklock as forklock
        def gen():
            for i in range(1000):
                yield np.full((3, 3, 5, 7), i % 256, np.uint8), np.arange(3)
        p1 = pinstream.prefetch(gen(), dtype="uint8", process=True, dry_run=True)
        next(iter(p1))
        done = []
        def other():
            p2 = pinstream.prefetch(gen(), dtype="uint8", process=True, dry_run=True)
            next(iter(p2))  # forks its helper: waits for the lock this thread does not hold
            p2.close()
            done.append(1)
        forklock.LOCK.acquire()
        t = threading.Thread(target=other)
        t.start()
        time.sleep(0.3)
        p1.close()  # its cleanup takes the lock again, on this thread
        del p1
        gc.collect()
        forklock.LOCK.release()
        t.join(60)
        assert done and not t.is_alive()
        print("ok")
        """,
        timeout=120,
    )


def test_finding_a_workers_own_fork_keeps_no_ring(tmp_path):
    out = str(tmp_path / "grandchild")

    class Forks(Batches):
        def __getitem__(self, i):
            if i == 14:
                pid = os.fork()
                if pid == 0:
                    try:
                        n = 0
                        for fd in os.listdir("/proc/self/fd"):
                            try:
                                n += "pinstream-worker-ring" in os.readlink(f"/proc/self/fd/{fd}")
                            except OSError:
                                pass
                        with open("/proc/self/maps") as f:
                            n += sum("pinstream-worker-ring" in line for line in f)
                        with open(out, "w") as f:
                            f.write(str(n))
                    finally:
                        os._exit(0)
                os.waitpid(pid, 0)
            return super().__getitem__(i)

    p = pinstream.prefetch(loader(Forks(20)), dtype="uint8", worker_ring=True, dry_run=True)
    for i, (x, _) in enumerate(p):
        assert np.array_equal(host(x), pixels(i))
    p.close()
    with open(out) as f:
        assert f.read() == "0"


def test_finding_a_sampler_that_starts_another_ring_does_not_hang():
    run_child(
        """
        import torch
        class B(torch.utils.data.Dataset):
            def __len__(self): return 8
            def __getitem__(self, i):
                return torch.full((3, 3, 5, 7), i, dtype=torch.uint8), torch.arange(3)
        probe = torch.utils.data.DataLoader(B(), batch_size=None, num_workers=1)
        class Probing(torch.utils.data.Sampler):
            def __len__(self): return 8
            def __iter__(self):
                q = pinstream.prefetch(probe, dtype="uint8", worker_ring=True, dry_run=True)
                next(iter(q))
                q.close()
                return iter(range(8))
        dl = torch.utils.data.DataLoader(B(), batch_size=None, num_workers=2, sampler=Probing())
        p = pinstream.prefetch(dl, dtype="uint8", worker_ring=True, dry_run=True)
        assert sum(1 for _ in p) == 8
        p.close()
        print("ok")
        """,
        timeout=120,
    )


def test_finding_close_with_workers_stuck_and_no_pull_ends_them():
    """Workers stuck in the dataset while no next() waits (the consumer is behind): close()
    ends them itself instead of torch's 5 s per worker (20 s here; the watchdog allows 15)."""
    run_child(
        """
        import torch
        class Stuck(torch.utils.data.Dataset):
            def __len__(self): return 100
            def __getitem__(self, i):
                if i >= 12:
                    time.sleep(3600)
                return torch.full((3, 3, 5, 7), i, dtype=torch.uint8), torch.arange(3)
        dl = torch.utils.data.DataLoader(Stuck(), batch_size=None, num_workers=4)
        p = pinstream.prefetch(dl, dtype="uint8", worker_ring=True, dry_run=True, depth=8)
        it = iter(p)
        next(it)
        time.sleep(1.0)  # the loader threads fill the queue; the workers hang on 12 and later
        p.close()
        print("ok")
        """,
        timeout=15,
    )


class FaultyBatches(torch.utils.data.Dataset):
    """A schedule's dataset: batch ``i``'s pixels from the seed ``(seed, i)`` (the same in every
    worker and here), and at batch ``k`` the fault drawn."""

    def __init__(self, plan):
        self.plan = plan

    def __len__(self):
        return self.plan["n"]

    def __getitem__(self, i):
        p = self.plan
        if i == p["k"]:
            if p["fault"] == "raise":
                raise KeyError(f"no sample {i}")
            if p["fault"] == "dtype":
                return torch.rand(p["shape"]), torch.arange(p["shape"][0])
            if p["fault"] == "shape":
                return torch.zeros((2, 3, 4), dtype=torch.uint8), torch.arange(2)
            if p["fault"] == "stall":
                time.sleep(0.3)
        return torch.from_numpy(fault_pixels(p, i)), torch.arange(p["shape"][0]) + 1000 * i


def fault_pixels(plan, i):
    return np.random.default_rng((plan["seed"], i)).integers(0, 256, plan["shape"], dtype=np.uint8)


@pytest.mark.parametrize("dry", MODES)
def test_worker_ring_random_fault_schedules(dry):
    """Random schedules (a worker raising, a wrong dtype or shape, a stall, a close from another
    thread; a consumer that breaks out early or holds its batches): every batch delivered is
    the next one's, an error names its batch, and nothing is left behind (workers, descriptors,
    rings). ``PINSTREAM_FAULT_SEED`` replays a run, as in test_faults.py."""
    import faulthandler
    import sys
    import threading

    seed = int(os.environ.get("PINSTREAM_FAULT_SEED", str(int.from_bytes(os.urandom(4), "little"))))
    rng = np.random.default_rng(seed)
    fds0 = _fds()
    names0 = sorted(os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                    if os.path.exists(f"/proc/self/fd/{fd}"))
    for s in range(int(os.environ.get("PINSTREAM_RING_FAULT_SCHEDULES", "24"))):
        big = rng.integers(4) == 0
        plan = {
            "seed": int(rng.integers(1 << 32)),
            "n": int(rng.integers(0, 13)),
            "k": int(rng.integers(0, 13)),
            "fault": str(rng.choice(["none", "none", "raise", "dtype", "shape", "stall", "close"])),
            "shape": (int(rng.integers(1, 4)), 3, 5, 7) if not big else (4, 3, 300, 300),
            "workers": int(rng.integers(1, 4)),
            "threads": int(rng.integers(1, 4)),
            "depth": int(rng.integers(1, 4)),
            "break_at": int(rng.integers(0, 15)),
            "hold": bool(rng.integers(2)),
        }
        where = f"seed {seed} schedule {s}: {plan}"
        faulthandler.dump_traceback_later(120, exit=True, file=sys.__stderr__)
        try:
            p = pinstream.prefetch(loader(FaultyBatches(plan), workers=plan["workers"]), dtype="uint8",
                                   worker_ring=True, loader_threads=plan["threads"],
                                   depth=plan["depth"], dry_run=dry)
            timer = None
            if plan["fault"] == "close":
                timer = threading.Timer(0.01 * plan["k"], p.close)
                timer.start()
            got, error, held = 0, None, []
            try:
                for x, y in p:
                    assert np.array_equal(host(x), fault_pixels(plan, got)), where
                    assert np.array_equal(host(y), np.arange(plan["shape"][0]) + 1000 * got), where
                    if plan["hold"]:
                        held.append((x, y))
                    got += 1
                    if got == plan["break_at"]:
                        break
            except pinstream.LoaderError as e:
                error = e
            faulty = plan["fault"] in ("raise", "dtype", "shape") and plan["k"] < plan["n"]
            if error is not None:
                assert faulty and error.batch == plan["k"] == got, (where, repr(error))
            elif plan["fault"] != "close" and got < plan["break_at"]:
                assert got == (plan["k"] if faulty else plan["n"]), (where, got)
            if timer is not None:
                timer.join()
            p.close()
            # The error's traceback refers to the loader's own iterator (torch's queues).
            del p, held, error
            gc.collect()
        finally:
            faulthandler.cancel_dump_traceback_later()
    # Nothing left behind (the kept ring given back): bounded polls (a watchdog, not a speed
    # bound).
    for _ in range(1500):
        gc.collect()
        wr.release_kept()
        if not workers_alive() and _fds() <= fds0 and _maps_ring() == 0:
            break
        time.sleep(0.02)
    names = sorted(os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                   if os.path.exists(f"/proc/self/fd/{fd}"))
    assert not workers_alive(), (seed, workers_alive())
    assert _fds() <= fds0, (seed, _fds(), fds0, names, names0)
    assert _maps_ring() == 0, seed


def test_worker_ring_an_error_kept_after_close_keeps_no_ring():
    """A LoaderError the caller keeps refers to the reader through its traceback: close()
    lets go of the ring's descriptors and mapping all the same."""
    p = pinstream.prefetch(loader(Batches(20, fail_at=14)), dtype="uint8", worker_ring=True,
                           dry_run=True)
    kept = None
    try:
        for _ in p:
            pass
    except pinstream.LoaderError as e:
        kept = e
    assert kept is not None
    p.close()
    del p
    gc.collect()
    # The ring is kept for the next iteration (not by the error): given back, nothing is left
    # while the error is still held.
    wr.release_kept()
    names = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
             if os.path.exists(f"/proc/self/fd/{fd}")]
    assert not any("pinstream-worker-ring" in n for n in names)
    assert _maps_ring() == 0
    del kept


@pytest.mark.parametrize("dry", MODES)
@pytest.mark.parametrize("ring", [True, False], ids=["worker_ring", "plain"])
def test_batches_held_a_while_stay_whole(dry, ring):
    # The last three batches kept while the next comes (on a GPU the prefetcher lends at most
    # depth + export_spares batches at once and says so past that), each compared as it is
    # let go: a slot or a buffer used again while a batch from it is held would show another
    # batch's bytes.
    n = 3 * 14 + 1
    want = list(sample_loader(Samples(n)))
    p = pinstream.prefetch(sample_loader(Samples(n)), dtype="uint8", worker_ring=ring, dry_run=dry)
    held, seen = [], 0

    def check(j, a):
        b = want[j]
        assert np.array_equal(host(a[0]), b[0].numpy()), j
        assert np.array_equal(host(a[1]), b[1].numpy()), j
        assert list(a[2]) == list(b[2]), j

    for a in p:
        held.append((seen, a))
        seen += 1
        if len(held) > 3:
            check(*held.pop(0))
    for j, a in held:
        check(j, a)
    assert seen == len(want) == 15
    p.close()


@pytest.mark.parametrize("dry", MODES)
def test_worker_ring_is_the_default_for_a_plain_dataloader(dry, readers, stack_small):
    n = 3 * 10
    p = pinstream.prefetch(sample_loader(Samples(n)), dtype="uint8", dry_run=dry)
    got = 0
    for i, (x, y, names) in enumerate(p):
        assert np.array_equal(host(x), pixels(i)), i
        assert host(y).tolist() == [3 * i, 3 * i + 1, 3 * i + 2], i
        assert list(names) == [f"s{3 * i + k}" for k in range(3)], i
        got += 1
    assert got == 10
    (r,) = readers
    assert r.in_ring >= 3 and r.stacked >= 3, (r.in_ring, r.stacked, r.usual)
    p.close()


class SubLoader(torch.utils.data.DataLoader):
    """A DataLoader subclass (as accelerate's and others are): its ``__iter__`` may change the
    batches, so the default leaves it to pull the usual way."""


@pytest.mark.parametrize("case", ["subclass", "persistent", "no_workers", "process", "zero_copy",
                                  "not_fresh", "off", "iterator"])
def test_worker_ring_default_stays_off_where_it_does_not_apply(case, readers):
    n = 3 * 6
    kw = {}
    src = sample_loader(Samples(n))
    if case == "subclass":
        src = SubLoader(Samples(n), batch_size=3, num_workers=2)
    elif case == "persistent":
        src = sample_loader(Samples(n), persistent_workers=True)
    elif case == "no_workers":
        src = torch.utils.data.DataLoader(Samples(n), batch_size=3, num_workers=0)
    elif case == "iterator":
        src = iter(src)
    elif case == "process":
        kw = {"process": True}
    elif case == "zero_copy":
        kw = {"zero_copy": True}
    elif case == "not_fresh":
        kw = {"fresh": False}
    elif case == "off":
        kw = {"worker_ring": False}
    assert wr.allows(src) is (case in ("process", "zero_copy", "not_fresh", "off"))
    p = pinstream.prefetch(src, dtype="uint8", dry_run=True, **kw)
    got = 0
    for i, (x, y, _) in enumerate(p):
        assert np.array_equal(host(x), pixels(i)), i
        got += 1
    assert got == 6
    assert readers == []
    p.close()


def test_worker_ring_default_off_for_spawned_workers():
    dl = sample_loader(Samples(6), multiprocessing_context="spawn")
    assert wr.allows(dl) is False
    assert wr.allows(object()) is False
    assert wr.allows([np.zeros((1, 3, 2, 2), np.uint8)]) is False


@pytest.mark.parametrize("dry", MODES)
def test_worker_ring_default_with_pin_memory(dry, readers):
    # pin_memory=True (the DataLoader's pin thread in this process): the first batches come
    # pinned the usual way, the ring's messages pass the pin thread as they are.
    import warnings

    n = 3 * 10
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # without a GPU, torch warns that it pins nothing
        p = pinstream.prefetch(sample_loader(Samples(n), pin_memory=True), dtype="uint8",
                               dry_run=dry)
        got = 0
        for i, (x, y, names) in enumerate(p):
            assert np.array_equal(host(x), pixels(i)), i
            assert host(y).tolist() == [3 * i, 3 * i + 1, 3 * i + 2], i
            assert list(names) == [f"s{3 * i + k}" for k in range(3)], i
            got += 1
    assert got == 10
    (r,) = readers
    assert r.in_ring >= 3 and r.in_ring + r.usual == 10, (r.in_ring, r.usual)
    p.close()


def test_worker_ring_small_images_are_collated_then_copied(readers):
    # Below STACK_MIN_BYTES a sample (here 105 bytes), default_collate's one C call and one
    # copy cost less than stacking sample by sample: the ring still, not stacked.
    assert wr.STACK_MIN_BYTES > 3 * 5 * 7
    n = 3 * 10
    p = pinstream.prefetch(sample_loader(Samples(n)), dtype="uint8", dry_run=True)
    for i, (x, y, _) in enumerate(p):
        assert np.array_equal(host(x), pixels(i)), i
    (r,) = readers
    assert r.in_ring >= 3 and r.stacked == 0, (r.in_ring, r.stacked)
    p.close()


def _flip_rows(batch, *, collate_fn_map=None):
    # A program's own collate for tensors, registered in torch's table: stacked, rows reversed.
    return torch.flip(torch.stack(batch), [0])


def test_worker_ring_honours_a_registered_collate_for_tensors(readers, stack_small, monkeypatch):
    # default_collate_fn_map is how torch says to extend default_collate: with an entry of the
    # program's own, the batches are what the loader itself makes, not stacked by pinstream.
    import torch.utils.data._utils.collate as tc

    monkeypatch.setitem(tc.default_collate_fn_map, torch.Tensor, _flip_rows)
    n = 3 * 10
    want = list(sample_loader(Samples(n)))
    p = pinstream.prefetch(sample_loader(Samples(n)), dtype="uint8", dry_run=True)
    got = 0
    for i, (x, _, _) in enumerate(p):
        assert np.array_equal(host(x), want[i][0].numpy()), i
        assert np.array_equal(host(x), pixels(i)[::-1]), i
        got += 1
    assert got == 10
    (r,) = readers
    assert r.in_ring >= 3 and r.stacked == 0, (r.in_ring, r.stacked)
    p.close()


def test_worker_ring_honours_a_default_collate_put_in_torchs_place(readers, stack_small, monkeypatch):
    # A library that replaces torch's default_collate (the DataLoader takes the module's
    # attribute): its function runs, not pinstream's stacking.
    import torch.utils.data._utils.collate as tc

    real = tc.default_collate

    def default_collate(batch):
        out = real(batch)
        out[0] = 255 - out[0]
        return out

    monkeypatch.setattr(tc, "default_collate", default_collate)
    n = 3 * 10
    p = pinstream.prefetch(sample_loader(Samples(n)), dtype="uint8", dry_run=True)
    got = 0
    for i, (x, _, _) in enumerate(p):
        assert np.array_equal(host(x), 255 - pixels(i)), i
        got += 1
    assert got == 10
    (r,) = readers
    assert r.in_ring >= 3 and r.stacked == 0, (r.in_ring, r.stacked)
    p.close()


@pytest.mark.parametrize("fresh", [0, np.False_, False])
def test_worker_ring_default_off_for_any_false_fresh(fresh, readers):
    p = pinstream.prefetch(sample_loader(Samples(3 * 4)), dtype="uint8", fresh=fresh, dry_run=True)
    assert len(list(p)) == 4
    assert readers == [] and p.stats()["fresh"] is False
    p.close()


class Large(torch.utils.data.Dataset):
    """Images above STACK_MIN_BYTES (3x160x160), each of its index's value."""

    def __len__(self):
        return 40

    def __getitem__(self, j):
        return torch.full((3, 160, 160), j, dtype=torch.uint8), j


def _large_first_pixels(**kw):
    want = [int(b[0][0, 0, 0, 0]) for b in torch.utils.data.DataLoader(Large(), batch_size=4,
                                                                      num_workers=2, **kw)]
    p = pinstream.prefetch(torch.utils.data.DataLoader(Large(), batch_size=4, num_workers=2, **kw),
                           dtype="uint8", dry_run=True)
    got = [int(host(b[0])[0, 0, 0, 0]) for b in p]
    p.close()
    return want, got


def test_worker_ring_stacks_large_images_of_torchs_own_collate(readers):
    want, got = _large_first_pixels()
    assert got == want == [4 * i for i in range(10)]
    assert readers[0].stacked >= 3, (readers[0].in_ring, readers[0].stacked)


def test_worker_ring_runs_a_collate_fn_wrapped_around_default_collate(readers):
    # functools.wraps copies default_collate's names: the wrapper still runs on every batch.
    import functools

    from torch.utils.data import default_collate

    @functools.wraps(default_collate)
    def inverted(batch):
        out = default_collate(batch)
        out[0] = 255 - out[0]
        return out

    want, got = _large_first_pixels(collate_fn=inverted)
    assert got == want == [255 - 4 * i for i in range(10)]
    assert readers[0].stacked == 0


@pytest.mark.parametrize("how", ["wrapped_entry", "module_collate", "no_tensor_entry"])
def test_worker_ring_follows_torchs_collate_as_changed(how, readers, monkeypatch):
    # A wrapped table entry for tensors, the module's `collate` replaced (default_collate looks
    # it up at each call), torch's entry for tensors removed: the batches (or the error) are
    # the loader's own.
    import functools

    import torch.utils.data._utils.collate as tc

    if how == "wrapped_entry":
        orig = tc.default_collate_fn_map[torch.Tensor]

        @functools.wraps(orig)
        def inv(batch, *, collate_fn_map=None):
            return 255 - orig(batch, collate_fn_map=collate_fn_map)

        monkeypatch.setitem(tc.default_collate_fn_map, torch.Tensor, inv)
    elif how == "module_collate":
        orig = tc.collate

        def collate(batch, *, collate_fn_map=None):
            out = orig(batch, collate_fn_map=collate_fn_map)
            return 255 - out if isinstance(out, torch.Tensor) and out.dim() == 4 else out

        monkeypatch.setattr(tc, "collate", collate)
    else:
        # Removed by the dataset in its worker, at sample 33 (batch 8, long after the ring was
        # made): from there the loader fails with TypeError, and so must the prefetcher, at
        # that batch.
        class Drops(Large):
            def __getitem__(self, j):
                if j == 33:
                    tc.default_collate_fn_map.pop(torch.Tensor, None)
                return super().__getitem__(j)

        def make():
            return torch.utils.data.DataLoader(Drops(), batch_size=4, num_workers=2)

        got = []
        with pytest.raises(TypeError):
            for b in make():
                got.append(int(b[1][0]))
        assert got == [4 * i for i in range(8)]
        p = pinstream.prefetch(make(), dtype="uint8", dry_run=True)
        got = []
        with pytest.raises(pinstream.LoaderError, match="TypeError"):
            for b in p:
                got.append(int(host(b[1])[0]))
        assert got == [4 * i for i in range(8)]
        assert readers[0].stacked >= 1
        p.close()
        return
    want, got = _large_first_pixels()
    assert got == want == [255 - 4 * i for i in range(10)]
    assert readers[0].stacked == 0


def test_worker_ring_leaves_pythons_random_alone():
    # The ring's id was drawn from Python's global `random`, moving the caller's draws.
    import random

    random.seed(0)
    want = random.random()
    random.seed(0)
    p = pinstream.prefetch(loader(Batches(4)), dtype="uint8", worker_ring=True, dry_run=True)
    assert sum(1 for _ in p) == 4
    p.close()
    assert random.random() == want
