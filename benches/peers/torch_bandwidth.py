"""PyTorch peer for `pinstream bandwidth`: pinned copy_(non_blocking=True) at 256 MiB, H2D, D2H and
both directions at once on two streams (the same definitions as pinstream's bidir-h2d, -d2h,
-sum and -pair); CUDA events, warm-up, median of 9 samples of >= 20 ms.

Run on the GPU machine: python3 benches/peers/torch_bandwidth.py
"""
import statistics

import torch

N = 256 << 20
REPS = 8  # 8 x 256 MiB at ~55 GB/s = ~39 ms per sample
SAMPLES = 9


def main():
    src = torch.randint(1, 256, (N,), dtype=torch.uint8).pin_memory()
    dst = torch.empty(N, dtype=torch.uint8).pin_memory()
    d_a = torch.empty(N, dtype=torch.uint8, device="cuda")
    d_b = src.to("cuda")
    up, down = torch.cuda.Stream(), torch.cuda.Stream()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]

    def h2d():
        d_a.copy_(src, non_blocking=True)

    def d2h():
        dst.copy_(d_b, non_blocking=True)

    def one(fn, stream):
        out = []
        for i in range(SAMPLES + 2):
            with torch.cuda.stream(stream):
                ev[0].record()
                for _ in range(REPS):
                    fn()
                ev[1].record()
            ev[1].synchronize()
            if i >= 2:
                out.append(N * REPS / (ev[0].elapsed_time(ev[1]) / 1e3) / 1e9)
        return statistics.median(out)

    ev2 = [torch.cuda.Event(enable_timing=True) for _ in range(2)]

    def bidir(extra):
        """Both directions released by one event. With `extra` > 0 each stream keeps copying
        after its timed copies (as pinstream does), so each rate is taken under load; with 0,
        the pair time runs to the later end. Returns medians of (h2d, d2h, h2d+d2h, pair)."""
        ups, downs, sums, pairs = [], [], [], []
        for i in range(SAMPLES + 2):
            torch.cuda.synchronize()
            with torch.cuda.stream(up):
                torch.cuda._sleep(2_000_000)  # hold both streams while the copies are queued
                ev[0].record()
            down.wait_event(ev[0])
            with torch.cuda.stream(up):
                for _ in range(REPS):
                    h2d()
                ev[1].record()
                for _ in range(extra):
                    h2d()
                ev2[0].record()
            with torch.cuda.stream(down):
                for _ in range(REPS):
                    d2h()
                ev[3].record()
                for _ in range(extra):
                    d2h()
                ev2[1].record()
            torch.cuda.synchronize()
            if i >= 2:
                t_up = ev[0].elapsed_time(ev[1]) / 1e3
                t_down = ev[0].elapsed_time(ev[3]) / 1e3
                ups.append(N * REPS / t_up / 1e9)
                downs.append(N * REPS / t_down / 1e9)
                sums.append(ups[-1] + downs[-1])
                pairs.append(2 * N * REPS / max(t_up, t_down) / 1e9)
        m = statistics.median
        return m(ups), m(downs), m(sums), m(pairs)

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, 256 MiB pinned, copy_(non_blocking=True)")
    print(f"torch h2d        {one(h2d, up):6.2f} GB/s")
    print(f"torch d2h        {one(d2h, down):6.2f} GB/s")
    u, d, s, _ = bidir(REPS // 2)
    print(f"torch bidir h2d  {u:6.2f} GB/s, d2h {d:6.2f} GB/s, sum {s:6.2f} GB/s (each under load)")
    _, _, _, p = bidir(0)
    print(f"torch bidir pair {p:6.2f} GB/s (2 x bytes until both are done)")
    assert torch.equal(dst, src)


if __name__ == "__main__":
    main()
