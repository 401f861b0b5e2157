"""PyTorch peer for `pinstream prefetch`: a training loop's time per batch when the input comes
from synthetic pageable u8 batches, the step is a calibrated busy kernel on the consumer's
(default) stream, and the batch is uploaded and normalized three ways, in one process:

  s  serial: the main thread fills the batch, .to("cuda") (pageable, blocking), normalizes, and
     queues the step; nothing is loaded ahead (the host fill can overlap the previous step only
     because kernels are asynchronous; the blocking copy waits for that step)
  a  apex: DataLoader(pin_memory=True, num_workers=--workers, batch_size=None) feeding APEX's
     data_prefetcher (examples/imagenet/main_amp.py), re-written here: one batch ahead on a side
     stream, .cuda(non_blocking=True), float()/sub_/div_ on the side stream, the consumer's stream
     waits for the side stream, record_stream on what is handed out
  d  dataloader: the same DataLoader, .cuda(non_blocking=True) + normalize on the default stream

Batches are the bytes `pinstream prefetch` makes (cli/src/bench/prefetch.rs `synth`): batch i is
filled with (i % 251) + 1 and every 4096th byte is (k + i) % 256; labels are int64
(i * batch + arange(batch)) % 1000. The serial loop fills one preallocated buffer; loader workers
allocate a fresh tensor per batch (it leaves the worker through shared memory, so a reused buffer
would be overwritten under the pin thread). Normalize is x.float().sub_(mean).div_(std) with the
ImageNet mean/std times 255 as (1,3,1,1) f32 CUDA tensors; an NHWC input is permuted and cast to a
contiguous NCHW float in the first of the three kernels, so every mode hands out NCHW f32.

The step is torch.cuda._sleep(cycles), calibrated once with CUDA events (a probe, scaled
linearly, each target checked to be within 5 %, corrected once if not). Time per batch: the host
clock around --batches batches (after --warmup), ended by torch.cuda.synchronize(), divided by
--batches. --sync-every N also waits for the default stream every N batches, as loss.item()
would; by default (0) it never does, like `pinstream prefetch`, so the host and APEX's side
stream may run ahead of the step (record_stream and the pinned allocator's events then hold
memory back: the notes give the peak device memory and the pinned pool). Parts, alone (median of
10): pinned H2D copy of one batch + labels and normalize (CUDA events), pageable .to() and the
fill of one batch on one thread (host clock), and the step. ideal = max(step, pinned copy +
normalize). Each mode's first batch is checked against a float64 NumPy reference (relative error
<= 1e-5), its labels against the expected ones; a mismatch stops the run.

Run on the GPU machine:
  python3 benches/peers/torch_prefetch.py --compute-ms 0.5,2,4,8,16 [--format csv|json]
  python3 benches/peers/torch_prefetch.py --batches 5 --warmup 1 --compute-ms 1   (smoke test)
"""
import argparse
import csv
import gc
import json
import os
import statistics
import sys
import time

try:
    import numpy as np
    import torch
except ImportError:  # --help and syntax checks work without them
    np = torch = None

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
MODES = {"s": "serial", "a": "apex", "d": "dataloader"}
REPS = 10  # samples of each part measured alone
RTOL = 1e-5


def parse_shape(text):
    try:
        c, h, w = (int(p) for p in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad shape {text!r} (CxHxW, e.g. 3x224x224)")
    if c != len(MEAN) or h < 1 or w < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r}: C must be {len(MEAN)} (ImageNet mean/std)")
    return c, h, w


def parse_ms_list(text):
    try:
        v = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad list {text!r} (e.g. 0.5,2,4,8,16)")
    if not v or min(v) <= 0:
        raise argparse.ArgumentTypeError(f"--compute-ms {text!r}: positive milliseconds")
    return v


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="PyTorch DataLoader + APEX prefetcher figures (peer of `pinstream prefetch`).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--batch", type=int, default=256, help="samples per batch (default 256)")
    p.add_argument("--shape", type=parse_shape, default=(3, 224, 224),
                   help="sample CxHxW (default 3x224x224)")
    p.add_argument("--layout", choices=["nchw", "nhwc"], default="nchw",
                   help="layout of the u8 input batches (the output is NCHW f32; default nchw)")
    p.add_argument("--compute-ms", type=parse_ms_list, default=parse_ms_list("4"),
                   help="GPU time of the step in ms; a comma list sweeps it (default 4)")
    p.add_argument("--batches", type=int, default=200, help="timed batches per point (default 200)")
    p.add_argument("--warmup", type=int, default=20,
                   help="batches before the clock starts (>= 1, default 20)")
    p.add_argument("--workers", type=int, default=4, help="DataLoader num_workers for a and d (default 4)")
    p.add_argument("--modes", default="sad",
                   help="which modes, by letter: s serial, a apex, d dataloader (default sad)")
    p.add_argument("--sync-every", type=int, default=0, metavar="N",
                   help="wait for the default stream every N batches, as loss.item() does (default 0: never)")
    p.add_argument("--device", type=int, default=0, help="CUDA device ordinal (default 0)")
    p.add_argument("--format", choices=["table", "csv", "json"], default="table",
                   help="table (default) as it runs; csv or json to stdout at the end "
                        "(the table then goes to stderr)")
    a = p.parse_args(argv)
    if a.batch < 1 or a.batches < 1 or a.warmup < 1 or a.workers < 0 or a.sync_every < 0:
        p.error("--batch, --batches and --warmup must be >= 1, --workers and --sync-every >= 0")
    bad = set(a.modes) - set(MODES)
    if bad or not a.modes:
        p.error(f"unknown modes {''.join(sorted(bad))!r} (letters s, a, d)")
    return a


class Synth:
    """Batch i's pixels and labels; the same bytes as `synth` in cli/src/bench/prefetch.rs."""

    def __init__(self, batch, shape, nhwc):
        c, h, w = shape
        self.batch = batch
        self.shape = (batch, h, w, c) if nhwc else (batch, c, h, w)
        self.ramp = np.arange(-(-batch * c * h * w // 4096), dtype=np.int64)  # k of each 4096th byte

    def fill(self, i, out):
        """Writes batch i into `out` (a C-contiguous u8 array of self.shape)."""
        assert out.flags.c_contiguous and out.shape == self.shape
        flat = out.reshape(-1)  # a view
        flat.fill(i % 251 + 1)
        flat[::4096] = (self.ramp + i) & 255

    def labels(self, i):
        return (np.arange(self.batch, dtype=np.int64) + i * self.batch) % 1000


class SynthBatches(torch.utils.data.Dataset if torch else object):
    """Map-style dataset whose item i is a whole batch (DataLoader(batch_size=None))."""

    def __init__(self, synth, n):
        self.synth, self.n = synth, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = torch.empty(self.synth.shape, dtype=torch.uint8)  # fresh: see the module doc
        self.synth.fill(i, x.numpy())
        return x, torch.from_numpy(self.synth.labels(i))


def normalize(x, mean, std, nhwc):
    """APEX's three kernels: float(), sub_, div_ (an NHWC input becomes contiguous NCHW in the first)."""
    if nhwc:
        f = x.permute(0, 3, 1, 2).to(torch.float32, memory_format=torch.contiguous_format)
    else:
        f = x.float()
    return f.sub_(mean).div_(std)


class DataPrefetcher:
    """APEX's data_prefetcher: the next batch is uploaded and normalized on a side stream while the
    consumer's stream runs the step on this one (one batch deep)."""

    def __init__(self, loader, norm):
        self.loader = iter(loader)
        self.stream = torch.cuda.Stream()
        self.norm = norm
        self.preload()

    def preload(self):
        try:
            self.next_input, self.next_target = next(self.loader)
        except StopIteration:
            self.next_input = self.next_target = None
            return
        with torch.cuda.stream(self.stream):
            self.next_input = self.next_input.cuda(non_blocking=True)
            self.next_target = self.next_target.cuda(non_blocking=True)
            self.next_input = self.norm(self.next_input)

    def next(self):
        consumer = torch.cuda.current_stream()
        consumer.wait_stream(self.stream)
        x, y = self.next_input, self.next_target
        if x is not None:  # allocated on the side stream, used on the consumer's
            x.record_stream(consumer)
        if y is not None:
            y.record_stream(consumer)
        self.preload()
        return x, y


# Each mode is a generator of (normalized NCHW f32, labels) on the device, ready in the order of
# the default stream; the timed loop queues the step after each.

def serial_batches(synth, n, dev, norm):
    host = np.empty(synth.shape, np.uint8)  # reused: .to() below returns when the copy is done
    host_t = torch.from_numpy(host)
    for i in range(n):
        synth.fill(i, host)
        x = host_t.to(dev)
        y = torch.from_numpy(synth.labels(i)).to(dev)
        yield norm(x), y


def make_loader(synth, n, workers):
    return torch.utils.data.DataLoader(SynthBatches(synth, n), batch_size=None, shuffle=False,
                                       num_workers=workers, pin_memory=True)


def apex_batches(synth, n, workers, norm):
    pf = DataPrefetcher(make_loader(synth, n, workers), norm)
    x, y = pf.next()
    while x is not None:
        yield x, y
        x, y = pf.next()


def dataloader_batches(synth, n, workers, norm):
    for x, y in make_loader(synth, n, workers):
        yield norm(x.cuda(non_blocking=True)), y.cuda(non_blocking=True)


def gpu_ms(fn, reps=REPS):
    """Median of `reps` CUDA-event timings of fn() on the current stream, after one untimed call."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def host_ms(fn, reps=REPS):
    """Median of `reps` host-clock timings of fn() + synchronize, after one untimed call."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def calibrate(targets, log):
    """cycles for torch.cuda._sleep per target ms: {target: (cycles, measured ms)}."""
    probe = 20_000_000  # ~10 ms at 2 GHz: long enough that the launch is noise
    gpu_ms(lambda: torch.cuda._sleep(probe), reps=3)  # let the clocks come up
    t = gpu_ms(lambda: torch.cuda._sleep(probe), reps=5)
    per_ms = probe / t
    log(f"calibration: _sleep({probe}) = {t:.3f} ms -> {per_ms / 1e6:.4f} Mcycles/ms")
    out = {}
    for target in targets:
        cycles = max(1, round(target * per_ms))
        got = gpu_ms(lambda: torch.cuda._sleep(cycles))
        if abs(got - target) > 0.05 * target:  # one proportional correction
            cycles = max(1, round(cycles * target / got))
            got = gpu_ms(lambda: torch.cuda._sleep(cycles))
        ok = "ok" if abs(got - target) <= 0.05 * target else "NOT within 5 %"
        log(f"  step {target:g} ms -> _sleep({cycles}) = {got:.3f} ms ({ok})")
        out[target] = (cycles, got)
    return out


def check_first(name, x, y, synth, mean, std, nhwc):
    """The first batch out equals the float64 reference of batch 0 in; returns the max rel error."""
    host = np.empty(synth.shape, np.uint8)
    synth.fill(0, host)
    ref = host.astype(np.float64)
    if nhwc:
        ref = ref.transpose(0, 3, 1, 2)
    # The constants the GPU used (f32), in float64.
    ref = (ref - mean.double().cpu().numpy()) / std.double().cpu().numpy()
    if x.dtype != torch.float32 or tuple(x.shape) != ref.shape or not x.is_contiguous():
        raise AssertionError(f"{name}: output is {x.dtype} {tuple(x.shape)} "
                             f"contiguous={x.is_contiguous()}, want float32 {ref.shape} NCHW")
    rel = np.abs(x.cpu().numpy() - ref) / np.abs(ref)  # ref is never 0: x is an integer, mean is not
    worst = float(rel.max())
    if worst > RTOL:
        at = tuple(int(k) for k in np.unravel_index(int(rel.argmax()), rel.shape))
        raise AssertionError(f"{name}: first batch differs from the CPU reference at {at}: "
                             f"relative error {worst:.3g} > {RTOL:g}")
    if y.dtype != torch.int64 or not np.array_equal(y.cpu().numpy(), synth.labels(0)):
        raise AssertionError(f"{name}: labels of the first batch differ")
    return worst


def pinned_pool():
    """(bytes the pinned host allocator holds, blocks it has created), None where PyTorch lacks them."""
    try:
        st = torch.cuda.host_memory_stats()
        return st["allocated_bytes.current"], st["num_host_alloc"]
    except (AttributeError, KeyError, RuntimeError):
        return None


def timed(batches, cycles, args, check=None):
    """Runs the loop; returns (ms per batch over the timed part, max rel error or None)."""
    it = iter(batches)
    err = None
    for i in range(args.warmup + args.batches):
        if i == args.warmup:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        x, y = next(it)
        if i == 0 and check:
            err = check(x, y)
        torch.cuda._sleep(cycles)  # the training step, on the default stream after the batch
        if args.sync_every and (i + 1) % args.sync_every == 0:
            torch.cuda.current_stream().synchronize()  # not the device: the side stream runs on
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3 / args.batches
    it.close()  # stops the DataLoader's workers
    return ms, err


def main(argv=None):
    args = parse_args(argv)
    out = sys.stdout if args.format == "table" else sys.stderr
    if torch is None:
        print("PyTorch or NumPy is not installed: skipping", file=out)
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: skipping", file=out)
        return 0
    torch.cuda.set_device(args.device)
    dev = torch.device("cuda", args.device)
    nhwc = args.layout == "nhwc"
    synth = Synth(args.batch, args.shape, nhwc)
    nbytes = int(np.prod(synth.shape))
    mean = (torch.tensor(MEAN) * 255).view(1, -1, 1, 1).to(dev)
    std = (torch.tensor(STD) * 255).view(1, -1, 1, 1).to(dev)
    norm = lambda x: normalize(x, mean, std, nhwc)
    log = lambda s: print(s, file=out, flush=True)

    log(f"torch {torch.__version__} (CUDA {torch.version.cuda}), {torch.cuda.get_device_name(args.device)}, "
        f"{os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} usable)")
    log(f"batch {'x'.join(map(str, synth.shape))} u8 {args.layout} ({nbytes / 1e6:.1f} MB) + int64 labels "
        f"-> NCHW f32; {args.batches} batches after {args.warmup} warm-up; {args.workers} DataLoader "
        f"workers; sync every {args.sync_every or 'never'}; times in ms")
    steps = calibrate(args.compute_ms, log)

    # Parts, each alone.
    host = np.empty(synth.shape, np.uint8)
    synth.fill(1, host)
    host_t, labels = torch.from_numpy(host), torch.from_numpy(synth.labels(1))
    pinned, pinned_l = host_t.pin_memory(), labels.pin_memory()
    d_x = torch.empty(synth.shape, dtype=torch.uint8, device=dev)
    d_y = torch.empty(args.batch, dtype=torch.int64, device=dev)

    def h2d_pinned():
        d_x.copy_(pinned, non_blocking=True)
        d_y.copy_(pinned_l, non_blocking=True)
    parts = {
        "h2d_pinned": (gpu_ms(h2d_pinned), "pinned copy_(non_blocking=True) of one batch + labels, events"),
        "to_pageable": (host_ms(lambda: host_t.to(dev)), "pageable .to('cuda') of one batch, host clock"),
        "normalize": (gpu_ms(lambda: norm(d_x)), "float()/sub_/div_ of one batch on the GPU, events"),
        "fill": (host_ms(lambda: synth.fill(2, host)), "filling one batch on one thread, host clock"),
    }
    transfer = parts["h2d_pinned"][0] + parts["normalize"][0]
    del pinned, pinned_l, d_x, d_y
    torch.cuda.empty_cache()

    rows = []
    cols = ["mode", "compute_ms", "ms_per_batch", "batches_per_s", "ideal_ms", "ratio_to_ideal", "notes"]

    def add(mode, compute, ms, ideal, notes):
        row = dict(zip(cols, (mode, compute, ms, 1e3 / ms, ideal, ideal and ms / ideal, notes)))
        rows.append(row)
        num = lambda v, w, p: f"{'-':>{w}}" if v is None else f"{v:{w}.{p}f}"
        log(f"{mode:<12} {num(compute, 10, 3)} {num(ms, 12, 3)} {num(row['batches_per_s'], 13, 1)} "
            f"{num(ideal, 8, 3)} {num(row['ratio_to_ideal'], 8, 3)}  {notes}")

    log(f"{'mode':<12} {'compute_ms':>10} {'ms_per_batch':>12} {'batches_per_s':>13} {'ideal_ms':>8} "
        f"{'ratio':>8}  notes")
    for name, (ms, notes) in parts.items():
        add(name, None, ms, None, notes)
    checked = set()
    n = args.warmup + args.batches
    for target in args.compute_ms:
        cycles, step = steps[target]
        ideal = max(step, transfer)
        add("compute", step, step, None, f"_sleep({cycles}) alone (target {target:g} ms), events")
        for letter in args.modes:
            mode = MODES[letter]
            if letter == "s":
                gen = serial_batches(synth, n, dev, norm)
                how = "fill on the main thread, pageable .to('cuda') (blocking), float/sub_/div_"
            elif letter == "a":
                gen = apex_batches(synth, n, args.workers, norm)
                how = (f"DataLoader(pin_memory=True, num_workers={args.workers}) + APEX data_prefetcher "
                       "(side stream, 1 deep, record_stream)")
            else:
                gen = dataloader_batches(synth, n, args.workers, norm)
                how = (f"DataLoader(pin_memory=True, num_workers={args.workers}), .cuda(non_blocking=True) "
                       "+ float/sub_/div_ on the default stream")
            check = None
            if mode not in checked:
                checked.add(mode)
                check = lambda x, y, mode=mode: check_first(mode, x, y, synth, mean, std, nhwc)
            torch.cuda.reset_peak_memory_stats()
            pool0 = pinned_pool()
            ms, err = timed(gen, cycles, args, check)
            del gen
            gc.collect()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.empty_cache()
            notes = f"{how}; peak device {peak:.2f} GiB"
            pool = pinned_pool()
            if pool and pool0:  # growth of the pinned pool: run-ahead held back by events
                notes += f", pinned pool {pool[0] / 2**30:.2f} GiB (+{pool[1] - pool0[1]} blocks)"
            if err is not None:
                notes += f"; first batch checked (max rel err {err:.1e})"
            add(mode, step, ms, ideal, notes)

    if args.format == "csv":
        w = csv.DictWriter(sys.stdout, fieldnames=cols, lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({k: "" if v is None else f"{v:.4f}" if isinstance(v, float) else v
                        for k, v in r.items()})
    elif args.format == "json":
        json.dump(rows, sys.stdout, indent=1)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
