"""torchvision v2's resized_crop on the GPU beside pinstream's fused kernel (benches/resize.rs).

Two parts, on the GPU machine after `.gpu/bench/resize --bench > resize.txt` (with
PINSTREAM_RESIZE_DUMP=dir for the first):

  --dump DIR   the kernel's f32 results for a 16-image batch (train boxes and the val transform,
               mean 0 / std 1) against torchvision on the same pixels and boxes, in float32:
               F.resized_crop(..., antialias=True) (+ horizontal_flip), and
               F.center_crop(F.resize(img, 256, antialias=True), 224). Prints the largest
               difference in input levels.
  --ours FILE  the bench's output: its RESIZE_JSON line gives pinstream's time per batch; the
               same batch shape is timed here with torchvision v2 on uint8 CUDA tensors:
               a per-sample loop (resized_crop, flip, stack, to_dtype + normalize), and the
               validation transform batched (one uniform 375 x 500 batch: resize, center_crop,
               normalize), the only form torchvision can batch. Medians of 10 after warm-up,
               wall clock with a synchronize.
"""

import argparse
import json
import time

import numpy as np
import torch
from torchvision.transforms.v2 import functional as F

MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]
SIZES = [(375, 500), (500, 375), (333, 500), (500, 333), (400, 400), (480, 640)]


def compare(dump):
    arena = np.fromfile(f"{dump}/arena.u8", dtype=np.uint8)
    boxes = json.load(open(f"{dump}/boxes.json"))
    n = len(boxes)
    worst = {}
    for mode in ("train", "val"):
        ours = np.fromfile(f"{dump}/{mode}.f32", dtype=np.float32).reshape(n, 3, 224, 224)
        w = 0.0
        for i, b in enumerate(boxes):
            h, wd, off = b["h"], b["w"], b["offset"]
            img = torch.from_numpy(arena[off:off + h * wd * 3].reshape(h, wd, 3).copy())
            img = img.permute(2, 0, 1).float().cuda()
            if mode == "train":
                t, l, bh, bw, flip = b["train"]
                ref = F.resized_crop(img, int(t), int(l), int(bh), int(bw), [224, 224],
                                     antialias=True)
                if flip:
                    ref = F.horizontal_flip(ref)
            else:
                ref = F.center_crop(F.resize(img, 256, antialias=True), 224)
            d = (ref.cpu().numpy() - ours[i]).__abs__().max()
            w = max(w, float(d))
        worst[mode] = w
        print(f"torchvision vs pinstream, {mode}: largest difference {w:.4f} levels "
              f"(0..255 scale, float32 both)")
    return worst


def median(v):
    v = sorted(v)
    return v[len(v) // 2]


def timed(fn, reps=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return median(out)


def bench(ours_file):
    ours = None
    for line in open(ours_file):
        if line.startswith("RESIZE_JSON "):
            ours = json.loads(line[len("RESIZE_JSON "):])
    n = ours["n"]
    g = torch.Generator().manual_seed(0)
    imgs = []
    for i in range(n):
        h, w = SIZES[(i * 7 + i // 3) % len(SIZES)]
        imgs.append(torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g).cuda())
    import random

    rnd = random.Random(0)
    params = []
    from torchvision.transforms import RandomResizedCrop

    for im in imgs:
        t, l, h, w = RandomResizedCrop.get_params(im, (0.08, 1.0), (3 / 4, 4 / 3))
        params.append((t, l, h, w, rnd.random() < 0.5))
    mean = torch.tensor(MEAN, device="cuda").view(1, 3, 1, 1)
    std = torch.tensor(STD, device="cuda").view(1, 3, 1, 1)

    def train_loop():
        outs = []
        for im, (t, l, h, w, flip) in zip(imgs, params):
            x = F.resized_crop(im, t, l, h, w, [224, 224], antialias=True)
            if flip:
                x = F.horizontal_flip(x)
            outs.append(x)
        b = torch.stack(outs)
        return F.normalize(F.to_dtype(b, torch.float32, scale=True), MEAN, STD)

    def val_loop():
        outs = [F.center_crop(F.resize(im, 256, antialias=True), 224) for im in imgs]
        b = torch.stack(outs)
        return F.normalize(F.to_dtype(b, torch.float32, scale=True), MEAN, STD)

    uniform = torch.randint(0, 256, (n, 3, 375, 500), dtype=torch.uint8, generator=g).cuda()

    def val_batched():
        x = F.center_crop(F.resize(uniform, 256, antialias=True), 224)
        return (x.float().div_(255) - mean) / std

    t_train = timed(train_loop)
    t_val = timed(val_loop)
    t_valb = timed(val_batched)
    rows = {(r["mode"], r["dtype"], r["layout"]): r["kernel_ms"] for r in ours["rows"]}
    p_train, p_val = rows[("train", "f32", "NCHW")], rows[("val", "f32", "NCHW")]
    print(f"\n{n} images -> 224 x 224 f32 NCHW normalized, {torch.cuda.get_device_name()}")
    print("| transform | torchvision v2 (GPU) ms | pinstream ms | pinstream x |")
    print("| --- | --- | --- | --- |")
    print(f"| train: RandomResizedCrop + flip, per-sample loop | {t_train * 1e3:.2f} | "
          f"{p_train:.3f} | {t_train * 1e3 / p_train:.0f} |")
    print(f"| val: Resize(256) + CenterCrop(224), per-sample loop | {t_val * 1e3:.2f} | "
          f"{p_val:.3f} | {t_val * 1e3 / p_val:.0f} |")
    print(f"| val, batched (one uniform 375 x 500 batch) | {t_valb * 1e3:.2f} | "
          f"{p_val:.3f} | {t_valb * 1e3 / p_val:.1f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dump")
    ap.add_argument("--ours")
    a = ap.parse_args()
    if a.dump:
        compare(a.dump)
    if a.ours:
        bench(a.ours)


if __name__ == "__main__":
    main()
