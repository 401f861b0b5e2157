"""Where the host's time goes when a training loop takes batches from pinstream.torch.image_feed:
what one `next()` costs, split into its parts, and how fast the host launches kernels while the
feed's threads run.

    python3 feed_host.py --root DIR [--threads 4] [--batches 60] [--batch 256]

Parts, each timed per batch with perf_counter (median, 90th percentile and largest, in ms):
  native_next   the binding's next(): wait until ready, take the batch, hand it out
  from_dlpack   the two torch.from_dlpack calls
  release       dropping the previous batch's tensors (DLPack deleters)
with the consumer sleeping `--gap-ms` between batches (the GPU idle: every batch ready), and
with a GPU kept busy by matmuls for the same gap and a host sync before each next() (as
GradScaler's step syncs). Then the launch rate: `--launches` tiny kernels queued behind a long
one, host time per launch (next() left out), with the feed taking a batch every `--every` launches,
and without a feed.
One JSON line (FEED_HOST_JSON) on stdout.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def summary(xs):
    xs = sorted(xs)
    return {"median_ms": round(statistics.median(xs) * 1e3, 4),
            "p90_ms": round(xs[int(0.9 * (len(xs) - 1))] * 1e3, 4),
            "max_ms": round(xs[-1] * 1e3, 4), "n": len(xs)}


def context_sched(want):
    """The primary context's scheduling flag through the driver API (ctypes on libcuda): set to
    `want` where given, then read back."""
    import ctypes
    cu = ctypes.CDLL("libcuda.so.1")
    flags = {"auto": 0, "spin": 1, "yield": 2, "blocking": 4}
    ctx = ctypes.c_void_p()
    if want:
        dev = ctypes.c_int()
        assert cu.cuCtxGetDevice(ctypes.byref(dev)) == 0
        rc = cu.cuCtxSetFlags(ctypes.c_uint(flags[want]))
        if rc != 0:
            rc2 = cu.cuDevicePrimaryCtxSetFlags(dev, ctypes.c_uint(flags[want]))
            print(f"cuCtxSetFlags: {rc}, cuDevicePrimaryCtxSetFlags: {rc2}", file=sys.stderr)
    got = ctypes.c_uint()
    cu.cuCtxGetFlags(ctypes.byref(got))
    return {v: k for k, v in flags.items()}.get(got.value & 7, got.value)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--gap-ms", type=float, default=40.0)
    ap.add_argument("--launches", type=int, default=6000)
    ap.add_argument("--decode", default="auto")
    ap.add_argument("--decodes-at-once", type=int, default=0)
    ap.add_argument("--launch-only", action="store_true", help="only the launch-rate part")
    ap.add_argument("--every", type=int, default=600, help="launches per batch taken in the launch-rate part")
    ap.add_argument("--sched", default="", help="set the primary context's scheduling flag first: spin, yield, blocking")
    a = ap.parse_args()
    import torch

    import pinstream.torch as pt

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    sched = context_sched(a.sched)

    out = {"device": torch.cuda.get_device_name(), "threads": a.threads, "batch": a.batch,
           "decode": a.decode, "decodes_at_once": a.decodes_at_once, "sched": sched}

    def feed():
        return pt.image_feed(a.root, a.batch, threads=a.threads, layout="NHWC",
                             dtype=torch.float16, rank=0, world_size=1, drop_last=True,
                             decode=a.decode, decodes_at_once=a.decodes_at_once)

    big = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)

    for mode in () if a.launch_only else ("idle_gpu", "busy_gpu"):
        f = feed()
        native = f._live()
        parts = {"native_next": [], "from_dlpack": [], "release": []}
        held = None
        taken = 0
        while taken < a.batches + 10:
            if mode == "idle_gpu":
                time.sleep(a.gap_ms / 1e3)
            else:
                t = time.perf_counter()
                while (time.perf_counter() - t) * 1e3 < a.gap_ms:
                    big @ big
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            got = native.next()
            t1 = time.perf_counter()
            if got is None:
                continue
            x, y = torch.from_dlpack(got[0]), torch.from_dlpack(got[1])
            t2 = time.perf_counter()
            del got
            held_old, held = held, (x, y)
            del x, y
            t3 = time.perf_counter()
            del held_old
            t4 = time.perf_counter()
            taken += 1
            if taken > 10:
                parts["native_next"].append(t1 - t0)
                parts["from_dlpack"].append(t2 - t1)
                parts["release"].append(t4 - t3)
        del held
        f.close()
        out[mode] = {k: summary(v) for k, v in parts.items()}
        print(mode, json.dumps(out[mode]), file=sys.stderr, flush=True)

    # Launch rate: tiny kernels queued behind a long one (the GPU never catches up), host time
    # per launch, with and without the feed's threads working.
    small = torch.zeros(16, device="cuda")

    def os_counts():
        # TLB shootdowns (IPIs, all CPUs), this process's minor faults, this thread's
        # involuntary context switches.
        tlb = 0
        try:
            for line in open("/proc/interrupts"):
                if line.strip().startswith("TLB:"):
                    tlb = sum(int(v) for v in line.split()[1:] if v.isdigit())
        except OSError:
            pass
        import resource
        ru = resource.getrusage(resource.RUSAGE_SELF)
        rt = resource.getrusage(resource.RUSAGE_THREAD)
        return {"tlb_shootdowns": tlb, "minor_faults": ru.ru_minflt, "main_thread_invol_switches": rt.ru_nivcsw}

    def launches(f):
        c0 = os_counts()
        per, nexts = [], []
        def endless():
            while True:
                yield from f

        it = endless() if f is not None else None
        for rep in range(5):
            torch.cuda.synchronize()
            for _ in range(40):
                big @ big
            t, in_next = time.perf_counter(), 0.0
            for i in range(a.launches):
                small.add_(1.0)
                if it is not None and i % a.every == 0:
                    t1 = time.perf_counter()
                    next(it)
                    in_next += time.perf_counter() - t1
            # The launches alone: the time in next() left out.
            per.append((time.perf_counter() - t - in_next) / a.launches)
            nexts.append(in_next)
        torch.cuda.synchronize()
        c1 = os_counts()
        return {"us": round(statistics.median(per) * 1e6, 3),
                "next_ms_per_rep": round(statistics.median(nexts) * 1e3, 3),
                **{k: c1[k] - c0[k] for k in c0}}

    out["launch_us_no_feed"] = launches(None)
    f = feed()
    print("PHASE with_feed", file=sys.stderr, flush=True)
    out["launch_us_with_feed"] = launches(f)
    f.close()
    out["launch_us_no_feed_again"] = launches(None)
    print("FEED_HOST_JSON " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
