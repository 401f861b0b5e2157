"""Peer for benches/handoff.rs: PyTorch's own hand-off costs on the same GPU, median µs per call
over 2 000 calls after 200 warm-up: `torch.from_dlpack(x)` of a CUDA tensor (its own producer,
the stream handshake included), a CuPy array's `__dlpack__` taken by torch, and
`Tensor.record_stream`. Run: python3 benches/peers/torch_handoff.py"""
import statistics
import time

import torch


def med(f, n=2000, warm=200):
    for _ in range(warm):
        f()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        out.append((time.perf_counter() - t) * 1e6)
    return statistics.median(out)


x = torch.randn(8, 3, 32, 32, device="cuda")
s = torch.cuda.Stream()
print(f"torch {torch.__version__}, {torch.cuda.get_device_name()} (median µs per call)")
print(f"  torch.from_dlpack(cuda tensor) + release        {med(lambda: torch.from_dlpack(x)):8.2f}")
print(f"  Tensor.record_stream(s)                          {med(lambda: x.record_stream(s)):8.2f}")
try:
    import cupy

    a = cupy.random.rand(8, 3, 32, 32, dtype=cupy.float32)
    print(f"  torch.from_dlpack(cupy array) + release         {med(lambda: torch.from_dlpack(a)):8.2f}")
except Exception as e:  # noqa: BLE001
    print(f"  cupy: {e}")
