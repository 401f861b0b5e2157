"""``pinstream.ImageFeed``: a folder of JPEGs to training batches on the GPU.

The Rust feed (``pinstream-vision``) thinly bound: JPEGs decoded by the GPU's JPEG engines
(nvJPEG) where it has them, else on loader threads; ``RandomResizedCrop`` + flip (train) or
``Resize`` + ``CenterCrop`` (val), normalize and cast in one kernel. This module adds the
defaults, the distributed rank, ``set_epoch`` and the state dict.
"""

import operator
import os
import sys

from . import IMAGENET, _native
from .errors import InvalidArgumentError

_STATE_VERSION = 1


def _int_env(name):
    text = os.environ.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise InvalidArgumentError(f"pinstream.ImageFeed: {name}={text!r} is not an integer") from None


def distributed_defaults(rank=None, world_size=None):
    """``(rank, world_size)``: those given; else ``torch.distributed``'s where it is initialized;
    else the ``RANK`` and ``WORLD_SIZE`` environment variables (as ``torchrun`` sets them); else
    ``(0, 1)``."""
    r, w = None, None
    if "torch" in sys.modules:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                r, w = dist.get_rank(), dist.get_world_size()
        except ImportError:
            pass
    if w is None:
        w = _int_env("WORLD_SIZE")
        r = _int_env("RANK")
        if w is not None and w > 1 and r is None and rank is None:
            raise InvalidArgumentError(
                f"pinstream.ImageFeed: WORLD_SIZE={w} but no RANK: give rank= or set RANK"
            )
    if world_size is not None:
        w = world_size
    if rank is not None:
        r = rank
    w = 1 if w is None else w
    r = 0 if r is None else r
    for name, v in (("rank", r), ("world_size", w)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidArgumentError(f"pinstream.ImageFeed: {name} {v!r} is not an integer")
    if w < 1 or not 0 <= r < w:
        raise InvalidArgumentError(
            f"pinstream.ImageFeed: rank {r} of world size {w}: need world_size >= 1 and 0 <= rank < world_size"
        )
    return r, w


def _pair(name, v, cast):
    try:
        a, b = v
        return cast(a), cast(b)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"pinstream.ImageFeed: {name}={v!r} is not a pair of numbers") from None


def _count(name, v, least=0, most=2**63 - 1):
    # An integer, numpy's too (as the labels take them), never a bool, float or string cut or
    # parsed into one.
    n = None
    if not isinstance(v, bool):
        try:
            n = operator.index(v)
        except TypeError:
            pass
    if n is None or not least <= n <= most:
        raise InvalidArgumentError(
            f"pinstream.ImageFeed: {name}={v!r} must be an integer in {least}..={most}"
        )
    return n


class ImageFeed:
    """Training (or validation) batches from a folder of JPEGs (or PNGs), on the GPU.

    ``data`` is a folder of class folders (``root/<class>/<image>.jpg``, labels by sorted class
    name, as torchvision's ``ImageFolder``) or a list of ``(path, label)`` pairs. Iterating
    gives one epoch of ``(images, labels)``: ``images`` ``[N, 3, H, W]`` (``layout="NCHW"``) or
    ``[N, H, W, 3]`` of ``dtype``, normalized as ``(x - mean) / std`` on the 0..255 scale
    (``normalize=None``: the raw 0..255 values), ``labels`` int64 ``[N]``. The next ``for``
    goes on with the next epoch; ``len(feed)`` is the batches in one epoch of this rank.

    - ``train=True``: ``RandomResizedCrop(size, scale, ratio)`` + a flip with probability
      ``flip``; ``train=False``: ``Resize(resize)`` + ``CenterCrop(size)``.
    - ``decode``: ``"auto"`` (the GPU's JPEG engines where nvJPEG loads and the GPU has them,
      else the CPU), ``"gpu"`` or ``"cpu"``. ``threads`` loader threads read and parse the files
      (and decode them on the CPU path); ``None``, the default, runs 2 with GPU decoding
      (more would contend with a training step for the GPU) and 4 with CPU decoding.
    - ``seed``, ``shuffle`` (default: ``train``) and ``drop_last`` as ``DistributedSampler``'s:
      each epoch's order is drawn from ``(seed, epoch)``, and the augmentation from ``(seed,
      epoch, batch)``, so a position replays exactly.
    - ``rank`` and ``world_size`` default to ``torch.distributed`` where it is initialized, else
      to ``RANK`` and ``WORLD_SIZE``. Every rank gets a disjoint share of equal length (the list
      padded by wrapping around, as ``DistributedSampler`` does, unless ``drop_last``).
    - ``device``: an ordinal, ``"cuda:N"`` or a ``torch.device``; by default ``LOCAL_RANK``, else 0.
    - ``bad_files``: ``"error"`` (the batch raises an error naming the file) or ``"skip"``
      (left out and counted in ``stats()``).
    - ``cache_bytes``: GPU memory for keeping decoded images between epochs (0, the default:
      none), taken when the feed starts. Each image is kept the first time it is decoded, while
      it fits; later epochs crop it from there, reading and decoding nothing. Size it to the
      decoded set: height x width x 3 bytes per image (3.27 GB for 5 000 ImageNet-sized
      JPEGs; per rank, the whole set: ranks see other files every epoch). Every image is then
      decoded whole. A file changed on disk after it was kept is fed as it was. A jump
      (``set_epoch`` to another epoch, ``load_state_dict``) starts over with an empty cache.
      GPU decoding only (``decode="cpu"`` refuses it; where ``"auto"`` decodes on the CPU it
      does nothing). ``stats()`` says what it holds.
    - ``cpus``: the CPUs the feed's threads run on (any iterable of CPU numbers), whatever the
      calling thread's own mask; ``None``: where the caller may run. With the training thread
      pinned to a CPU of its own (``os.sched_setaffinity(0, {c})``), give the others here:
      threads otherwise inherit the pinned thread's one CPU (docs/python.md).

    Batches are ordered on the consumer's stream (``torch.from_dlpack`` passes torch's current
    stream): no host wait. Waiting for a batch releases the GIL and handles Ctrl-C.
    """

    def __init__(
        self,
        data,
        batch_size=256,
        *,
        train=True,
        size=224,
        resize=256,
        scale=(0.08, 1.0),
        ratio=(3.0 / 4.0, 4.0 / 3.0),
        flip=0.5,
        normalize=IMAGENET,
        dtype="bfloat16",
        layout="NCHW",
        seed=0,
        shuffle=None,
        drop_last=False,
        decode="auto",
        threads=None,
        depth=2,
        decodes_at_once=0,
        cache_bytes=0,
        device=None,
        rank=None,
        world_size=None,
        bad_files="error",
        cpus=None,
    ):
        from . import _cpus, _device, _dtype_name

        if isinstance(data, (str, bytes, os.PathLike)):
            root, items = os.fsdecode(data), None
        else:
            root = None
            try:
                # An integer (numpy's too), never a float or string cut or parsed into one.
                items = [(os.fsdecode(p), operator.index(label)) for p, label in data]
            except (TypeError, ValueError):
                raise InvalidArgumentError(
                    "pinstream.ImageFeed: data must be a folder or (path, label) pairs with "
                    "integer labels"
                ) from None
            for p, label in items:
                if not 0 <= label < 2**63:
                    why = "is negative" if label < 0 else "does not fit in int64"
                    raise InvalidArgumentError(f"pinstream.ImageFeed: {p}: label {label} {why}")
        if isinstance(size, int) and not isinstance(size, bool):
            size = (size, size)
        size = _pair("size", size, int)
        if normalize is None:
            mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
        else:
            try:
                mean, std = normalize
                mean, std = [float(m) for m in mean], [float(s) for s in std]
            except (TypeError, ValueError):
                raise InvalidArgumentError(
                    f"pinstream.ImageFeed: normalize={normalize!r} is not (mean, std)"
                ) from None
        if device is None:
            local = _int_env("LOCAL_RANK")
            device = 0 if local is None else local
        rank, world_size = distributed_defaults(rank, world_size)
        self._args = dict(
            root=root,
            items=items,
            device=_device(device),
            batch_size=_count("batch_size", batch_size, 1),
            train=bool(train),
            size=size,
            resize=_count("resize", resize, 1),
            scale=_pair("scale", scale, float),
            ratio=_pair("ratio", ratio, float),
            flip=float(flip),
            mean=list(mean),
            std=list(std),
            dtype=_dtype_name(dtype),
            layout=str(layout),
            seed=_count("seed", seed, 0, 2**64 - 1),
            shuffle=bool(train if shuffle is None else shuffle),
            drop_last=bool(drop_last),
            decode=str(decode),
            # None: the native default (0), 2 loaders with GPU decoding, 4 with CPU decoding.
            threads=0 if threads is None else _count("threads", threads, 1),
            depth=_count("depth", depth, 1),
            decodes_at_once=_count("decodes_at_once", decodes_at_once),
            cache_bytes=_count("cache_bytes", cache_bytes),
            rank=rank,
            world_size=world_size,
            bad_files=str(bad_files),
            cpus=_cpus("pinstream.ImageFeed", cpus),
        )
        self._native = None
        self._build(0, 0)

    def _build(self, epoch, batch, args=None):
        """A native feed of ``args`` (default: this feed's) at ``(epoch, batch)`` in place of the
        running one; where it cannot be made, the running one goes on as it was (its own
        arguments: ``self._args`` is set only once the new feed is made). With a cache the
        running one is closed first and made again at its position: a ``for`` loop over it
        then ends with an error (iterate again), and its cache starts empty."""
        args = self._args if args is None else args
        if self._native is not None and self._args["cache_bytes"]:
            # Two caches at once might not fit the device: the old feed goes first, and comes
            # back at its own position, with its own arguments, where the new one cannot be made
            # (an interrupt included, once it is closed).
            was, closed = self._native.position(), False
            try:
                self._native.close()
                closed = True
                self._native = None
                self._native = _native.ImageFeed(**args, start_epoch=epoch, start_batch=batch)
            except BaseException as e:
                if not closed:
                    raise
                try:
                    self._native = _native.ImageFeed(**self._args, start_epoch=was[0], start_batch=was[1])
                except BaseException as again:
                    self._broken = (f"pinstream.ImageFeed: the feed could not be made again at epoch "
                                    f"{was[0]}, batch {was[1]} after a failed move ({again!r})")
                    e.add_note(self._broken)
                raise e
            self._args = args
            return
        # The new feed first: where it cannot be made, the old one goes on.
        new = _native.ImageFeed(**args, start_epoch=epoch, start_batch=batch)
        self._args = args
        old, self._native = self._native, new
        if old is not None:
            old.close()

    def _convert(self, pixels, labels):
        return pixels, labels

    def __iter__(self):
        feed = self._live()
        first = True
        while True:
            got = feed.next()
            if got is None:
                if first:
                    # The end of the previous epoch, not yet reported (its last batch was
                    # taken without a further call): this loop is the next epoch.
                    first = False
                    continue
                return
            first = False
            yield self._convert(*got)

    def _live(self):
        if self._native is None:
            raise InvalidArgumentError(getattr(self, "_broken", None) or "pinstream.ImageFeed: the feed was closed")
        return self._native

    def __len__(self):
        return self._live().batches_per_epoch

    @property
    def position(self):
        """``(epoch, batch)`` of the next batch."""
        return self._live().position()

    @property
    def epoch(self):
        """The epoch of the next batch."""
        return self.position[0]

    @property
    def rank(self):
        return self._args["rank"]

    @property
    def world_size(self):
        return self._args["world_size"]

    @property
    def decoding(self):
        """``"gpu"`` or ``"cpu"``."""
        return self._live().decoding

    @property
    def hardware_engines(self):
        """The GPU's JPEG engines in use (0 when decoding on the CPU)."""
        return self._live().hardware_engines

    @property
    def threads(self):
        """The loader threads it runs (``threads=None``: 2 decoding on the GPU, 4 on the CPU)."""
        return self._live().threads

    def stats(self):
        """Images decoded per route (``hardware``, ``cuda``, ``cpu``), bad files skipped, and the
        cache of decoded images (``cache_budget``, ``cache_used`` bytes, ``cache_images`` kept,
        ``cache_hits``: images served from it instead of decoded, ``cache_failures``: batches
        whose images could not be kept)."""
        return self._live().stats()

    def set_epoch(self, epoch):
        """Starts epoch ``epoch`` at its first batch, unless the feed is in that epoch already
        (so calling it at the top of every epoch keeps a mid-epoch resume and costs nothing)."""
        epoch = _count("epoch", epoch)
        if self.position[0] != epoch:
            self._build(epoch, 0)

    def state_dict(self):
        """Where the feed is: the next batch's epoch and index, and what the order depends on.
        Batches handed out count as consumed."""
        epoch, batch = self.position
        a = self._args
        return {
            "version": _STATE_VERSION,
            "epoch": epoch,
            "batch": batch,
            "seed": a["seed"],
            "world_size": a["world_size"],
            "batch_size": a["batch_size"],
            "drop_last": a["drop_last"],
            "shuffle": a["shuffle"],
            "files": self._live().files,
        }

    def load_state_dict(self, state):
        """Resumes at ``state``'s position with its seed: the same batches, in the same order, with
        the same crops. The world size, batch size, ``drop_last``, ``shuffle`` and number of files
        must be those of the state (else another order would be replayed)."""
        try:
            version = state["version"]
            epoch, batch, seed = state["epoch"], state["batch"], state["seed"]
        except (TypeError, KeyError) as e:
            raise InvalidArgumentError(f"pinstream.ImageFeed.load_state_dict: missing {e}") from None
        if type(version) is not int or version != _STATE_VERSION:
            raise InvalidArgumentError(f"pinstream.ImageFeed.load_state_dict: version {version!r}")
        here = self.state_dict()
        for k in ("world_size", "batch_size", "drop_last", "shuffle", "files"):
            if state.get(k) != here[k]:
                raise InvalidArgumentError(
                    f"pinstream.ImageFeed.load_state_dict: {k} {state.get(k)!r} in the state, "
                    f"{here[k]!r} here: the order would differ"
                )
        epoch, batch = _count("epoch", epoch), _count("batch", batch)
        seed = _count("seed", seed, 0, 2**64 - 1)
        if batch >= len(self):
            raise InvalidArgumentError(
                f"pinstream.ImageFeed.load_state_dict: batch {batch} of an epoch of {len(self)}"
            )
        self._build(epoch, batch, dict(self._args, seed=seed))

    def close(self):
        """Stops the loader threads; the batches handed out stay valid."""
        if self._native is not None:
            self._native.close()
            self._native = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
