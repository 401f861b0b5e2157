"""pinstream for PyTorch: the same calls, returning torch tensors.

Device results are handed to torch through DLPack on ``torch.cuda.current_stream()``: torch's
stream waits for pinstream's copy on the GPU, and the host does not wait.
"""

import torch

import pinstream
from pinstream import _native

_TORCH_DTYPES = {
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "uint16": torch.uint16,
    "uint32": torch.uint32,
    "uint64": torch.uint64,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}


try:
    _raw_stream = torch._C._cuda_getCurrentRawStream
except AttributeError:  # a torch without it: the public way

    def _raw_stream(index):
        return torch.cuda.current_stream(index).cuda_stream


def _handed(t, streams):
    """``torch.from_dlpack(t)`` for a ``pinstream.Tensor``, the same handover at a fraction of
    its cost: torch's current stream of the tensor's device is looked up once per batch
    (``streams``, a dict the caller keeps for one batch) without making a Python stream object,
    and the capsule is the one every torch takes (DLPack 0.x). ``torch.from_dlpack`` spent 0.2 ms
    on a batch's two tensors, most of it making stream objects, on the training thread at the
    moment its GPU has the least queued (BENCHMARKS.md, 2026-11-27, eighth session). A tensor
    this way refuses (a read-only one, which that capsule cannot mark) is left as it was and
    goes torch's way; host memory goes torch's way too."""
    kind, index = t.__dlpack_device__()
    if kind != 2:
        return torch.from_dlpack(t)
    s = streams.get(index)
    if s is None:
        # The protocol's 1 is the legacy default stream, whose handle is 0.
        s = streams[index] = _raw_stream(index) or 1
    try:
        capsule = t.__dlpack__(stream=s)
    except pinstream.PinstreamError:
        return torch.from_dlpack(t)
    return torch.utils.dlpack.from_dlpack(capsule)


def _device(device):
    if device is None:
        return torch.cuda.current_device()
    return pinstream._device(device)


def upload(x, device=None):
    """``x`` (a CPU tensor or array) on the GPU as a torch tensor, through pinstream's staging
    engine: ``x.to(device, non_blocking=True)`` at link speed from pageable memory."""
    return torch.from_dlpack(pinstream.upload(x, _device(device)))


def upload_many(xs, device=None):
    """Many CPU tensors in one packed upload, as torch tensors: views of one device arena (freed
    when the last is). The tensors are read by pointer on the native side (plain dense torch
    CPU tensors; anything else goes through ``pinstream.upload_many``); tensors of one dtype
    and shape become their views in one ``unbind``."""
    xs = list(xs)
    if not all(type(x) is torch.Tensor or type(x) is torch.nn.Parameter for x in xs):
        # Subclasses as plain tensors over the same memory; arrays and sequences as tensors.
        xs = [
            x.as_subclass(torch.Tensor) if isinstance(x, torch.Tensor) else torch.as_tensor(x)
            for x in xs
        ]
    arena, offsets, uniform = _native.upload_torch_packed(xs, _device(device))
    if arena is None:
        return []
    a = torch.from_dlpack(arena)
    if uniform:
        x0 = xs[0]
        n = len(xs) * x0.nbytes
        return list(a[:n].view(x0.dtype).view(len(xs), *x0.shape).unbind(0))
    out = []
    for x, off in zip(xs, offsets):
        out.append(a[off : off + x.nbytes].view(x.dtype).view(x.shape))
    return out


def download(x):
    """A CUDA tensor as a CPU tensor, returned only once the data has arrived: one DMA into
    page-locked memory from pinstream's pool, handed to torch without a copy (its memory goes
    back to the pool when torch frees the tensor)."""
    t, dtype, shape = _native.download(x)
    dt = _TORCH_DTYPES.get(dtype)
    if dt is None:
        raise pinstream.InvalidArgumentError(f"pinstream.torch.download: torch has no {dtype}")
    if t is None:
        return torch.empty(shape, dtype=dt)
    return torch.from_dlpack(t)


class Prefetcher:
    """``pinstream.Prefetcher`` giving torch tensors (on the current stream)."""

    def __init__(self, inner):
        self._inner = inner

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self._inner)
        streams = {}
        if isinstance(item, pinstream.Tensor):
            return _handed(item, streams)
        if isinstance(item, dict):
            return {k: _handed(v, streams) if isinstance(v, pinstream.Tensor) else v for k, v in item.items()}
        return tuple(_handed(x, streams) if isinstance(x, pinstream.Tensor) else x for x in item)

    def close(self):
        """Stops the threads early; the tensors handed out stay valid."""
        self._inner.close()

    def stats(self):
        """The loader threads' counters (``pinstream.Prefetcher.stats``)."""
        return self._inner.stats()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def prefetch(iterable, device=None, **kwargs):
    """``pinstream.prefetch`` giving torch tensors: APEX's ``data_prefetcher`` in one line,
    ``for images, labels in pinstream.torch.prefetch(loader, normalize=pinstream.IMAGENET,
    dtype=torch.float16): ...``. A ``DataLoader`` with worker processes is taken without the
    serial copy (``fresh``: its batches are copied into page-locked memory on several loader
    threads while the next one is pulled; with ``pin_memory=True`` they go to the GPU as they
    are, one DMA each). A dict batch comes back as a dict."""
    return Prefetcher(pinstream.prefetch(iterable, _device(device), **kwargs))


def load_safetensors(path, device=None, direct="auto"):
    """``safetensors.torch.load_file(path, device="cuda:N")`` through pinstream:
    ``{name: torch tensor}`` on the GPU, the bytes staged at link speed into one arena. ``path``
    may also be a sharded checkpoint: its ``*.index.json`` or its folder (see
    ``pinstream.load_safetensors``)."""
    return {k: torch.from_dlpack(v) for k, v in pinstream.load_safetensors(path, _device(device), direct).items()}


class ImageFeed(pinstream.ImageFeed):
    """``pinstream.ImageFeed`` giving torch tensors: ``(images, labels)`` on the GPU, ordered on
    torch's current stream (no host wait). ``device`` defaults to torch's current device and
    ``dtype`` may be a torch dtype (default ``torch.bfloat16``)."""

    def __init__(self, data, batch_size=256, *, device=None, dtype=torch.bfloat16, **kwargs):
        super().__init__(data, batch_size, device=_device(device), dtype=dtype, **kwargs)

    def _convert(self, pixels, labels):
        streams = {}
        return _handed(pixels, streams), _handed(labels, streams)


def image_feed(data, batch_size=256, **kwargs):
    """``pinstream.torch.ImageFeed(data, batch_size, ...)``: ``for images, labels in
    pinstream.torch.image_feed("/data/imagenet/train", 256): ...``."""
    return ImageFeed(data, batch_size, **kwargs)
