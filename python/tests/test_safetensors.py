"""load_safetensors on a GPU: every byte and every tensor against safetensors' own reader."""

import numpy as np
import pytest

import pinstream

from conftest import needs_gpu

pytestmark = needs_gpu


def test_every_tensor_matches(tmp_path):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    rng = np.random.default_rng()
    tensors = {}
    for i, (shape, dt) in enumerate(
        [((4096, 1024), torch.float16), ((1000,), torch.float32), ((7, 3), torch.int64),
         ((1,), torch.bfloat16), ((0, 5), torch.float32), ((33, 17, 3), torch.uint8),
         ((12,), torch.bool), ((513,), torch.int8), ((2, 2), torch.float64)]
    ):
        raw = torch.from_numpy(rng.integers(0, 256, int(np.prod(shape)) * torch.empty((), dtype=dt).element_size(), dtype=np.uint8))
        t = raw.view(dt).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dt)
        if dt.is_floating_point:
            t = torch.nan_to_num(t)
        if dt == torch.bool:
            t = raw.view(torch.uint8) % 2 == 1
        tensors[f"layer.{i}.weight"] = t.contiguous()
    path = tmp_path / "model.safetensors"
    st.save_file(tensors, str(path), metadata={"format": "pt"})
    want = st.load_file(str(path))
    import pinstream.torch as pt

    for direct in ["never", "auto"]:
        got = pt.load_safetensors(path, direct=direct)
        assert set(got) == set(want)
        for k, v in want.items():
            g = got[k]
            assert g.is_cuda and g.dtype == v.dtype and g.shape == v.shape, k
            assert torch.equal(g.cpu(), v), k
        got["layer.0.weight"].add_(1)  # writable
    raw = pinstream.load_safetensors(path)
    assert raw["layer.2.weight"].dtype == "int64" and raw["layer.2.weight"].shape == (7, 3)
    with pytest.raises(pinstream.errors.FormatError):
        bad = tmp_path / "cut.safetensors"
        bad.write_bytes(path.read_bytes()[:-10])
        pinstream.load_safetensors(bad)
