"""The ring a DataLoader's workers write (``worker_ring``) outlives its iteration: once nothing
refers to its slots, it waits, mapped and page-locked, for the next iteration, which takes it
over (no page-locking or unpinning at each epoch's edges). Checked: the next epoch takes it and
its batches are whole; views still alive keep it from being taken; a ring too small for the
next epoch's batches is not kept again; ``KEEP_RING = False``, ``release_kept`` and
``empty_cache`` give it back; a forked process neither keeps its descriptor nor lets it go."""

import gc
import os
import warnings

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


def epoch(dl, dry, n):
    """One iteration of ``dl`` through ``pinstream.prefetch``, every batch checked; its reader."""
    made = []
    init = wr.WorkerRingReader.__init__

    def record(self, *a, **k):
        init(self, *a, **k)
        made.append(self)

    wr.WorkerRingReader.__init__ = record
    try:
        p = pinstream.prefetch(dl, dtype="uint8", worker_ring=True, dry_run=dry)
    finally:
        wr.WorkerRingReader.__init__ = init
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
    kept = wr._KEPT[0]
    assert kept is not None and kept.map is not None and kept.device == device_of(dry)
    registration = kept.registration
    assert (registration is None) == dry
    second = epoch(dl, dry, 24)
    # The same ring (its mapping and, on a GPU, its page-locking), from the first batches on.
    assert wr._KEPT[0] is kept
    assert kept.registration is registration
    assert second.in_ring >= 24 - 4, (second.in_ring, second.usual)
    assert second.in_ring + second.usual == 24
    assert ring_fds() == 1 and _maps_ring() == 1
    del registration  # (it holds the mapping)
    wr.release_kept()
    assert wr._KEPT[0] is None
    assert ring_fds() == 0 and _maps_ring() == 0


def test_views_still_alive_keep_the_ring_from_the_next_iteration():
    """A slot still viewed after its reader closed is not written by the next iteration's
    workers: the ring is kept only once the last view is gone."""
    r = wr.WorkerRingReader(loader(Batches(30)), None, 12, None)
    it = iter(r)
    held = [next(it) for _ in range(15)]
    assert r.in_ring > 0
    r.close()
    assert wr._KEPT[0] is None
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
    assert wr._KEPT[0] is not None  # one of the two, the other closed
    assert _maps_ring() == 1


@pytest.mark.parametrize("dry", MODES)
def test_a_kept_ring_too_small_for_the_next_batches_is_not_kept_again(dry):
    class Big(torch.utils.data.Dataset):
        """Batch ``i``: ``k`` 3x256x256 images (``k`` 4: 768 KiB, a 2 MiB slot; ``k`` 16:
        3 MiB), each filled from its batch and image numbers."""

        def __init__(self, n, k):
            self.n, self.k = n, k

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            x = torch.arange(self.k * 3 * 256 * 256, dtype=torch.int64).reshape(self.k, 3, 256, 256)
            return ((x * 7 + i * 13) % 251).to(torch.uint8), torch.arange(self.k) + 100 * i

    def run(k, n=10):
        p = pinstream.prefetch(loader(Big(n, k)), dtype="uint8", worker_ring=True, dry_run=dry)
        ds = Big(n, k)
        for i, (x, y) in enumerate(p):
            want_x, want_y = ds[i]
            assert np.array_equal(host(x), want_x.numpy()), (k, i)
            assert np.array_equal(host(y), want_y.numpy()), (k, i)
        p.close()
        del p, x, y
        gc.collect()

    run(4)
    small = wr._KEPT[0]
    assert small is not None and small.slot_bytes == 2 << 20
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run(16)
    assert any("kept from the last iteration" in str(w.message) for w in seen), [str(w.message) for w in seen]
    # Closed once its iteration was over, not kept again; the next epoch sizes a ring anew.
    assert wr._KEPT[0] is None and small.fd == -1
    run(16)
    assert wr._KEPT[0] is not None and wr._KEPT[0].slot_bytes == 4 << 20
    wr.release_kept()


def test_keep_ring_false_closes_the_ring_with_its_iteration(monkeypatch):
    monkeypatch.setattr(wr, "KEEP_RING", False)
    epoch(loader(Batches(16)), True, 16)
    assert wr._KEPT[0] is None
    assert ring_fds() == 0 and _maps_ring() == 0


@needs_gpu
def test_empty_cache_gives_the_kept_ring_back():
    epoch(loader(Batches(16)), False, 16)
    assert wr._KEPT[0] is not None
    pinstream.empty_cache()
    assert wr._KEPT[0] is None
    assert ring_fds() == 0 and _maps_ring() == 0


def test_a_forked_process_neither_keeps_the_ring_nor_lets_it_go():
    epoch(loader(Batches(16)), True, 16)
    kept = wr._KEPT[0]
    assert kept is not None
    rd, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ok = wr._KEPT[0] is None and ring_fds() == 0 and _maps_ring() == 0
            wr.release_kept()  # nothing to give back here
            os.write(w, b"ok" if ok else f"{wr._KEPT[0]} {ring_fds()} {_maps_ring()}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    said = os.read(rd, 200)
    os.close(rd)
    _, status = os.waitpid(pid, 0)
    assert said == b"ok" and status == 0, said
    # Still the parent's, whole.
    assert wr._KEPT[0] is kept and ring_fds() == 1 and _maps_ring() == 1
    second = epoch(loader(Batches(16)), True, 16)
    assert second.in_ring > 0
    wr.release_kept()
