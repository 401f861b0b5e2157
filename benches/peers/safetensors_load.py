"""Peers for `pinstream load` (pinstream::safetensors): model weights from a file to the GPU.

For each size (e.g. 4G 16G) it writes a model-like safetensors file of about that size (a
transformer's layout: bf16 projections and embeddings, f32 norms, an int64 buffer, a bool mask,
odd and tiny tensors; random contents) and the same tensors as a `.pt` file, then times, in one
run, with one warm-up each (which also warms the page cache) and the median of --repeat runs:

  pinned H2D      a pinned uint8 tensor of 1 GiB copied with non_blocking=True (CUDA events):
                  the link's rate, the ceiling
  load_file       safetensors.torch.load_file(path, device="cuda:0")
  safe_open       safe_open(path, framework="pt", device="cuda:0"), get_tensor for every key
  torch.load+to   torch.load(pt, mmap=True, weights_only=True), then .to("cuda") for every tensor
  pinstream       `pinstream load FILE --repeat N --verify --format json` (its own warm-up and
                  median; --verify downloads the arena and compares every byte with the file)

Each torch timing is host wall time from before the call to a torch.cuda.synchronize() after it;
results are deleted between runs (the caching allocator keeps its memory, as it would in a
program). The table gives GB/s of the file's data region (decimal), the ratio to pinned H2D and
to the fastest of the three peers. Files are removed after their size is measured unless --keep;
at most two files exist at once (2 x the largest size), which must stay within 40 GB.

Run on the GPU machine (Python 3.12, torch, safetensors), with the program packed by
../shared/gpu/pack:
    python3 benches/peers/safetensors_load.py 4G 16G --dir /tmp/st --pinstream .gpu/bin/pinstream
"""
import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

GB = 1e9
DISK_LIMIT = 40e9


def parse_size(s):
    s = s.strip().upper()
    mul = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "KMG" else s) * mul)


def random_tensor(shape, dtype):
    """Random bits of `dtype` (made on the GPU, then moved to the host: fast)."""
    n = 1
    for d in shape:
        n *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, dtype=torch.uint8, device="cuda").bool().cpu()
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, device="cuda")
    return raw.view(dtype).reshape(shape).cpu()


def model_tensors(target):
    """About `target` bytes of a transformer's weights (hidden 4096, MLP 11008, vocab 32000)."""
    h, m, vocab = 4096, 11008, 32000
    t = {
        "model.embed_tokens.weight": ((vocab, h), torch.bfloat16),
        "lm_head.weight": ((vocab, h), torch.bfloat16),
        "model.norm.weight": ((h,), torch.float32),
        "model.rotary.inv_freq": ((h // 64,), torch.float32),
        "model.position_ids": ((1, 4097), torch.int64),
        "model.causal_mask": ((61, 67), torch.bool),
        "model.scale": ((), torch.float32),
        "model.tiny": ((3,), torch.int16),
    }
    fixed = sum(torch.empty((), dtype=d).element_size() * _numel(s) for s, d in t.values())
    per_layer = 2 * (4 * h * h + 3 * h * m) + 2 * 4 * h + 4 * 7
    layers = max(1, int((target - fixed) // per_layer))
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[p + f"self_attn.{name}.weight"] = ((h, h), torch.bfloat16)
        t[p + "mlp.gate_proj.weight"] = ((m, h), torch.bfloat16)
        t[p + "mlp.up_proj.weight"] = ((m, h), torch.bfloat16)
        t[p + "mlp.down_proj.weight"] = ((h, m), torch.bfloat16)
        t[p + "input_layernorm.weight"] = ((h,), torch.float32)
        t[p + "post_attention_layernorm.weight"] = ((h,), torch.float32)
        t[p + "odd.bias"] = ((7,), torch.float32)
    return t


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def write_files(target, folder):
    base = os.path.join(folder, f"model-{target >> 20}M")
    st, pt = base + ".safetensors", base + ".pt"
    spec = model_tensors(target)
    t0 = time.perf_counter()
    tensors = {k: random_tensor(s, d) for k, (s, d) in spec.items()}
    save_file(tensors, st, metadata={"format": "pt"})
    torch.save(tensors, pt)
    del tensors
    gc.collect()
    print(f"  wrote {st} ({os.path.getsize(st) / GB:.2f} GB, {len(spec)} tensors) and "
          f"{pt} in {time.perf_counter() - t0:.1f} s", flush=True)
    return st, pt


def data_bytes(st):
    with open(st, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    return os.path.getsize(st) - 8 - n


def timed(fn, repeat):
    """Wall seconds of fn() (which must leave the GPU done): one warm-up, then `repeat` runs."""
    out = fn()
    del out
    samples = []
    for _ in range(repeat):
        gc.collect()
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t)
        del out
    return samples


def pinned_h2d_gbps(repeat):
    n = 1 << 30
    src = torch.randint(0, 256, (n,), dtype=torch.uint8).pin_memory()
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for i in range(repeat + 2):
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        if i >= 2:
            out.append(n / (start.elapsed_time(end) / 1e3) / GB)
    assert torch.equal(dst[:4096].cpu(), src[:4096]), "pinned copy check failed"
    return statistics.median(out)


def peers(st, pt, repeat):
    def lf():
        return load_file(st, device="cuda:0")

    def so():
        with safe_open(st, framework="pt", device="cuda:0") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    def tl():
        cpu = torch.load(pt, mmap=True, weights_only=True)
        return {k: v.to("cuda") for k, v in cpu.items()}

    return {
        "load_file": timed(lf, repeat),
        "safe_open": timed(so, repeat),
        "torch.load+to": timed(tl, repeat),
    }


def pinstream(binary, st, repeat):
    torch.cuda.empty_cache()
    cmd = [binary, "load", st, "--repeat", str(repeat), "--verify", "--format", "json"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        print(f"  pinstream failed ({p.returncode}): {p.stderr.strip()}", flush=True)
        return None
    r = json.loads(p.stdout)
    if r.get("verified") is not True:
        print(f"  pinstream --verify did not pass: {r}", flush=True)
        return None
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sizes", nargs="+", help="file sizes, e.g. 4G 16G")
    ap.add_argument("--dir", default="/tmp/pinstream-st", help="folder for the files")
    ap.add_argument("--pinstream", default=".gpu/bin/pinstream", help="the pinstream program")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs after a warm-up")
    ap.add_argument("--keep", action="store_true", help="keep the files (and reuse them)")
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes]
    if (args.keep and 2 * sum(sizes) > DISK_LIMIT) or 2 * max(sizes) > DISK_LIMIT:
        sys.exit(f"files of {args.sizes} would take more than {DISK_LIMIT / GB:.0f} GB of disk")
    os.makedirs(args.dir, exist_ok=True)
    import safetensors

    print(f"torch {torch.__version__}, safetensors {safetensors.__version__}, "
          f"{torch.cuda.get_device_name()}; {args.repeat} timed runs after a warm-up", flush=True)
    pinned = pinned_h2d_gbps(9)
    print(f"pinned H2D (1 GiB, non_blocking): {pinned:.2f} GB/s", flush=True)
    results = []
    for target in sizes:
        print(f"size {target / GB:.2f} GB:", flush=True)
        base = os.path.join(args.dir, f"model-{target >> 20}M")
        st, pt = base + ".safetensors", base + ".pt"
        if not (args.keep and os.path.exists(st) and os.path.exists(pt)):
            st, pt = write_files(target, args.dir)
        nbytes = data_bytes(st)
        rows = {}
        for name, samples in peers(st, pt, args.repeat).items():
            s = statistics.median(samples)
            rows[name] = (nbytes / s / GB, s)
            print(f"  {name:<14} {rows[name][0]:8.2f} GB/s  {s:8.3f} s", flush=True)
        ps = pinstream(args.pinstream, st, args.repeat)
        if ps is not None:
            rows["pinstream"] = (ps["gbps_median"], ps["seconds_median"])
            print(f"  {'pinstream':<14} {ps['gbps_median']:8.2f} GB/s  "
                  f"{ps['seconds_median']:8.3f} s  ({ps['read']}, first load "
                  f"{ps['first_seconds']:.3f} s, verified)", flush=True)
        results.append((target, nbytes, rows))
        if not args.keep:
            for f in (st, pt):
                os.remove(f)

    print()
    print(f"{'size':>8}  {'method':<14} {'GB/s':>8} {'s':>8} {'/pinned':>8} {'/best peer':>10}")
    for target, nbytes, rows in results:
        best = max(v[0] for k, v in rows.items() if k != "pinstream")
        for name, (g, s) in rows.items():
            print(f"{nbytes / GB:7.2f}G  {name:<14} {g:8.2f} {s:8.3f} {g / pinned:8.2f} "
                  f"{g / best:10.2f}")
    print(f"{'':>8}  {'pinned H2D':<14} {pinned:8.2f}")
    ok = all("pinstream" in rows for _, _, rows in results)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
