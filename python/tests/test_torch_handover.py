"""``pinstream.torch``'s handover of device tensors (``_handed``, in place of
``torch.from_dlpack``): ordered on torch's current stream of the tensor's device, whichever it is;
the legacy default stream named as the protocol names it; a tensor the short way refuses goes
torch's way; host memory goes torch's way."""

import numpy as np
import pytest

import pinstream

from conftest import needs_gpu

pytestmark = needs_gpu
RNG = np.random.default_rng()


def _torch():
    torch = pytest.importorskip("torch")
    import pinstream.torch  # noqa: F401

    return torch


def test_prefetched_batches_on_a_busy_side_stream_are_ordered():
    torch = _torch()
    import pinstream.torch as pt

    data = [(RNG.integers(0, 256, (4, 3, 32, 32), dtype=np.uint8), np.arange(4) + 10 * i) for i in range(6)]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for i, (x, y) in enumerate(pt.prefetch(iter(data), dtype=torch.uint8)):
            # A long kernel queued first on the consumer stream: reads after it must still see
            # the batch, which they do only if the stream waits for pinstream's copy.
            torch.cuda._sleep(2_000_000)
            assert torch.equal(x.cpu(), torch.from_numpy(data[i][0]))
            assert torch.equal(y.cpu(), torch.from_numpy(data[i][1]))
    side.synchronize()


def test_handed_on_the_default_stream_and_on_another():
    torch = _torch()
    import pinstream.torch as pt

    src = RNG.integers(0, 256, (1000,), dtype=np.uint8)
    for stream in (None, torch.cuda.Stream()):
        t = pinstream.upload(src)
        if stream is None:
            got = pt._handed(t, {})
        else:
            with torch.cuda.stream(stream):
                got = pt._handed(t, {})
        assert t.handed_over
        assert np.array_equal(got.cpu().numpy(), src)


def test_a_tensor_the_short_way_refuses_goes_torchs_way():
    torch = _torch()
    import pinstream.torch as pt

    real = torch.arange(7, device="cuda", dtype=torch.int64)
    calls = []

    class Refusing:
        """A device tensor whose legacy capsule is refused (as pinstream refuses a read-only
        tensor's), handed over by torch's own way."""

        def __dlpack_device__(self):
            return real.__dlpack_device__()

        def __dlpack__(self, **kw):
            calls.append(sorted(kw))
            if "max_version" not in kw:
                raise pinstream.InvalidArgumentError("refused as a legacy capsule")
            return real.__dlpack__(**kw)

    got = pt._handed(Refusing(), {})
    assert torch.equal(got, real)
    assert calls[0] == ["stream"] and "max_version" in calls[1]


def test_host_memory_goes_torchs_way():
    torch = _torch()
    import pinstream.torch as pt

    src = np.arange(16, dtype=np.float32) + 0.5
    host, dtype, _ = pinstream._native.download(pinstream.upload(src))
    assert dtype == "float32" and host.__dlpack_device__()[0] != 2
    got = pt._handed(host, {})
    assert got.device.type == "cpu"
    assert np.array_equal(got.numpy(), src)
