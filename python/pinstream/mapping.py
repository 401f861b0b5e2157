"""Shared memory mapped in this process only: a file's pages (a memfd ring) mapped read-write
with ``MADV_DONTFORK``, so that no process forked from this one (another loader's workers, a
``multiprocessing`` pool) inherits the mapping and keeps the memory after this process let it
go. Python's ``mmap`` cannot do that, and it keeps a duplicate of the descriptor, which forks
inherit too.

The mapping is a ctypes array over the pages; it is unmapped once nothing refers to the array
any more (numpy views and memoryviews of it hold it), and only by the process that mapped it.
"""

import ctypes
import mmap
import os

MADV_DONTFORK = 10
MADV_HUGEPAGE = 14
_FAILED = ctypes.c_void_p(-1).value

_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                             ctypes.c_int, ctypes.c_long]
        lib.munmap.restype = ctypes.c_int
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.madvise.restype = ctypes.c_int
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _LIBC = lib
    return _LIBC


def _error(what):
    e = ctypes.get_errno()
    return OSError(e, f"{what}: {os.strerror(e)}")


class _Unmap:
    """Unmaps the pages when the array holding it goes, in the process that mapped them (in a
    fork they were never there)."""

    __slots__ = ("addr", "size", "pid")

    def __init__(self, addr, size):
        self.addr, self.size, self.pid = addr, size, os.getpid()

    def __del__(self):
        if os.getpid() == self.pid:
            _libc().munmap(self.addr, self.size)


def map_shared(fd, size):
    """``size`` bytes of ``fd`` from offset 0, shared and writable, in this process only: a
    ctypes ``c_ubyte`` array (a writable buffer). Huge pages are asked for where the kernel
    backs shared memory with them. ``OSError`` where the mapping or ``MADV_DONTFORK`` fails."""
    c = _libc()
    addr = c.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _FAILED:
        raise _error("mmap")
    if c.madvise(addr, size, MADV_DONTFORK) != 0:
        err = _error("madvise(MADV_DONTFORK)")
        c.munmap(addr, size)
        raise err
    c.madvise(addr, size, MADV_HUGEPAGE)  # advice only: 4 KiB pages where it is not taken
    array = (ctypes.c_ubyte * size).from_address(addr)
    array._unmap = _Unmap(addr, size)
    return array


MADV_POPULATE_WRITE = 23


def populate_write(array, offset, length):
    """Makes the page table of ``length`` bytes of a ``map_shared`` mapping from ``offset`` at
    once (``MADV_POPULATE_WRITE``, Linux 5.14), rather than by a fault per page as they are
    written; nothing where the kernel does not have it."""
    m = array._unmap
    if offset < 0 or length < 0 or offset + length > m.size:
        raise ValueError(f"{offset} + {length} bytes do not lie in the {m.size}-byte mapping")
    _libc().madvise(m.addr + offset, length, MADV_POPULATE_WRITE)
