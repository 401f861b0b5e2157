import pytest

import pinstream


def _gpu_reason():
    try:
        if pinstream.device_count() > 0:
            return None
        return "no CUDA device"
    except pinstream.NoDeviceError as e:
        return f"no CUDA device: {e}"


GPU_REASON = _gpu_reason()

needs_gpu = pytest.mark.skipif(GPU_REASON is not None, reason=GPU_REASON or "")
