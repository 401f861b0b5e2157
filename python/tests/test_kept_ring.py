"""The ring a DataLoader's workers write (``worker_ring``) outlives its iteration: once nothing
refers to its slots and its workers have exited, it waits, mapped and page-locked, for the next
iteration of its loader (or of any, once its loader is gone), which takes it over (no
page-locking or unpinning at each epoch's edges). Checked: the next epoch takes it and its
batches are whole; views still alive, or a worker that outlives its iteration, keep it from
being kept; two loaders that alternate keep one each; a ring too small for the next epoch's
batches is not kept again; an interrupted ``iter()`` loses nothing; ``KEEP_RING = False``,
``release_kept`` and ``empty_cache`` give it back; a forked process neither keeps its
descriptor nor lets it go, nor waits for a lock a parent thread held."""

import contextlib
import gc
import os
import signal
import threading
import time
import types
import warnings
import weakref

import numpy as np
import pytest

import pinstream

from conftest import needs_gpu
from test_dataloader import host, labels, pixels

torch = pytest.importorskip("torch")

import pinstream.worker_ring as wr  # noqa: E402
from test_worker_ring import MODES, Batches, _maps_ring, loader  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def device_of(dry):
    return None if dry else 0


@contextlib.contextmanager
def recorded():
    """Every ``WorkerRingReader`` made meanwhile, in a list."""
    made = []
    init = wr.WorkerRingReader.__init__

    def record(self, *a, **k):
        init(self, *a, **k)
        made.append(self)

    wr.WorkerRingReader.__init__ = record
    try:
        yield made
    finally:
        wr.WorkerRingReader.__init__ = init


def epoch(dl, dry, n):
    """One iteration of ``dl`` through ``pinstream.prefetch``, every batch checked; its reader."""
    with recorded() as made:
        p = pinstream.prefetch(dl, dtype="uint8", worker_ring=True, dry_run=dry)
    got = 0
    for i, (x, y) in enumerate(p):
        assert np.array_equal(host(x), pixels(i)), i
        assert np.array_equal(host(y), labels(i)), i
        got += 1
    assert got == n
    p.close()
    del p, x, y
    gc.collect()
    (r,) = made
    return r


def ring_fds():
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return sum("pinstream-worker-ring" in n for n in names)


@pytest.mark.parametrize("dry", MODES)
def test_the_next_epoch_takes_the_ring_over_and_its_batches_are_whole(dry):
    dl = loader(Batches(24))
    first = epoch(dl, dry, 24)
    assert first.in_ring > 0
    (kept,) = wr.kept_rings()
    assert kept.map is not None and kept.device == device_of(dry)
    registration = kept.registration
    assert (registration is None) == dry
    second = epoch(dl, dry, 24)
    # The same ring (its mapping and, on a GPU, its page-locking), from the first batches on.
    assert wr.kept_rings() == [kept]
    assert kept.registration is registration
    assert second.in_ring >= 24 - 4, (second.in_ring, second.usual)
    assert second.in_ring + second.usual == 24
    assert ring_fds() == 1 and _maps_ring() == 1
    del registration  # (it holds the mapping)
    wr.release_kept()
    assert wr.kept_rings() == []
    assert ring_fds() == 0 and _maps_ring() == 0


def test_views_still_alive_keep_the_ring_from_the_next_iteration():
    """A slot still viewed after its reader closed is not written by the next iteration's
    workers: the ring is kept only once the last view is gone."""
    r = wr.WorkerRingReader(loader(Batches(30)), None, 12, None)
    it = iter(r)
    held = [next(it) for _ in range(15)]
    assert r.in_ring > 0
    r.close()
    assert wr.kept_rings() == []
    # A reader started now makes a ring of its own; the views stay whole meanwhile.
    other = wr.WorkerRingReader(loader(Batches(30)), None, 12, None)
    it2 = iter(other)
    more = [next(it2) for _ in range(15)]
    for i, (x, _) in enumerate(held):
        assert np.array_equal(np.asarray(x), pixels(i)), i
    for i, (x, _) in enumerate(more):
        assert np.array_equal(np.asarray(x), pixels(i)), i
    other.close()
    del held, it, r, x, _, more, it2, other
    gc.collect()
    assert len(wr.kept_rings()) == 2
    assert _maps_ring() == 2


class Big(torch.utils.data.Dataset):
    """Batch ``i``: ``k`` 3x256x256 images (``k`` 4: 768 KiB, a 2 MiB slot; ``k`` 16: 3 MiB, a
    4 MiB slot), each filled from its batch and image numbers; ``k`` may change between epochs."""

    def __init__(self, n, k):
        self.n, self.k = n, k

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = torch.arange(self.k * 3 * 256 * 256, dtype=torch.int64).reshape(self.k, 3, 256, 256)
        return ((x * 7 + i * 13) % 251).to(torch.uint8), torch.arange(self.k) + 100 * i


def big_epoch(dl, dry):
    """One iteration of ``dl`` over ``Big``, every batch checked; its reader and its warnings."""
    with recorded() as made:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            p = pinstream.prefetch(dl, dtype="uint8", worker_ring=True, dry_run=dry)
            ds = dl.dataset
            for i, (x, y) in enumerate(p):
                want_x, want_y = ds[i]
                assert np.array_equal(host(x), want_x.numpy()), i
                assert np.array_equal(host(y), want_y.numpy()), i
            p.close()
            del p, x, y
            gc.collect()
    (r,) = made
    return r, [str(w.message) for w in seen if "kept" in str(w.message)]


@pytest.mark.parametrize("dry", MODES)
def test_a_loaders_own_ring_too_small_for_its_next_batches_is_not_kept_again(dry):
    ds = Big(10, 4)
    dl = loader(ds)
    r, warned = big_epoch(dl, dry)
    (small,) = wr.kept_rings()
    assert small.slot_bytes == 2 << 20 and r.in_ring > 0 and not warned
    ds.k = 16  # the same loader's images grow
    r, warned = big_epoch(dl, dry)
    assert warned and r.in_ring == 0
    # Closed once its iteration was over, not kept again; the next epoch sizes a ring anew.
    assert wr.kept_rings() == [] and small.fd == -1
    r, warned = big_epoch(dl, dry)
    assert r.in_ring > 0 and not warned
    assert [k.slot_bytes for k in wr.kept_rings()] == [4 << 20]


@pytest.mark.parametrize("dry", MODES)
def test_a_ring_left_by_a_loader_that_is_gone_is_made_anew_for_larger_batches(dry):
    """A ring whose loader is gone goes to the next loader, whatever its batches: where they do
    not fit its slots, it is made anew from the same memory before any worker maps it, with no
    warning and no epoch lost (found by the second review: the new loader's whole first epoch
    came the usual way, with a warning about another loader's ring)."""
    r, warned = big_epoch(loader(Big(10, 4)), dry)
    (small,) = wr.kept_rings()
    fd = small.fd
    r, warned = big_epoch(loader(Big(10, 16)), dry)  # the first loader is gone
    assert r.in_ring > 0 and not warned, (r.in_ring, r.usual, warned)
    (again,) = wr.kept_rings()
    assert again is small and again.fd == fd and again.slot_bytes == 4 << 20
    # And a smaller one after it uses the larger slots as they are.
    r, warned = big_epoch(loader(Big(10, 4)), dry)
    assert r.in_ring > 0 and not warned
    assert [k.slot_bytes for k in wr.kept_rings()] == [4 << 20]


def test_ctrl_c_as_the_kept_ring_leaves_the_list_loses_nothing(monkeypatch):
    """A Ctrl-C right after the kept ring left the list, before ``iter()`` had it (found by the
    second review: the ring's memory and descriptor stayed, owned by nobody)."""
    epoch(loader(Batches(16)), True, 16)
    assert len(wr.kept_rings()) == 1

    class Interrupted(list):
        def remove(self, x):
            super().remove(x)
            raise KeyboardInterrupt

    monkeypatch.setattr(wr, "_KEPT", Interrupted(wr._KEPT))
    r = wr.WorkerRingReader(loader(Batches(16)), None, 8, None)
    with pytest.raises(KeyboardInterrupt):
        iter(r)
    del r
    gc.collect()
    assert wr.kept_rings() == []
    assert ring_fds() == 0 and _maps_ring() == 0


def test_keep_ring_false_closes_the_ring_with_its_iteration(monkeypatch):
    monkeypatch.setattr(wr, "KEEP_RING", False)
    epoch(loader(Batches(16)), True, 16)
    assert wr.kept_rings() == []
    assert ring_fds() == 0 and _maps_ring() == 0


@needs_gpu
def test_empty_cache_gives_the_kept_ring_back():
    epoch(loader(Batches(16)), False, 16)
    assert len(wr.kept_rings()) == 1
    pinstream.empty_cache()
    assert wr.kept_rings() == []
    assert ring_fds() == 0 and _maps_ring() == 0


def test_a_forked_process_neither_keeps_the_ring_nor_lets_it_go():
    epoch(loader(Batches(16)), True, 16)
    (kept,) = wr.kept_rings()
    rd, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ok = wr.kept_rings() == [] and ring_fds() == 0 and _maps_ring() == 0
            wr.release_kept()  # nothing to give back here
            os.write(w, b"ok" if ok else f"{wr.kept_rings()} {ring_fds()} {_maps_ring()}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    said = os.read(rd, 200)
    os.close(rd)
    _, status = os.waitpid(pid, 0)
    assert said == b"ok" and status == 0, said
    # Still the parent's, whole.
    assert wr.kept_rings() == [kept] and ring_fds() == 1 and _maps_ring() == 1
    second = epoch(loader(Batches(16)), True, 16)
    assert second.in_ring > 0
    wr.release_kept()


def _ignore_sigterm(_):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class SlowFrom(Batches):
    """``Batches`` whose items from ``k`` on take ``seconds`` (a worker stuck in its dataset)."""

    def __init__(self, n, k, seconds):
        super().__init__(n)
        self.k, self.seconds = k, seconds

    def __getitem__(self, i):
        if i >= self.k:
            time.sleep(self.seconds)
        return super().__getitem__(i)


def test_a_worker_that_outlives_its_iteration_keeps_the_ring_from_being_kept():
    """A worker stuck in its dataset with SIGTERM ignored outlives its iteration, and still has
    the ring and its free slots: it could write a slot of the next iteration's. The ring is then
    closed, not kept, and the next iteration's batches are whole (found by the review: epoch
    2's batch 2 showed epoch 1's batch 4)."""
    dl = loader(SlowFrom(40, 8, 10), workers=1, worker_init_fn=_ignore_sigterm)
    r = wr.WorkerRingReader(dl, None, 8, None)
    it = iter(r)
    pids = [w.pid for w in r._it._workers]
    got = [next(it) for _ in range(8)]
    assert r.in_ring > 0  # the ring was made, and used
    r.close()
    del got, it, r
    gc.collect()
    try:
        assert any(os.path.exists(f"/proc/{p}") for p in pids), "the worker was to outlive its iteration"
        assert wr.kept_rings() == []
        other = wr.WorkerRingReader(loader(Batches(40)), None, 8, None)
        it2 = iter(other)
        held = [next(it2) for _ in range(8)]
        time.sleep(6)  # the stray worker wakes and takes a slot, if it has one
        for i, (x, _) in enumerate(held):
            assert np.array_equal(np.asarray(x), pixels(i)), i
        other.close()
        del held, it2, other, x, _
    finally:
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass


def test_two_loaders_that_alternate_keep_a_ring_each():
    """A training and a validation loader of different sizes, epoch after epoch: each takes its
    own kept ring back, no warning, and their batches come in the ring from the first epoch on
    (found by the review: the larger one was given the smaller one's ring, warned every epoch
    and never had a ring)."""

    class Sized(torch.utils.data.Dataset):
        def __init__(self, n, k):
            self.n, self.k = n, k

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            x = torch.arange(self.k * 3 * 256 * 256, dtype=torch.int64).reshape(self.k, 3, 256, 256)
            return ((x * 5 + i * 11 + self.k) % 253).to(torch.uint8), torch.arange(self.k) + 100 * i

    train, val = loader(Sized(12, 4)), loader(Sized(12, 16))
    for e in range(3):
        for dl, ds in ((train, Sized(12, 4)), (val, Sized(12, 16))):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                p = pinstream.prefetch(dl, dtype="uint8", worker_ring=True, dry_run=True)
                for i, (x, y) in enumerate(p):
                    assert np.array_equal(host(x), ds[i][0].numpy()), (e, i)
                    assert np.array_equal(host(y), ds[i][1].numpy()), (e, i)
                p.close()
                del p, x, y
                gc.collect()
            assert not [w for w in seen if "kept" in str(w.message)], [str(w.message) for w in seen]
    assert sorted(r.slot_bytes for r in wr.kept_rings()) == [2 << 20, 4 << 20]


def test_ctrl_c_in_iter_after_the_kept_ring_was_taken_loses_nothing():
    """Ctrl-C while ``iter()`` waits for the fork lock (another thread forking), after it took
    the kept ring: the ring is closed, its descriptor too, and nothing is left in the table
    (found by the review: the memfd stayed open, owned by nobody)."""
    import pinstream.forklock as forklock

    epoch(loader(Batches(16)), True, 16)
    assert len(wr.kept_rings()) == 1
    busy, done = threading.Event(), threading.Event()

    def forking_elsewhere():
        with forklock.LOCK:
            busy.set()
            done.wait(10)

    th = threading.Thread(target=forking_elsewhere)
    th.start()
    busy.wait()
    main = threading.get_ident()
    timer = threading.Timer(0.3, lambda: signal.pthread_kill(main, signal.SIGINT))
    timer.start()
    r = wr.WorkerRingReader(loader(Batches(16)), None, 8, None)
    try:
        with pytest.raises(KeyboardInterrupt):
            iter(r)
    finally:
        done.set()
        th.join()
        timer.cancel()
    del r
    gc.collect()
    assert wr.kept_rings() == []
    assert ring_fds() == 0 and _maps_ring() == 0
    assert not any(wr._FDS.values())


def test_empty_cache_checks_its_device_before_giving_anything_back():
    epoch(loader(Batches(16)), True, 16)
    with pytest.raises(pinstream.InvalidArgumentError):
        pinstream.empty_cache(True)
    assert len(wr.kept_rings()) == 1  # a dry run's ring: not the device's


def test_a_child_forked_while_the_lock_is_held_can_give_rings_back():
    """The kept rings' lock held by a thread of the parent at the fork (here the forking thread
    itself) is a new lock in the child: its exit handler does not wait for it forever."""
    rd, w = os.pipe()
    with wr._KEPT_LOCK:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.alarm(20)  # a watchdog: a hang ends the child, and the test fails
                wr.release_kept()
                wr._at_exit()
                os.write(w, b"ok")
                code = 0
            finally:
                os._exit(code)
    os.close(w)
    said = os.read(rd, 10)
    os.close(rd)
    _, status = os.waitpid(pid, 0)
    assert said == b"ok" and status == 0, (said, status)


def test_a_collection_inside_the_kept_rings_lock_does_not_deadlock():
    """A collection while a thread holds the kept rings' lock (any allocation there) can let
    another ring's last view go, whose finalizer keeps that ring on the same thread (found by
    the second review: with a lock that was not reentrant, this hung). Here the collection is
    made to happen there."""
    from test_hostile import run_child

    run_child(
        """
        import torch, numpy as np, pinstream.worker_ring as wr
        class B(torch.utils.data.Dataset):
            def __len__(self): return 6
            def __getitem__(self, i):
                return torch.full((3, 3, 5, 7), i, dtype=torch.uint8), torch.arange(3)
        def loader():
            return torch.utils.data.DataLoader(B(), batch_size=None, num_workers=2)
        A, C = loader(), loader()
        def views(dl):
            r = wr.WorkerRingReader(dl, None, 4, None)
            got = []
            for i, (x, y) in enumerate(r):
                assert int(x[0, 0, 0, 0]) == i
                got.append(x)
            made = r.in_ring
            r.close()
            return got, made
        a, made = views(A)
        assert made > 0
        del a
        gc.collect()
        assert len(wr.kept_rings()) == 1           # A's
        gc.disable()
        c, made = views(C)
        assert made > 0
        c.append(c)
        del c                                       # C's views: garbage in a cycle, not collected
        orphan = wr._Ring.orphan
        def collecting(self):
            gc.collect()                            # under the lock: C's ring goes, and is kept
            return orphan(self)
        wr._Ring.orphan = collecting
        again, made = views(A)                      # iter() takes A's ring under the lock
        wr._Ring.orphan = orphan
        assert made > 0
        del again
        gc.enable()
        gc.collect()
        assert len(wr.kept_rings()) == 2
        print("ok")
        """,
        timeout=120,
    )


def pipe_fds():
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
        except OSError:
            pass
    return n


def _is_pipe(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
    except OSError:
        return False


def _settled(base_pipes):
    """The workers gone (they are joined as the loader's iterator ends), and no pipe left open
    beyond ``base_pipes``."""
    import multiprocessing

    for _ in range(200):
        if not multiprocessing.active_children():
            break
        time.sleep(0.05)
    assert not multiprocessing.active_children()
    assert pipe_fds() == base_pipes


@pytest.mark.parametrize("at", ["slots", "finalizer", "adopting"])
def test_ctrl_c_in_iter_after_the_loaders_iter_loses_nothing(at, monkeypatch):
    """Ctrl-C in ``iter()`` after the loader's own ``iter()`` returned (its workers forked), while
    the reader takes over the pipe's write end, or hands its own kept ring's slots to the new
    workers (``at``): within ``iter()`` itself (the caller never gets the reader), the pipe is
    closed and the workers end; the ring is kept or closed as after any iteration (left by the
    first review: the free slots' pipe stayed open; the adopting case found by the review of
    that fix)."""
    import pinstream.process as pp

    ld = loader(Batches(16))
    if at == "adopting":
        epoch(ld, True, 16)
        assert len(wr.kept_rings()) == 1
    base_pipes, base_rings = pipe_fds(), ring_fds()

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    if at == "slots":
        monkeypatch.setattr(wr, "_Slots", interrupted)
    elif at == "finalizer":
        # Only the reader's own finalizer (``_stop``): the ring's hold makes one earlier.
        def finalize(obj, f, *a, **k):
            if f is wr._stop:
                raise KeyboardInterrupt
            return weakref.finalize(obj, f, *a, **k)

        monkeypatch.setattr(wr, "weakref", types.SimpleNamespace(ref=weakref.ref, finalize=finalize))
    else:
        class Slots(pp._Slots):
            given = 0

            def release(self, s):
                Slots.given += 1
                if Slots.given == 3:
                    raise KeyboardInterrupt
                return super().release(s)

        monkeypatch.setattr(wr, "_Slots", Slots)
    r = wr.WorkerRingReader(ld, None, 8, None)
    with pytest.raises(KeyboardInterrupt):
        iter(r)
    monkeypatch.undo()
    # Within iter() itself (the traceback still refers to the reader, and its frame to the
    # loader's iterator and that iterator's queues): no pipe of the ring's left in the table.
    assert not [fd for fd in wr._FDS.get(r._ring_id, ()) if _is_pipe(fd)]
    del r
    gc.collect()
    _settled(base_pipes)
    wr.release_kept()
    assert not any(wr._FDS.values())
    assert ring_fds() == 0 if at == "adopting" else ring_fds() == base_rings
    # The loader's next epoch is whole.
    epoch(ld, True, 16)


def test_a_second_ctrl_c_while_iter_ends_the_workers_loses_nothing(monkeypatch):
    """A first Ctrl-C as the reader's finalizer is made, a second while ``iter()`` waits for the
    workers to end: the free slots' pipe is closed all the same (found by the review: the slots'
    write end and its table entry stayed for good)."""
    import multiprocessing.process as mpp

    base_pipes = pipe_fds()
    armed = []
    real_join = mpp.BaseProcess.join

    def join(self, timeout=None):
        if armed:
            armed.clear()
            raise KeyboardInterrupt("second")
        return real_join(self, timeout)

    def finalize(obj, f, *a, **k):
        if f is wr._stop:
            armed.append(1)
            raise KeyboardInterrupt("first")
        return weakref.finalize(obj, f, *a, **k)

    monkeypatch.setattr(wr, "weakref", types.SimpleNamespace(ref=weakref.ref, finalize=finalize))
    monkeypatch.setattr(mpp.BaseProcess, "join", join)
    r = wr.WorkerRingReader(loader(Batches(16)), None, 8, None)
    with pytest.raises(KeyboardInterrupt):
        iter(r)
    monkeypatch.undo()
    del r
    gc.collect()
    _settled(base_pipes)
    wr.release_kept()
    assert not any(wr._FDS.values())
