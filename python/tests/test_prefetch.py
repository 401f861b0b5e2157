"""The prefetcher over Python iterables, on a GPU: normalize against numpy in float64 for
every output type and layout, labels and passed-through items, an iterable that raises at
batch k, an early exit that must end the threads, DataLoader input."""

import gc
import os
import time

import numpy as np
import pytest

import pinstream

from conftest import needs_gpu

pytestmark = needs_gpu
RNG = np.random.default_rng()


def _torch():
    """torch, or the test skipped; and ``pinstream.torch`` imported (a submodule: importing
    ``pinstream`` alone does not, so the test must not depend on another file having done so)."""
    torch = pytest.importorskip("torch")
    import pinstream.torch  # noqa: F401

    return torch
MEAN, STD = pinstream.IMAGENET


def batches(n_batches, n=4, c=3, h=17, w=23, nhwc=False, labels=True, extra=None):
    out = []
    for i in range(n_batches):
        shape = (n, h, w, c) if nhwc else (n, c, h, w)
        px = RNG.integers(0, 256, size=shape, dtype=np.uint8)
        item = [px]
        if labels:
            item.append(np.arange(n, dtype=np.int64) + 100 * i)
        if extra is not None:
            item.append(extra(i))
        out.append(tuple(item) if len(item) > 1 else px)
    return out


def reference(px, nhwc_in, nhwc_out, mean=MEAN, std=STD):
    x = px.astype(np.float64)
    if not nhwc_in:
        x = x.transpose(0, 2, 3, 1)
    x = (x - np.array(mean)) / np.array(std)
    return x if nhwc_out else x.transpose(0, 3, 1, 2)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("float16", 2e-3), ("bfloat16", 1e-2)])
@pytest.mark.parametrize("lin,lout", [("nchw", "nchw"), ("nhwc", "nchw"), ("nhwc", "nhwc")])
def test_normalize_matches_numpy_float64(dtype, tol, lin, lout):
    torch = _torch()
    data = batches(5, nhwc=lin == "nhwc")
    p = pinstream.torch.prefetch(
        iter(data), normalize=pinstream.IMAGENET, dtype=dtype, layout=lout, input_layout=lin
    )
    seen = 0
    for (x, y), (px, labels) in zip(p, data):
        want = reference(px, lin == "nhwc", lout == "nhwc")
        assert x.dtype == getattr(torch, dtype) and tuple(x.shape) == want.shape
        got = x.float().cpu().numpy().astype(np.float64)
        assert np.abs(got - want).max() <= tol * max(1.0, np.abs(want).max())
        assert y.dtype == torch.int64 and y.is_cuda and np.array_equal(y.cpu().numpy(), labels)
        seen += 1
    assert seen == 5


def test_uint8_cast_and_pixels_only_items():
    torch = _torch()
    data = batches(3, labels=False)
    got = list(pinstream.torch.prefetch(data, dtype=torch.uint8))
    assert len(got) == 3
    for x, px in zip(got, data):
        assert isinstance(x, torch.Tensor) and np.array_equal(x.cpu().numpy(), px)


def test_rest_is_passed_through_and_raw_tensors_work():
    data = batches(3, extra=lambda i: {"batch": i})
    p = pinstream.prefetch(data)
    for i, (x, y, meta) in enumerate(p):
        assert isinstance(x, pinstream.Tensor) and isinstance(y, pinstream.Tensor)
        assert meta == {"batch": i}
        assert x.shape == (4, 3, 17, 23) and y.shape == (4,)
        assert np.allclose(pinstream.download(x), data[i][0].astype(np.float32))


class Boom(ValueError):
    pass


def raising(k, n=8):
    for i, item in enumerate(batches(n)):
        if i == k:
            raise Boom(f"the loader broke at {i}")
        yield item


def test_an_iterable_that_raises_at_batch_k():
    p = pinstream.prefetch(raising(3), normalize=pinstream.IMAGENET)
    got = []
    with pytest.raises(pinstream.LoaderError) as e:
        for x, y in p:
            got.append(pinstream.download(y)[0] // 100)
    assert got == [0, 1, 2]
    assert e.value.batch == 3
    assert isinstance(e.value.__cause__, Boom) and "broke at 3" in str(e.value)
    with pytest.raises(StopIteration):  # ended there
        next(p)


def test_bad_items_are_loader_errors_naming_the_batch():
    items = batches(2) + [(np.zeros((4, 3, 8, 8), np.float32), np.arange(4))]
    p = pinstream.prefetch(items)
    next(p), next(p)
    with pytest.raises(pinstream.LoaderError) as e:
        next(p)
    assert e.value.batch == 2 and isinstance(e.value.__cause__, pinstream.InvalidArgumentError)
    with pytest.raises(pinstream.InvalidArgumentError):
        pinstream.prefetch([], dtype="float64")
    with pytest.raises(pinstream.InvalidArgumentError):
        pinstream.prefetch([], normalize=((1, 2, 3), None))
    with pytest.raises(TypeError):
        pinstream.prefetch(42)


def threads():
    return len(os.listdir("/proc/self/task"))


def test_early_exit_ends_the_threads_and_frees_memory():
    torch = _torch()
    big = batches(64, n=32, h=224, w=224)

    def run(stop_after):
        p = pinstream.torch.prefetch(iter(big), normalize=pinstream.IMAGENET)
        try:
            for i, (x, y) in enumerate(p):
                if i == stop_after:
                    raise KeyboardInterrupt  # as a Ctrl-C in the training loop would
        except KeyboardInterrupt:
            pass

    run(1)  # warm up: contexts, pools
    gc.collect()
    time.sleep(0.2)
    torch.cuda.synchronize()
    t0, (free0, _) = threads(), torch.cuda.mem_get_info()
    for _ in range(5):
        run(3)
    gc.collect()
    time.sleep(0.5)
    torch.cuda.synchronize()
    t1, (free1, _) = threads(), torch.cuda.mem_get_info()
    assert t1 <= t0, f"threads {t0} -> {t1}"
    assert free0 - free1 < 256 << 20, f"{(free0 - free1) >> 20} MiB kept"


def test_dataloader_without_pin_memory():
    torch = _torch()
    from torch.utils.data import DataLoader, TensorDataset

    x = torch.randint(0, 256, (64, 3, 16, 16), dtype=torch.uint8)
    y = torch.arange(64)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, num_workers=2, pin_memory=False)
    got_y = []
    for images, labels in pinstream.torch.prefetch(loader, normalize=pinstream.IMAGENET, dtype=torch.float16):
        assert images.shape == (16, 3, 16, 16) and images.dtype == torch.float16
        got_y.append(labels.cpu())
    assert torch.equal(torch.cat(got_y), y)
