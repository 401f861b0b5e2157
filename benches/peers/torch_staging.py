"""Peer figures for pinstream's staging engine: what PyTorch users do today to get host data onto
one GPU (and back), measured in one run.

Cases (letters for --cases):
  a  pageable tensor -> device, t.to("cuda") (blocking)
  b  pageable tensor -> device, t.to("cuda", non_blocking=True) + synchronize
  c  t.pin_memory().to("cuda", non_blocking=True) + synchronize, end to end (pinning included)
  d  pre-pinned tensor -> device, copy_(non_blocking=True): the link reference (CUDA events)
  e  device -> host: .to("cpu") into fresh pageable memory, copy_ into a preallocated pageable
     tensor, .to("cpu", non_blocking=True) + synchronize, and copy_ into pre-pinned memory (events)
  f  many small tensors (--many N of --many-elems float32): a loop of .to("cuda"); a loop of
     .to("cuda", non_blocking=True) then one synchronize; TensorDict-style pinning on a pool of
     --pin-threads threads, then non_blocking copies, then one synchronize; the same copies from
     pre-pinned tensors (reference); and TensorDict(...).to("cuda", non_blocking_pin=True,
     num_threads=K) when the tensordict package is importable
  g  a file range (--file, --file-bytes, --file-offset) read with readinto into a pageable buffer
     (read alone, and read + .to("cuda")) and into a pinned buffer (read + copy), page cache warm

Timing: each case is warmed up (--warmup untimed samples), then --samples samples are timed and the
median is reported. A sample repeats the operation until it has moved about --sample-bytes (at
least once) and reports the time per operation. Host-clock cases time the call and a
torch.cuda.synchronize() after each operation; the pinned copy_ cases (d, and d2h_pinned) use CUDA
events around the batch, like benches/peers/torch_memcpy.py. GB = 1e9 bytes. cpu_s_per_gb is the
process CPU time (user + system, all threads: time.process_time) over the timed samples, divided
by the GB they moved; with CUDA's default scheduling a synchronize spins, so it counts the wait
too (see --sync). Source data is random (torch.randint / torch.rand), never zeros, and every
case's last result is checked against its source.

Run on the GPU machine:  python3 benches/peers/torch_staging.py [--json [PATH]] [--file PATH]
"""
import argparse
import concurrent.futures
import ctypes
import json
import os
import re
import statistics
import sys
import time

try:
    import torch
except ImportError:  # --help and syntax checks work without PyTorch
    torch = None

GB = 1e9
SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "kb": 10**3,
    "m": 1 << 20,
    "mib": 1 << 20,
    "mb": 10**6,
    "g": 1 << 30,
    "gib": 1 << 30,
    "gb": 10**9,
}
SYNC_FLAGS = {"spin": 1, "yield": 2, "blocking": 4}  # cudaDeviceSchedule{Spin,Yield,BlockingSync}


def parse_size(text):
    """'4MiB', '64M' (binary), '4MB' (decimal), '1GiB', '4096' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (e.g. 4MiB, 64M, 4MB, 1GiB, 4096)")
    n = int(float(m.group(1)) * SIZE_UNITS[m.group(2).lower()])
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size {text!r} must be positive")
    return n


def parse_sizes(text):
    return [parse_size(s) for s in text.split(",") if s.strip()]


def fmt_size(n):
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult} {unit}"
    for unit, mult in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= mult and n % mult == 0:
            return f"{n // mult} {unit}"
    return f"{n} B"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="PyTorch host<->device staging figures (peer of pinstream's staging engine).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--sizes", type=parse_sizes, default=parse_sizes("4MiB,64MiB,256MiB,1GiB"),
                   help="comma-separated sizes for cases a-e (default 4MiB,64MiB,256MiB,1GiB; "
                        "K/M/G and KiB/MiB/GiB are binary, KB/MB/GB decimal)")
    p.add_argument("--samples", type=int, default=7, help="timed samples per case (>= 5, default 7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed samples before each case (default 2)")
    p.add_argument("--sample-bytes", type=parse_size, default=parse_size("256MiB"),
                   help="repeat the operation within a sample until this much has moved "
                        "(default 256MiB; small sizes get several repetitions per sample)")
    p.add_argument("--cases", default="abcdefg", help="which cases to run, by letter (default abcdefg)")
    p.add_argument("--many", type=int, default=1000, help="case f: number of tensors (default 1000)")
    p.add_argument("--many-elems", type=int, default=1000,
                   help="case f: float32 elements per tensor (default 1000, i.e. 4 KB)")
    p.add_argument("--pin-threads", type=int, default=8,
                   help="case f: threads that call pin_memory(), and TensorDict's num_threads (default 8)")
    p.add_argument("--file", help="case g: file to read (skipped without it)")
    p.add_argument("--file-bytes", type=parse_size, default=parse_size("1GiB"),
                   help="case g: bytes to read (default 1GiB, cut to the file's end)")
    p.add_argument("--file-offset", type=parse_size, default=0, help="case g: where to start (default 0)")
    p.add_argument("--device", type=int, default=0, help="CUDA device ordinal (default 0)")
    p.add_argument("--sync", choices=["auto", *SYNC_FLAGS], default="auto",
                   help="cudaSetDeviceFlags scheduling before CUDA starts: auto leaves CUDA's default "
                        "(a synchronize spins, which shows up in cpu_s_per_gb); blocking makes the "
                        "waiting thread sleep (default auto)")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="also write the rows as JSON: to PATH, or with no PATH to stdout "
                        "(the table then goes to stderr)")
    args = p.parse_args(argv)
    if args.samples < 5:
        p.error("--samples must be at least 5")
    if args.warmup < 1:
        p.error("--warmup must be at least 1")
    if args.many < 1 or args.many_elems < 1 or args.pin_threads < 1:
        p.error("--many, --many-elems and --pin-threads must be positive")
    unknown = set(args.cases) - set("abcdefg")
    if unknown:
        p.error(f"unknown cases {''.join(sorted(unknown))} (letters a-g)")
    return args


def set_sync_mode(mode, device):
    """cudaSetDeviceFlags on the cudart that PyTorch loaded, before PyTorch creates its context.
    Returns a note for the report."""
    if mode == "auto":
        return "sync=auto (CUDA default scheduling)"
    path = None
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libcudart.so" in line:
                path = line.split()[-1]
                break
    try:
        lib = None
        for name in (path, "libcudart.so.13", "libcudart.so"):
            if name:
                try:
                    lib = ctypes.CDLL(name)
                    break
                except OSError:
                    continue
        if lib is None:
            raise OSError("no libcudart found")
        if lib.cudaSetDevice(ctypes.c_int(device)) != 0:
            raise OSError("cudaSetDevice failed")
        err = lib.cudaSetDeviceFlags(ctypes.c_uint(SYNC_FLAGS[mode]))
        if err != 0:
            raise OSError(f"cudaSetDeviceFlags returned {err}")
    except OSError as e:
        print(f"warning: --sync {mode} not applied ({e}); CUDA default scheduling", file=sys.stderr)
        return f"sync={mode} NOT applied ({e})"
    return f"sync={mode} (cudaSetDeviceFlags)"


class Runner:
    def __init__(self, args, out):
        self.args = args
        self.out = out
        self.rows = []
        self.dev = torch.device("cuda", args.device)

    def reps_for(self, nbytes):
        return max(1, self.args.sample_bytes // nbytes)

    def time_host(self, op, reps):
        """Host clock around `reps` calls of op (each ends with its own synchronize)."""
        for _ in range(self.args.warmup * reps):
            last = op()
        torch.cuda.synchronize(self.dev)
        times = []
        cpu0 = time.process_time()
        for _ in range(self.args.samples):
            t0 = time.perf_counter()
            for _ in range(reps):
                last = op()
            torch.cuda.synchronize(self.dev)
            times.append((time.perf_counter() - t0) / reps)
        cpu = time.process_time() - cpu0
        return times, cpu, last

    def time_events(self, op, reps):
        """CUDA events around `reps` queued calls of op (no synchronize between them)."""
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        for _ in range(self.args.warmup * reps):
            last = op()
        torch.cuda.synchronize(self.dev)
        times = []
        cpu0 = time.process_time()
        for _ in range(self.args.samples):
            start.record()
            for _ in range(reps):
                last = op()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / reps)
        cpu = time.process_time() - cpu0
        return times, cpu, last

    def case(self, name, nbytes, op, *, check, notes="", events=False, reps=None):
        reps = reps or self.reps_for(nbytes)
        timer = self.time_events if events else self.time_host
        times, cpu, last = timer(op, reps)
        check(last)
        sec = statistics.median(times)
        moved = nbytes * reps * self.args.samples
        note = f"{reps} per sample" if reps > 1 else ""
        note = "; ".join(x for x in (notes, note, "events" if events else "host clock") if x)
        self.add(name, nbytes, sec * 1e3, nbytes / sec / GB, cpu / (moved / GB), note)

    def add(self, case, nbytes, median_ms, gbps, cpu_s_per_gb, notes):
        row = {
            "case": case,
            "size_bytes": nbytes,
            "median_ms": median_ms,
            "gbps": gbps,
            "cpu_s_per_gb": cpu_s_per_gb,
            "notes": notes,
        }
        self.rows.append(row)
        def num(v, width, prec):
            return f"{'-':>{width}s}" if v is None else f"{v:{width}.{prec}f}"

        print(f"{case:28s} {fmt_size(nbytes):>9s} {num(median_ms, 10, 3)} {num(gbps, 8, 2)} "
              f"{num(cpu_s_per_gb, 9, 4)}  {notes}", file=self.out, flush=True)


def expect(cond, what):
    if not cond:
        raise AssertionError(f"wrong data: {what}")


def run_sizes(r, base):
    """Cases a-e at each size. `base` is random pageable uint8 data of the largest size."""
    dev, cases = r.dev, r.args.cases
    for n in r.args.sizes:
        src = base[:n]
        pinned = src.pin_memory()
        ref = pinned.to(dev)  # the right device-side result
        torch.cuda.synchronize(dev)
        on_dev = lambda out: expect(torch.equal(out, ref), "device result")
        on_host = lambda out: expect(torch.equal(out, src), "host result")

        if "a" in cases:
            def a():
                out = src.to(dev)
                torch.cuda.synchronize(dev)
                return out
            r.case("h2d_pageable_to", n, a, check=on_dev, notes=".to('cuda')")
        if "b" in cases:
            def b():
                out = src.to(dev, non_blocking=True)
                torch.cuda.synchronize(dev)
                return out
            r.case("h2d_pageable_to_nonblocking", n, b, check=on_dev,
                   notes=".to('cuda', non_blocking=True) + sync")
        if "c" in cases:
            def c():
                out = src.pin_memory().to(dev, non_blocking=True)
                torch.cuda.synchronize(dev)
                return out
            r.case("h2d_pin_memory_then_to", n, c, check=on_dev,
                   notes="pin_memory() + .to(non_blocking=True) + sync; pinned block from the "
                         "caching host allocator after warm-up")
        if "d" in cases:
            d = torch.empty(n, dtype=torch.uint8, device=dev)

            def dd():
                d.copy_(pinned, non_blocking=True)
                return d
            r.case("h2d_pinned", n, dd, check=on_dev, events=True,
                   notes="pre-pinned copy_(non_blocking=True): link reference")
            d = None
        if "e" in cases:
            def e_to():
                return ref.to("cpu")
            r.case("d2h_pageable_to", n, e_to, check=on_host,
                   notes=".to('cpu') into fresh pageable memory (page faults included)")
            pageable_dst = torch.empty(n, dtype=torch.uint8)
            pageable_dst.fill_(0)  # touch every page before timing

            def e_copy():
                pageable_dst.copy_(ref)
                return pageable_dst
            r.case("d2h_pageable_prealloc", n, e_copy, check=on_host,
                   notes="copy_ into a preallocated, touched pageable tensor")
            pageable_dst = None

            def e_nb():
                out = ref.to("cpu", non_blocking=True)
                torch.cuda.synchronize(dev)
                return out
            kind = "pinned" if e_nb().is_pinned() else "pageable"
            r.case("d2h_to_nonblocking", n, e_nb, check=on_host,
                   notes=f".to('cpu', non_blocking=True) + sync (PyTorch's destination is {kind})")
            pinned_dst = torch.empty(n, dtype=torch.uint8).pin_memory()

            def e_pinned():
                pinned_dst.copy_(ref, non_blocking=True)
                return pinned_dst
            r.case("d2h_pinned", n, e_pinned, check=on_host, events=True,
                   notes="copy_(non_blocking=True) into pre-pinned memory: link reference")
            pinned_dst = None
        pinned = ref = None  # free before the next size
        torch.cuda.empty_cache()


def run_many(r, gen):
    """Case f: many small tensors."""
    args, dev = r.args, r.dev
    k = args.pin_threads
    tensors = [torch.rand(args.many_elems, generator=gen) for _ in range(args.many)]
    total = args.many * args.many_elems * 4
    ref = torch.stack(tensors).to(dev)
    check = lambda outs: expect(torch.equal(torch.stack(outs), ref), "many tensors")
    shape = f"{args.many} x {args.many_elems} float32"

    def blocking():
        outs = [t.to(dev) for t in tensors]
        torch.cuda.synchronize(dev)
        return outs
    r.case("many_to", total, blocking, check=check, reps=1, notes=f"{shape}, loop of .to('cuda')")

    def nonblocking():
        outs = [t.to(dev, non_blocking=True) for t in tensors]
        torch.cuda.synchronize(dev)
        return outs
    r.case("many_to_nonblocking", total, nonblocking, check=check, reps=1,
           notes=f"{shape}, loop of .to('cuda', non_blocking=True), one sync")

    with concurrent.futures.ThreadPoolExecutor(max_workers=k) as pool:
        def threadpin():
            pinned = list(pool.map(lambda t: t.pin_memory(), tensors))
            outs = [p.to(dev, non_blocking=True) for p in pinned]
            torch.cuda.synchronize(dev)
            return outs
        r.case(f"many_pin_threads{k}", total, threadpin, check=check, reps=1,
               notes=f"{shape}, pin_memory() on a pool of {k} threads (pool made once, untimed), "
                     "then non_blocking copies, one sync")

    prepinned = [t.pin_memory() for t in tensors]

    def from_pinned():
        outs = [p.to(dev, non_blocking=True) for p in prepinned]
        torch.cuda.synchronize(dev)
        return outs
    r.case("many_prepinned", total, from_pinned, check=check, reps=1,
           notes=f"{shape}, pre-pinned (untimed), non_blocking copies, one sync: per-copy overhead")
    prepinned = None

    try:
        import tensordict
        from tensordict import TensorDict
    except ImportError as e:
        r.add(f"many_tensordict{k}", total, None, None, None, f"tensordict not importable ({e})")
        return
    td = TensorDict({str(i): t for i, t in enumerate(tensors)}, batch_size=[])

    def tensordict_to():
        out = td.to(dev, non_blocking_pin=True, num_threads=k)
        torch.cuda.synchronize(dev)
        return [out[str(i)] for i in range(args.many)]
    r.case(f"many_tensordict{k}", total, tensordict_to, check=check, reps=1,
           notes=f"{shape}, TensorDict.to('cuda', non_blocking_pin=True, num_threads={k}) + sync "
                 f"(tensordict {getattr(tensordict, '__version__', '?')})")


def run_file(r):
    """Case g: a file range through a pageable or a pinned buffer, page cache warm."""
    args, dev = r.args, r.dev
    size = os.path.getsize(args.file)
    if args.file_offset >= size:
        raise SystemExit(f"--file-offset {args.file_offset} is past the end of {args.file} ({size} bytes)")
    n = min(args.file_bytes, size - args.file_offset)
    cut = "" if n == args.file_bytes else f"cut to the file's end ({n} bytes); "

    def view(t):
        return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")

    f = open(args.file, "rb", buffering=0)

    def read_into(mv):
        f.seek(args.file_offset)
        got = 0
        while got < n:
            k = f.readinto(mv[got:])
            if not k:
                raise EOFError(f"{args.file} ended after {got} of {n} bytes")
            got += k

    pageable = torch.empty(n, dtype=torch.uint8)
    pinned = torch.empty(n, dtype=torch.uint8).pin_memory()
    pageable_mv, pinned_mv = view(pageable), view(pinned)
    read_into(pageable_mv)  # warm the page cache
    expected = pageable.clone()
    ref = expected.to(dev)
    note = f"{cut}{args.file} at {args.file_offset}, warm page cache"

    def read_only():
        read_into(pageable_mv)
        return pageable
    r.case("file_read_pageable", n, read_only, check=lambda t: expect(torch.equal(t, expected), "file"),
           notes=f"readinto a pageable tensor only; {note}")

    def via_pageable():
        read_into(pageable_mv)
        out = pageable.to(dev)
        torch.cuda.synchronize(dev)
        return out
    r.case("file_pageable_to", n, via_pageable, check=lambda t: expect(torch.equal(t, ref), "file"),
           notes=f"readinto pageable, .to('cuda') + sync; {note}")

    def via_pinned():
        read_into(pinned_mv)
        out = pinned.to(dev, non_blocking=True)
        torch.cuda.synchronize(dev)
        return out
    r.case("file_pinned_to", n, via_pinned, check=lambda t: expect(torch.equal(t, ref), "file"),
           notes=f"readinto a pre-pinned buffer, .to('cuda', non_blocking=True) + sync; {note}")
    f.close()


def main(argv=None):
    args = parse_args(argv)
    if torch is None:
        raise SystemExit("PyTorch is not installed (pip install torch)")
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device visible to PyTorch")
    sync_note = set_sync_mode(args.sync, args.device)
    torch.cuda.set_device(args.device)
    out = sys.stderr if args.json == "-" else sys.stdout
    r = Runner(args, out)

    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"{torch.cuda.get_device_name(args.device)}, {os.cpu_count()} CPUs, {sync_note}; "
          f"median of {args.samples}, GB = 1e9 B", file=out)
    print(f"{'case':28s} {'size':>9s} {'median ms':>10s} {'GB/s':>8s} {'CPU s/GB':>9s}  notes",
          file=out, flush=True)

    gen = torch.Generator().manual_seed(1)
    if set(args.cases) & set("abcde"):
        base = torch.randint(1, 256, (max(args.sizes),), dtype=torch.uint8, generator=gen)
        run_sizes(r, base)
        del base
    if "f" in args.cases:
        run_many(r, gen)
    if "g" in args.cases:
        if args.file:
            run_file(r)
        else:
            print("(case g skipped: no --file)", file=out)

    if args.json == "-":
        json.dump(r.rows, sys.stdout, indent=1)
        print()
    elif args.json:
        with open(args.json, "w") as fh:
            json.dump(r.rows, fh, indent=1)
            fh.write("\n")


if __name__ == "__main__":
    main()
