"""pinstream: host <-> GPU transfers at link speed, for Python.

>>> import numpy as np, pinstream, torch
>>> t = pinstream.upload(np.ones((1024, 1024), np.float32))   # staged, GIL released
>>> x = torch.from_dlpack(t)                                   # zero copy, ordered on the GPU
>>> y = pinstream.download(x)                                  # numpy, only once it arrived

Results are DLPack producers (``torch.from_dlpack``, ``cupy.from_dlpack``,
``jax.dlpack.from_dlpack`` take them without a copy; the consumer's stream waits on the GPU).
``pinstream.torch`` returns torch tensors directly. Every failure is a
``pinstream.errors.PinstreamError`` of its kind.
"""

import atexit
import collections.abc
import itertools
import operator
import os
import weakref

# More hardware work queues than CUDA's default 8, where the process has not chosen: the image
# feed's nvJPEG keeps a dozen internal streams, and with 8 queues its work shares a queue with
# the training step's, each waiting behind the other (BENCHMARKS.md, 2026-11-27 fourth
# session). CUDA reads the variable when it initializes, so it only acts where pinstream is
# imported before the first CUDA call. A value already set is kept: in os.environ, or only in
# the C environment (os.putenv, a native setenv). Child processes inherit it.
_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"


def _c_environment_has(name):
    try:
        import ctypes

        getenv = ctypes.CDLL(None).getenv
        getenv.restype = ctypes.c_char_p
        getenv.argtypes = [ctypes.c_char_p]
        return getenv(name.encode()) is not None
    except Exception:  # no C library to ask: os.environ alone decides
        return False


if _CONNECTIONS not in os.environ and not _c_environment_has(_CONNECTIONS):
    os.environ[_CONNECTIONS] = "32"

from . import errors
from ._native import (
    Prefetcher,
    Tensor,
    __version__,
    device_count,
    device_name,
    memory_stats,
    stream_handle,
    synchronize,
)
from . import _native
from .errors import (
    CudaError,
    ForkedError,
    InvalidArgumentError,
    IoError,
    LoaderError,
    NoDeviceError,
    OutOfMemoryError,
    PinstreamError,
)

__all__ = [
    "Tensor",
    "ImageFeed",
    "distributed_defaults",
    "MAX_CPUS",
    "Prefetcher",
    "prefetch",
    "load_safetensors",
    "IMAGENET",
    "upload",
    "upload_many",
    "download",
    "device_count",
    "device_name",
    "empty_cache",
    "memory_stats",
    "stream_handle",
    "synchronize",
    "errors",
    "PinstreamError",
    "NoDeviceError",
    "CudaError",
    "OutOfMemoryError",
    "InvalidArgumentError",
    "IoError",
    "LoaderError",
    "ForkedError",
]


def _device(device):
    """A device ordinal from an int, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``."""
    if device is None:
        return 0
    if isinstance(device, bool):
        raise InvalidArgumentError(f"pinstream: device {device!r} is not a CUDA device")
    if isinstance(device, int):
        return device
    kind = getattr(device, "type", None)
    if kind is not None:  # torch.device
        if kind != "cuda":
            raise InvalidArgumentError(f"pinstream: device {device!r} is not a CUDA device")
        return device.index if device.index is not None else _current_torch_device()
    if isinstance(device, str):
        if device == "cuda":
            return _current_torch_device()
        if device.startswith("cuda:") and device[5:].isdigit():
            return int(device[5:])
    raise InvalidArgumentError(f"pinstream: device {device!r} is not a CUDA device")


def _current_torch_device():
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return 0


def _contiguous(x):
    """numpy arrays and torch tensors in C order (a copy only where they are not); numpy
    scalars as 0-d arrays."""
    if type(x).__module__ == "numpy":
        import numpy

        if isinstance(x, numpy.generic):
            return numpy.asarray(x)
    if hasattr(x, "is_contiguous") and hasattr(x, "contiguous"):  # torch
        return x if x.is_contiguous() else x.contiguous()
    flags = getattr(x, "flags", None)
    if flags is not None and hasattr(flags, "c_contiguous") and not flags.c_contiguous:
        import numpy

        return numpy.ascontiguousarray(x)
    return x


def upload(x, device=0):
    """Copies a host array (numpy, a torch CPU tensor, anything with ``__dlpack__`` on the CPU
    or the buffer protocol) to the GPU through pinstream's staging engine and returns a
    ``pinstream.Tensor``; the source is free again when the call returns."""
    return _native.upload(_contiguous(x), _device(device))


def upload_many(xs, device=0):
    """Many host arrays in one packed upload; returns one ``pinstream.Tensor`` per array."""
    return _native.upload_many([_contiguous(x) for x in xs], _device(device))


_NUMPY_NAMES = {"bfloat16": None}


def download(x):
    """Copies a CUDA array (torch, CuPy, JAX, a ``pinstream.Tensor``) to a numpy array and
    returns it only once the data is there: never the unfinished result a ``non_blocking`` copy
    read too early gives. One DMA into page-locked memory from pinstream's pool (no first-touch
    page faults), which the array keeps and gives back when it is freed."""
    import numpy

    t, dtype, shape = _native.download(x, bf16_as_u16=True)
    if dtype == "bfloat16":
        try:
            import ml_dtypes

            np_dtype = ml_dtypes.bfloat16
        except ImportError as e:
            raise InvalidArgumentError(
                "pinstream.download: numpy has no bfloat16 (install ml_dtypes, or use "
                "pinstream.torch.download)"
            ) from e
        if t is None:
            return numpy.empty(shape, np_dtype)
        # numpy's DLPack import knows no bfloat16: take the bytes, then the type.
        return numpy.from_dlpack(t).view(np_dtype)
    try:
        np_dtype = numpy.dtype(dtype)
    except TypeError as e:
        raise InvalidArgumentError(f"pinstream.download: numpy has no {dtype}") from e
    if t is None:
        return numpy.empty(shape, np_dtype)
    return numpy.from_dlpack(t)


#: ImageNet's mean and std on the 0..255 scale of uint8 images (RGB), for ``normalize=``.
IMAGENET = ((123.675, 116.28, 103.53), (58.395, 57.12, 57.375))


def _dtype_name(dtype):
    """``"float16"`` from ``torch.float16``, ``numpy.float16`` or the string."""
    if isinstance(dtype, str):
        return dtype.removeprefix("torch.")
    text = str(dtype)
    if text.startswith("torch."):
        return text.removeprefix("torch.")
    try:
        import numpy

        return numpy.dtype(dtype).name
    except (ImportError, TypeError) as e:
        raise InvalidArgumentError(f"pinstream: dtype {dtype!r}") from e


def _is_worker_dataloader(iterable):
    """Whether ``iterable`` is a torch ``DataLoader`` with worker processes (or the iterator of
    one): its batches come from the workers through shared memory, a new tensor every batch.
    torch is not imported for this (an iterable of torch's means torch is loaded)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return False
    data = getattr(getattr(torch, "utils", None), "data", None)
    if data is None:
        return False
    if isinstance(iterable, data.DataLoader):
        return iterable.num_workers > 0
    multi = getattr(data.dataloader, "_MultiProcessingDataLoaderIter", None)
    return multi is not None and isinstance(iterable, multi)


#: Loader threads when each item's pixels are copied after its turn (``fresh``): the pull is
#: serial, the copies (and the DataLoader's shared memory mapped in and out) run on every
#: loader at once.
FRESH_LOADER_THREADS = 6


#: Loader threads with ``process=True``: a turn only reads a slot's number and hands the slot
#: to the DMA, and every other thread would take the GIL from an eager training step
#: (ResNet-18: 1.027 / 1.043 of the ideal with one, 1.028 / 1.105 with two; BENCHMARKS.md).
PROCESS_LOADER_THREADS = 1

#: Loader threads with ``worker_ring=True``: a turn receives a small message from a worker and
#: hands the slot to the DMA.
WORKER_RING_LOADER_THREADS = 1


def _count(name, n):
    """A positive integer argument (a numpy integer too; never a bool, float or string)."""
    try:
        if isinstance(n, bool):
            raise TypeError
        n = operator.index(n)
    except TypeError:
        raise InvalidArgumentError(f"pinstream.prefetch: {name}={n!r}: a positive integer") from None
    if n < 1:
        raise InvalidArgumentError(f"pinstream.prefetch: {name}={n}: a positive integer")
    return n


#: The most CPUs ``cpus=`` may name, and one past the highest CPU number (``CPU_SETSIZE``).
MAX_CPUS = 1024


def _cpus(op, cpus):
    """``cpus=`` as a list (a set, a range or a generator read once, so a feed that is rebuilt
    keeps it); the native side checks each entry. At most ``MAX_CPUS + 1`` items are read;
    what the iterable itself raises while it is read goes to the caller as it is."""
    if cpus is None:
        return None
    if isinstance(cpus, (str, bytes, bytearray, memoryview, collections.abc.Mapping)):
        raise InvalidArgumentError(
            f"{op}: cpus: give CPU numbers (a list or set of integers), not {type(cpus).__name__}"
        )
    try:
        it = iter(cpus)
    except TypeError:
        raise InvalidArgumentError(
            f"{op}: cpus: give CPU numbers (a list or set of integers), not {type(cpus).__name__}"
        ) from None
    return list(itertools.islice(it, MAX_CPUS + 1))


def prefetch(
    iterable,
    device=0,
    depth=2,
    normalize=None,
    dtype="float32",
    layout="nchw",
    input_layout="nchw",
    loader_threads=None,
    zero_copy=False,
    dry_run=False,
    fresh=None,
    keys=None,
    cpus=None,
    process=False,
    worker_ring=None,
):
    """Prefetches the batches of ``iterable`` to the GPU: a ``pinstream.Prefetcher``.

    Each item is a uint8 image batch (``[N, C, H, W]``, or ``[N, H, W, C]`` with
    ``input_layout="nhwc"``; numpy, a torch CPU tensor, anything with ``__dlpack__``), a tuple
    or list ``(images, labels, *rest)``, or a mapping (a dict batch) whose images and labels are
    named by ``keys=(images_key, labels_key)`` (default: the first of ``image``, ``images``,
    ``pixel_values``, ``pixels``, ``img``, ``input``, ``x``, and of ``label``, ``labels``,
    ``target``, ``targets``, ``y``, that it has): a ``DataLoader``, a generator. pinstream's
    engine uploads the pixels, and one fused kernel normalizes (``normalize=(mean, std)`` on the
    0..255 scale, e.g. ``pinstream.IMAGENET``), casts to ``dtype`` (float32, float16, bfloat16,
    uint8) and lays out (``layout``) each batch, ``depth`` batches ahead. Labels go to the GPU as
    int64; ``rest`` (a mapping's other entries) is passed through as it is. Results are
    ``pinstream.Tensor``s (``pinstream.torch.prefetch`` gives torch tensors), a mapping item's
    as a dict with the same keys.

    Loader threads take the items in turn, holding the GIL only to pull them. By default each
    item's pixels are copied into page-locked memory in its turn, before the iterable is asked
    for the next one, so an iterable may refill and yield the same array again.

    ``fresh=True`` promises that every item is a new array that nobody writes after yielding
    it: the copy then runs after the turn, on each loader thread, while the next item is already
    being pulled, so only the iterable's own ``__next__`` is serial; arrays already page-locked
    (a ``DataLoader`` with ``pin_memory=True``) are not copied at all but go to the GPU with one
    DMA each. ``fresh=None`` (the default) chooses it for a torch ``DataLoader`` with
    ``num_workers > 0`` (or its iterator), whose batches come from the workers through shared
    memory, a new tensor each, and ``fresh=False`` for anything else. ``loader_threads=None``
    means 2, or ``FRESH_LOADER_THREADS`` (6) when ``fresh``.

    ``zero_copy=True`` skips pinstream's copy: the array is held and read later, by the upload
    (the staging engine copies it into its pinned slots; page-locked arrays go with one DMA).
    It makes the same promise as ``fresh=True``; an iterable that refills its array would then
    deliver another item's pixels.

    ``dry_run=True`` runs the same loader threads and checks without a GPU: each batch comes as
    numpy arrays (pixels normalized by pinstream's float64 CPU reference, bfloat16 as its
    uint16 bits; labels as int64), for testing an iterable on a machine without a device. It
    is slow and not meant for training.

    ``cpus``: the CPUs the loader threads (and the threads they start) run on, whatever the
    calling thread's own mask; ``None``: where the caller may run, next to the GPU. Give it
    when the training thread is pinned to a CPU of its own (docs/python.md).

    ``process=True`` iterates ``iterable`` in a helper process forked when the prefetcher
    starts, so that this process spends no interpreter time on it (a ``DataLoader`` beside an
    eager training step that keeps the GIL busy: docs/python.md). The helper copies each item's
    uint8 images into a ring of shared-memory slots and sends the rest pickled (with ``fresh``,
    chosen as above, it pulls the next item meanwhile; without, only after the copy). The
    iterable must work in a forked process without CUDA (a
    ``DataLoader``'s ``pin_memory`` is turned off there); pass a ``DataLoader``, not an iterator
    already started here. Needs numpy.

    ``worker_ring=True`` (a ``DataLoader`` with workers forked, ``persistent_workers=False``):
    the loader's workers copy each batch's uint8 images into a page-locked ring of shared
    memory (with torch's ``default_collate``, they stack the samples straight into it), and the
    prefetcher DMAs them from there; this process neither maps nor copies them
    (docs/python.md). The loader's ``collate_fn`` is wrapped for the workers of this iteration
    only. Needs numpy. ``worker_ring=None`` (the default) turns it on for a
    ``torch.utils.data.DataLoader`` itself (not a subclass) that allows it, unless
    ``process=True``, ``zero_copy=True`` or a false ``fresh`` is given; ``False`` pulls the
    loader's batches in this process. A ``DataLoader`` with workers pulled in this process is
    ended by ``close()`` even while a worker is stuck (``pinstream.dataloader_end``).

    ``next()`` waits in short slices and handles Ctrl-C (``KeyboardInterrupt``) while it waits;
    the prefetcher stays usable. In a process forked after the prefetcher started, its calls
    raise ``ForkedError`` (see docs/python.md for DataLoader workers and multiprocessing)."""
    mean, std = normalize if normalize is not None else (None, None)
    if not isinstance(process, bool):
        raise InvalidArgumentError(f"pinstream.prefetch: process={process!r}: True or False")
    if worker_ring is not None and not isinstance(worker_ring, bool):
        raise InvalidArgumentError(
            f"pinstream.prefetch: worker_ring={worker_ring!r}: True, False or None (where the "
            "loader allows it)"
        )
    if worker_ring is None:
        # On for a plain torch DataLoader that allows it, unless another choice was asked for.
        worker_ring = False
        if not process and not zero_copy and (fresh is None or bool(fresh)):
            from . import worker_ring as _worker_ring

            worker_ring = _worker_ring.allows(iterable)
    if worker_ring:
        from . import worker_ring as _worker_ring

        if process:
            raise InvalidArgumentError(
                "pinstream.prefetch: process=True and worker_ring=True: choose one (the ring is "
                "written by the DataLoader's workers in this process, or by the helper)"
            )
        _worker_ring.check_loader(iterable)
        fresh = True
        if loader_threads is None:
            loader_threads = WORKER_RING_LOADER_THREADS
    if process:
        from . import process as _process

        if not (hasattr(type(iterable), "__iter__") or hasattr(type(iterable), "__getitem__")):
            raise TypeError("pinstream.prefetch: the source is not iterable")
        if _process.is_started_dataloader_iterator(iterable):
            raise InvalidArgumentError(
                "pinstream.prefetch: process=True takes the DataLoader itself, not an iterator "
                "of it already started in this process (its workers would feed this process)"
            )
        # In the helper, `fresh` decides whether the next item is pulled while one is copied
        # into its slot; here every item's images are a slot of their own either way.
        ahead = _is_worker_dataloader(iterable) if fresh is None else bool(fresh)
        fresh = True
        if loader_threads is None:
            loader_threads = PROCESS_LOADER_THREADS
    if fresh is None:
        fresh = _is_worker_dataloader(iterable)
    fresh = bool(fresh)
    if loader_threads is None:
        loader_threads = FRESH_LOADER_THREADS if fresh and not zero_copy else 2
    if process or worker_ring:
        loader_threads = _count("loader_threads", loader_threads)
        depth = _count("depth", depth)
    if keys is not None:
        if isinstance(keys, str):
            keys = (keys, None)
        keys = tuple(keys)
        if len(keys) == 1:
            keys = (keys[0], None)
        if len(keys) != 2 or not all(k is None or isinstance(k, str) for k in keys) or keys[0] is None:
            raise InvalidArgumentError(
                f"pinstream.prefetch: keys={keys!r}: give (images_key, labels_key), strings "
                "(labels_key may be None)"
            )
    if process:
        # Slots for the items the loader threads hold, those waiting in the pipe, and one the
        # helper fills meanwhile. The helper is forked where the native side calls iter(),
        # after every setting was checked.
        iterable = _process.HelperReader(
            iterable, keys, loader_threads + depth + 2, None if dry_run else _device(device), ahead
        )
    if worker_ring:
        # Slots for the batches the loader's workers may have made ahead (their prefetch), those
        # the loader threads hold and the prefetcher queues, and one in flight; a batch finding
        # none free comes the usual way.
        ahead = (getattr(iterable, "prefetch_factor", None) or 2) * iterable.num_workers
        iterable = _worker_ring.WorkerRingReader(
            iterable, keys, ahead + loader_threads + depth + 2, None if dry_run else _device(device)
        )
    in_process = False
    if not process and not worker_ring:
        try:
            in_process = _is_worker_dataloader(iterable)
        except Exception:  # noqa: BLE001 - a loader whose attributes raise: pulled as it is
            in_process = False
    if in_process:
        # A DataLoader with workers pulled here: close() (and the interpreter's exit) ends a
        # next() that waits for a stuck worker, rather than waiting with it.
        from .dataloader_end import InProcessReader

        iterable = InProcessReader(iterable)
    on_close = iterable.close if process or worker_ring or in_process else None
    p = _native.prefetch(
        iterable,
        _device(device),
        depth,
        None if mean is None else [float(m) for m in mean],
        None if std is None else [float(s) for s in std],
        _dtype_name(dtype),
        layout,
        input_layout,
        loader_threads,
        bool(zero_copy),
        bool(dry_run),
        fresh,
        keys,
        _cpus("pinstream.prefetch", cpus),
        on_close,
        bool(process or worker_ring),
    )
    _LIVE.add(p)
    return p


# Prefetchers still running when the interpreter exits are closed first (their threads pull
# from Python objects, which must not happen during finalization).
_LIVE = weakref.WeakSet()


@atexit.register
def _close_live_prefetchers():
    # Every one is closed, also after a Ctrl-C during one's close (a DataLoader reader waiting
    # for a stuck worker), which is raised again once all are.
    interrupt = None
    for p in list(_LIVE):
        try:
            p.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
        except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt, SystemExit: raised after
            interrupt = interrupt or e
    if interrupt is not None:
        raise interrupt


def empty_cache(device=0):
    """Gives the memory pinstream keeps for reuse back: the device memory of freed uploads and
    of tensors their consumers released (as ``torch.cuda.empty_cache()`` does for PyTorch's;
    call it where PyTorch needs the room), the idle page-locked host memory of released
    downloads, and the page-locked rings DataLoaders' workers wrote (``worker_ring``), kept
    for their next iteration on that device. Memory still in use stays."""
    from . import worker_ring

    device = _device(device)
    worker_ring.release_kept(device)
    _native.empty_cache(device)


def load_safetensors(path, device=0, direct="auto"):
    """Every tensor of a safetensors file, or of a sharded checkpoint, on the GPU:
    ``{name: pinstream.Tensor}``. ``path`` is a ``.safetensors`` file, a checkpoint's index
    (``model.safetensors.index.json``, as ``save_pretrained`` writes it), or a folder (its one
    ``*.safetensors.index.json``, else every ``*.safetensors`` in it). The index and every
    header are parsed and checked before the GPU is touched (a bad checkpoint is a
    ``FormatError`` naming the file and tensor; a missing shard an ``IoError``); the names are
    the index's. Every shard's data region goes from the page cache (or with O_DIRECT when cold,
    ``direct="auto"``) through the staging engine into one device arena; the GIL is released
    throughout."""
    return _native.load_safetensors(os.fsdecode(path), _device(device), direct)


from .feed import ImageFeed, distributed_defaults  # noqa: E402  (uses _device and _dtype_name above)
