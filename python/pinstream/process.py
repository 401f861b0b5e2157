"""``pinstream.prefetch(iterable, process=True)``: the iterable pulled in a helper process.

A ``DataLoader``'s batches cost the training process interpreter time even with worker
processes: each one is received from a worker, unpickled and its shared memory mapped, with the
GIL held, and an eager training step (ResNet-18: 15 ms of host time per 15 ms step) needs the
GIL all the time. With ``process=True`` the iterable is iterated in a helper forked from this
process (when the prefetcher starts: where ``iter()`` would be called). The helper copies each
item's images into a slot of a ring of shared memory and sends the rest of the item (labels,
other entries) pickled; this process reads a slot number and the small rest, and the
prefetcher DMAs the images straight from the slot (the ring is page-locked; in a dry run the
loader threads copy them). A slot is written again only once nothing here refers to its images
any more.

The helper never touches CUDA or pinstream's native side (neither carries over a fork). It
closes the descriptors of other readers' helpers, ignores Ctrl-C (the training process handles
it), ends when the iteration ends, when this process closes the prefetcher (SIGTERM if it sits
in a slow ``next()``: it stops there) or goes away, running the iterator's cleanup, and sends
what the iterable raised (the exception itself where it pickles, else its type, message and
traceback as a ``LoaderError``). Messages are framed by their length on a raw pipe, read in
slices here, so a helper that dies mid-message is noticed even while a process it forked holds
the pipe open.
"""

import collections.abc
import math
import mmap
import os
import pickle
import random
import select
import signal
import struct
import sys
import threading
import time
import traceback
import warnings
import weakref

from . import forklock
from .dataloader_end import end_iteration
from .errors import InvalidArgumentError, LoaderError

#: The keys tried for a mapping item's images, in order: the native side's ``IMAGE_KEYS``.
IMAGE_KEYS = ("image", "images", "pixel_values", "pixels", "img", "input", "x")

#: How long a wait lasts between two checks that the other side is still there.
POLL_SECONDS = 0.05

#: One free slot's number on the pipe back to the helper (8 bytes: one atomic pipe write).
_TOKEN = struct.Struct("<q")

OP = "pinstream.prefetch(process=True)"

#: Threads that copy a large item's images into its slot, each a part (numpy copies without
#: the GIL): one thread copies about 8 GB/s, a 256 x 3x224x224 batch in 5 ms.
COPY_THREADS = 4
#: Items below this size are copied by one thread.
_PARALLEL_BYTES = 1 << 20
#: Items pulled ahead of the one being copied and sent (``fresh``: every item a new array).
_AHEAD = 2
#: A message's length before it, on the pipe from the helper.
_LENGTH = struct.Struct("<Q")

#: The descriptors and rings of every reader alive in this process, by reader: a helper closes
#: the others' (so that a closed prefetcher's pipes end, and its ring goes, with its own helper).
#: Under ``forklock.LOCK`` (held across every fork): a descriptor leaves it before it is
#: closed, so a helper never closes a number that was reused meanwhile.
_OWNED = {}

#: How long a helper's DataLoader workers get to stop when the helper ends, before SIGTERM
#: (within ``CLEANUP_SECONDS``).
WORKERS_SECONDS = 1.0

#: How long a helper's cleanup may take (the iterator's ``finally``, a DataLoader's workers)
#: once it was asked to end, before it is killed.
CLEANUP_SECONDS = 5.0


def _close_owned(token, fd):
    """Closes one of reader ``token``'s descriptors, leaving the registry first."""
    with forklock.LOCK:
        entry = _OWNED.get(token)
        if entry is not None and fd in entry[0]:
            _OWNED[token] = (tuple(f for f in entry[0] if f != fd), entry[1])
        try:
            os.close(fd)
        except OSError:
            pass


class _TorchArray:
    """A torch CPU tensor of an item's rest, sent as its numpy array and made a tensor again
    (``torch.from_numpy``) on arrival."""

    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array

    def __reduce__(self):
        return (_TorchArray, (self.array,))


def _numpy():
    try:
        import numpy
    except ImportError as e:
        raise InvalidArgumentError(f"{OP} needs numpy (pip install numpy)") from e
    return numpy


def is_started_dataloader_iterator(iterable):
    """Whether ``iterable`` is the iterator of a DataLoader whose workers were started here
    (they would keep feeding this process, not the helper)."""
    torch = sys.modules.get("torch")
    data = getattr(getattr(torch, "utils", None), "data", None)
    base = getattr(getattr(data, "dataloader", None), "_BaseDataLoaderIter", None)
    return base is not None and isinstance(iterable, base)


def _images_place(item, keys):
    """Where an item's images are, found as the native side finds them: ``("seq", 0)`` for a
    tuple or list, ``("map", key)`` for a mapping, ``("item", None)`` for the item itself;
    ``None`` where it has none (the native side then says what is wrong)."""
    if isinstance(item, (tuple, list)):
        return ("seq", 0) if len(item) else None
    if isinstance(item, collections.abc.Mapping):
        if keys is not None:
            return ("map", keys[0]) if keys[0] in item else None
        for k in IMAGE_KEYS:
            if k in item:
                return ("map", k)
        return None
    return ("item", None)


def _ring_array(x, np):
    """``x`` as a uint8 numpy array for the ring (a numpy array or a torch CPU tensor), or
    ``None`` for anything else, which is sent pickled (the native side then says what is
    wrong with it)."""
    if isinstance(x, np.ndarray):
        a = np.asarray(x)  # a subclass (np.matrix) as a plain array
    elif type(x).__module__.startswith("torch") and hasattr(x, "numpy"):
        try:
            if x.device.type != "cpu":
                return None
            a = x.detach().numpy()
        except Exception:  # noqa: BLE001 - not a plain CPU tensor: sent as it is
            return None
    else:
        try:
            view = memoryview(x)  # a typed buffer (memoryview, array.array), as in-process
        except TypeError:
            return None
        if view.format not in ("B", "<B", "=B", "|B") or not view.c_contiguous:
            return None
        a = np.asarray(view)
    # Only C-contiguous uint8 goes to the ring; anything else is sent as it is, and the
    # native side takes it or says why not, as it does in-process.
    if a.dtype != np.uint8 or a.size == 0 or not a.flags.c_contiguous:
        return None
    return a


def _pack(value, max_bytes=None, exact=False):
    """A rest value for pickling: torch CPU tensors as numpy (torch's own pickling is slow);
    with ``max_bytes``, only those at most that large, and with ``exact`` only a plain
    ``torch.Tensor`` (a subclass is sent as it is, keeping its type)."""
    if type(value).__module__.startswith("torch") and hasattr(value, "numpy"):
        try:
            if exact and type(value) is not sys.modules["torch"].Tensor:
                return value
            if (value.device.type == "cpu" and not value.requires_grad
                    and (max_bytes is None or value.numel() * value.element_size() <= max_bytes)):
                return _TorchArray(value.numpy())
        except Exception:  # noqa: BLE001 - pickled as it is
            pass
    return value


def _unpack(value):
    if isinstance(value, _TorchArray):
        import torch

        return torch.from_numpy(value.array)
    return value


def _without_images(item, place, pack=_pack):
    """The item with its images left out (``None`` in their place), the rest packed."""
    kind, key = place
    if kind == "seq":
        parts = [None] + [pack(v) for v in item[1:]]
        return parts if isinstance(item, list) else tuple(parts)
    if kind == "map":
        return {k: (None if k == key else pack(v)) for k, v in item.items()}
    return None


def _with_images(rest, place, images):
    kind, key = place
    if kind == "seq":
        parts = [images] + [_unpack(v) for v in rest[1:]]
        return parts if isinstance(rest, list) else tuple(parts)
    if kind == "map":
        return {k: (images if k == key else _unpack(v)) for k, v in rest.items()}
    return images


def _error_payload(e):
    """What the iterable raised, for the other side: the exception itself where it pickles
    and unpickles, and in any case its type, message and traceback."""
    try:
        text = "".join(traceback.format_exception(e))
    except BaseException:  # noqa: BLE001 - a __str__ or __notes__ that raises
        text = ""
    try:
        exc = pickle.dumps(e)
        pickle.loads(exc)
    except BaseException:  # noqa: BLE001 - a __reduce__ that raises anything: sent as text
        exc = None
    try:
        message = str(e)
    except BaseException:  # noqa: BLE001 - a __str__ that raises
        message = "(its message could not be read)"
    return (exc, type(e).__name__, message, text)


class _Stop(Exception):
    """The training process closed the prefetcher or went away: the helper ends."""


class _Terminated(BaseException):
    """SIGTERM in the helper (the training process ends it, or it went away): the iteration
    stops where it is, and its cleanup (``finally`` blocks, a DataLoader's workers) runs."""


def _on_sigterm(signum, frame):
    raise _Terminated


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _close_others(own):
    """In the helper: closes the descriptors and rings of every other reader of the training
    process (they belong to other helpers)."""
    for token, (fds, ring) in list(_OWNED.items()):
        if token == own:
            continue
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass
        if ring is not None:
            try:
                ring.close()
            except (BufferError, ValueError):
                pass  # a view of it is alive in this copy: left mapped


def _copy(np, dst, src, threads=None):
    """``dst[:] = src`` (flat uint8), in ``threads`` (``COPY_THREADS``) parts at once for a
    large item (numpy copies without the GIL); plain threads, which start in any state of the
    interpreter (a ``ThreadPoolExecutor`` refuses once it is shutting down, as a fork of it may
    be)."""
    n = src.size
    threads = COPY_THREADS if threads is None else threads
    if n < _PARALLEL_BYTES or threads <= 1:
        np.copyto(dst, src)
        return
    step = -(-n // threads)
    bounds = [(a, min(a + step, n)) for a in range(step, n, step)]
    failed = []

    def part(a, b):
        try:
            np.copyto(dst[a:b], src[a:b])
        except BaseException as e:  # noqa: BLE001 - raised on the sender below
            failed.append(e)

    threads = [threading.Thread(target=part, args=ab, daemon=True) for ab in bounds]
    for t in threads:
        t.start()
    part(0, min(step, n))
    for t in threads:
        t.join()
    if failed:
        raise failed[0]


def _helper(*args):
    """The helper process's body; SIGTERM (the training process ends it) ends it quietly."""
    try:
        _pull(*args)
    except _Terminated:
        pass


#: In a helper: the pid of the process that is forking (``os.register_at_fork`` ``before``).
_FORKER = [0]


def _die_with(helper):
    """In a helper: makes each process its main thread forks (a DataLoader's workers) end when
    the helper does, also when the helper is killed (``PR_SET_PDEATHSIG``, which comes when the
    forking thread ends: another thread's forks are left alone). Torch's workers notice their
    parent's end only if it happens after their check began; one that began after the helper
    died (inside the loader's ``iter()``) lived on."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return  # not Linux: torch's own check only

    def before():
        # Only the main thread's forks: the signal comes when the forking *thread* ends.
        main = threading.current_thread() is threading.main_thread()
        _FORKER[0] = os.getpid() if main else 0

    def after_in_child():
        if _FORKER[0] != helper:
            return  # forked by a process the helper forked (a worker's own child)
        prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != helper:
            os._exit(1)  # the helper ended before the signal was asked for

    os.register_at_fork(before=before, after_in_child=after_in_child)


def _pull(iterable, keys, slots, ring_fd, ready_fd, free_fd, theirs, own, ahead, rng_source=None,
          random_state=None):
    """The helper process: this thread pulls the items, a second one takes a free slot for
    each, copies its images there and sends the slot's number and the rest, in order. With
    ``ahead`` (every item a new array) the next item is pulled meanwhile; without, only once
    the item was copied (an iterable may refill its array). ``iter()`` is answered first, with
    the random states it changed (``_rng_states`` of ``rng_source``, the iterable) or with its
    error. Never touches CUDA."""
    import queue

    for fd in theirs:
        os.close(fd)
    _close_others(own)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    _die_with(os.getpid())
    if random_state is not None:
        # CPython reseeds `random` in a forked child: the helper draws from the training
        # process's state, as an iteration there would.
        random.setstate(random_state)
    parent = os.getppid()
    torch = sys.modules.get("torch")
    if torch is not None:
        # An OpenMP pool started before the fork does not work after it.
        torch.set_num_threads(1)
        data = getattr(getattr(torch, "utils", None), "data", None)
        if data is not None and isinstance(iterable, data.DataLoader) and iterable.pin_memory:
            # Pinning needs CUDA, which a forked child cannot use; pinstream copies anyway.
            iterable.pin_memory = False
    np = _numpy()
    free = list(range(slots))
    jobs = queue.Queue(maxsize=_AHEAD if ahead else 1)
    # The sender has ended (it sent why); the puller has ended (nothing more will be queued).
    ended = threading.Event()
    stopping = threading.Event()

    def send(msg):
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)  # its errors are the item's
        try:
            _write_all(ready_fd, _LENGTH.pack(len(data)) + data)
        except OSError as e:
            raise _Stop from e

    def take_slot():
        while not free:
            r, _, _ = select.select([free_fd], [], [], POLL_SECONDS)
            if not r:
                if stopping.is_set():
                    raise _Stop
                continue
            data = os.read(free_fd, _TOKEN.size * slots)
            if not data:
                raise _Stop
            free.extend(s for (s,) in _TOKEN.iter_unpack(data))
        return free.pop(0)

    def deliver():
        ring = None
        slot_bytes = 0
        i = 0
        try:
            while True:
                try:
                    job = jobs.get(timeout=POLL_SECONDS)
                except queue.Empty:
                    if stopping.is_set():
                        return
                    continue
                if job[0] != "item":
                    send(job)
                    return
                _, i, item, copied, news = job
                place = _images_place(item, keys)
                images = None
                if place is not None:
                    images = _ring_array(item[place[1]] if place[0] != "item" else item, np)
                if images is None:
                    # Sent (pickled) before the item may be refilled (without `ahead`).
                    send(("item", i, -1, None, None, _pack(item), news))
                    copied.set()
                    continue
                if ring is None:
                    slot_bytes = max(mmap.PAGESIZE, -(-images.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
                    os.ftruncate(ring_fd, slot_bytes * slots)
                    ring = mmap.mmap(ring_fd, slot_bytes * slots)
                    send(("ring", slot_bytes))
                if images.nbytes > slot_bytes:
                    send(("error", i, None, "InvalidArgumentError",
                          f"{OP}: batch {i}'s images are {images.nbytes} bytes, more than the "
                          f"first batch's {slot_bytes} that the slots were made for: give "
                          "batches of one size (or smaller ones)", ""))
                    return
                s = take_slot()
                _copy(np, np.frombuffer(ring, np.uint8, images.nbytes, s * slot_bytes),
                      images.reshape(-1))
                msg = ("item", i, s, images.shape, place, _without_images(item, place), news)
                del item, images
                # The rest is pickled by `send`: only then may the item be refilled.
                send(msg)
                copied.set()
        except _Stop:
            pass
        except BaseException as e:  # noqa: BLE001 - a rest that does not pickle, among others
            try:
                send(("error", i, *_error_payload(e)))
            except BaseException:  # noqa: BLE001 - the training process is gone
                pass
        finally:
            ended.set()

    def watch():
        # The training process gone (killed): end as if it had closed the prefetcher, and
        # for good if the iterable keeps SIGTERM from ending it.
        while not ended.wait(0.5):
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(CLEANUP_SECONDS)
                os.kill(os.getpid(), signal.SIGKILL)

    def put(job):
        """Queues a job for the sender and, without ``ahead``, waits until it was copied;
        ``_Stop`` once the sender has ended (it sent why)."""
        while not ended.is_set() and sender.is_alive():
            try:
                jobs.put(job, timeout=POLL_SECONDS)
                break
            except queue.Full:
                continue
        else:
            raise _Stop
        copied = job[3] if job[0] == "item" else None
        while copied is not None and not ahead and not copied.wait(POLL_SECONDS):
            if ended.is_set() or not sender.is_alive():
                raise _Stop

    sender = threading.Thread(target=deliver, name="pinstream-helper-send", daemon=True)
    watchdog = threading.Thread(target=watch, name="pinstream-helper-watch", daemon=True)
    i = 0
    it = None
    # The puller queued its last message (the end, or the error): the sender delivers every
    # item before it, however long the training process takes to free their slots.
    finished = False
    try:
        try:
            # First: a DataLoader forks its workers here, before this process has threads.
            before = _rng_states(rng_source)
            it = iter(iterable)
            started = _rng_states(rng_source)
            # The training process waits for this (nothing else is sent yet): the random
            # draws of a DataLoader's iter() (its order, its workers' seeds) are then made
            # there too, as if it had iterated the loader itself.
            send(("started", _rng_changes(before, started)))
        finally:
            sender.start()
            watchdog.start()
        iterable = None
        sent = {k: v for k, v in started.items() if k[0] == "loader"}

        def generator_news():
            now = {k: v for k, v in _rng_states(rng_source, loader_only=True).items()
                   if sent.get(k) != v}
            sent.update(now)
            return now or None

        while True:
            try:
                item = next(it)
            except StopIteration:
                break
            # The loader's own generators as they are once this item was pulled (where they
            # moved since the last item sent): a sampler draws from them lazily, and the
            # training process takes their states as it takes the item.
            put(("item", i, item, threading.Event(), generator_news()))
            del item
            i += 1
        # The end carries them too (torch's RandomSampler draws at the end of its order).
        # Torch's, numpy's and Python's global generators are set only after `iter()`: the
        # training process draws from them meanwhile.
        put(("end", generator_news()))
        finished = True
    except (_Stop, _Terminated):
        pass
    except BaseException as e:  # noqa: BLE001 - everything goes to the training process
        try:
            put(("error", i, *_error_payload(e)))
            finished = True
        except BaseException:  # noqa: BLE001 - the sender has ended
            pass
    finally:
        # The iterator's own cleanup: a generator's `finally` blocks, a DataLoader's workers.
        # A second SIGTERM does not cut it short; the training process kills the helper if it
        # takes more than CLEANUP_SECONDS.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            if getattr(it, "_workers", None):
                # A DataLoader's iterator: its workers asked to stop, and ended (SIGTERM) if
                # they do not within `WORKERS_SECONDS` (one stuck in the dataset would
                # outlive this helper otherwise: torch waits 5 s for each, then ends them).
                end_iteration(it, False, WORKERS_SECONDS)
        except BaseException:  # noqa: BLE001 - nothing to report it to any more
            pass
        try:
            close = getattr(it, "close", None)
            if callable(close):
                close()
        except BaseException:  # noqa: BLE001 - nothing to report it to any more
            pass
        it = None
        if not finished:
            stopping.set()  # the sender stops at its next wait
    # The sender ends once it sent the last message, or when the training process closes the
    # prefetcher or goes away: the free-slot pipe ends, the pipe to it breaks, or SIGTERM comes
    # (a close where the free-slot pipe does not end, a process forked there holding it too;
    # the watchdog's, the training process gone). A helper that does not end is killed.
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.set())
    while sender.is_alive() and not stopping.is_set():
        sender.join(POLL_SECONDS)


#: Where a DataLoader keeps the ``torch.Generator`` objects its ``iter()`` may draw from.
_GENERATOR_PATHS = (
    ("generator",),
    ("sampler", "generator"),
    ("batch_sampler", "generator"),
    ("batch_sampler", "sampler", "generator"),
)


def _generators(source):
    """``(path, generator)`` for each ``torch.Generator`` found on ``source`` along
    ``_GENERATOR_PATHS``."""
    torch = sys.modules.get("torch")
    found = []
    if torch is None or source is None:
        return found
    for path in _GENERATOR_PATHS:
        obj = source
        try:
            for name in path:
                obj = getattr(obj, name, None)
        except Exception:  # noqa: BLE001 - an attribute that raises: not followed
            obj = None
        if isinstance(obj, torch.Generator):
            found.append((path, obj))
    return found


def _rng_states(source, loader_only=False):
    """The states of the random generators a ``DataLoader``'s ``iter()`` may draw from, by
    name: torch's default one, those found on ``source``, Python's ``random`` and numpy's
    global one (where imported); with ``loader_only``, those found on ``source`` only. Values
    are plain picklable objects."""
    if loader_only:
        return {("loader", *path): state
                for path, state in _generator_states(dict(_generators(source))).items()}
    states = {("random",): random.getstate()}
    np = sys.modules.get("numpy")
    if np is not None:
        try:
            states[("numpy",)] = np.random.get_state()
        except Exception:  # noqa: BLE001 - not read: not synchronised
            pass
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            states[("torch",)] = bytes(torch.get_rng_state().numpy())
        except Exception:  # noqa: BLE001 - not read: not synchronised
            pass
    states.update(_rng_states(source, loader_only=True))
    return states


def _rng_changes(before, after):
    """The states in ``after`` that differ from ``before``."""
    out = {}
    for key, state in after.items():
        try:
            same = key in before and pickle.dumps(before[key]) == pickle.dumps(state)
        except Exception:  # noqa: BLE001 - not comparable: sent
            same = False
        if not same:
            out[key] = state
    return out


def _generator_states(generators):
    """The states of ``generators`` (by path), as ``_rng_states`` reads them: each generator
    read once (a DataLoader's is found at two or three paths)."""
    out, read = {}, {}
    for path, g in generators.items():
        try:
            if id(g) not in read:
                read[id(g)] = bytes(g.get_state().numpy())
            out[path] = read[id(g)]
        except Exception:  # noqa: BLE001 - not read: never taken for unchanged
            pass
    return out


def _apply_rng(generators, changes):
    """Sets, in the training process, the states the helper changed, on the same generators
    (``generators``: ``_generators`` of the loader as this process holds it, by path)."""
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    for key, state in (changes or {}).items():
        if (key == ("numpy",) and np is None) or (key != ("random",) and key != ("numpy",)
                                                    and torch is None):
            continue  # imported in the helper only: this process has no such generator to set
        try:
            if key == ("random",):
                random.setstate(state)
            elif key == ("numpy",):
                np.random.set_state(state)
            elif key == ("torch",):
                torch.set_rng_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
            elif key[0] == "loader" and key[1:] in generators:
                generators[key[1:]].set_state(
                    torch.frombuffer(bytearray(state), dtype=torch.uint8))
        except Exception as e:  # noqa: BLE001 - said, and the iteration goes on
            warnings.warn(f"{OP}: the random state {key!r} the helper changed could not be "
                          f"set here ({e}): this process's draws differ from an iteration "
                          "here", RuntimeWarning, stacklevel=3)


def _copy_reraise_note(e, text):
    if text:
        try:
            e.add_note(f"raised in {OP}'s helper process:\n{text}")
        except Exception:  # noqa: BLE001 - an odd __notes__: the exception as it is
            pass
    return e


class _Slots:
    """This process's side of the ring's free slots: a slot's number goes back to the helper
    once its images are no longer referred to here; nothing is sent after ``close``."""

    def __init__(self, fd, token=None, close_fd=None):
        self._fd = fd
        self._token = token
        #: How its descriptor is closed (leaving its table first); ``_close_owned`` by default.
        self._close_fd = close_fd
        self._pid = os.getpid()
        self._lock = threading.RLock()  # a collection inside may release another slot

    def release(self, s):
        if os.getpid() != self._pid:
            return  # a fork's copy (a helper, a worker): the slots are not its to give back
        with self._lock:
            if self._fd is None:
                return
            try:
                os.write(self._fd, _TOKEN.pack(s))
            except OSError:
                pass

    def close(self):
        if os.getpid() != self._pid:
            return
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            if self._close_fd is not None:
                self._close_fd(fd)
            else:
                _close_owned(self._token, fd)


def _end_helper(proc, slots):
    """Ends the helper: no more free slots (it ends at its next wait for one), then SIGTERM
    (it stops where it is and cleans up), then SIGKILL. Only in the process that started it
    (not in a fork of this one)."""
    slots.close()
    try:
        if proc is not None and proc._parent_pid == os.getpid():  # noqa: SLF001 - a fork's copy
            proc.join(0.5)
            if proc.exitcode is None:
                proc.terminate()
                proc.join(CLEANUP_SECONDS)
            if proc.exitcode is None:
                proc.kill()
                proc.join(2.0)
    except (OSError, ValueError, AssertionError):
        pass


def _stop(token, proc, slots, fds):
    """The reader is gone: the helper ends, and the pipe from it and the ring's descriptor are
    closed (nothing reads them any more). Nothing in a fork's copy of it (a helper, a
    DataLoader worker): the helper and the descriptors are the process's that made it."""
    if proc is None or proc._parent_pid != os.getpid():  # noqa: SLF001
        return
    _end_helper(proc, slots)
    with forklock.LOCK:
        _OWNED.pop(token, None)
        for fd in fds:
            fd.close()


class HelperReader:
    """The iterable ``pinstream.prefetch`` pulls when ``process=True``: iterated once, it forks
    the helper (``iter()``), and each ``next()`` gives the next item with its images as a
    read-only numpy view of their slot."""

    def __init__(self, iterable, keys, slots, device=None, ahead=True):
        if slots < 2:
            raise InvalidArgumentError(f"{OP}: {slots} slots: at least 2")
        self._np = _numpy()
        #: The loader's own ``torch.Generator`` objects, by path (``_generators``): the states
        #: the helper changed are set on them here.
        self._generators = dict(_generators(iterable))
        #: Their states when the helper's were last set here, and the paths of those this
        #: process drew from since (left alone for the rest of the iteration).
        self._generators_set = {}
        self._drawn_here = set()
        #: The device whose DMA reads the ring (it is registered for it); ``None``: a dry run.
        self._device = device
        self._ahead = ahead
        self._registration = None
        self._iterable = iterable
        self._keys = keys
        self._slots_n = slots
        self._started = False
        self._done = False
        self._ring = None
        self._slot_bytes = 0
        self._proc = None
        self._ready = None
        self._slots = None
        self._finalizer = None
        self._ring_fd = None
        # The message being read: its length's bytes, then its body (allocated at its size).
        self._head = bytearray()
        self._body = None
        self._got = 0

    def __iter__(self):
        if self._started:
            return self
        self._started = True
        import multiprocessing

        if multiprocessing.current_process().daemon:
            raise InvalidArgumentError(
                f"{OP}: this is a daemonic process (a Pool worker, a Process(daemon=True)), "
                "which may not start one: use process=False here"
            )
        ctx = multiprocessing.get_context("fork")
        fds = []
        try:
            ring_fd = os.memfd_create("pinstream-ring", os.MFD_CLOEXEC)
            fds.append(_FdCloser(ring_fd))
            ready_r, ready_w = os.pipe()
            fds += [_FdCloser(ready_r), _FdCloser(ready_w)]
            try:
                import fcntl

                fcntl.fcntl(ready_w, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
            except OSError:
                pass  # a smaller pipe (a limit on pipe buffers): only slower
            free_r, free_w = os.pipe()
            fds += [_FdCloser(free_r), _FdCloser(free_w)]
        except BaseException:
            for fd in fds:
                fd.close()
            raise
        token = object()
        slots = _Slots(free_w, token)
        proc = ctx.Process(
            target=_helper,
            args=(self._iterable, self._keys, self._slots_n, ring_fd, ready_w, free_r,
                  (ready_r, free_w), token, self._ahead, self._iterable, random.getstate()),
            name="pinstream-helper",
        )
        try:
            with forklock.LOCK, warnings.catch_warnings():
                _OWNED[token] = ((ring_fd, ready_r, free_w), None)
                # Python 3.12 warns of fork() in a process with threads; the helper only runs
                # Python (and the DataLoader, which forks its workers the same way).
                warnings.simplefilter("ignore", DeprecationWarning)
                proc.start()
                fds[2].close()  # ready_w and free_r are the helper's
                fds[3].close()
        except BaseException:
            fds[4] = _FdCloser(None)  # closed by `slots`
            slots.close()
            with forklock.LOCK:
                _OWNED.pop(token, None)
                for fd in fds:
                    fd.close()
            raise
        finally:
            fds[2].close()  # ready_w and free_r are the helper's
            fds[3].close()
        self._ring_fd = ring_fd
        self._ready = ready_r
        self._slots = slots
        self._proc = proc
        self._token = token
        # The iterable lives on in the helper; this process lets go of it (a DataLoader's
        # dataset, a generator's frame).
        self._iterable = None
        self._finalizer = weakref.finalize(
            self, _stop, token, proc, slots, (fds[0], fds[1])
        )
        try:
            self._await_start()
        except BaseException:
            self.close()
            raise
        return self

    def _await_start(self):
        """Waits for the helper's ``iter()``: its error is raised here, as ``iter()`` of the
        iterable in this process would, and the random states it changed (a DataLoader's
        shuffle and its workers' seeds) are set here, so that this process draws on as after
        an ``iter()`` of its own (each epoch's helper starts from them: a new order each)."""
        msg = pickle.loads(self._frame())
        if msg[0] == "started":
            _apply_rng(self._generators, msg[1])
            self._generators_set = _generator_states(self._generators)
            return
        if msg[0] == "error":
            self._raise(msg)
        raise LoaderError(f"{OP}: the helper's first message was {msg[0]!r}, not its start")

    def _raise(self, msg):
        """Raises what the helper sent as an error (it ended the iteration)."""
        self.close()
        _, i, exc, name, message, text = msg
        if exc is not None:
            try:
                e = pickle.loads(exc)
            except Exception:  # noqa: BLE001 - raised as text below
                e = None
            if isinstance(e, BaseException):
                raise _copy_reraise_note(e, text)
        if name == "InvalidArgumentError":
            raise InvalidArgumentError(message)
        raise LoaderError(f"{OP}: batch {i}: {name}: {message} (in the helper process)\n{text}")

    def close(self):
        """Ends the helper: the iteration is over, or the prefetcher is being closed (its
        ``on_close``). A loader thread waiting in ``next()`` sees it within ``POLL_SECONDS``
        and ends the iteration; the pipe stays open until the reader itself is gone, so that
        no wait ever sees its descriptor closed (or reused) under it."""
        self._done = True
        if self._proc is not None:
            _end_helper(self._proc, self._slots)

    def _frame(self):
        """The next message's bytes: read in slices, checking between them that the
        prefetcher is not closing (``StopIteration``) and that the helper is alive."""
        while True:
            if self._body is not None and self._got == len(self._body):
                data, self._body = self._body, None
                return data
            if self._done:
                raise StopIteration
            r, _, _ = select.select([self._ready], [], [], POLL_SECONDS)
            if r:
                if self._body is None:
                    chunk = os.read(self._ready, _LENGTH.size - len(self._head))
                    if chunk:
                        self._head += chunk
                        if len(self._head) == _LENGTH.size:
                            (n,) = _LENGTH.unpack(self._head)
                            self._head = bytearray()
                            self._body = bytearray(n)
                            self._got = 0
                        continue
                else:
                    k = os.readv(self._ready, [memoryview(self._body)[self._got:]])
                    if k:
                        self._got += k
                        continue
            elif self._proc.exitcode is None:
                continue
            # The pipe ended, or nothing more comes from a helper that has exited (a process
            # it forked may still hold the pipe open).
            if self._done:
                raise StopIteration
            self._proc.join(1.0)
            code = self._proc.exitcode
            self.close()
            raise LoaderError(
                f"{OP}: the helper process {self._proc.pid} ended (exit code {code}) before the "
                "iteration did"
            )

    def __next__(self):
        if self._done or not self._started:
            raise StopIteration
        while True:
            msg = pickle.loads(self._frame())  # what it raises is the item's error
            kind = msg[0]
            if kind == "ring":
                if self._ring is not None:
                    self.close()
                    raise LoaderError(f"{OP}: the helper made its ring twice")
                self._slot_bytes = msg[1]
                size = self._slot_bytes * self._slots_n
                self._ring = mmap.mmap(self._ring_fd, size, mmap.MAP_SHARED,
                                       mmap.PROT_READ | mmap.PROT_WRITE)
                with forklock.LOCK:
                    if self._token in _OWNED:
                        _OWNED[self._token] = (_OWNED[self._token][0], self._ring)
                if self._device is not None:
                    self._registration = _register(self._ring, self._device)
                continue
            if kind == "end":
                self.close()
                if len(msg) > 1:
                    self._take_news(msg[1])
                raise StopIteration
            if kind == "error":
                self._raise(msg)
            if kind == "item":
                return self._item(msg)
            self.close()
            raise LoaderError(f"{OP}: an unknown message from the helper: {kind!r}")

    def _take_news(self, news):
        """Sets the loader's generators to the states the helper sent (as a sampler's lazy
        draws in this process would move them), except one this process drew from since its
        state was last set here: it keeps its own draws, for the rest of the iteration."""
        if not news:
            return
        now = _generator_states(self._generators)
        for path in self._generators:
            if now.get(path) != self._generators_set.get(path):
                self._drawn_here.add(path)
        _apply_rng(self._generators,
                   {k: v for k, v in news.items() if k[1:] not in self._drawn_here})
        self._generators_set = _generator_states(self._generators)

    def _item(self, msg):
        _, i, s, shape, place, rest, news = msg
        self._take_news(news)
        if s < 0:
            return _unpack(rest)
        n = math.prod(shape)
        if self._ring is None or not 0 <= s < self._slots_n or n > self._slot_bytes:
            self.close()
            raise LoaderError(f"{OP}: batch {i}: slot {s} of {n} bytes does not lie in the ring")
        images = self._np.frombuffer(self._ring, self._np.uint8, n, s * self._slot_bytes).reshape(shape)
        # The slot is written again only once this view is gone (the prefetcher holds it
        # until its DMA is over), and the ring stays registered until then: the finalizer
        # holds the registration. Not run at exit: the prefetchers are closed then, and the
        # registration goes with the interpreter.
        weakref.finalize(images, _release, self._slots, s, self._registration).atexit = False
        return _with_images(rest, place, images)


def _release(slots, s, registration):
    """A slot's view is gone: the slot goes back to the helper (``registration`` was only
    kept alive until now)."""
    slots.release(s)


def _register(ring, device):
    """Page-locks the ring for ``device``'s DMA; where that fails (a limit on locked memory),
    the prefetcher stages the slots instead, and a warning says so."""
    from . import _native
    from .errors import PinstreamError

    try:
        return _native.HostRegistration(ring, device)
    except PinstreamError as e:
        warnings.warn(f"{OP}: the ring could not be page-locked ({e}); its batches are staged",
                      RuntimeWarning, stacklevel=2)
        return None


class _FdCloser:
    """Closes a raw file descriptor once (the helper's copy of this process's end; the ring's
    descriptor here when the reader is gone)."""

    def __init__(self, fd):
        self.fd = fd

    def close(self):
        fd, self.fd = self.fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
