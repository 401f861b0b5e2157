"""Peer figures for benches/memcpy.rs: PyTorch copies of the same 64 MiB, measured the same way
(pinned: CUDA events around a batch of copies, median of samples; pageable: host clock).

Run on the GPU machine next to `.gpu/bench/memcpy --bench`:  python3 benches/peers/torch_memcpy.py
"""
import statistics
import time

import torch

N = 64 << 20
SAMPLES = 20
REPS = 20


def gpu_time(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(SAMPLES):
        start.record()
        for _ in range(REPS):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3 / REPS)
    return statistics.median(out)


def host_time(fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(SAMPLES):
        t = time.perf_counter()
        for _ in range(REPS // 4):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) / (REPS // 4))
    return statistics.median(out)


def main():
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(1, 256, (N,), dtype=torch.uint8, generator=gen)
    pinned = data.pin_memory()
    pinned_dst = torch.empty(N, dtype=torch.uint8).pin_memory()
    pageable_dst = torch.empty(N, dtype=torch.uint8)
    d = torch.empty(N, dtype=torch.uint8, device="cuda")
    rows = [
        ("h2d_pinned", gpu_time(lambda: d.copy_(pinned, non_blocking=True))),
        ("d2h_pinned", gpu_time(lambda: pinned_dst.copy_(d, non_blocking=True))),
        ("h2d_pageable", host_time(lambda: d.copy_(data))),
        ("d2h_pageable", host_time(lambda: pageable_dst.copy_(d))),
    ]
    assert torch.equal(pinned_dst, data) and torch.equal(pageable_dst, data)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for name, sec in rows:
        print(f"torch {name:14s} {sec * 1e3:8.4f} ms  {N / sec / 1e9:6.2f} GB/s")
    # Small pageable host-to-device copies, each followed by a synchronize (benches/memcpy.rs
    # group pageable_h2d_small).
    for n in (4 << 10, 64 << 10, 1 << 20):
        src = data[:n].clone()
        dst = torch.empty(n, dtype=torch.uint8, device="cuda")

        def one():
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()

        for _ in range(50):
            one()
        out = []
        for _ in range(SAMPLES):
            t = time.perf_counter()
            for _ in range(100):
                one()
            out.append((time.perf_counter() - t) / 100)
        assert torch.equal(dst.cpu(), src)
        sec = statistics.median(out)
        print(f"torch pageable_h2d_small {n >> 10:5d} KiB {sec * 1e6:8.2f} us")


if __name__ == "__main__":
    main()
