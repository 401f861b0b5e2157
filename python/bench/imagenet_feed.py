"""ImageNet-style input pipelines on the same JPEG files, at the same thread count.

    python3 imagenet_feed.py make DIR [--images 5000]   # JPEGs cut from the shared photographs
    python3 imagenet_feed.py torch DIR --workers N      # (b) and (c) below, one epoch each

(b) torchvision ImageFolder + DataLoader(num_workers=N, pin_memory=True) with CPU
    RandomResizedCrop(224) + RandomHorizontalFlip + ToTensor + Normalize, through APEX's
    data_prefetcher (its side-stream copy, as in apex/examples/imagenet/main_amp.py).
(c) the same DataLoader decoding only (uint8 tensors of each image's own size), then on the GPU
    torchvision v2 resized_crop + flip per sample, stack, to_dtype + normalize.

(a), pinstream, is `examples/imagenet_feed DIR --threads N --json`, run beside this.

Each pipeline runs 2 epochs of batch 256 and reports the second (the first warms the page
cache, the workers' imports and cuDNN/torch's allocator): images/s and CPU seconds per image
(this process plus its worker processes, from os.times() after the workers are joined). The
consumer synchronizes on each batch (standing for a training step that waits for its input).
Prints one FEED_JSON line per pipeline.
"""

import argparse
import json
import os
import random
import sys
import time

SIZES = [(500, 375), (375, 500), (500, 333), (333, 500), (500, 400), (400, 500), (500, 500),
         (640, 480), (480, 640)]  # (width, height), ImageNet's common shapes


def make(root, n, classes=100, seed=0):
    from PIL import Image
    here = os.path.dirname(os.path.abspath(__file__))
    shared = None
    for c in [os.environ.get("PINSTREAM_SHARED_IMAGES", ""),
              os.path.join(here, "../../../shared/data/images"), "../shared/data/images",
              "shared/data/images"]:
        if os.path.isdir(c):
            shared = c
            break
    if shared is None:
        sys.exit("no shared/data/images")
    photos = [Image.open(os.path.join(shared, f)).convert("RGB")
              for f in sorted(os.listdir(shared)) if f.endswith((".png", ".jpg"))]
    rnd = random.Random(seed)
    for c in range(classes):
        os.makedirs(os.path.join(root, f"c{c:03d}"), exist_ok=True)
    for i in range(n):
        p = photos[rnd.randrange(len(photos))]
        W, H = p.size
        # A random crop (30..100 % of each side), mirrored half the time, scaled to a common
        # ImageNet size, saved at quality 90.
        cw, ch = int(W * rnd.uniform(0.3, 1.0)), int(H * rnd.uniform(0.3, 1.0))
        x, y = rnd.randrange(W - cw + 1), rnd.randrange(H - ch + 1)
        img = p.crop((x, y, x + cw, y + ch))
        if rnd.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        img = img.resize(SIZES[rnd.randrange(len(SIZES))], Image.BILINEAR)
        img.save(os.path.join(root, f"c{i % classes:03d}", f"{i:06d}.jpg"), quality=90)
    print(f"made {n} JPEGs in {classes} classes under {root}")


class DataPrefetcher:
    """APEX's data_prefetcher (examples/imagenet/main_amp.py): the next batch copied on a side
    stream, normalized there, record_stream for the consumer."""

    def __init__(self, loader, normalize_on_gpu):
        import torch
        self.loader = iter(loader)
        self.stream = torch.cuda.Stream()
        self.normalize_on_gpu = normalize_on_gpu
        self.preload()

    def preload(self):
        import torch
        try:
            self.next_input, self.next_target = next(self.loader)
        except StopIteration:
            self.next_input = None
            return
        with torch.cuda.stream(self.stream):
            self.next_input = self.next_input.cuda(non_blocking=True)
            self.next_target = self.next_target.cuda(non_blocking=True)

    def next(self):
        import torch
        torch.cuda.current_stream().wait_stream(self.stream)
        x, y = self.next_input, self.next_target
        if x is not None:
            x.record_stream(torch.cuda.current_stream())
            y.record_stream(torch.cuda.current_stream())
        self.preload()
        return x, y


def cpu_total():
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def run_epochs(make_iter, epochs=2):
    import torch
    out = None
    for e in range(epochs):
        c0, t0 = cpu_total(), time.perf_counter()
        n = 0
        for x, y in make_iter():
            torch.cuda.current_stream().synchronize()
            n += y.shape[0] if hasattr(y, "shape") else len(y)
        dt = time.perf_counter() - t0
        out = (n, dt, cpu_total() - c0)
    return out


def torch_pipelines(root, workers, batch):
    import torch
    import torchvision
    from torchvision import transforms as T
    from torchvision.transforms.v2 import functional as F
    from torchvision.io import decode_image, read_file, ImageReadMode

    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    results = {}

    # (b) CPU augmentation + APEX prefetcher.
    tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize(mean, std)])
    ds = torchvision.datasets.ImageFolder(root, tf)

    def iter_b():
        loader = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True,
                                             num_workers=workers, pin_memory=True)
        pf = DataPrefetcher(loader, False)
        x, y = pf.next()
        while x is not None:
            yield x, y
            x, y = pf.next()

    n, dt, cpu = run_epochs(iter_b)
    results["torchvision_cpu_apex"] = (n, dt, cpu)

    # (c) decode only in the workers, v2 resized_crop on the GPU per sample.
    def load_u8(path):
        return decode_image(read_file(path), mode=ImageReadMode.RGB)

    ds_c = torchvision.datasets.ImageFolder(root, loader=load_u8)
    g = torch.Generator().manual_seed(0)

    def collate(items):
        return [x for x, _ in items], torch.tensor([y for _, y in items])

    def iter_c():
        loader = torch.utils.data.DataLoader(ds_c, batch_size=batch, shuffle=True,
                                             num_workers=workers, pin_memory=True,
                                             collate_fn=collate)
        for imgs, y in loader:
            outs = []
            for im in imgs:
                im = im.cuda(non_blocking=True)
                t, l, h, w = T.RandomResizedCrop.get_params(im, (0.08, 1.0), (3 / 4, 4 / 3))
                o = F.resized_crop(im, t, l, h, w, [224, 224], antialias=True)
                if torch.rand(1, generator=g).item() < 0.5:
                    o = F.horizontal_flip(o)
                outs.append(o)
            x = F.normalize(F.to_dtype(torch.stack(outs), torch.float32, scale=True), mean, std)
            yield x, y.cuda(non_blocking=True)

    n, dt, cpu = run_epochs(iter_c)
    results["torchvision_decode_v2_gpu"] = (n, dt, cpu)
    for k, (n, dt, cpu) in results.items():
        print(f"FEED_JSON " + json.dumps({"pipeline": k, "images": n, "secs": round(dt, 4),
                                         "cpu": round(cpu, 4), "threads": workers}))
        print(f"{k}: {n} images in {dt:.2f} s = {n / dt:.0f} images/s, "
              f"{cpu / n * 1e3:.2f} CPU ms per image", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["make", "torch"])
    ap.add_argument("root")
    ap.add_argument("--images", type=int, default=5000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=256)
    a = ap.parse_args()
    if a.what == "make":
        make(a.root, a.images)
    else:
        torch_pipelines(a.root, a.workers, a.batch)


if __name__ == "__main__":
    main()
