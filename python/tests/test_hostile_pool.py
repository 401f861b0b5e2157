"""A hostile caller against what 6e84220 added to the Python package: downloads into
page-locked pool blocks handed to numpy / torch as CPU DLPack tensors, ``pinstream.empty_cache``,
the typed buffer-protocol fast path of ``upload``, and ``pinstream.torch.upload_many``'s native
read of torch tensors by ``data_ptr()`` / ``nbytes``.

A test passes when the package held (a typed exception, the right bytes, memory that lives as
long as a view of it, no hang, no crash, no unbounded growth) and fails when it broke. Attacks
that could hang or crash the interpreter run in a child process with a time limit.

Tests named ``test_finding_*`` are attacks that, by reading the code, are expected to break the
package as of 6646de0 (the docstring names the cause).
"""

import array
import ctypes
import gc
import time

import numpy as np
import pytest

import pinstream
from pinstream import _native

from conftest import run_child as _run_child, needs_gpu

pytestmark = needs_gpu

RNG = np.random.default_rng(1234)


def run_child(code, timeout=60):
    """``PRELUDE`` and ``code`` in a fresh interpreter (conftest's ``run_child``): a hang, a
    crash or a non-zero exit fails; the child prints ``ok`` at its end."""
    return _run_child(code, timeout, prelude=PRELUDE)


PRELUDE = """
import ctypes, gc, os, sys, threading, time
import numpy as np
import pinstream
from pinstream import _native

def torch_or_skip():
    try:
        import torch
    except ImportError:
        print("skip: no torch"); sys.exit(0)
    if not torch.cuda.is_available():
        print("skip: torch has no CUDA"); sys.exit(0)
    return torch

def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0
"""


def torch_or_skip():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    return torch


def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def down(a):
    """``a`` uploaded, then downloaded again (no torch needed: a pinstream.Tensor is a CUDA
    producer)."""
    return pinstream.download(pinstream.upload(a))


# ------------------------------------------------------------------------------------------------
# Downloads: page-locked pool blocks behind numpy arrays and torch tensors.


def test_view_of_a_download_outlives_the_array():
    """``b = a[10:]; del a``: b keeps the block; later downloads of the same size (which reuse
    released blocks) must not write into it."""
    v = RNG.integers(0, 2**31, 1 << 20, dtype=np.int32)
    a = down(v)
    b = a[10:]
    c = a.reshape(1024, 1024)[::7, 3]  # a strided view too
    del a
    gc.collect()
    for i in range(20):
        w = down(np.full_like(v, i))
        w[:] = -1
        del w
    gc.collect()
    assert np.array_equal(b, v[10:])
    assert np.array_equal(c, v.reshape(1024, 1024)[::7, 3])


def test_torch_view_of_a_download_outlives_the_tensor():
    torch = torch_or_skip()
    import pinstream.torch as pt

    x = torch.arange(1 << 20, dtype=torch.int32, device="cuda")
    y = pt.download(x)
    v = y[5:]
    s = y.view(torch.uint8)[3::4]
    del y
    gc.collect()
    for i in range(20):
        w = pt.download(torch.full_like(x, i))
        w.fill_(-1)
        del w
    assert torch.equal(v, torch.arange(5, 1 << 20, dtype=torch.int32))
    assert torch.equal(s, x.cpu().view(torch.uint8)[3::4])


@pytest.mark.parametrize(
    "a",
    [
        np.array([True, False, True]),
        np.arange(-5, 5, dtype=np.int8),
        (np.arange(6) + 1j).astype(np.complex64),
        np.arange(6, dtype=np.float16).reshape(2, 3),
        np.asarray(2.5, np.float32),  # 0-d
        np.float64(7.0),  # numpy scalar
        np.zeros((0, 3), np.float32),  # empty
        np.zeros((3, 0, 2), np.int64),  # empty in the middle
        np.arange(2, dtype=np.uint64).reshape((1,) * 30 + (2,)),  # many dimensions
        np.arange(10, dtype=np.uint16),
    ],
    ids=lambda a: f"{a.dtype}{tuple(np.shape(a))}"[:40],
)
def test_download_dtypes_and_shapes(a):
    got = down(a)
    assert got.dtype == np.asarray(a).dtype and got.shape == np.shape(a)
    assert np.array_equal(got, a)
    if got.size:
        assert got.flags.writeable
        got[...] = 0  # ours to write


def test_download_bfloat16_numpy_and_torch():
    torch = torch_or_skip()
    import pinstream.torch as pt

    x = torch.randn(33, 7, device="cuda").to(torch.bfloat16)
    assert torch.equal(pt.download(x), x.cpu())
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        with pytest.raises(pinstream.InvalidArgumentError):
            pinstream.download(x)
        return
    a = pinstream.download(x)
    assert str(a.dtype) == "bfloat16" and a.shape == (33, 7)
    assert np.array_equal(a.view(np.uint16), x.cpu().view(torch.int16).numpy().view(np.uint16))
    for d in [torch.bool, torch.complex64, torch.float16]:
        y = torch.ones(0, 4, device="cuda", dtype=d)
        assert pt.download(y).shape == (0, 4)
    z = torch.tensor(3.5, device="cuda")
    assert pt.download(z).shape == () and pt.download(z).item() == 3.5


def test_download_of_a_large_array_is_right_at_both_ends():
    n = 256 << 20
    x = pinstream.upload(np.arange(n // 4, dtype=np.uint32))
    a = pinstream.download(x)
    assert a.shape == (n // 4,)
    assert a[0] == 0 and a[-1] == n // 4 - 1 and a[n // 8] == n // 8
    del a


def raw_download(v):
    t, dtype, shape = _native.download(pinstream.upload(v))
    return t


def test_cpu_tensor_dlpack_arguments():
    """The CPU ``pinstream.Tensor`` of a download: refusals hand nothing over; a second handover
    is refused; what numpy gets is right."""
    v = np.arange(1000, dtype=np.float32)
    t = raw_download(v)
    assert t.__dlpack_device__() == (1, 0)
    assert "cpu" in repr(t)
    for kw in [dict(dl_device=(2, 0)), dict(dl_device=(1, 1)), dict(dl_device=(3, 0)), dict(copy=True)]:
        with pytest.raises(BufferError):
            t.__dlpack__(**kw)
        assert not t.handed_over
    a = np.from_dlpack(t)
    assert np.array_equal(a, v)
    assert t.handed_over
    with pytest.raises(BufferError):
        t.__dlpack__()
    with pytest.raises(BufferError):
        np.from_dlpack(t)


def test_cpu_tensor_dlpack_with_cuda_stream_arguments():
    """A CUDA stream argument given to a host tensor (stream=5, 0, -1, 2, a huge int, a
    string): ignored or refused, never dereferenced."""
    run_child(
        """
        v = np.arange(4096, dtype=np.int64)
        for s in [5, 0, -1, 1, 2, 2**63 - 8, 4096, "x", 3.5]:
            t, _, _ = _native.download(pinstream.upload(v))
            try:
                cap = t.__dlpack__(stream=s, max_version=(1, 0))
            except (BufferError, pinstream.PinstreamError, TypeError, ValueError):
                assert not t.handed_over, s
                continue
            del cap  # never consumed: the block goes back
        t, _, _ = _native.download(pinstream.upload(v))
        assert np.array_equal(np.from_dlpack(t), v)
        print("ok")
        """
    )


def test_unconsumed_capsules_and_tensors_do_not_grow_memory():
    """Capsules made and dropped unconsumed, download tensors never handed over, arrays dropped:
    the blocks go back to the pool (RSS stays bounded)."""
    v = np.ones(8 << 20, np.uint8)
    for _ in range(5):
        raw_download(v)  # warm the pool
    gc.collect()
    r0 = rss()
    for i in range(200):
        t = raw_download(v)
        if i % 3 == 0:
            cap = t.__dlpack__(max_version=(1, 0))
            del cap
        elif i % 3 == 1:
            a = np.from_dlpack(t)
            del a
        del t
    gc.collect()
    grown = rss() - r0
    assert grown < 256 << 20, f"RSS grew by {grown >> 20} MiB over 200 downloads of 8 MiB"


def test_cpu_tensor_is_not_a_download_source_but_is_an_upload_source():
    v = RNG.integers(0, 255, 10000, dtype=np.uint8)
    t = raw_download(v)
    with pytest.raises(pinstream.InvalidArgumentError):
        pinstream.download(t)
    assert not t.handed_over
    back = pinstream.download(pinstream.upload(t))  # read as a host source (page-locked)
    assert np.array_equal(back, v)


def test_releases_from_many_threads_while_downloading():
    run_child(
        """
        import queue
        q = queue.Queue()
        errors = []
        def drop():
            while True:
                a = q.get()
                if a is None:
                    return
                want, arr, view = a
                if not np.array_equal(view, want[1:]):
                    errors.append("a view changed before its release")
                del arr, view, a
        ts = [threading.Thread(target=drop) for _ in range(8)]
        for t in ts: t.start()
        for i in range(400):
            want = np.full(1 << 16, i % 251, np.uint8)
            arr = pinstream.download(pinstream.upload(want))
            q.put((want, arr, arr[1:]))
            del arr
        for _ in ts: q.put(None)
        for t in ts: t.join()
        assert not errors, errors[:3]
        print("ok")
        """,
        timeout=120,
    )


def test_regression_release_does_not_wait_for_unrelated_gpu_work():
    """Was a FINDING, fixed (stall): a download's array is a host tensor handed over with no stream, so its
    release takes ``Consumer::Unknown`` and calls ``device.synchronize()``
    (src/dlpack/export.rs, ``release_tracked``) -- with the GIL held, in numpy's or torch's
    deleter. ``del a`` then waits for every stream of the device, e.g. a training step queued
    by another thread."""
    torch = torch_or_skip()
    a = pinstream.download(pinstream.upload(np.ones(1 << 16, np.float32)))
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(4_000_000_000)  # a few seconds of someone else's work
    t0 = time.monotonic()
    del a
    gc.collect()
    dt = time.monotonic() - t0
    s.synchronize()
    assert dt < 0.5, f"releasing a downloaded numpy array took {dt:.2f} s (waited for another stream)"


def test_regression_release_deadlocks_with_a_host_callback_needing_the_gil():
    """Was a FINDING, fixed (deadlock): as above, the release of a download's array runs
    ``cudaDeviceSynchronize`` with the GIL held; a host function queued on any stream of the
    device whose callback needs the GIL (ctypes, CuPy's ``launch_host_func``) then never runs,
    and the synchronize never returns."""
    run_child(
        """
        torch = torch_or_skip()
        try:
            libcuda = ctypes.CDLL("libcuda.so.1")
        except OSError:
            print("skip: no libcuda.so.1"); sys.exit(0)
        CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
        ran = []
        cb = CB(lambda _: ran.append(1))
        libcuda.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, CB, ctypes.c_void_p]
        libcuda.cuLaunchHostFunc.restype = ctypes.c_int
        a = pinstream.download(pinstream.upload(np.ones(1 << 16, np.float32)))
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            torch.cuda._sleep(1_000_000_000)
        r = libcuda.cuLaunchHostFunc(ctypes.c_void_p(s.cuda_stream), cb, None)
        assert r == 0, r
        del a  # the DLPack deleter, GIL held
        s.synchronize()
        assert ran == [1]
        print("ok")
        """,
        timeout=60,
    )


def test_regression_nonblocking_copy_to_another_device_then_release():
    """Was a FINDING, fixed (multi-GPU, data race): torch sees a download as pinned memory, so ``.to("cuda:1", non_blocking=True)`` is an
    async DMA from the block. The release then synchronizes only the block's device (cuda:0):
    the block goes back to the pool and the next download may overwrite it while cuda:1 still
    reads it."""
    run_child(
        """
        torch = torch_or_skip()
        if torch.cuda.device_count() < 2:
            print("skip: one GPU"); sys.exit(0)
        import pinstream.torch as pt
        n = 64 << 20
        bad = 0
        for i in range(10):
            x = torch.full((n,), i, dtype=torch.int32, device="cuda:0")
            y = pt.download(x)
            s1 = torch.cuda.Stream(device="cuda:1")
            with torch.cuda.stream(s1):
                torch.cuda._sleep(200_000_000)
                z = y.to("cuda:1", non_blocking=True)
            del y
            w = pt.download(torch.full((n,), -7, dtype=torch.int32, device="cuda:0"))
            s1.synchronize()
            if not torch.equal(z.cpu(), torch.full((n,), i, dtype=torch.int32)):
                bad += 1
            del w, z
        assert bad == 0, f"{bad} of 10 copies to cuda:1 read a reused block"
        print("ok")
        """,
        timeout=180,
    )


def test_regression_download_from_a_second_device_says_its_device():
    """Was a FINDING, fixed (multi-GPU, minor): ``Tensor::from_parts`` sets ``device_id`` 0 for host memory,
    so the binding's ``device`` is 0 and ``__dlpack__`` makes the context of cuda:0. The CPU tensor's ``device`` is documented as the device the download came from; and a
    download from cuda:1 should not need a context on cuda:0."""
    run_child(
        """
        if pinstream.device_count() < 2:
            print("skip: one GPU"); sys.exit(0)
        v = np.arange(100, dtype=np.float32)
        t, _, _ = _native.download(pinstream.upload(v, device=1))
        assert t.device == 1, f"device {t.device} for a download from cuda:1"
        assert np.array_equal(np.from_dlpack(t), v)
        print("ok")
        """
    )


def test_regression_empty_cache_gives_back_the_download_pool():
    """Was a FINDING, fixed (leak-like): downloads keep up to 4 GiB (``PoolConfig::default``) of page-locked
    host memory per device in the context's ``PinnedPool``, and ``pinstream.empty_cache`` only
    trims the device pool (python/src/context.rs): nothing in the Python API gives that memory
    back."""
    run_child(
        """
        for _ in range(3):  # the context, its stager and pool exist before the baseline
            pinstream.download(pinstream.upload(np.ones(1 << 20, np.uint8)))
        gc.collect()
        r0 = rss()
        for k in range(1, 9):  # eight size classes, each cached once released
            a = pinstream.download(pinstream.upload(np.ones(k * (48 << 20), np.uint8)))
            del a
        gc.collect()
        pinstream.empty_cache()
        grown = rss() - r0
        assert grown < 512 << 20, f"{grown >> 20} MiB of RSS kept after empty_cache"
        print("ok")
        """,
        timeout=180,
    )


def test_empty_cache_arguments():
    pinstream.empty_cache()
    pinstream.empty_cache(0)
    with pytest.raises(pinstream.InvalidArgumentError):
        pinstream.empty_cache(-1)
    with pytest.raises(pinstream.PinstreamError):
        pinstream.empty_cache(10**6)
    with pytest.raises((OverflowError, TypeError, pinstream.PinstreamError)):
        pinstream.empty_cache(2**70)
    with pytest.raises(TypeError):
        pinstream.empty_cache("cuda:0")


def test_empty_cache_storm_while_uploading_and_downloading():
    run_child(
        """
        stop = threading.Event()
        errors = []
        def trimmer():
            try:
                while not stop.is_set():
                    pinstream.empty_cache()
            except BaseException as e:
                errors.append(repr(e))
        def worker(w):
            try:
                for i in range(150):
                    n = 1 + (i * 7919 + w * 104729) % (3 << 20)
                    v = np.full(n, (w * 37 + i) % 251, np.uint8)
                    t = pinstream.upload(v)
                    if i % 4 == 0:
                        pinstream.empty_cache()
                    got = pinstream.download(t)
                    if not np.array_equal(got, v):
                        errors.append(f"worker {w} round {i}: wrong bytes")
                        return
            except BaseException as e:
                errors.append(repr(e))
        ts = [threading.Thread(target=trimmer) for _ in range(2)]
        ws = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
        for t in ts + ws: t.start()
        for t in ws: t.join()
        stop.set()
        for t in ts: t.join()
        assert not errors, errors[:3]
        print("ok")
        """,
        timeout=180,
    )


def test_torch_gets_the_memory_pinstream_freed_after_empty_cache():
    """The documented recipe: pinstream's freed uploads stay in its pool until
    ``empty_cache``; after it, torch can allocate that memory."""
    run_child(
        """
        torch = torch_or_skip()
        import pinstream.torch as pt
        pinstream.upload(np.ones(16, np.uint8))  # pinstream's context first
        free0, _ = torch.cuda.mem_get_info()
        n = 4 << 30
        if free0 < 3 * n:
            print("skip: too little device memory"); sys.exit(0)
        hog = torch.empty(free0 - n - (n // 2), dtype=torch.uint8, device="cuda")
        y = pt.upload(np.ones(n, np.uint8))
        del y
        torch.cuda.synchronize()
        pinstream.empty_cache()
        z = torch.empty(n, dtype=torch.uint8, device="cuda")  # needs what pinstream freed
        z.fill_(1)
        torch.cuda.synchronize()
        del hog, z
        print("ok")
        """,
        timeout=120,
    )


# ------------------------------------------------------------------------------------------------
# upload: the typed buffer-protocol path.


def check_upload(src, dtype, shape, want_bytes):
    t = pinstream.upload(src)
    assert t.dtype == dtype and tuple(t.shape) == tuple(shape), (t.dtype, t.shape)
    got = pinstream.download(t)
    assert got.tobytes() == want_bytes


def test_typed_buffers_of_every_format():
    raw = bytes(range(48))
    mv = memoryview(bytearray(raw))
    check_upload(mv.cast("f", shape=[3, 4]), "float32", (3, 4), raw)
    check_upload(mv.cast("d"), "float64", (6,), raw)
    check_upload(mv.cast("e"), "float16", (24,), raw)
    check_upload(mv.cast("q"), "int64", (6,), raw)
    check_upload(mv.cast("Q"), "uint64", (6,), raw)
    check_upload(mv.cast("h", shape=[2, 3, 4]), "int16", (2, 3, 4), raw)
    check_upload(mv.cast("b"), "int8", (48,), raw)
    # Not typed: pointers, chars, size_t: bytes.
    check_upload(mv.cast("P"), "uint8", (48,), raw)
    check_upload(mv.cast("c"), "uint8", (48,), raw)
    check_upload(mv.cast("N"), "uint8", (48,), raw)
    # bool: bytes that are not 0 / 1 stay what they were.
    check_upload(memoryview(bytearray(b"\x00\x01\x02\xff")).cast("?"), "bool", (4,), b"\x00\x01\x02\xff")
    # array.array: typed now.
    aa = array.array("i", range(12))
    check_upload(aa, "int32", (12,), aa.tobytes())
    aa = array.array("u", "hello")
    check_upload(aa, "uint8", (len(aa.tobytes()),), aa.tobytes())
    # ctypes: native and big-endian.
    ca = (ctypes.c_double * 5)(*range(5))
    check_upload(ca, "float64", (5,), bytes(ca))
    cb = (ctypes.c_bool * 3)(True, False, True)
    check_upload(cb, "bool", (3,), bytes(cb))
    be = (ctypes.c_int32.__ctype_be__ * 4)(1, 2, 3, 4)
    t = pinstream.upload(be)  # '>i': not typed, bytes (or refused)
    assert t.dtype == "uint8" and pinstream.download(t).tobytes() == bytes(be)

    class S(ctypes.Structure):
        _fields_ = [("a", ctypes.c_float), ("b", ctypes.c_uint8)]

    cs = (S * 4)()
    t = pinstream.upload(cs)
    assert pinstream.download(t).tobytes() == bytes(cs)


def test_odd_buffers():
    mv = memoryview(bytearray(range(64))).cast("i")
    with pytest.raises(pinstream.InvalidArgumentError):
        pinstream.upload(mv[::2])  # not contiguous
    # A misaligned numpy array: typed, its bytes read as bytes.
    b = np.frombuffer(bytes(range(33)), dtype=np.float32, offset=1, count=8)
    got = pinstream.download(pinstream.upload(b))
    assert got.dtype == np.float32 and got.tobytes() == b.tobytes()
    # Read-only numpy array, 0-d, empty, Fortran order.
    r = np.arange(10, dtype=np.int16)
    r.flags.writeable = False
    assert np.array_equal(pinstream.download(pinstream.upload(r)), r)
    z = np.asarray(5, np.uint32)
    assert pinstream.download(pinstream.upload(z)).shape == ()
    e = np.zeros((4, 0), np.float64)
    assert pinstream.download(pinstream.upload(e)).shape == (4, 0)
    f = np.asfortranarray(np.arange(12, dtype=np.int32).reshape(3, 4))
    assert np.array_equal(pinstream.download(pinstream.upload(f)), f)
    # Empty bytes-likes.
    for src in [b"", bytearray(), memoryview(b""), array.array("d")]:
        t = pinstream.upload(src)
        assert tuple(t.shape) == (0,)


def test_buffer_resized_from_another_thread_during_upload():
    run_child(
        """
        n = 64 << 20
        ba = bytearray(b"\\x07") * n
        stop = threading.Event()
        refused = []
        def grow():
            while not stop.is_set():
                try:
                    ba.extend(b"x")
                    del ba[-1:]
                except BufferError:
                    refused.append(1)
        t = threading.Thread(target=grow); t.start()
        for _ in range(10):
            got = pinstream.download(pinstream.upload(ba))
            # extend can succeed and the del be refused (exported): the array only grows.
            assert got.size >= n and (got[:n] == 7).all()
        stop.set(); t.join()
        print("ok")
        """,
        timeout=120,
    )


# ------------------------------------------------------------------------------------------------
# pinstream.torch.upload_many: torch tensors read by pointer.


def test_regression_instance_attribute_data_ptr_is_believed():
    """Was a FINDING, fixed (reads arbitrary memory): the exact-type check (python/src/torch_many.rs, ``read``)
    stops subclasses, but ``x.data_ptr`` is looked up on the instance, and a plain torch.Tensor
    takes instance attributes that shadow its methods: ``x.data_ptr = lambda: other_address``
    makes the upload read any memory of the process (here another tensor's; an unmapped address
    crashes)."""
    run_child(
        """
        torch = torch_or_skip()
        import pinstream.torch as pt
        x = torch.arange(1024, dtype=torch.float32)
        secret = torch.full((1024,), 42.0)
        try:
            x.data_ptr = lambda: secret.data_ptr()
        except (AttributeError, TypeError):
            print("ok"); sys.exit(0)  # torch refuses the shadowing: nothing to attack
        (y,) = pt.upload_many([x])
        assert torch.equal(y.cpu(), torch.arange(1024, dtype=torch.float32)), (
            "upload_many read the memory an instance attribute pointed at"
        )
        print("ok")
        """
    )


def test_regression_instance_attribute_is_contiguous_overreads():
    """Was a FINDING, fixed (heap over-read / crash): ``x.is_contiguous = lambda: True`` on an expanded tensor
    (4 bytes of storage, 64 MiB of ``nbytes``) skips the resolved copy, and 64 MiB are read
    from a 4-byte allocation."""
    run_child(
        """
        torch = torch_or_skip()
        import pinstream.torch as pt
        x = torch.full((1,), 3.0).expand(16 << 20)
        try:
            x.is_contiguous = lambda *a, **k: True
        except (AttributeError, TypeError):
            print("ok"); sys.exit(0)
        try:
            (y,) = pt.upload_many([x])
        except pinstream.PinstreamError:
            print("ok"); sys.exit(0)
        assert torch.equal(y.cpu(), torch.full((16 << 20,), 3.0)), "read past the storage"
        print("ok")
        """,
        timeout=90,
    )


def test_regression_callback_frees_an_earlier_tensors_storage():
    """Was a FINDING, fixed (use after free): ``read`` records ``data_ptr()`` of each tensor as it goes, then
    reads them all later with the GIL released; ``held`` keeps the tensor objects, not their
    storages. Python code run while later tensors are checked (a shadowing ``is_contiguous``
    here; through ``_native.upload_torch_packed`` any generator) can ``set_`` an earlier tensor
    onto new storage, freeing the old one before it is read."""
    run_child(
        """
        torch = torch_or_skip()
        import pinstream.torch as pt
        n = 64 << 20  # freed with munmap: a read after the free faults
        victim = torch.ones(n // 4)
        other = torch.zeros(4)
        def evil(*a, **k):
            victim.set_(torch.empty(0))
            gc.collect()
            return True
        try:
            other.is_contiguous = evil
        except (AttributeError, TypeError):
            other = None
        if other is not None:
            try:
                ys = pt.upload_many([victim, other])
            except pinstream.PinstreamError:
                pass
        # The private entry point with a generator: no shadowing needed.
        victim2 = torch.ones(n // 4)
        def gen():
            yield victim2
            victim2.set_(torch.empty(0))
            gc.collect()
            yield torch.zeros(4)
        try:
            arena, offsets, uniform = _native.upload_torch_packed(gen(), 0)
        except pinstream.PinstreamError:
            arena = None
        if arena is not None:
            # The iterable is consumed before any pointer is read: the tensor is read as it
            # is then (set_ to empty storage), never from the freed memory.
            assert offsets[1] == offsets[0], f"read {offsets[1] - offsets[0]} bytes of a freed storage"
        print("ok")
        """,
        timeout=90,
    )


@pytest.mark.xfail(reason="documented as the caller's race (torch_many.rs); a crash is a finding", strict=False)
def test_tensor_resized_from_another_thread_during_upload_many():
    run_child(
        """
        torch = torch_or_skip()
        import pinstream.torch as pt
        xs = [torch.ones(4 << 20) for _ in range(8)]
        stop = threading.Event()
        def churn():
            i = 0
            while not stop.is_set():
                x = xs[i % len(xs)]
                x.set_(torch.ones(4 << 20))
                i += 1
        t = threading.Thread(target=churn); t.start()
        for _ in range(30):
            ys = pt.upload_many(xs)
            del ys
        stop.set(); t.join()
        print("ok")
        """,
        timeout=120,
    )


def test_upload_many_zero_bytes_offsets_parameters_and_odd_lists():
    torch = torch_or_skip()
    import pinstream.torch as pt

    base = torch.randn(1000)
    p = torch.nn.Parameter(torch.randn(7, 3))
    xs = [
        torch.empty(0),
        base[-1:],  # storage offset at the very end
        torch.empty(0, 5),
        p,
        torch.randn(3, requires_grad=True) * 2,  # non-leaf needing grad
        base[::3],  # strided
        torch.tensor(4.0),  # 0-d
        torch.randn(2, 2).t(),  # transposed
        torch.zeros(3, dtype=torch.bool),
    ]
    ys = pt.upload_many(xs)
    for x, y in zip(xs, ys):
        assert y.shape == x.shape and y.dtype == x.dtype
        assert torch.equal(y.cpu(), x.detach())
    # All empty, uniform: one unbind over an empty arena.
    ys = pt.upload_many([torch.empty(0, 3) for _ in range(5)])
    assert len(ys) == 5 and all(y.shape == (0, 3) for y in ys)
    # A list mutated while its iterator is consumed.
    src = [torch.full((4,), float(i)) for i in range(4)]

    class Mutating(list):
        def __iter__(self):
            for i, x in enumerate(list.__iter__(self)):
                if i == 1:
                    self.append(torch.full((4,), 99.0))
                    self[0].fill_(-1)
                yield x
                if i > 10:
                    return

    m = Mutating(src)
    ys = pt.upload_many(m)
    assert len(ys) >= 4
    for x, y in zip(list.__iter__(m), ys):
        assert torch.equal(y.cpu(), x)
    # Many tiny tensors.
    many = [torch.full((3,), float(i)) for i in range(100_000)]
    t0 = time.monotonic()
    ys = pt.upload_many(many)
    assert time.monotonic() - t0 < 60
    assert torch.equal(ys[-1].cpu(), many[-1]) and torch.equal(ys[12345].cpu(), many[12345])


def test_upload_many_subclass_lies_go_through_dlpack():
    """Subclasses whose ``data_ptr`` / ``nbytes`` / ``is_contiguous`` / ``as_subclass`` lie are
    turned into plain tensors over the same memory (``as_subclass``), or refused; none is read
    by the pointer it claims."""
    torch = torch_or_skip()
    import pinstream.torch as pt

    secret = torch.full((16,), 42.0)

    class Liar(torch.Tensor):
        def data_ptr(self):
            return secret.data_ptr()

        def is_contiguous(self, *a, **k):
            return True

        @property
        def nbytes(self):
            return 1 << 30

    x = torch.arange(16, dtype=torch.float32).as_subclass(Liar)
    try:
        (y,) = pt.upload_many([x])
    except (pinstream.PinstreamError, RuntimeError, TypeError):
        return
    assert torch.equal(y.cpu(), torch.arange(16, dtype=torch.float32))

    class AsLiar(torch.Tensor):
        def as_subclass(self, cls):
            t = torch.zeros(2)
            return t

    z = torch.arange(4, dtype=torch.float32).as_subclass(AsLiar)
    try:
        (w,) = pt.upload_many([z])
    except (pinstream.PinstreamError, RuntimeError, TypeError):
        return
    # Whatever as_subclass returned, the view cut for it must not reach past the arena.
    assert w.numel() <= 4
