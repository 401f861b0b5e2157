"""The exceptions pinstream raises: one class per kind of ``pinstream::Error``, each carrying the
library's message (which names the call, the sizes and the CUDA error). Each also derives from
the builtin a Python caller already catches where one fits (``ValueError``, ``MemoryError``,
``OSError``)."""


class PinstreamError(RuntimeError):
    """Any pinstream failure. ``cuda_error`` is the CUDA error's name where the runtime
    reported one (``"cudaErrorMemoryAllocation"``), else None."""

    cuda_error = None


class NoDeviceError(PinstreamError):
    """No CUDA driver, a driver too old, or no device: the machine cannot run CUDA."""


class CudaError(PinstreamError):
    """Any other error the CUDA runtime reported."""


class OutOfMemoryError(PinstreamError, MemoryError):
    """A device or page-locked allocation failed for lack of memory."""


class InvalidArgumentError(PinstreamError, ValueError):
    """An argument was refused before anything was queued; nothing changed."""


class LengthMismatchError(InvalidArgumentError):
    """Source and destination sizes differ."""


class WrongDeviceError(InvalidArgumentError):
    """Memory of one device used with a stream of another."""


class NoPeerAccessError(PinstreamError):
    """Two devices cannot reach each other's memory."""


class IoError(PinstreamError, OSError):
    """Reading a file failed, or it ended early."""


class FormatError(PinstreamError, ValueError):
    """A file is not what its format says (a safetensors header that is not valid); the
    message names the file and the tensor."""


class PanickedError(PinstreamError):
    """A worker thread failed unexpectedly; its work was stopped and waited for."""


class LoaderError(PinstreamError):
    """The iterable a prefetcher reads raised, or gave a batch that does not fit. ``batch`` is
    the batch index; the original exception is the ``__cause__`` where there was one."""

    batch = None


class ForkedError(PinstreamError):
    """A call in a process forked after pinstream started CUDA or a prefetcher's threads in
    its parent: neither survives a fork. Make pinstream's objects in the process that uses
    them (start workers with ``spawn`` or ``forkserver``); see docs/python.md."""


__all__ = [
    "PinstreamError",
    "NoDeviceError",
    "CudaError",
    "OutOfMemoryError",
    "InvalidArgumentError",
    "LengthMismatchError",
    "WrongDeviceError",
    "NoPeerAccessError",
    "IoError",
    "FormatError",
    "PanickedError",
    "LoaderError",
    "ForkedError",
]
