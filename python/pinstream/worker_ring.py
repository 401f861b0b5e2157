"""``pinstream.prefetch(loader, worker_ring=True)``: a DataLoader's workers write each batch's
images into a page-locked ring, and the upload reads them from there with one DMA.

A ``DataLoader`` hands each batch from a worker to this process through shared memory: the
batch is pickled with a file descriptor, which this process receives, maps and faults in page
by page before a byte can be copied to page-locked memory, all of it serial and part of it under
the GIL. With ``worker_ring=True`` the loader's ``collate_fn`` is wrapped, for the workers this
iteration forks, by one that collates as before and then copies the batch's uint8 images into a
free slot of a ring of shared memory (a memfd the workers inherit). Where the loader collates
with torch's ``default_collate`` (a batch size, no ``collate_fn``), the samples' images are
stacked straight into the slot instead, and the rest collated as before: the batch's one copy,
made into the ring rather than into new shared memory. The batch comes here as the
rest plus the slot's number, and the ring is page-locked here, so the prefetcher DMAs straight
from the slot: no copy and no mapping in this process.

A slot's number goes back to the workers (on a pipe they read without waiting) once nothing here
refers to its images any more, which is after the DMA. The ring is made from the first batch (its
images' size), so the first few batches, and any batch when no slot is free or its images do not
fit, come the usual way; nothing is ever lost or waits for a slot. The loader itself is left as it
was: its ``collate_fn`` is swapped only while ``iter()`` forks the workers.

The ring outlives its iteration (``KEEP_RING``): once the iteration is over, nothing refers to its
slots any more and every worker of that iteration has exited, it waits, mapped and page-locked,
for the next iteration of the same loader on the same device, which takes it over before its
workers fork (once that loader is gone, the next loader takes it: as it is where its first batch
fits the slots, made anew from the same memfd otherwise). At most ``KEEP_MAX`` rings and
``MAX_RING_BYTES`` are kept (the oldest go first); ``pinstream.empty_cache()``, ``release_kept()``
and the interpreter's exit give them back. Page-locking a ring of hundreds of megabytes, and
unpinning it, takes milliseconds during which the CUDA driver holds up the training thread's own
calls: once an epoch, at its end and at the next one's first batch, without it.
"""

import atexit
import os
import struct
import sys
import threading
import time
import types
import weakref

from . import forklock
from .dataloader_end import end_iteration
from .errors import InvalidArgumentError, LoaderError
from .mapping import map_shared, populate_write
from .process import (
    _TOKEN,
    _copy,
    _images_place,
    _numpy,
    _pack,
    _register,
    _ring_array,
    _Slots,
    _with_images,
    _without_images,
)

OP = "pinstream.prefetch(worker_ring=True)"

#: The slots' alignment: a huge page, so that where the kernel backs shared memory with huge
#: pages (``MADV_HUGEPAGE``) a worker maps a slot with a few faults, not one per 4 KiB.
_ALIGN = 2 << 20
#: The ring's first ``_ALIGN`` bytes hold the slots' size and count (written here before any
#: slot is handed out; only its first page is ever touched); the slots follow.
_HEADER = _ALIGN
_SIZE = struct.Struct("<Q")

#: The most bytes the ring may page-lock: fewer slots where the batches are larger (the batches
#: beyond come the usual way).
MAX_RING_BYTES = 4 << 30

#: Threads a worker copies a batch's images into its slot with (numpy copies without the GIL);
#: ``None``: the CPUs this process may use over the loader's workers, 1 to 4 (the copy is the
#: workers' limit: 4 workers with 1 / 2 / 4 threads took 2.34 / 1.48 / 1.19 ms per batch, 8
#: workers with 2 / 4 threads 1.22 / 1.29 on 16 CPUs; BENCHMARKS.md, seventh session).
WORKER_COPY_THREADS = None

#: Whether a worker whose loader collates with torch's ``default_collate`` (a batch size and no
#: ``collate_fn``) stacks the samples' images straight into a slot, the one copy of the batch
#: (read at ``iter()``). ``False``: collated into new shared memory first, then copied into the
#: slot (a benchmark's control).
STACK_SAMPLES = True
#: The least bytes a sample's images must have to be stacked into the slot one by one (read at
#: ``iter()``): below it, ``default_collate`` (one C call for the batch) and then one copy into
#: the slot cost less than the stacking's few microseconds of Python a sample (a 3x32x32 image
#: took 14 µs a sample stacked, 4 through ``default_collate``; a 3x224x224 one 38 against 93, in
#: one worker on a 2-CPU machine).
STACK_MIN_BYTES = 64 << 10

#: Whether the ring is page-locked for the device (its batches then go with one DMA each);
#: ``False``: the loader threads copy each batch into pinstream's page-locked pool first, as for
#: any other array (a benchmark's control; read when the ring is made).
REGISTER = True

#: Whether a ring is kept for the next iteration once its own is over and nothing refers to its
#: slots (read when the ring goes); ``False``: unpinned, unmapped and closed then.
KEEP_RING = True

#: The most rings kept at once (a training and a validation loader, say); together they hold at
#: most ``MAX_RING_BYTES``.
KEEP_MAX = 4

#: The rings kept for a next iteration (their ``_Ring`` states), oldest first; under
#: ``_KEPT_LOCK``. Reentrant: a collection while it is held (any allocation) may let a ring's
#: last view go, whose finalizer keeps the ring on this very thread; every section under it
#: reads the list again after anything that allocates.
_KEPT = []
_KEPT_LOCK = threading.RLock()
#: Set at the interpreter's exit: rings that go from then on are closed, not kept.
_EXITING = [False]
#: Kept rings inherited by a forked child: never let go there (their page-locking is the
#: parent's: unpinning it in a child would be the parent's CUDA call).
_INHERITED = []

#: The module of torch's own ``default_collate`` and of the functions its table holds.
_TORCH_COLLATE = "torch.utils.data._utils.collate"


def copy_threads(workers):
    """The threads each of ``workers`` workers copies with (``WORKER_COPY_THREADS``)."""
    if WORKER_COPY_THREADS is not None:
        return max(1, int(WORKER_COPY_THREADS))
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus // max(1, workers)))


#: How long ``close()`` lets a loader thread's ``next()`` go on before the workers are ended.
STUCK_SECONDS = 0.5

#: Rest tensors at most this large travel pickled by value, not as shared memory of their own
#: (a file descriptor passed and mapped for 2 KB of labels).
_SMALL_REST = 1 << 16


#: The descriptors of every live reader's ring, by ring id, under ``forklock.LOCK`` (held
#: across every fork: a descriptor enters the table as it is made and leaves it before it is
#: closed). A process forked meanwhile closes all of them but those of the ring its own fork is
#: for (the workers of that ring's iteration), so that no other child keeps a ring's memory or
#: its pipe; a worker keeps its own ring's in the table, so that its own forks close them.
_FDS = {}
#: In a worker forked for a ring (``iter()`` of its loader): that ring's id; ``None`` in any
#: other process. A ``RingCollate`` acts only in the workers of its own ring.
_MY_RING = None
#: A lock per loader, held while its ``collate_fn`` is swapped for the workers' fork and put
#: back (``_LOADER_LOCKS_LOCK`` only while the table is read or written).
_LOADER_LOCKS = weakref.WeakKeyDictionary()
_LOADER_LOCKS_LOCK = threading.Lock()
#: The ring whose workers this thread is forking (``iter()`` of the loader).
_FORKING = threading.local()


def _after_fork_in_child():
    global _FDS, _MY_RING, _KEPT_LOCK
    # Another thread of the parent may have held the lock at the fork.
    _KEPT_LOCK = threading.RLock()
    _INHERITED.extend(_KEPT)
    _KEPT.clear()
    keep = getattr(_FORKING, "ring", None)
    _FORKING.ring = None  # this process's own forks are for no ring
    for ring, fds in list(_FDS.items()):
        if ring == keep:
            continue
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
    # The rings' mappings were never inherited (``MADV_DONTFORK``).
    _FDS = {keep: _FDS[keep]} if keep in _FDS else {}
    _MY_RING = keep


os.register_at_fork(after_in_child=_after_fork_in_child)


def _loader_lock(loader):
    with _LOADER_LOCKS_LOCK:
        lock = _LOADER_LOCKS.get(loader)
        if lock is None:
            lock = _LOADER_LOCKS[loader] = threading.Lock()
        return lock


def _close_fd(ring, fd):
    """Closes one of ring ``ring``'s descriptors, leaving the table first."""
    with forklock.LOCK:
        fds = _FDS.get(ring)
        if fds is not None:
            _FDS[ring] = tuple(f for f in fds if f != fd)
        try:
            os.close(fd)
        except OSError:
            pass


class InRing:
    """A batch whose images are in slot ``slot`` of ring ``ring``, as a worker sends it: the
    batch's rest (its images left out), where they go back (``place``), and their shape."""

    __slots__ = ("ring", "slot", "shape", "place", "rest", "stacked")

    def __init__(self, ring, slot, shape, place, rest, stacked=False):
        self.ring = ring
        self.slot = slot
        self.shape = shape
        self.place = place
        self.rest = rest
        #: The samples' images were stacked straight into the slot (``_stack_into_ring``).
        self.stacked = stacked

    def __reduce__(self):
        return (InRing, (self.ring, self.slot, self.shape, self.place, self.rest, self.stacked))


def _rest(item, place):
    """The batch with its images left out (``None`` in their place); small plain tensors by
    value (not a shared-memory file each for 2 KB of labels), subclasses as they are."""
    return _without_images(item, place, lambda v: _pack(v, _SMALL_REST, exact=True))


class RingCollate:
    """The loader's ``collate_fn`` in the workers of one iteration: the batch collated as
    before, then its images copied into a free slot, if one is free and they fit; anything
    that goes wrong here sends the batch the usual way. In this process (or any other than
    those workers) it is the wrapped ``collate_fn`` and nothing else."""

    def __init__(self, collate, keys, ring, ring_fd, free_r, free_w, threads=1):
        self.collate = collate
        self._threads = threads
        self._keys = keys
        self._ring_id = ring
        self._ring_fd = ring_fd
        self._free_r = free_r
        self._free_w = free_w
        self._map = None
        self._slot_bytes = 0
        self._slots = 0
        #: The slots this worker has written (their page table made).
        self._mapped = set()
        #: The wrapped function is torch's ``default_collate``: the samples' images are
        #: stacked straight into the slot (``_stack_into_ring``).
        self._direct = STACK_SAMPLES and _is_default_collate(collate)
        self._stack_min = STACK_MIN_BYTES

    def __call__(self, batch):
        if _MY_RING != self._ring_id:
            # Not a worker of this ring's iteration (this process, a worker of another, a
            # wrapper left on a loader by a caller's own swap): its descriptors are not ours.
            return self.collate(batch)
        if self._direct:
            try:
                msg = self._stack_into_ring(batch)
            except Exception:  # noqa: BLE001 - the batch is collated the usual way
                msg = None
            if msg is not None:
                return msg
        out = self.collate(batch)
        try:
            return self._into_ring(out)
        except Exception:  # noqa: BLE001 - the batch goes the usual way
            return out

    def _take(self):
        try:
            data = os.read(self._free_r, _TOKEN.size)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            return None
        if len(data) != _TOKEN.size:
            return None
        return _TOKEN.unpack(data)[0]

    def _give_back(self, s):
        try:
            os.write(self._free_w, _TOKEN.pack(s))
        except OSError:
            pass

    def _slot(self, nbytes):
        """A free slot's number and its first ``nbytes`` bytes as a writable uint8 array, or
        ``None`` where no slot is free; raises (the slot given back) where the ring is not made
        yet or ``nbytes`` do not fit a slot."""
        np = _numpy()
        s = self._take()
        if s is None:
            return None
        try:
            if self._map is None:
                (slot_bytes,) = _SIZE.unpack(os.pread(self._ring_fd, _SIZE.size, 0))
                (slots,) = _SIZE.unpack(os.pread(self._ring_fd, _SIZE.size, _SIZE.size))
                size = os.fstat(self._ring_fd).st_size
                if not slot_bytes or not slots or _HEADER + slot_bytes * slots > size:
                    raise ValueError("the ring is not made yet")
                # Mapped in this worker only (a process it forks keeps none of the ring).
                self._map = map_shared(self._ring_fd, _HEADER + slot_bytes * slots)
                self._slot_bytes, self._slots = slot_bytes, slots
            if not 0 <= s < self._slots or nbytes > self._slot_bytes:
                raise ValueError("the images do not fit a slot")
            if s not in self._mapped:
                # The slot's page table made at once, the first time this worker writes it,
                # rather than by a fault per page during the copy (nor the whole ring's at
                # once, which would hold up this worker's first batch).
                populate_write(self._map, _HEADER + s * self._slot_bytes, self._slot_bytes)
                self._mapped.add(s)
            return s, np.frombuffer(self._map, np.uint8, nbytes, _HEADER + s * self._slot_bytes)
        except BaseException:
            self._give_back(s)
            raise

    def _into_ring(self, out):
        np = _numpy()
        place, images = _ring_images(out, self._keys, np)
        if images is None:
            return out
        got = self._slot(images.nbytes)
        if got is None:
            return out
        s, dst = got
        try:
            _copy(np, dst, images.reshape(-1), self._threads)
            del dst
            msg = InRing(self._ring_id, s, tuple(images.shape), place, _rest(out, place))
        except BaseException:
            self._give_back(s)
            raise
        return msg

    def _stack_into_ring(self, batch):
        """``default_collate(batch)`` with the samples' images stacked straight into a slot:
        the one copy ``default_collate`` makes (into new shared memory, which this worker
        faults in and the training process maps) made into the ring instead. ``None`` (the
        batch then collated the usual way) unless every sample is a plain tuple, list or dict
        with its images where ``_images_place`` finds them, or is the images itself, and every
        sample's images are C-contiguous uint8 of one shape and one type (torch CPU tensor or
        numpy array), at least ``STACK_MIN_BYTES`` each: what ``default_collate`` stacks into
        the same bytes, as long as its table (``default_collate_fn_map``) holds torch's own
        functions only."""
        np = _numpy()
        torch = sys.modules.get("torch")
        if torch is None or type(batch) is not list or not batch or not _torch_collate_table():
            return None
        first = batch[0]
        kind = type(first)
        place = _images_place(first, self._keys)
        if place is None or kind not in (tuple, list, dict, torch.Tensor, np.ndarray):
            return None
        where = place[1]
        image_type = type(first if place[0] == "item" else first[where])
        if image_type not in (torch.Tensor, np.ndarray):
            return None
        shape, images = None, []
        for sample in batch:
            if type(sample) is not kind:
                return None
            if place[0] == "seq" and len(sample) != len(first):
                return None
            if place[0] == "map" and (where not in sample or len(sample) != len(first)):
                return None
            x = sample if place[0] == "item" else sample[where]
            if type(x) is not image_type or (image_type is torch.Tensor and x.requires_grad):
                # (default_collate's stack into shared memory refuses a tensor that requires
                # grad: its own error, from the usual way.)
                return None
            a = _ring_array(x, np)
            if a is None or (shape is not None and a.shape != shape):
                return None
            if shape is None and a.nbytes < self._stack_min:
                return None
            shape = a.shape
            images.append(a)
        per = images[0].nbytes
        # The slot first: without one (none free, the batch too large) the batch is collated
        # the usual way once, not its rest twice.
        got = self._slot(per * len(images))
        if got is None:
            return None
        s, dst = got
        try:
            if place[0] == "item":
                rest = None
            else:
                # The rest collated by default_collate itself, a placeholder where the images
                # were (its error, if any, is raised again by the usual collate).
                if place[0] == "seq":
                    held = [(0,) + sample[1:] if kind is tuple else [0] + sample[1:]
                            for sample in batch]
                else:
                    held = [{**sample, where: 0} for sample in batch]
                rest = _rest(self.collate(held), place)
            _copy_rows(np, dst.reshape(len(images), per), images, self._threads)
            del dst
            msg = InRing(self._ring_id, s, (len(images),) + tuple(shape), place, rest, True)
        except BaseException:
            self._give_back(s)
            raise
        return msg


def _ring_images(item, keys, np):
    """Where an item's images are (``_images_place``) and their array as the ring takes it
    (``_ring_array``); ``(None, None)`` / ``(place, None)`` where it has none the ring takes."""
    place = _images_place(item, keys)
    if place is None:
        return None, None
    return place, _ring_array(item[place[1]] if place[0] != "item" else item, np)


def _torch_code(f, name=None):
    """Whether ``f`` is a plain function whose code is in torch's collate module (named
    ``name``): torch's own, not a wrapper that copied its names (``functools.wraps``), a
    ``partial`` or an object that says it is one."""
    if type(f) is not types.FunctionType:
        return False
    code = f.__code__
    if name is not None and code.co_name != name:
        return False
    ok = _TORCH_CODE.get(code)
    if ok is None:
        path = getattr(sys.modules.get(_TORCH_COLLATE), "__file__", None)
        try:
            ok = path is not None and os.path.realpath(code.co_filename) == os.path.realpath(path)
        except (OSError, TypeError, ValueError):
            ok = False
        _TORCH_CODE[code] = ok
    return ok


#: ``_torch_code``'s answer for each code object it has seen.
_TORCH_CODE = {}


def _is_default_collate(collate):
    """Whether ``collate`` is torch's own ``default_collate`` (a ``DataLoader`` given a batch
    size and no ``collate_fn``), not a function put in its place or wrapped around it."""
    return _torch_code(collate, "default_collate")


def _torch_collate_table():
    """Whether ``default_collate`` would stack the images as torch does: the module's
    ``collate`` (looked up at each call) and every function of its table by type
    (``default_collate_fn_map``) torch's own, tensors and numpy arrays among them (a program
    may register or wrap its own: then the usual way)."""
    mod = sys.modules.get(_TORCH_COLLATE)
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    table = getattr(mod, "default_collate_fn_map", None)
    if not isinstance(table, dict) or torch is None or np is None:
        return False
    try:
        return (_torch_code(getattr(mod, "collate", None), "collate")
                and _torch_code(table.get(torch.Tensor), "collate_tensor_fn")
                and _torch_code(table.get(np.ndarray), "collate_numpy_array_fn")
                and all(_torch_code(f) for f in table.values()))
    except Exception:  # noqa: BLE001 - a table that cannot be read: the usual way
        return False


def _copy_rows(np, dst, rows, threads):
    """``dst[i] = rows[i]`` (flat uint8) for every row, in ``threads`` runs of rows at once
    (numpy copies without the GIL)."""
    n = len(rows)
    threads = max(1, min(threads, n))
    step = -(-n // threads)
    failed = []

    def run(a, b):
        try:
            for i in range(a, b):
                np.copyto(dst[i], rows[i].reshape(-1))
        except BaseException as e:  # noqa: BLE001 - raised below
            failed.append(e)

    workers = [threading.Thread(target=run, args=(a, min(a + step, n)), daemon=True)
               for a in range(step, n, step)]
    for t in workers:
        t.start()
    run(0, min(step, n))
    for t in workers:
        t.join()
    if failed:
        raise failed[0]


def check_loader(loader):
    """Refuses a source the workers cannot write a ring for, with the reason."""
    import sys

    torch = sys.modules.get("torch")
    data = getattr(getattr(torch, "utils", None), "data", None)
    if data is None or not isinstance(loader, data.DataLoader):
        raise InvalidArgumentError(
            f"{OP} takes a torch DataLoader (its workers write the ring), not "
            f"{type(loader).__name__}"
        )
    if loader.num_workers < 1:
        raise InvalidArgumentError(f"{OP}: the DataLoader has no workers (num_workers=0)")
    if loader.persistent_workers:
        raise InvalidArgumentError(
            f"{OP}: the DataLoader has persistent_workers=True: its workers outlive one "
            "iteration, and each iteration's ring; use persistent_workers=False"
        )
    ctx = loader.multiprocessing_context or torch.multiprocessing.get_context()
    method = ctx.get_start_method()
    if method != "fork":
        raise InvalidArgumentError(
            f"{OP}: the DataLoader starts its workers with {method!r}; the ring needs them "
            "forked (multiprocessing_context='fork')"
        )


def allows(loader):
    """Whether ``worker_ring=None`` (the default) turns the ring on for ``loader``: a
    ``torch.utils.data.DataLoader`` itself (a subclass may change its batches, which come as
    ring messages to its own ``__iter__``) that ``check_loader`` takes, with numpy."""
    torch = sys.modules.get("torch")
    data = getattr(getattr(torch, "utils", None), "data", None)
    if data is None or type(loader) is not data.DataLoader:
        return False
    try:
        check_loader(loader)
        _numpy()
    except (InvalidArgumentError, ImportError):
        return False
    except Exception:  # noqa: BLE001 - a loader whose attributes raise: the usual way
        return False
    return True


class WorkerRingReader:
    """The iterable ``pinstream.prefetch`` pulls when ``worker_ring=True``: iterated once, it
    makes the ring's descriptors and starts the loader's iterator (its workers fork then, with
    the wrapped ``collate_fn``); each ``next()`` gives the next batch, its images a read-only
    numpy view of their slot where they came in the ring."""

    def __init__(self, loader, keys, slots, device=None):
        if slots < 2:
            raise InvalidArgumentError(f"{OP}: {slots} slots: at least 2")
        self._np = _numpy()
        self._loader = loader
        self._keys = keys
        self._slots_n = slots
        #: The device whose DMA reads the ring (it is registered for it); ``None``: a dry run.
        self._device = device
        self._started = False
        self._done = False
        self._it = None
        # Not from Python's `random`: the caller's draws are the caller's.
        self._ring_id = int.from_bytes(os.urandom(8), "little") >> 1
        self._ring_fd = None
        self._ring = None
        self._slot_bytes = 0
        self._made = 0
        self._tried = False
        self._registration = None
        #: The ring's state (``_Ring``), shared with the views of its slots: the ring is kept or
        #: closed once the last of them lets it go.
        self._state = None
        #: The ring was taken over from an earlier iteration (its slots' size checked against
        #: the first batch that comes the usual way).
        self._adopted = False
        self._slots = None
        self._out = set()
        #: Batches that came in a slot, and the usual way.
        self.in_ring = 0
        self.usual = 0
        #: Of those in a slot, the ones whose samples were stacked straight into it.
        self.stacked = 0
        self._lock = threading.RLock()  # a collection inside may release another slot
        self._finalizer = None
        # A loader thread is in the loader's next() (and which).
        self._pulling = False
        self._puller = None

    def __iter__(self):
        if self._started:
            return self
        self._started = True
        loader, self._loader = self._loader, None
        fds = []
        kept = None
        taken = []  # the kept ring, from before it leaves the list (a Ctrl-C between loses it not)
        try:
            kept, own = _take_kept(self._device, loader, taken)
            # Made and entered in the table under the lock every fork takes: no fork between.
            with forklock.LOCK:
                try:
                    if kept is not None:
                        # The kept ring's descriptor moves to this ring's entry.
                        rest = tuple(f for f in _FDS.get(kept.ring_id, ()) if f != kept.fd)
                        if rest:
                            _FDS[kept.ring_id] = rest
                        else:
                            _FDS.pop(kept.ring_id, None)
                        ring_fd = kept.fd
                    else:
                        ring_fd = os.memfd_create("pinstream-worker-ring", os.MFD_CLOEXEC)
                    fds.append(ring_fd)
                    free_r, free_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
                    fds += [free_r, free_w]
                finally:
                    _FDS[self._ring_id] = tuple(fds)
            state = kept if kept is not None else _Ring(ring_fd, self._device)
            state.ring_id = self._ring_id
            state.owner = _owner(loader)
            self._state = _Hold(state)
            with _loader_lock(loader):
                collate = loader.collate_fn
                while isinstance(collate, RingCollate):
                    collate = collate.collate  # another reader's, left by a caller's swap
                wrapper = RingCollate(collate, self._keys, self._ring_id, ring_fd,
                                      free_r, free_w, copy_threads(loader.num_workers))
                loader.collate_fn = wrapper
                _FORKING.ring = self._ring_id
                try:
                    it = iter(loader)  # the workers fork here, with the wrapper
                finally:
                    _FORKING.ring = None
                    if loader.collate_fn is wrapper:
                        loader.collate_fn = collate
                # This iteration's workers: the ring is kept only once all of them have exited
                # (one that outlives its iteration could still write a slot).
                state.workers = list(getattr(it, "_workers", None) or [])
                state.known_workers = hasattr(it, "_workers")
        except BaseException:
            if kept is None and taken:
                kept = taken[0]
                with _KEPT_LOCK:
                    if kept in _KEPT:
                        _KEPT.remove(kept)
            hold, self._state = self._state, None
            if hold is not None:
                hold.state.fd = -1  # closed below, with the rest
            for fd in fds:
                _close_fd(self._ring_id, fd)
            with forklock.LOCK:
                _FDS.pop(self._ring_id, None)
            if kept is not None:
                # Taken over and not used: its descriptor is closed above if it got that far,
                # by `_close_ring` otherwise; its page-locking and mapping go now, not with the
                # traceback.
                if kept.fd in fds:
                    kept.fd = -1
                _close_ring(kept)
            raise
        try:
            # The workers hold their own copies of the read end; this process only gives back.
            _close_fd(self._ring_id, free_r)
            self._it = it
            self._ring_fd = ring_fd
            ring = self._ring_id
            self._slots = _Slots(free_w, close_fd=lambda fd: _close_fd(ring, fd))
            self._finalizer = weakref.finalize(self, _stop, os.getpid(), self._slots)
            st = self._state.state
            if st.map is not None and own:
                # This loader's own kept ring: its slots go to these workers from the first
                # batch.
                self._adopted = self._tried = True
                self._use_kept(st)
        except BaseException:
            # A Ctrl-C here, after the loader's own iter() (the caller never gets this reader):
            # the loader's iterator ends, its workers with it, and the pipe's ends still open
            # close (the write end with the slots once they hold it; the table says which are
            # open, so none is closed twice), also after a second Ctrl-C in the first part.
            self._it = it
            try:
                self.close()
            finally:
                with forklock.LOCK:
                    still = set(_FDS.get(self._ring_id, ()))
                if free_r in still:
                    _close_fd(self._ring_id, free_r)
                if self._slots is None and free_w in still:
                    _close_fd(self._ring_id, free_w)
            raise
        # Another loader's (one that is gone): its slots go out once the first batch says
        # they fit (no worker maps the ring before it has a slot); else it is made anew
        # (`_make_ring_locked`).
        return self

    def close(self):
        """The iteration is over, or the prefetcher is being closed: the loader's iterator
        goes (its workers end), and no slot goes back to them any more. A loader thread
        waiting in the loader's ``next()`` for a worker that does not answer is not waited
        for: after ``STUCK_SECONDS`` the workers are ended, and a message the loader cannot
        take, put on its data queue, ends that ``next()`` with an error, which the closing
        prefetcher drops."""
        self._done = True
        it, self._it = self._it, None
        try:
            if it is not None:
                try:
                    if self._pulling and threading.get_ident() != self._puller:
                        deadline = time.monotonic() + STUCK_SECONDS
                        while self._pulling and time.monotonic() < deadline:
                            time.sleep(0.005)
                finally:
                    # Also when a second Ctrl-C ends the wait: the loader thread would wait
                    # forever.
                    end_iteration(it, self._pulling, STUCK_SECONDS)
        finally:
            # Also when a Ctrl-C ends the workers' end early: nothing else closes the slots
            # of a reader whose finalizer was never made.
            del it
            # The ring's descriptors and this reader's hold on its mapping go now, not with
            # the reader: an exception kept by the caller refers to the reader through its
            # traceback. Views still out keep the mapping (and its registration) until they go.
            with self._lock:
                if self._finalizer is not None:
                    self._finalizer()
                elif self._slots is not None:
                    self._slots.close()
                self._ring = None
                self._registration = None
                # The ring is kept (or closed) once the views still out are gone too.
                self._state = None

    def __next__(self):
        it = self._it
        self._puller = threading.get_ident()
        # Marked before `_done` is read (close() sets `_done`, then reads this): one of the two
        # always sees the other.
        self._pulling = True
        if self._done or not self._started or it is None:
            self._pulling = False
            raise StopIteration
        try:
            item = next(it)
        except StopIteration:
            self._pulling = False
            self.close()
            raise
        except Exception:
            if self._done:
                # close() from another thread ended the wait (a message the loader cannot
                # take, or its workers gone): the iteration is over, not failed.
                raise StopIteration from None
            raise
        finally:
            self._pulling = False
        if isinstance(item, InRing):
            stacked = item.stacked is True
            item = self._from_ring(item)
            self.in_ring += 1
            self.stacked += stacked
            return item
        self.usual += 1
        if self._adopted:
            self._adopted = False
            self._check_kept_fits(item)
        if not self._tried:
            self._tried = True
            try:
                self._make_ring(item)
            except (OSError, ValueError, OverflowError) as e:
                import warnings

                warnings.warn(f"{OP}: no ring ({e}); every batch comes the usual way",
                              RuntimeWarning, stacklevel=2)
        return item

    def _check_kept_fits(self, item):
        """The first batch that came the usual way through a ring taken over from an earlier
        iteration: where its images are larger than that ring's slots (the images' size
        changed), every batch of this iteration comes the usual way, a warning says so, and the
        ring is not kept again (the next iteration makes one of the new size)."""
        _, images = _ring_images(item, self._keys, self._np)
        if images is None or images.nbytes <= self._slot_bytes:
            return
        with self._lock:
            if self._state is not None:
                self._state.state.keep = False
        import warnings

        warnings.warn(f"{OP}: the ring kept from the last iteration has slots of "
                      f"{self._slot_bytes} bytes, and this iteration's batches have "
                      f"{images.nbytes}: they come the usual way until the next iteration "
                      "makes a ring of their size", RuntimeWarning, stacklevel=3)

    def _make_ring(self, item):
        """The ring, sized for the first batch's images, and every slot handed to the
        workers. A batch without ring-able images (they are not uint8, or not C-contiguous)
        makes none: every batch then comes the usual way."""
        with self._lock:
            if not self._done:  # closed meanwhile: its descriptor is gone
                self._make_ring_locked(item)

    def _make_ring_locked(self, item):
        _, images = _ring_images(item, self._keys, self._np)
        if images is None:
            return
        slot_bytes = max(_ALIGN, -(-images.nbytes // _ALIGN) * _ALIGN)
        slots = min(self._slots_n, MAX_RING_BYTES // slot_bytes)
        if slots < 2:
            return
        st = self._state.state
        if st.map is not None:
            # A ring kept for another loader, taken over: used as it is where this batch fits
            # its slots; otherwise let go (unpinned, unmapped) and made anew from its memfd,
            # before any worker has mapped it.
            if images.nbytes <= st.slot_bytes and st.slots >= 2:
                self._use_kept(st)
                return
            st.registration = st.map = None
        size = _HEADER + slot_bytes * slots
        os.ftruncate(self._ring_fd, size)
        # Mapped here only: a process forked later (another loader's workers, a pool) does not
        # inherit it, so it never keeps the ring's memory after this process let it go.
        ring = map_shared(self._ring_fd, size)
        if self._device is not None and REGISTER:
            # The slots only (the pages are made here, page-locked for the DMA).
            self._registration = _register(memoryview(ring)[_HEADER:], self._device)
        os.pwrite(self._ring_fd, _SIZE.pack(slot_bytes) + _SIZE.pack(slots), 0)
        self._ring, self._slot_bytes, self._made = ring, slot_bytes, slots
        st.map, st.registration, st.slot_bytes, st.slots = ring, self._registration, slot_bytes, slots
        for s in range(slots):
            self._slots.release(s)

    def _use_kept(self, st):
        """A kept ring taken over as it is: its mapping and page-locking become this reader's,
        and every slot goes to the workers."""
        self._ring, self._registration = st.map, st.registration
        self._slot_bytes, self._made = st.slot_bytes, st.slots
        for s in range(st.slots):
            self._slots.release(s)

    def _from_ring(self, msg):
        s, shape = msg.slot, msg.shape
        try:
            n = 1
            for d in shape:
                n *= int(d)
        except (TypeError, ValueError):
            n = -1
        with self._lock:
            hold = self._state
            ok = (msg.ring == self._ring_id and self._ring is not None and hold is not None
                  and isinstance(s, int) and 0 <= s < self._made
                  and 0 < n <= self._slot_bytes and s not in self._out)
            if ok:
                self._out.add(s)
        if not ok:
            self.close()
            raise LoaderError(
                f"{OP}: a worker sent slot {s!r} of shape {shape!r}, which does not lie in the "
                "ring (or is in use)"
            )
        images = self._np.frombuffer(self._ring, self._np.uint8, n,
                                     _HEADER + s * self._slot_bytes).reshape(shape)
        # The slot goes back to the workers only once this view is gone (the prefetcher holds
        # it until its DMA is over), and the ring stays registered until then: the finalizer
        # holds the registration.
        weakref.finalize(images, _release, self._slots, self._out, self._lock, s,
                         hold).atexit = False
        return _with_images(msg.rest, msg.place, images)


def _release(slots, out, lock, s, hold):
    """A slot's view is gone: the slot goes back to the workers (``hold``, the ring's state,
    was only kept alive until now: the ring is kept or closed once nothing holds it)."""
    with lock:
        out.discard(s)
    slots.release(s)


def _stop(pid, slots):
    """The reader is closed or gone: no slot goes back to the workers any more (in the process
    that made the pipe only). The ring's own descriptor goes with the ring (``_ring_gone``)."""
    if os.getpid() != pid:
        return
    slots.close()


class _Ring:
    """A ring's memory: its memfd, this process's mapping of it and the mapping's page-locking
    (``map`` is ``None`` until the first batch sized it), its slots' size and count, and the
    ``_FDS`` entry its descriptor is in."""

    __slots__ = ("fd", "device", "map", "registration", "slot_bytes", "slots", "ring_id", "pid",
                 "keep", "owner", "workers", "known_workers")

    def __init__(self, fd, device):
        self.fd, self.device, self.pid = fd, device, os.getpid()
        #: ``False``: closed, not kept, when it goes (its slots were too small for a batch).
        self.keep = True
        self.map = self.registration = None
        self.slot_bytes = self.slots = 0
        self.ring_id = None
        #: The loader it was last iterated for (a weak reference; ``None``: none, or gone).
        self.owner = None
        #: That iteration's worker processes, and whether the loader's iterator said which.
        self.workers = []
        self.known_workers = False

    def nbytes(self):
        return _HEADER + self.slot_bytes * self.slots

    def orphan(self):
        return self.owner is None or self.owner() is None


def _owner(loader):
    try:
        return weakref.ref(loader)
    except TypeError:
        return None


def _workers_gone(workers, known):
    """Whether every one of a ring's last iteration's ``workers`` has exited (a process that
    outlives its iteration, stuck in its dataset with SIGTERM ignored, may still write a slot);
    ``known``: the loader's iterator said which they were."""
    if not known:
        return False
    try:
        return not any(w.is_alive() for w in workers)
    except Exception:  # noqa: BLE001 - not a worker we can ask: not kept
        return False


class _Hold:
    """What the reader and every view of a slot hold: once the last of them is gone, the ring
    is kept for the next iteration, or closed (``_ring_gone``)."""

    __slots__ = ("state", "__weakref__")

    def __init__(self, state):
        self.state = state
        weakref.finalize(self, _ring_gone, state).atexit = False


def _ring_gone(state):
    """Nothing refers to the ring any more: kept for a next iteration (the oldest kept rings
    closed where there are more than ``KEEP_MAX`` or ``MAX_RING_BYTES``), or closed; in the
    process that made it only."""
    if os.getpid() != state.pid or state.fd < 0:
        return
    workers, state.workers = state.workers, []
    if (KEEP_RING and state.keep and state.map is not None and not _EXITING[0]
            and _workers_gone(workers, state.known_workers)):
        # Its descriptor stays in the table under its entry (a fork closes it).
        out = []
        with _KEPT_LOCK:
            _KEPT.append(state)
            while len(_KEPT) > max(0, KEEP_MAX) or sum(r.nbytes() for r in _KEPT) > MAX_RING_BYTES:
                # The oldest whose loader is gone first, else the oldest.
                old = next((r for r in _KEPT if r.orphan()), None)
                if old is None:
                    old = _KEPT[0] if _KEPT else None
                if old is None:
                    break
                if old in _KEPT:  # (a collection above may have taken it meanwhile)
                    _KEPT.remove(old)
                    out.append(old)
        for old in out:
            _close_ring(old)
        return
    _close_ring(state)


def _close_ring(state):
    """Unpins (without the GIL), unmaps and closes a ring."""
    state.workers = []
    state.registration = None
    state.map = None
    fd, state.fd = state.fd, -1
    if fd >= 0:
        _close_fd(state.ring_id, fd)
    with forklock.LOCK:
        fds = _FDS.get(state.ring_id)
        if fds is not None and not fds:
            _FDS.pop(state.ring_id, None)


def _take_kept(device, loader, taken):
    """A kept ring for ``device`` (``None`` in a dry run), taken: ``(ring, True)`` for the one
    last iterated for ``loader`` (its batches' size), ``(ring, False)`` for one whose loader is
    gone, ``(None, False)`` for none. ``taken`` gets the ring before it leaves the list (a
    Ctrl-C between is the caller's to clean up)."""
    with _KEPT_LOCK:
        while True:
            mine = [r for r in _KEPT if r.device == device and not r.orphan() and r.owner() is loader]
            free = [r for r in _KEPT if r.device == device and r.orphan()]
            st = (mine or free or [None])[-1]
            if st is None:
                return None, False
            if st in _KEPT:  # (a collection above may have taken it meanwhile)
                taken.append(st)
                _KEPT.remove(st)
                return st, bool(mine)


def kept_rings():
    """The rings kept for a next iteration now, oldest first (``_Ring`` states)."""
    with _KEPT_LOCK:
        return list(_KEPT)


def release_kept(device=...):
    """Gives back the rings kept for a next iteration: all of them, or those page-locked for
    ``device`` (``None``: the dry runs')."""
    out = []
    with _KEPT_LOCK:
        for r in [r for r in _KEPT if device is ... or r.device == device]:
            if r in _KEPT:  # (a collection above may have taken it meanwhile)
                _KEPT.remove(r)
                out.append(r)
    for r in out:
        _close_ring(r)


@atexit.register
def _at_exit():
    _EXITING[0] = True
    release_kept()
