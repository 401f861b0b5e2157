"""load_safetensors on sharded checkpoints (issue 32): a folder of shards, its index, or the
folder without its index. The checks of the index and the folder run on any machine (they come
before the GPU is touched); loading and comparing byte for byte needs a GPU."""

import json
import os
import struct

import pytest

import pinstream

from conftest import needs_gpu

FormatError = pinstream.errors.FormatError


def write_st(path, tensors):
    """A safetensors file of ``tensors``: (name, dtype, shape, raw bytes), back to back."""
    header, data, at = {}, b"", 0
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + len(raw)]}
        at += len(raw)
        data += raw
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return path


def write_index(path, weight_map, text=None):
    path.write_text(text if text is not None else json.dumps(
        {"metadata": {"total_size": 1}, "weight_map": weight_map}))
    return path


@pytest.fixture
def two_shards(tmp_path):
    """s1: a, b; s2: c (U8, 4 bytes each), and the good index."""
    write_st(tmp_path / "s1.safetensors", [("a", "U8", [4], b"\1\2\3\4"), ("b", "U8", [4], b"\5\6\7\x08")])
    write_st(tmp_path / "s2.safetensors", [("c", "U8", [4], b"\x09\x0a\x0b\x0c")])
    write_index(tmp_path / "model.safetensors.index.json",
                {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"})
    return tmp_path


def check_format(path, *needles):
    with pytest.raises(FormatError) as e:
        pinstream.load_safetensors(path)
    for n in needles:
        assert n in str(e.value), str(e.value)
    return e.value


# ----- any machine: the checks come before the GPU ---------------------------------------------


def test_index_value_not_a_string(two_shards):
    idx = two_shards / "model.safetensors.index.json"
    write_index(idx, {"a": 3, "b": "s1.safetensors", "c": "s2.safetensors"})
    for p in [idx, two_shards]:
        check_format(p, '"a"', "file name")


def test_index_names_a_tensor_the_shard_lacks(two_shards):
    idx = two_shards / "model.safetensors.index.json"
    write_index(idx, {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors",
                      "ghost": "s2.safetensors"})
    check_format(idx, "ghost", "s2.safetensors", "holds no tensor")


def test_shard_tensor_missing_from_the_index(two_shards):
    idx = two_shards / "model.safetensors.index.json"
    write_index(idx, {"a": "s1.safetensors", "c": "s2.safetensors"})
    check_format(idx, "s1.safetensors", '"b"', "does not name")


def test_tensor_in_two_shards(two_shards):
    write_st(two_shards / "s2.safetensors", [("c", "U8", [4], b"\0" * 4), ("a", "U8", [1], b"\0")])
    check_format(two_shards, "s2.safetensors", '"a"', "s1.safetensors")
    # Without the index, too.
    os.remove(two_shards / "model.safetensors.index.json")
    check_format(two_shards, '"a"', "one shard only")


def test_missing_shard_is_an_io_error(two_shards):
    os.remove(two_shards / "s2.safetensors")
    with pytest.raises(pinstream.IoError) as e:
        pinstream.load_safetensors(two_shards / "model.safetensors.index.json")
    assert "s2.safetensors" in str(e.value) and '"c"' in str(e.value), str(e.value)


def test_shard_names_may_not_leave_the_folder(tmp_path):
    inner = tmp_path / "inner"
    inner.mkdir()
    outside = write_st(tmp_path / "x.safetensors", [("w", "U8", [1], b"\1")])
    for shard in ["../x.safetensors", str(outside), ""]:
        write_index(inner / "model.safetensors.index.json", {"w": shard})
        check_format(inner, '"w"', "refused")


def test_duplicate_keys_and_bad_json(two_shards):
    idx = two_shards / "model.safetensors.index.json"
    for text, needle in [
        ('{"weight_map": {"a": "s1.safetensors", "a": "s1.safetensors"}}', "appears twice"),
        ('{"weight_map": {}, "weight_map": {}}', "appears twice"),
        ('{"metadata": {"k": 1, "k": 2}, "weight_map": {"a": "s1.safetensors"}}', "appears twice"),
        ('{"metadata": {}}', "weight_map"),
        ("[1, 2]", "not valid"),
        ("{", "not valid"),
    ]:
        write_index(idx, None, text)
        check_format(idx, needle)


def test_folder_rules(tmp_path):
    # Empty, two indexes.
    check_format(tmp_path, "no *.safetensors")
    write_st(tmp_path / "a.safetensors", [("a", "U8", [1], b"\1")])
    write_index(tmp_path / "x.safetensors.index.json", {"a": "a.safetensors"})
    write_index(tmp_path / "y.safetensors.index.json", {"a": "a.safetensors"})
    check_format(tmp_path, "x.safetensors.index.json", "y.safetensors.index.json")


def test_huge_index_is_refused_unread(tmp_path):
    idx = tmp_path / "model.safetensors.index.json"
    with open(idx, "wb") as f:
        f.truncate(100_000_001)
    check_format(idx, "above the limit")


def test_index_read_as_one_file_says_json(tmp_path, two_shards):
    # The nonsense of issue 32 ("header length 8387229874382703227") now names the cause, for a
    # JSON file that is not named *.json.
    p = tmp_path / "index.safetensors"
    p.write_text((two_shards / "model.safetensors.index.json").read_text())
    check_format(p, "looks like JSON")


# ----- GPU: loaded byte for byte -----------------------------------------------------------------


def _save_sharded(folder, state, max_shard_size):
    """A checkpoint as save_pretrained writes it: huggingface_hub's writer where installed,
    else safetensors' save_file per shard and the index by hand."""
    try:
        from huggingface_hub import save_torch_state_dict
    except ImportError:
        save_torch_state_dict = None
    if save_torch_state_dict is not None:
        save_torch_state_dict(state, folder, max_shard_size=max_shard_size)
        return
    from safetensors.torch import save_file

    shards, cur, size = [], {}, 0
    for k, v in state.items():
        n = v.numel() * v.element_size()
        if cur and size + n > max_shard_size:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = v
        size += n
    shards.append(cur)
    wm = {}
    for i, s in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(s, os.path.join(folder, name), metadata={"format": "pt"})
        wm.update({k: name for k in s})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(v.numel() * v.element_size() for v in state.values())},
                   "weight_map": wm}, f)


@needs_gpu
def test_sharded_checkpoint_byte_identical(tmp_path):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    state = {}
    for i in range(12):
        rows = int(torch.randint(1, 700, (), generator=g))
        state[f"model.layers.{i}.w"] = torch.randn(rows, 129 + i, generator=g).to(torch.bfloat16)
        state[f"model.layers.{i}.b"] = torch.randint(-100, 100, (i + 1,), generator=g, dtype=torch.int64)
    state["model.norm.weight"] = torch.randn(4096, generator=g)
    state["model.empty"] = torch.empty(0, 3)
    _save_sharded(str(tmp_path), state, max_shard_size=300_000)
    shards = sorted(p for p in os.listdir(tmp_path) if p.endswith(".safetensors"))
    assert len(shards) >= 3, shards
    with open(tmp_path / "model.safetensors.index.json") as f:
        index = json.load(f)
    want = {}
    for s in shards:
        want.update(st.load_file(str(tmp_path / s)))
    assert set(want) == set(index["weight_map"])
    import pinstream.torch as pt

    for path in [tmp_path, tmp_path / "model.safetensors.index.json"]:
        for direct in ["never", "auto"]:
            got = pt.load_safetensors(path, direct=direct)
            assert set(got) == set(index["weight_map"]), (path, direct)
            for k, v in want.items():
                assert got[k].is_cuda and got[k].dtype == v.dtype and got[k].shape == v.shape, k
                assert torch.equal(got[k].cpu(), v), k
    # The folder without its index: every *.safetensors.
    os.remove(tmp_path / "model.safetensors.index.json")
    got = pt.load_safetensors(tmp_path)
    assert set(got) == set(want)
    assert all(torch.equal(got[k].cpu(), v) for k, v in want.items())
    got["model.norm.weight"].add_(1)  # writable


@needs_gpu
def test_tied_weights_keep_the_index_names(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors.torch")
    emb = torch.randn(300, 64)
    state = {"model.embed_tokens.weight": emb, "lm_head.weight": emb,  # tied: one storage
             "model.norm.weight": torch.randn(64)}
    try:
        _save_sharded(str(tmp_path), state, max_shard_size=50_000)
    except RuntimeError:
        # safetensors' save_file refuses shared tensors where huggingface_hub is absent: store
        # it once, as save_pretrained does.
        del state["lm_head.weight"]
        _save_sharded(str(tmp_path), state, max_shard_size=50_000)
    with open(tmp_path / "model.safetensors.index.json") as f:
        names = set(json.load(f)["weight_map"])
    import pinstream.torch as pt

    got = pt.load_safetensors(tmp_path)
    assert set(got) == names
    kept = next(n for n in ["model.embed_tokens.weight", "lm_head.weight"] if n in names)
    assert torch.equal(got[kept].cpu(), emb)

