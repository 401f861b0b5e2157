"""Issue 32: a DataLoader as the prefetcher's source without the serial copy (``fresh``).

The loader threads take the items in turn and copy each item's pixels into page-locked memory
after its turn, on every loader at once (``fresh=True``, chosen by default for a torch
``DataLoader`` with worker processes); page-locked items (``pin_memory=True``) go to the GPU as
they are. Checked here: order with several loaders and several workers finishing out of order,
an error at batch k (a worker's included) with the original as ``__cause__``, an early exit
that must end the threads, ``pin_memory`` on and off (how many copies pinstream made),
``persistent_workers`` over several epochs, and dict and tuple batches with extra items.

The plain-Python tests need no torch (an iterable of fresh arrays stands in for the
DataLoader: worker threads that finish out of order, batches handed out in order); the
DataLoader tests skip without torch. Each runs as a dry run (CPU) and on a GPU where there is
one. No test measures time: the stats counted are copies, items and the chosen mode.
"""

import queue
import random
import threading
import time

import numpy as np
import pytest

import pinstream

from conftest import needs_gpu
from test_hostile import run_child

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

MODES = [
    pytest.param(True, id="dry_run"),
    pytest.param(False, id="device", marks=needs_gpu),
]


def host(x):
    """A batch's array on the host, whether it came from a dry run or the device."""
    return x if isinstance(x, np.ndarray) else pinstream.download(x)


def pixels(i, n=3, c=3, h=5, w=7):
    """Batch ``i``'s pixels: every byte from ``i`` (so a batch out of place shows)."""
    base = np.arange(n * c * h * w, dtype=np.int64).reshape(n, c, h, w)
    return ((base * 7 + i * 13) % 251).astype(np.uint8)


def labels(i, n=3):
    return np.arange(n, dtype=np.int64) + 1000 * i


class WorkerLike:
    """What a DataLoader with workers looks like to its consumer, in plain Python: ``workers``
    threads make the batches (a new array each, in an order of their own: each sleeps a random
    moment first), and ``__next__`` hands them out in index order, waiting for the one due.
    ``fail_at``: that batch's ``__next__`` raises the exception given."""

    def __init__(self, n, workers=3, fail_at=None, exc=None, extra=False):
        self.n, self.fail_at, self.exc, self.extra = n, fail_at, exc, extra
        self.done = {}
        self.cv = threading.Condition()
        self.next_i = 0
        self.todo = queue.Queue()
        for i in range(n):
            self.todo.put(i)
        self.threads = [threading.Thread(target=self._work, daemon=True) for _ in range(workers)]
        for t in self.threads:
            t.start()

    def _work(self):
        rng = random.Random()
        while True:
            try:
                i = self.todo.get_nowait()
            except queue.Empty:
                return
            time.sleep(rng.random() * 0.004)
            item = (pixels(i), labels(i)) + ((f"b{i}",) if self.extra else ())
            with self.cv:
                self.done[i] = item
                self.cv.notify_all()

    def __iter__(self):
        return self

    def __next__(self):
        i = self.next_i
        if i >= self.n:
            raise StopIteration
        if i == self.fail_at:
            raise self.exc
        with self.cv:
            self.cv.wait_for(lambda: i in self.done, timeout=60)
            item = self.done.pop(i)
        self.next_i += 1
        return item


@pytest.mark.parametrize("dry", MODES)
@pytest.mark.parametrize("threads", [1, 4, 7])
def test_fresh_keeps_order_and_copies_after_the_turn(dry, threads):
    p = pinstream.prefetch(
        WorkerLike(24), dtype="uint8", fresh=True, loader_threads=threads, dry_run=dry
    )
    got = 0
    for i, (x, y) in enumerate(p):
        assert np.array_equal(host(x), pixels(i)), i
        assert np.array_equal(host(y), labels(i)), i
        got += 1
    assert got == 24
    st = p.stats()
    assert st["fresh"] is True and st["items"] == 24
    # One host copy per batch, each after its turn.
    assert st["copied_after"] == 24 and st["copied_in_turn"] == 0 and st["direct"] == 0


@pytest.mark.parametrize("dry", MODES)
def test_default_copies_in_the_turn_for_an_iterable_that_refills(dry):
    """Not fresh (a plain iterable): the copy stays in the turn, so refilling one array is
    still safe."""
    buf = np.empty((3, 3, 5, 7), np.uint8)

    def refill():
        for i in range(9):
            buf[...] = pixels(i)
            yield buf, labels(i)

    p = pinstream.prefetch(refill(), dtype="uint8", loader_threads=4, dry_run=dry)
    for i, (x, y) in enumerate(p):
        assert np.array_equal(host(x), pixels(i)), i
    st = p.stats()
    assert st["fresh"] is False and st["copied_in_turn"] == 9 and st["copied_after"] == 0


def test_fresh_is_chosen_only_for_dataloaders_with_workers():
    assert pinstream.prefetch(iter([]), dry_run=True).stats()["fresh"] is False
    assert pinstream.prefetch(WorkerLike(0), dry_run=True).stats()["fresh"] is False
    assert pinstream.prefetch(iter([]), dry_run=True, fresh=True).stats()["fresh"] is True
    # zero_copy makes the same promise.
    assert pinstream.prefetch(iter([]), dry_run=True, zero_copy=True).stats()["fresh"] is True


@pytest.mark.parametrize("dry", MODES)
def test_fresh_error_at_k_is_a_loader_error_with_the_original_as_cause(dry):
    err = ValueError("worker says no at 3")
    p = pinstream.prefetch(
        WorkerLike(10, fail_at=3, exc=err), dtype="uint8", fresh=True, loader_threads=5,
        dry_run=dry,
    )
    seen = []
    with pytest.raises(pinstream.LoaderError) as e:
        for x, y in p:
            seen.append(host(y)[0] // 1000)
    assert seen == [0, 1, 2]
    assert e.value.batch == 3 and e.value.__cause__ is err


@pytest.mark.parametrize("dry", MODES)
def test_fresh_bad_batch_at_k_is_a_loader_error(dry):
    def items():
        for i in range(6):
            yield (pixels(i)[:, :, :, :0] if i == 2 else pixels(i)), labels(i)

    p = pinstream.prefetch(items(), dtype="uint8", fresh=True, loader_threads=3, dry_run=dry)
    with pytest.raises(pinstream.LoaderError) as e:
        list(host(x) for x, _ in p)
    assert e.value.batch == 2
    assert isinstance(e.value.__cause__, pinstream.InvalidArgumentError)


@pytest.mark.parametrize("dry", MODES)
def test_fresh_early_exit_ends_the_threads(dry):
    """``break``, ``close()`` and leaving a ``with`` block over an endless source of fresh
    arrays, with many loaders: no hang (the child is killed, and the test fails, if one
    does), and nothing left behind."""
    run_child(
        f"""
        dry = {dry!r}
        def endless():
            i = 0
            while True:
                yield np.full((2, 3, 4, 4), i % 251, np.uint8), np.arange(2) + i
                i += 1
        fetch = (lambda x: x) if dry else pinstream.download
        p = pinstream.prefetch(endless(), dtype="uint8", fresh=True, loader_threads=6, dry_run=dry)
        for k, (x, y) in enumerate(p):
            assert fetch(x)[0, 0, 0, 0] == k
            if k == 3:
                break
        p.close()
        with pinstream.prefetch(endless(), dtype="uint8", fresh=True, dry_run=dry) as q:
            next(q)
        r = pinstream.prefetch(endless(), dtype="uint8", fresh=True, dry_run=dry)
        next(r)
        del p, q, r, x, y
        gc.collect()
        assert pinstream.memory_stats()["prefetchers"] == 0, pinstream.memory_stats()
        print("ok")
        """,
        timeout=120,
    )


@pytest.mark.parametrize("dry", MODES)
@pytest.mark.parametrize("fresh", [False, True])
def test_dict_items_come_back_as_dicts(dry, fresh):
    def items():
        for i in range(5):
            yield {"name": f"s{i}", "image": pixels(i), "idx": i, "label": labels(i)}

    p = pinstream.prefetch(items(), dtype="uint8", fresh=fresh, dry_run=dry)
    n = 0
    for i, d in enumerate(p):
        assert list(d) == ["name", "image", "idx", "label"]
        assert d["name"] == f"s{i}" and d["idx"] == i
        assert np.array_equal(host(d["image"]), pixels(i))
        assert np.array_equal(host(d["label"]), labels(i))
        n += 1
    assert n == 5


@pytest.mark.parametrize("dry", MODES)
def test_dict_keys_named_and_missing(dry):
    items = [{"px": pixels(i), "cls": labels(i), "other": "x"} for i in range(3)]
    got = list(pinstream.prefetch(iter(items), dtype="uint8", keys=("px", "cls"), dry_run=dry))
    assert [host(d["cls"])[0] for d in got] == [0, 1000, 2000]
    assert all(d["other"] == "x" for d in got)
    # Images only: no labels key, so none.
    got = list(pinstream.prefetch(iter(items), dtype="uint8", keys="px", dry_run=dry))
    assert set(got[0]) == {"px", "cls", "other"} and got[0]["cls"] is items[0]["cls"]
    # No known key for the images, and a named key that is missing: a LoaderError naming the
    # batch, the cause saying what to do.
    for kw in ({}, {"keys": ("image", "cls")}):
        with pytest.raises(pinstream.LoaderError) as e:
            list(pinstream.prefetch(iter(items), dtype="uint8", dry_run=dry, **kw))
        assert e.value.batch == 0
        assert isinstance(e.value.__cause__, pinstream.InvalidArgumentError)
        assert "keys" in str(e.value.__cause__)
    with pytest.raises(pinstream.InvalidArgumentError):
        pinstream.prefetch(iter(items), keys=(1, 2), dry_run=True)


@pytest.mark.parametrize("dry", MODES)
def test_fresh_tuples_with_extra_items(dry):
    p = pinstream.prefetch(WorkerLike(8, extra=True), dtype="uint8", fresh=True, dry_run=dry)
    for i, (x, y, name) in enumerate(p):
        assert name == f"b{i}" and np.array_equal(host(x), pixels(i))


# ------------------------------------------------------------------------------------------
# torch DataLoaders (skipped without torch).


def _torch():
    return pytest.importorskip("torch")


def to_host(x):
    """A batch's array from ``pinstream.prefetch`` (dry run: numpy) or
    ``pinstream.torch.prefetch`` (torch, on the GPU) as numpy."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, pinstream.Tensor):
        return pinstream.download(x)
    return x.cpu().numpy()


def prefetch_of(dry):
    """The prefetcher that pulls a DataLoader in this process (``worker_ring=False``; the
    default ring for a plain DataLoader is tested in test_worker_ring.py)."""
    if dry:
        return lambda src, **kw: pinstream.prefetch(src, dry_run=True, worker_ring=False, **kw)
    import pinstream.torch as pt

    return lambda src, **kw: pt.prefetch(src, worker_ring=False, **kw)


def dataset(n, fail_at=None, kind="tuple"):
    torch = _torch()

    class DS(torch.utils.data.Dataset):
        """Batch ``i`` (``batch_size=None``): a new tensor, after a sleep of its own so that
        the workers finish out of order."""

        def __len__(self):
            return n

        def __getitem__(self, i):
            if i == fail_at:
                raise ValueError(f"bad sample {i}")
            time.sleep((i * 7 % 5) * 0.002)
            px, lab = torch.from_numpy(pixels(i)), torch.from_numpy(labels(i))
            if kind == "dict":
                return {"image": px, "label": lab, "name": f"s{i}"}
            if kind == "extra":
                return px, lab, i
            return px, lab

    return DS()


def loader(n, workers=3, **kw):
    torch = _torch()
    ds_kw = {k: kw.pop(k) for k in ("fail_at", "kind") if k in kw}
    return torch.utils.data.DataLoader(dataset(n, **ds_kw), batch_size=None, num_workers=workers, **kw)


@pytest.mark.parametrize("dry", MODES)
def test_dataloader_with_workers_in_order(dry):
    p = prefetch_of(dry)(loader(20, workers=4), dtype="uint8")
    n = 0
    for i, (x, y) in enumerate(p):
        assert np.array_equal(to_host(x), pixels(i)), i
        assert np.array_equal(to_host(y), labels(i)), i
        n += 1
    assert n == 20
    st = p.stats()
    assert st["fresh"] is True and st["copied_after"] == 20 and st["copied_in_turn"] == 0


@pytest.mark.parametrize("dry", MODES)
def test_dataloader_without_workers_copies_in_the_turn(dry):
    p = prefetch_of(dry)(loader(5, workers=0), dtype="uint8")
    assert [to_host(y)[0] for _, y in p] == [0, 1000, 2000, 3000, 4000]
    st = p.stats()
    assert st["fresh"] is False and st["copied_in_turn"] == 5


@pytest.mark.parametrize("dry", MODES)
def test_dataloader_worker_exception_is_the_cause(dry):
    p = prefetch_of(dry)(loader(12, workers=3, fail_at=5), dtype="uint8")
    seen = []
    with pytest.raises(pinstream.LoaderError) as e:
        for x, y in p:
            seen.append(int(to_host(y)[0]) // 1000)
    assert seen == [0, 1, 2, 3, 4]
    assert e.value.batch == 5
    # The DataLoader re-raises the worker's exception in the main process (same type, the
    # worker's traceback in its message): that is the cause.
    assert isinstance(e.value.__cause__, ValueError)
    assert "bad sample 5" in str(e.value.__cause__)


@pytest.mark.parametrize("dry", MODES)
def test_dataloader_early_break_does_not_hang(dry):
    pytest.importorskip("torch")
    run_child(
        f"""
        import torch
        dry = {dry!r}
        class DS(torch.utils.data.Dataset):
            def __len__(self):
                return 10_000
            def __getitem__(self, i):
                return torch.full((2, 3, 4, 4), i % 251, dtype=torch.uint8), torch.arange(2) + i
        if dry:
            pf = lambda src, **kw: pinstream.prefetch(src, dry_run=True, worker_ring=False, **kw)
        else:
            import pinstream.torch as pt
            pf = lambda src, **kw: pt.prefetch(src, worker_ring=False, **kw)
        for epoch in range(2):
            dl = torch.utils.data.DataLoader(DS(), batch_size=None, num_workers=2)
            p = pf(dl, dtype="uint8")
            for k, (x, y) in enumerate(p):
                assert int(y[0]) == k
                if k == 3:
                    break
            p.close()
            del p, dl, x, y
        gc.collect()
        assert pinstream.memory_stats()["prefetchers"] == 0, pinstream.memory_stats()
        print("ok")
        """,
        timeout=180,
    )


@pytest.mark.parametrize("pin", [False, True])
@pytest.mark.parametrize("dry", MODES)
def test_dataloader_pin_memory_on_and_off(dry, pin):
    """``pin_memory=False``: pinstream copies each batch into page-locked memory, once.
    ``pin_memory=True``: the batches are page-locked already and go to the GPU as they are, with
    no copy of pinstream's (on the device; a dry run has no page-locked memory)."""
    import warnings

    with warnings.catch_warnings():
        # Without a GPU, torch warns that pin_memory pins nothing.
        warnings.simplefilter("ignore")
        p = prefetch_of(dry)(loader(10, workers=2, pin_memory=pin), dtype="uint8")
        for i, (x, y) in enumerate(p):
            assert np.array_equal(to_host(x), pixels(i)), i
            assert np.array_equal(to_host(y), labels(i)), i
    st = p.stats()
    assert st["items"] == 10 and st["copied_in_turn"] == 0
    if pin and not dry:
        assert st["direct"] == 10 and st["copied_after"] == 0
    else:
        assert st["direct"] == 0 and st["copied_after"] == 10


@pytest.mark.parametrize("dry", MODES)
def test_dataloader_persistent_workers_over_epochs(dry):
    dl = loader(9, workers=2, persistent_workers=True)
    pf = prefetch_of(dry)
    # Epoch 0 is left early; the DataLoader resumes its workers for the next.
    p = pf(dl, dtype="uint8")
    assert int(to_host(next(p)[1])[0]) == 0
    p.close()
    for epoch in range(2):
        p = pf(dl, dtype="uint8")
        got = [(int(to_host(x)[0, 0, 0, 0]), int(to_host(y)[0])) for x, y in p]
        assert got == [(int(pixels(i)[0, 0, 0, 0]), 1000 * i) for i in range(9)], epoch
        assert p.stats()["fresh"] is True


@pytest.mark.parametrize("dry", MODES)
def test_dataloader_dict_batches(dry):
    torch = _torch()
    dl = torch.utils.data.DataLoader(
        dataset(12, kind="dict"), batch_size=None, num_workers=2
    )
    n = 0
    for i, d in enumerate(prefetch_of(dry)(dl, dtype="uint8")):
        assert list(d) == ["image", "label", "name"]
        assert d["name"] == f"s{i}"
        assert np.array_equal(to_host(d["image"]), pixels(i))
        assert np.array_equal(to_host(d["label"]), labels(i))
        n += 1
    assert n == 12


@pytest.mark.parametrize("dry", MODES)
def test_dataloader_collated_tuples_with_extra_items(dry):
    """Samples ``(image, label, index)`` collated by the DataLoader (``batch_size=2``): a list
    ``[images, labels, indices]``; the indices (a CPU tensor) are passed through."""
    torch = _torch()

    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.from_numpy(pixels(i, n=1)[0]), i + 100, i

    dl = torch.utils.data.DataLoader(Samples(), batch_size=2, num_workers=2)
    n = 0
    for b, (x, y, idx) in enumerate(prefetch_of(dry)(dl, dtype="uint8")):
        want = np.stack([pixels(2 * b + k, n=1)[0] for k in range(2)])
        assert np.array_equal(to_host(x), want)
        assert to_host(y).tolist() == [2 * b + 100, 2 * b + 101]
        assert isinstance(idx, torch.Tensor) and idx.tolist() == [2 * b, 2 * b + 1]
        n += 1
    assert n == 4


@pytest.mark.parametrize("how", ["close", "close_during_next", "exit"])
def test_dataloader_stuck_worker_does_not_hold_close_or_exit(how):
    """A worker stuck in the dataset (its read hangs): the prefetcher pulling in this process
    (``worker_ring=False``) still closes within a few seconds, a ``next()`` waiting meanwhile
    ends as the end of the iteration, and the interpreter exits without ``close()``."""
    pytest.importorskip("torch")
    run_child(
        f"""
        import threading, time, torch, multiprocessing
        how = {how!r}
        class Stuck(torch.utils.data.Dataset):
            def __len__(self): return 400
            def __getitem__(self, j):
                if j >= 40:
                    time.sleep(3600)
                return torch.full((3, 8, 8), j % 256, dtype=torch.uint8), j
        dl = torch.utils.data.DataLoader(Stuck(), batch_size=4, num_workers=2)
        p = pinstream.prefetch(dl, dtype="uint8", dry_run=True, worker_ring=False)
        it = iter(p)
        for i in range(10):
            x, y = next(it)
            assert int(y[0]) == 4 * i
        if how == "close":
            p.close()  # (the child's time limit is the watchdog)
        elif how == "close_during_next":
            threading.Timer(1.0, p.close).start()
            try:
                next(it)
                raise AssertionError("a batch after close")
            except StopIteration:
                pass
        if how != "exit":
            time.sleep(0.5)
            assert not multiprocessing.active_children(), multiprocessing.active_children()
        print("ok")
        """,
        timeout=120,
    )


@pytest.mark.parametrize("dry", MODES)
def test_dataloader_persistent_workers_survive_a_normal_close(dry):
    """The close that ends stuck workers leaves a persistent loader's workers alone when
    nothing is stuck: the next epoch runs on them."""
    dl = loader(9, workers=2, persistent_workers=True)
    pf = prefetch_of(dry)
    p = pf(dl, dtype="uint8")
    for i, (x, _) in enumerate(p):
        assert np.array_equal(to_host(x), pixels(i)), i
    p.close()
    workers = list(dl._iterator._workers)
    p = pf(dl, dtype="uint8")
    got = [int(to_host(y)[0]) for _, y in p]
    assert got == [1000 * i for i in range(9)]
    assert list(dl._iterator._workers) == workers and all(w.is_alive() for w in workers)
    p.close()


@pytest.mark.parametrize("ctrl_c_at", [None, 0.55, 5.2])
def test_dataloader_stuck_persistent_workers_are_replaced_and_ctrl_c_does_not_hang_close(ctrl_c_at):
    """A persistent loader whose worker is stuck at close: close() ends its workers (after
    ``STUCK_SECONDS``) and the loader's next epoch runs on new ones; a Ctrl-C in the middle of
    that close (in the wait, or while the workers are being ended) neither hangs it nor leaves
    workers behind."""
    pytest.importorskip("torch")
    run_child(
        f"""
        import os, signal, tempfile, threading, time, torch, multiprocessing
        flag = tempfile.mktemp()
        open(flag, "w").close()
        class Stuck(torch.utils.data.Dataset):
            def __len__(self): return 80
            def __getitem__(self, j):
                if j >= 40 and os.path.exists(flag):
                    time.sleep(3600)
                return torch.full((3, 8, 8), j % 256, dtype=torch.uint8), j
        dl = torch.utils.data.DataLoader(Stuck(), batch_size=4, num_workers=2, persistent_workers=True)
        p = pinstream.prefetch(dl, dtype="uint8", dry_run=True, worker_ring=False)
        it = iter(p)
        for i in range(10):
            assert int(next(it)[1][0]) == 4 * i
        time.sleep(0.2)
        at = {ctrl_c_at!r}
        if at is not None:
            threading.Timer(at, lambda: signal.raise_signal(signal.SIGINT)).start()
        try:
            p.close()
        except KeyboardInterrupt:
            pass
        os.unlink(flag)
        time.sleep(0.5)
        old = [c for c in multiprocessing.active_children()]
        assert not old, old
        for epoch in range(2):
            p = pinstream.prefetch(dl, dtype="uint8", dry_run=True, worker_ring=False)
            got = [int(y[0]) for _, y in p]
            assert got == [4 * i for i in range(20)], (epoch, got)
            p.close()
        print("ok")
        """,
        timeout=120,
    )
