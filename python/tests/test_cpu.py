"""What works without a GPU: the import, argument checks, and the exceptions a machine with no
CUDA device gets (typed, with the library's message)."""

import array

import numpy as np
import pytest

import pinstream
from pinstream import errors

from conftest import GPU_REASON


def test_import_and_version():
    assert pinstream.__version__
    assert pinstream.Tensor.__module__ == "pinstream"
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, pinstream.PinstreamError)
    assert issubclass(errors.InvalidArgumentError, ValueError)
    assert issubclass(errors.OutOfMemoryError, MemoryError)
    assert issubclass(errors.IoError, OSError)


@pytest.mark.parametrize("device", ["cpu", "cuda:x", "tpu:0", 1.5, True, object()])
def test_bad_device_argument(device):
    with pytest.raises(pinstream.InvalidArgumentError):
        pinstream.upload(np.arange(4, dtype=np.float32), device=device)


def test_negative_device_is_an_argument_error():
    with pytest.raises(pinstream.InvalidArgumentError, match="device"):
        pinstream.upload(np.arange(4, dtype=np.float32), device=-1)


@pytest.mark.skipif(GPU_REASON is None, reason="this machine has a GPU")
def test_no_gpu_is_a_typed_error():
    with pytest.raises(pinstream.NoDeviceError) as e:
        pinstream.device_count()
    assert "CUDA" in str(e.value) or "driver" in str(e.value)
    with pytest.raises(pinstream.NoDeviceError):
        pinstream.upload(np.arange(4, dtype=np.float32))
    with pytest.raises(pinstream.NoDeviceError):
        pinstream.upload_many([np.arange(4, dtype=np.float32)])
    with pytest.raises(pinstream.NoDeviceError):
        pinstream.synchronize()
    # Every error is also the library's base class, and a RuntimeError.
    with pytest.raises(RuntimeError):
        pinstream.device_name(0)


def test_download_refuses_host_arrays():
    # numpy arrays are host memory: refused before any device is touched.
    with pytest.raises(pinstream.InvalidArgumentError, match="not CUDA memory"):
        pinstream.download(np.arange(4))
    with pytest.raises(pinstream.InvalidArgumentError, match="__dlpack_device__"):
        pinstream.download(b"bytes")


def test_sources_without_protocols_are_refused():
    if GPU_REASON is not None:
        pytest.skip(f"the device is checked first: {GPU_REASON}")
    with pytest.raises(pinstream.InvalidArgumentError, match="neither __dlpack__"):
        pinstream.upload(object())
    with pytest.raises(pinstream.InvalidArgumentError, match="not C-contiguous"):
        pinstream.upload(memoryview(bytearray(64)).cast("B", (8, 8))[::2])
    assert array.array("f", [1.0]).itemsize == 4


def test_prefetch_argument_errors_come_first():
    with pytest.raises(pinstream.InvalidArgumentError, match="dtype"):
        pinstream.prefetch([], dtype="float64")
    with pytest.raises(pinstream.InvalidArgumentError, match="nchw"):
        pinstream.prefetch([], layout="chwn")
    with pytest.raises(pinstream.InvalidArgumentError, match="mean and std"):
        pinstream.prefetch([], normalize=((1, 2, 3), None))
    with pytest.raises(TypeError):
        pinstream.prefetch(42)


def test_safetensors_bad_files_are_typed(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    # The header is read before any device is touched.
    with pytest.raises(pinstream.errors.FormatError, match="bad.safetensors"):
        pinstream.load_safetensors(bad)
    with pytest.raises(pinstream.IoError):
        pinstream.load_safetensors(tmp_path / "missing.safetensors")
    with pytest.raises(pinstream.InvalidArgumentError, match="direct"):
        pinstream.load_safetensors(bad, direct="sometimes")
