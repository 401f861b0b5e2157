"""Diagnostic: what one `next()` of `pinstream.torch.prefetch` costs the training thread, part by
part, with the batch already there (a sleep before each): the native `next`, `__dlpack__` per
tensor, torch's `_from_dlpack`, `torch.cuda.current_stream`, and `torch.from_dlpack` whole.

    python3 next_cost.py [--n 200]
"""

import argparse
import statistics
import time

import numpy as np
import torch

import pinstream
import pinstream.torch as pt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    a = ap.parse_args()
    rng = np.random.default_rng()
    data = [(rng.integers(0, 256, (256, 3, 224, 224), dtype=np.uint8), np.arange(256, dtype=np.int64))
            for _ in range(2)]

    def gen():
        for i in range(a.n + 10):
            yield data[i % 2]

    p = pinstream.prefetch(gen(), normalize=pinstream.IMAGENET, dtype="float16", layout="nhwc")
    parts = {k: [] for k in ("native_next", "current_stream", "dlpack_px", "from_capsule_px",
                             "dlpack_lb", "from_capsule_lb", "torch_from_dlpack_both",
                             "pinstream_handed_both")}
    keep = []
    for i in range(a.n):
        time.sleep(0.02)
        t0 = time.perf_counter()
        px, lb = next(p)
        t1 = time.perf_counter()
        if i % 3 == 2:
            streams = {}
            x, y = pt._handed(px, streams), pt._handed(lb, streams)
            parts["pinstream_handed_both"].append(time.perf_counter() - t1)
        elif i % 3 == 1:
            s = torch.cuda.current_stream(0)
            ptr = 1 if s.cuda_stream == 0 else s.cuda_stream
            t2 = time.perf_counter()
            c = px.__dlpack__(stream=ptr, max_version=(1, 0))
            t3 = time.perf_counter()
            x = torch.utils.dlpack.from_dlpack(c)
            t4 = time.perf_counter()
            c = lb.__dlpack__(stream=ptr, max_version=(1, 0))
            t5 = time.perf_counter()
            y = torch.utils.dlpack.from_dlpack(c)
            t6 = time.perf_counter()
            parts["current_stream"].append(t2 - t1)
            parts["dlpack_px"].append(t3 - t2)
            parts["from_capsule_px"].append(t4 - t3)
            parts["dlpack_lb"].append(t5 - t4)
            parts["from_capsule_lb"].append(t6 - t5)
        else:
            x, y = torch.from_dlpack(px), torch.from_dlpack(lb)
            parts["torch_from_dlpack_both"].append(time.perf_counter() - t1)
        parts["native_next"].append(t1 - t0)
        keep.append((x, y))
        if len(keep) > 2:
            keep.pop(0)
        torch.cuda.synchronize()
    p.close()
    for k, v in parts.items():
        if v:
            print(f"NEXT_COST {k:<24} median {statistics.median(v) * 1e6:8.1f} us  p90 {sorted(v)[int(len(v) * 0.9)] * 1e6:8.1f}")


if __name__ == "__main__":
    main()
