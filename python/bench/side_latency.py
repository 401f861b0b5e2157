"""Diagnostic: how long a small piece of GPU work on another stream takes to come back while a
training step keeps the GPU busy, by the kind of work and the stream's priority.

    python3 side_latency.py [--model resnet18] [--graph] [--steps 40]

nvJPEG's hardware backend makes about five CUDA calls per image (a bitstream copy, a colour
conversion kernel, an event record, its synchronize, a query), each waited for on the host
(BENCHMARKS.md, 2026-11-27). Here one side thread does the same round trip in a loop, a small
kernel or a 100 kB pinned copy, then an event record and its synchronize, on a stream of the
least or the greatest priority, beside the step; the step's time is reported too. One JSON line
per configuration (SIDE_JSON)."""

import argparse
import json
import os
import statistics
import sys
import threading
import time

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # pinstream's import default
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--graph", action="store_true")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=256)
    a = ap.parse_args()
    import torch
    import torchvision

    from train_feed import make_model

    torch.backends.cudnn.benchmark = True
    x = torch.randn(a.batch, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (a.batch,), device="cuda")
    step = make_model(a.model, torch, torchvision, (x, y) if a.graph else None)
    for _ in range(10):
        step(x, y)
    torch.cuda.synchronize()
    least, greatest = torch.cuda.Stream.priority_range() if hasattr(torch.cuda.Stream, "priority_range") else (0, -1)

    def side(kind, prio, stop, out):
        s = torch.cuda.Stream(priority=prio)
        small = torch.ones(4096, device="cuda")
        host = torch.empty(100_000, dtype=torch.uint8).pin_memory()
        dev = torch.empty(100_000, dtype=torch.uint8, device="cuda")
        ev = torch.cuda.Event()
        while not stop.is_set():
            t = time.perf_counter()
            with torch.cuda.stream(s):
                if kind == "kernel":
                    small.add_(1)
                else:
                    dev.copy_(host, non_blocking=True)
                ev.record(s)
            ev.synchronize()
            out.append(time.perf_counter() - t)

    def measure(kind, prio, with_step=True):
        stop, out = threading.Event(), []
        th = None
        if kind:
            th = threading.Thread(target=side, args=(kind, prio, stop, out), daemon=True)
            th.start()
        time.sleep(0.05)
        torch.cuda.synchronize()
        times = []
        if with_step:
            for _ in range(a.steps):
                t = time.perf_counter()
                step(x, y)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
        else:
            time.sleep(0.5)
        stop.set()
        if th:
            th.join()
        lat = sorted(out[5:]) or [float("nan")]
        r = {"model": a.model, "graph": a.graph, "side": kind, "priority": prio, "with_step": with_step,
             "step_ms": round(statistics.median(times) * 1e3, 3) if times else None,
             "side_us_median": round(lat[len(lat) // 2] * 1e6, 1),
             "side_us_p90": round(lat[int(len(lat) * 0.9)] * 1e6, 1), "side_rounds": len(out)}
        print("SIDE_JSON " + json.dumps(r), flush=True)

    measure(None, 0)
    for kind in ("kernel", "copy"):
        measure(kind, least, with_step=False)
        measure(kind, least)
        measure(kind, greatest)
    measure(None, 0)


if __name__ == "__main__":
    main()
