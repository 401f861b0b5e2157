"""PyTorch peers for benches/normalize.rs: (x.float() - mean) / std on 256x3x224x224 uint8, eager
and torch.compile, f32 / f16 / bf16 output, NCHW input and NHWC (channels-last) input producing a
contiguous NCHW output. CUDA events, median of 20 samples of 20 calls. Also a d2d copy of the
same bytes, as in the pinstream bench.

Run on the GPU machine: python3 benches/peers/torch_normalize.py
"""
import statistics

import torch

N, C, H, W = 256, 3, 224, 224
MEAN = torch.tensor([0.485, 0.456, 0.406], device="cuda").view(1, 3, 1, 1) * 255
STD = torch.tensor([0.229, 0.224, 0.225], device="cuda").view(1, 3, 1, 1) * 255


def timed(fn, reps=20, samples=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(samples):
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / reps)
    return statistics.median(out)


def f32(x):
    return (x.float() - MEAN) / STD


def f16(x):
    return ((x.float() - MEAN) / STD).half()


def bf16(x):
    return ((x.float() - MEAN) / STD).bfloat16()


def from_nhwc(x):  # x: N,H,W,C uint8 -> contiguous NCHW float
    return ((x.permute(0, 3, 1, 2).float() - MEAN) / STD).contiguous()


def from_nhwc_f16(x):
    return ((x.permute(0, 3, 1, 2).float() - MEAN) / STD).half().contiguous()


def main():
    x = torch.randint(0, 256, (N, C, H, W), dtype=torch.uint8, device="cuda")
    xh = torch.randint(0, 256, (N, H, W, C), dtype=torch.uint8, device="cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {N}x{C}x{H}x{W} u8, ms per call (median)")
    for name, fn, inp, bpe in [
        ("nchw_to_nchw_f32", f32, x, 5),
        ("nchw_to_nchw_f16", f16, x, 3),
        ("nchw_to_nchw_bf16", bf16, x, 3),
        ("nhwc_to_nchw_f32", from_nhwc, xh, 5),
        ("nhwc_to_nchw_f16", from_nhwc_f16, xh, 3),
    ]:
        eager = timed(lambda: fn(inp))
        comp = torch.compile(fn)
        ref = fn(inp)
        assert torch.allclose(comp(inp).float(), ref.float(), atol=1e-2)
        compiled = timed(lambda: comp(inp))
        n = N * C * H * W
        src = torch.empty(n * bpe // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        copy = timed(lambda: dst.copy_(src))
        print(f"  {name:<20} eager {eager:.4f} ms  torch.compile {compiled:.4f} ms  "
              f"({n * bpe / compiled / 1e6:.1f} GB/s)  d2d copy of the same bytes {copy:.4f} ms")


if __name__ == "__main__":
    main()
