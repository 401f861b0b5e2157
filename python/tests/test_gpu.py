"""DLPack results on a GPU, consumed by torch, CuPy and JAX: every dtype, sources of every
kind, the consumer's stream ordering (no host sync), hand-over rules and releases. Skipped,
with the reason, where there is no GPU (or where a consumer library is missing)."""

import os
import threading
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np
import pytest

import pinstream

from conftest import needs_gpu

pytestmark = needs_gpu

RNG = np.random.default_rng()

DTYPES = [
    np.float16,
    np.float32,
    np.float64,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.bool_,
    np.complex64,
]


def random_array(shape, dtype):
    """Fresh random values (never zeros), of any dtype."""
    raw = RNG.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    a = raw.view(dtype).reshape(shape).copy()
    if np.dtype(dtype).kind in "fc":
        a[~np.isfinite(a)] = 1.5  # NaNs compare unequal
    if dtype == np.bool_:
        a = np.asarray(raw[: a.size].reshape(shape) % 2 == 1)
    return a


def torch_or_skip():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(37, 53), (3, 1, 5, 7), (1000,), ()])
def test_upload_every_dtype_to_torch(dtype, shape):
    torch = torch_or_skip()
    a = random_array(shape, dtype)
    t = pinstream.upload(a)
    assert t.shape == a.shape and t.dtype == np.dtype(dtype).name and not t.handed_over
    x = torch.from_dlpack(t)
    assert t.handed_over and x.is_cuda and tuple(x.shape) == a.shape
    assert np.array_equal(x.cpu().numpy(), a)
    # And back through pinstream.download.
    assert np.array_equal(pinstream.download(x), a)


def test_sources_of_every_kind():
    torch = torch_or_skip()
    a = random_array((256, 129), np.float32)
    for src in [
        a,
        torch.from_numpy(a),
        torch.from_numpy(a).pin_memory(),
        np.asfortranarray(a),  # made C-contiguous first
        a.T,  # transposed: likewise
    ]:
        want = np.ascontiguousarray(src.numpy() if hasattr(src, "numpy") else src)
        got = torch.from_dlpack(pinstream.upload(src)).cpu().numpy()
        assert np.array_equal(got, want)
    # A typed buffer keeps its element type and shape (numpy arrays are read this way).
    got = torch.from_dlpack(pinstream.upload(memoryview(a)))
    assert got.dtype == torch.float32 and tuple(got.shape) == a.shape
    assert np.array_equal(got.cpu().numpy(), a)
    for arr in [np.float32(2.5), np.asarray(7, np.int16)]:  # 0-d
        got = torch.from_dlpack(pinstream.upload(arr)).cpu().numpy()
        assert got.shape == np.shape(arr) and np.array_equal(got, arr)
    with pytest.raises(pinstream.InvalidArgumentError):
        pinstream.upload(a.astype(">f4"))  # big-endian: neither path takes it
    b = bytes(RNG.integers(0, 256, 1000, dtype=np.uint8))
    for src in [b, bytearray(b), memoryview(b)]:
        got = torch.from_dlpack(pinstream.upload(src)).cpu().numpy()
        assert got.dtype == np.uint8 and got.tobytes() == b


def test_large_upload_through_the_stager():
    torch = torch_or_skip()
    a = random_array((64 << 20,), np.uint8)
    x = torch.from_dlpack(pinstream.upload(a))
    assert torch.equal(x.cpu(), torch.from_numpy(a))


def test_upload_many_tensors_are_writable_and_separate():
    torch = torch_or_skip()
    arrays = [random_array((n,), d) for n, d in [(1, np.float32), (1000, np.int64), (7, np.uint8), (4096, np.float16), (0, np.float32)]]
    ts = pinstream.upload_many(arrays)
    xs = [torch.from_dlpack(t) for t in ts]
    for x, a in zip(xs, arrays):
        assert np.array_equal(x.cpu().numpy(), a)
    xs[2].add_(1)  # writable; the neighbours are untouched
    assert np.array_equal(xs[2].cpu().numpy(), arrays[2] + np.uint8(1))
    assert np.array_equal(xs[1].cpu().numpy(), arrays[1])
    assert np.array_equal(xs[3].cpu().numpy(), arrays[3])


def test_pinstream_torch_helpers():
    torch = torch_or_skip()
    import pinstream.torch as pt

    a = torch.randn(33, 65)
    x = pt.upload(a)
    assert x.device.type == "cuda" and torch.equal(x.cpu(), a)
    bf = torch.randn(1000, device="cuda").to(torch.bfloat16)
    assert torch.equal(pt.download(bf), bf.cpu())
    ys = pt.upload_many([a, a[:3]])
    assert torch.equal(ys[1].cpu(), a[:3])
    assert pt.download(torch.empty(0, 3, device="cuda")).shape == (0, 3)


def test_downloads_are_page_locked_owned_and_ordered():
    """A download is one DMA into pinstream's page-locked pool: the result is a plain CPU
    tensor / numpy array holding the data of the moment the producer's queued work finished
    (no host sync of the producer), writable, independent of the source, and its memory is
    reused once released."""
    torch = torch_or_skip()
    import pinstream.torch as pt

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = torch.randint(-(2**31), 2**31 - 1, (4 << 20,), dtype=torch.int32, device="cuda")
        want = x.cpu()
        torch.cuda._sleep(20_000_000)  # the producer's stream busy
        x.add_(1)  # queued after the sleep: the download must see it
        y = pt.download(x)
    assert y.device.type == "cpu" and y.is_pinned()
    assert torch.equal(y, want + 1)
    y.zero_()  # ours to write; the source is untouched
    assert torch.equal(x.cpu(), want + 1)
    a = pinstream.download(x)
    assert a.flags.writeable and np.array_equal(a, (want + 1).numpy())
    for dtype in [torch.float16, torch.bfloat16, torch.bool, torch.complex64, torch.uint8]:
        src = (torch.randn(37, 5, device="cuda") * 100).to(dtype)
        assert torch.equal(pt.download(src), src.cpu())
    for _ in range(200):  # 1.6 GB through the pool: released results are reused
        pt.download(x[: 2 << 20])


def test_handover_rules():
    a = random_array((100,), np.float32)
    t = pinstream.upload(a)
    assert t.__dlpack_device__() == (2, 0)
    with pytest.raises(pinstream.InvalidArgumentError, match="ambiguous"):
        t.__dlpack__(stream=0)
    with pytest.raises(BufferError):
        t.__dlpack__(dl_device=(1, 0))
    with pytest.raises(BufferError):
        t.__dlpack__(copy=True)
    assert not t.handed_over  # refusals keep it
    cap = t.__dlpack__(stream=-1, max_version=(1, 3))
    assert "dltensor_versioned" in repr(cap)
    with pytest.raises(BufferError, match="already handed"):
        t.__dlpack__()
    del cap  # never consumed: the capsule's destructor frees the memory
    legacy = pinstream.upload(a).__dlpack__(stream=1)
    assert "dltensor" in repr(legacy) and "versioned" not in repr(legacy)


def test_unconsumed_capsules_and_dropped_tensors_do_not_leak():
    torch = torch_or_skip()
    a = random_array((8 << 20,), np.uint8)
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    for _ in range(50):  # 400 MiB in all, were any kept
        pinstream.upload(a).__dlpack__(stream=-1)
        pinstream.upload(a)
        x = torch.from_dlpack(pinstream.upload(a))
        del x
    pinstream.synchronize()
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    assert free0 - free1 < 128 << 20


def test_consumer_stream_waits_on_the_gpu_not_the_host():
    torch = torch_or_skip()
    a = random_array((16 << 20,), np.uint8)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(1_000_000_000)  # about 0.5 s of GPU time on the consumer's stream
        t0 = time.perf_counter()
        x = torch.from_dlpack(pinstream.upload(a))
        handed = time.perf_counter() - t0
        y = x.to(torch.int32).sum()  # (torch's allocator may wait here: not pinstream's part)
    assert handed < 0.25, f"the handover waited {handed:.3f} s on the host"
    s.synchronize()
    assert int(y) == int(a.astype(np.int64).sum())


def test_download_waits_for_the_producers_stream():
    torch = torch_or_skip()
    s = torch.cuda.Stream()
    x = torch.empty(4 << 20, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        torch.cuda._sleep(200_000_000)
        x.fill_(7)  # queued behind the sleep
        got = pinstream.download(x)  # pinstream's stream waits for s on the GPU
    assert (got == 7).all()


def test_download_from_cupy_and_jax_and_consumers():
    a = random_array((1234, 7), np.float32)
    cp = pytest.importorskip("cupy")
    c = cp.from_dlpack(pinstream.upload(a))
    assert np.array_equal(cp.asnumpy(c), a)
    assert np.array_equal(pinstream.download(c), a)
    jax = pytest.importorskip("jax")
    j = jax.dlpack.from_dlpack(pinstream.upload(a))
    assert np.array_equal(np.asarray(j), a)
    assert np.array_equal(pinstream.download(j), a)


def test_gil_is_released_during_transfers():
    a = random_array((512 << 20,), np.uint8)
    ticks = 0
    stop = False

    def count():
        nonlocal ticks
        while not stop:
            ticks += 1
            time.sleep(0.0005)

    th = threading.Thread(target=count)
    th.start()
    try:
        t0 = time.perf_counter()
        for _ in range(3):
            pinstream.upload(a)
        took = time.perf_counter() - t0
    finally:
        stop = True
        th.join()
    # A thread that needs the GIL every 0.5 ms got it throughout.
    assert ticks > 0.2 * took / 0.0005, (ticks, took)


def test_errors_are_typed():
    torch = torch_or_skip()
    with pytest.raises(pinstream.InvalidArgumentError, match="not in host memory"):
        pinstream.upload(torch.ones(3, device="cuda"))
    with pytest.raises(pinstream.PinstreamError):
        pinstream.upload(np.ones(3), device=99)


def test_torch_upload_many_views_of_one_arena():
    torch = torch_or_skip()
    import pinstream.torch as pt

    xs = [
        torch.randn(33, 65),
        torch.randn(7, 9).t(),  # not contiguous
        torch.randint(-100, 100, (1000,), dtype=torch.int64),
        torch.randn(513).to(torch.bfloat16),  # no numpy type: through DLPack
        torch.tensor(3.5),  # 0-d
        torch.empty(0, 4),
        torch.rand(77) > 0.5,
        torch.randint(0, 255, (4096,), dtype=torch.uint8),
    ]
    ys = pt.upload_many(xs)
    assert len(ys) == len(xs)
    for x, y in zip(xs, ys):
        assert y.is_cuda and y.dtype == x.dtype and y.shape == x.shape
        assert torch.equal(y.cpu(), x)
    ys[2].add_(1)  # one view written, the others intact
    assert torch.equal(ys[2].cpu(), xs[2] + 1)
    assert torch.equal(ys[3].cpu(), xs[3]) and torch.equal(ys[7].cpu(), xs[7])
    assert pt.upload_many([]) == []
    with pytest.raises(pinstream.InvalidArgumentError):
        pt.upload_many([torch.ones(3, device="cuda")])


def test_torch_upload_many_reads_what_the_tensors_hold():
    """The native path reads torch tensors by pointer: lazy negation and conjugation, views
    with an offset, parameters, tensors needing grad, subclasses (through DLPack) and sparse
    tensors (refused) must all come out as they read; the uniform path (one ``unbind``)
    gives views that are separate."""
    torch = torch_or_skip()
    import pinstream.torch as pt

    base = torch.randn(4, 300)
    c = torch.randn(50, dtype=torch.complex64)

    class Sub(torch.Tensor):
        pass

    xs = [
        torch.randn(64)._neg_view(),  # is_neg: memory holds the opposite values
        c.conj(),  # is_conj
        base[2],  # a view at an offset
        base[:, 7],  # strided view
        torch.nn.Parameter(torch.randn(5, 5)),
        torch.randn(9, requires_grad=True),
        torch.randn(6, 3).as_subclass(Sub),
    ]
    ys = pt.upload_many(xs)
    for x, y in zip(xs, ys):
        want = x.detach().resolve_neg().resolve_conj().as_subclass(torch.Tensor)
        assert y.is_cuda and y.dtype == x.dtype and y.shape == x.shape
        assert torch.equal(y.cpu(), want)
    with pytest.raises(pinstream.InvalidArgumentError):
        pt.upload_many([torch.randn(3), torch.randn(4, 4).to_sparse()])
    # One dtype and shape: one unbind over the arena, every view its own tensor.
    same = [torch.randn(17, 3) for _ in range(100)]
    ys = pt.upload_many(same)
    assert all(torch.equal(y.cpu(), x) for x, y in zip(same, ys))
    ys[5].zero_()
    assert torch.equal(ys[4].cpu(), same[4]) and torch.equal(ys[6].cpu(), same[6])
    assert all(y.shape == (17, 3) for y in ys)
    # 4 KB each: back to back in the arena, the one-unbind path.
    same = [torch.randn(1024) for _ in range(1000)]
    assert all(torch.equal(y.cpu(), x) for x, y in zip(same, pt.upload_many(same)))
