"""A sharded safetensors checkpoint to the GPU (issue 32): pinstream against the peers, in one
run on one GPU, with the page cache warm and cold.

    python3 python/bench/sharded_load.py [--size-gb 6] [--shard-gb 1] [--dir DIR] [--keep]
                                         [--repeat 5] [--cold-repeat 3] [--toy]

It writes (once; reused with --keep) a transformer-like bf16 checkpoint of --size-gb decimal GB
as ``save_pretrained`` does: shards of at most --shard-gb named ``model-0000k-of-0000n`` and
``model.safetensors.index.json`` (huggingface_hub's ``save_torch_state_dict``, the writer
``save_pretrained`` uses, where installed; else safetensors' ``save_file`` per shard and the
index by hand). Random bits (NaN patterns too: bytes are compared, not values). Then, each the
median of --repeat runs after one warm-up, host wall time from before the call to a
``torch.cuda.synchronize()`` after it:

  pinstream            pinstream.torch.load_safetensors(folder): every shard into one arena
                       (direct="auto", the default; pinstream_never: direct="never", which
                       skips the page-cache residency check)
  pinstream per shard  pinstream.torch.load_safetensors(shard) for each shard, one after another
  pinned H2D           the same bytes as one pinned uint8 tensor, .to("cuda", non_blocking=True),
                       timed with CUDA events: the link's rate, the ceiling
  load_file            safetensors.torch.load_file(shard, device="cuda") for each shard
  safe_open            safe_open(shard, framework="pt", device="cuda"), get_tensor for every key
  mmap + .to           safetensors.torch.load_file(shard) (a CPU mmap), then .to("cuda") each

Cold: before each run, every shard's pages are dropped (os.posix_fadvise DONTNEED on clean pages
needs no root; the fraction still resident, read with mmap + mincore, is reported), the median
of --cold-repeat runs: pinstream with direct="auto" (O_DIRECT when cold) and "never" (the page
cache), and the three peers.

Every pinstream result is compared byte for byte with load_file's, tensor by tensor, on the GPU.
Prints a table to stderr and ONE JSON line to stdout: bytes, shards, GB/s of each way (warm and
cold), pinstream / pinned H2D, pinstream / the fastest peer, byte identity, residency.
"""

import argparse
import ctypes
import gc
import json
import mmap
import os
import statistics
import sys
import time

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import pinstream
import pinstream.torch as pt

GB = 1e9
DEV = "cuda:0"


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ----- the checkpoint --------------------------------------------------------------------------


def random_bf16(shape):
    """Random bits as bf16 (made on the GPU, moved to the host: fast)."""
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (2 * n,), dtype=torch.uint8, device=DEV)
    return raw.view(torch.bfloat16).reshape(shape).cpu()


#: A Llama-like model's hidden, MLP and vocabulary sizes; TOY's for a smoke run (`--toy`).
LLAMA = (4096, 11008, 32000)
TOY = (256, 688, 2000)


def model_state(target, dims=LLAMA):
    """About `target` bytes of a Llama-like model's weights, all bf16 (`dims`: hidden, MLP,
    vocab; as many layers as fit)."""
    h, m, vocab = dims
    shapes = {"model.embed_tokens.weight": (vocab, h), "lm_head.weight": (vocab, h),
              "model.norm.weight": (h,)}
    fixed = 2 * (2 * vocab * h + h)
    per_layer = 2 * (4 * h * h + 3 * h * m + 2 * h)
    for i in range(max(1, int((target - fixed) // per_layer))):
        p = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[p + f"self_attn.{n}.weight"] = (h, h)
        for n in ("gate_proj", "up_proj"):
            shapes[p + f"mlp.{n}.weight"] = (m, h)
        shapes[p + "mlp.down_proj.weight"] = (h, m)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    return {k: random_bf16(s) for k, s in shapes.items()}


def write_checkpoint(folder, size, shard, dims=LLAMA):
    os.makedirs(folder, exist_ok=True)
    log(f"writing a checkpoint of about {size / GB:.1f} GB in shards of at most {shard / GB:.1f} GB "
        f"to {folder}")
    state = model_state(size, dims)
    try:
        from huggingface_hub import save_torch_state_dict
    except ImportError:
        save_torch_state_dict = None
    if save_torch_state_dict is not None:
        save_torch_state_dict(state, folder, max_shard_size=int(shard))
    else:
        shards, cur, used = [], {}, 0
        for k, v in state.items():
            n = v.numel() * v.element_size()
            if cur and used + n > shard:
                shards.append(cur)
                cur, used = {}, 0
            cur[k] = v
            used += n
        shards.append(cur)
        wm = {}
        for i, s in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(s, os.path.join(folder, name), metadata={"format": "pt"})
            wm.update({k: name for k in s})
        total = sum(v.numel() * v.element_size() for v in state.values())
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": wm}, f, indent=2)
    del state
    gc.collect()
    os.sync()


def shards_of(folder):
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    names = sorted(set(index["weight_map"].values()))
    return index, [os.path.join(folder, n) for n in names]


def data_bytes(path):
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    return os.path.getsize(path) - 8 - n


# ----- the page cache --------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
MAP_FAILED = ctypes.c_void_p(-1).value


def resident_fraction(path, windows=256, window=1 << 20):
    """The fraction of the file in the page cache (mmap + mincore over evenly spread 1 MiB
    windows; nothing is read). None where it cannot be found out."""
    size = os.path.getsize(path)
    page = mmap.PAGESIZE
    if size == 0:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        base = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if base is None or base == MAP_FAILED:
            return None
        try:
            span = max(size - window, 0)
            starts = sorted({span * i // max(windows - 1, 1) // page * page for i in range(windows)})
            seen = resident = 0
            vec = (ctypes.c_ubyte * (window // page + 1))()
            for s in starts:
                n = min(window, size - s)
                if _libc.mincore(ctypes.c_void_p(base + s), n, vec) != 0:
                    return None
                pages = (n + page - 1) // page
                resident += sum(vec[i] & 1 for i in range(pages))
                seen += pages
            return resident / max(seen, 1)
        finally:
            _libc.munmap(ctypes.c_void_p(base), size)
    finally:
        os.close(fd)


def evict(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths):
    for p in paths:
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass


# ----- the ways to load ------------------------------------------------------------------------


def way_pinstream(folder, direct):
    return lambda: pt.load_safetensors(folder, device=0, direct=direct)


def way_pinstream_per_shard(paths):
    def run():
        out = {}
        for p in paths:
            out.update(pt.load_safetensors(p, device=0))
        return out
    return run


def way_load_file(paths):
    def run():
        out = {}
        for p in paths:
            out.update(load_file(p, device=DEV))
        return out
    return run


def way_safe_open(paths):
    def run():
        out = {}
        for p in paths:
            with safe_open(p, framework="pt", device=DEV) as f:
                for k in f.keys():
                    out[k] = f.get_tensor(k)
        return out
    return run


def way_mmap_to(paths):
    def run():
        out = {}
        for p in paths:
            for k, v in load_file(p).items():
                out[k] = v.to(DEV)
        return out
    return run


def release():
    gc.collect()
    torch.cuda.synchronize()


def timed_once(fn, before=None):
    if before is not None:
        before()
    release()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    s = time.perf_counter() - t0
    del out
    release()
    return s


def median_s(fn, repeat, warmup=1, before=None):
    for _ in range(warmup):
        timed_once(fn, before)
    return statistics.median(timed_once(fn, before) for _ in range(repeat))


def pinned_h2d(nbytes, repeat):
    """Median seconds of .to('cuda', non_blocking=True) of `nbytes` pinned bytes, CUDA events."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    src.fill_(1)
    ts = []
    for i in range(repeat + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        d = src.to(DEV, non_blocking=True)
        b.record()
        b.synchronize()
        if i:
            ts.append(a.elapsed_time(b) / 1e3)
        del d
    del src
    release()
    return statistics.median(ts)


def byte_identical(folder, paths):
    """pinstream's tensors against load_file's, every byte on the GPU; the names too."""
    got = pt.load_safetensors(folder)
    names = set()
    for p in paths:
        want = load_file(p, device=DEV)
        for k, v in want.items():
            names.add(k)
            g = got.get(k)
            if g is None or g.dtype != v.dtype or g.shape != v.shape:
                return False, f"{k}: missing or of another dtype / shape"
            if v.numel() and not torch.equal(g.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)):
                return False, f"{k}: bytes differ"
        del want
    if names != set(got):
        return False, f"names: {sorted(set(got) ^ names)[:5]} ..."
    del got
    release()
    return True, "every byte"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=6.0)
    ap.add_argument("--shard-gb", type=float, default=1.0)
    ap.add_argument("--dir", default=os.path.join(os.getcwd(), "sharded-ckpt"))
    ap.add_argument("--keep", action="store_true", help="keep (and reuse) the checkpoint")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cold-repeat", type=int, default=3)
    ap.add_argument("--skip-cold", action="store_true")
    ap.add_argument("--toy", action="store_true",
                    help="a small model's shapes (hidden 256): a smoke run of a few MB")
    a = ap.parse_args()

    index_path = os.path.join(a.dir, "model.safetensors.index.json")
    if not os.path.exists(index_path):
        write_checkpoint(a.dir, a.size_gb * GB, a.shard_gb * GB, TOY if a.toy else LLAMA)
    index, paths = shards_of(a.dir)
    nbytes = sum(data_bytes(p) for p in paths)
    log(f"{len(paths)} shards, {len(index['weight_map'])} tensors, {nbytes / GB:.2f} GB of data")

    result = {"bench": "sharded_load", "device": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "shards": len(paths), "tensors": len(index["weight_map"]),
              "bytes": nbytes, "repeat": a.repeat, "cold_repeat": a.cold_repeat}
    try:
        import safetensors
        result["safetensors"] = safetensors.__version__
    except Exception:  # noqa: BLE001 - a version string only
        pass

    ok, why = byte_identical(a.dir, paths)
    result["byte_identical"] = ok
    log(f"byte identity: {ok} ({why})")

    gbps = lambda s: nbytes / s / GB  # noqa: E731
    warm(paths)
    result["resident_warm"] = statistics.mean(resident_fraction(p) or 0.0 for p in paths)
    ways = {
        "pinstream": way_pinstream(a.dir, "auto"),
        "pinstream_never": way_pinstream(a.dir, "never"),
        "pinstream_per_shard": way_pinstream_per_shard(paths),
        "load_file": way_load_file(paths),
        "safe_open": way_safe_open(paths),
        "mmap_to": way_mmap_to(paths),
    }
    warm_s = {}
    for name, fn in ways.items():
        warm_s[name] = median_s(fn, a.repeat)
        log(f"  warm  {name:<20} {warm_s[name]:8.3f} s  {gbps(warm_s[name]):7.2f} GB/s")
    h2d = pinned_h2d(nbytes, a.repeat)
    log(f"  pinned H2D                 {h2d:8.3f} s  {gbps(h2d):7.2f} GB/s")
    peers = ("load_file", "safe_open", "mmap_to")
    fastest = min(peers, key=lambda k: warm_s[k])
    result["warm_gbps"] = {k: gbps(v) for k, v in warm_s.items()}
    result["pinned_h2d_gbps"] = gbps(h2d)
    result["warm_ratio_to_pinned_h2d"] = h2d / warm_s["pinstream"]
    result["warm_fastest_peer"] = fastest
    result["warm_ratio_to_fastest_peer"] = warm_s[fastest] / warm_s["pinstream"]

    if not a.skip_cold:
        drop = lambda: evict(paths)  # noqa: E731
        evict(paths)
        result["resident_after_eviction"] = statistics.mean(resident_fraction(p) or 0.0 for p in paths)
        cold = {
            "pinstream_auto": way_pinstream(a.dir, "auto"),
            "pinstream_never": way_pinstream(a.dir, "never"),
            "load_file": ways["load_file"],
            "safe_open": ways["safe_open"],
            "mmap_to": ways["mmap_to"],
        }
        cold_s = {}
        for name, fn in cold.items():
            cold_s[name] = median_s(fn, a.cold_repeat, warmup=0, before=drop)
            log(f"  cold  {name:<20} {cold_s[name]:8.3f} s  {gbps(cold_s[name]):7.2f} GB/s")
        cfast = min(peers, key=lambda k: cold_s[k])
        result["cold_gbps"] = {k: gbps(v) for k, v in cold_s.items()}
        result["cold_fastest_peer"] = cfast
        result["cold_ratio_to_fastest_peer"] = cold_s[cfast] / cold_s["pinstream_auto"]

    if not a.keep:
        for p in paths + [index_path]:
            os.remove(p)
        try:
            os.rmdir(a.dir)
        except OSError:
            pass
    pinstream.empty_cache()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
