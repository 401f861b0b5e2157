"""GPU-decoding peers of pinstream's image feed, on the JPEG set of imagenet_feed.py.

    python3 decode_peers.py make --root DIR [--n 5000]            # the JPEG set (imagenet_feed.make)
    python3 decode_peers.py dali --root DIR --threads N [--hw-load 0.65]
    python3 decode_peers.py tv_gpu --root DIR --threads N
    python3 decode_peers.py check --root DIR --threads N [--pipeline dali|tv_gpu|all]
    common: [--batch 256] [--epochs 2] [--size 224] [--device 0]

dali    NVIDIA DALI: readers.file (shuffled) -> decoders.image_random_crop on "mixed" (nvJPEG,
        hw_decoder_load of the batch on the hardware decoder; --hw-load 0: none) -> resize to
        size x size (antialias) -> crop_mirror_normalize (random flip, float CHW). Driven by the
        plain Pipeline.run(); each batch is copied into a torch tensor on torch's current stream
        (ordered after DALI's work) and that stream is synchronized.
tv_gpu  torchvision: a pool of N threads reads the files' bytes (one batch ahead), decode_jpeg of
        the whole batch on the GPU, then per sample v2 RandomResizedCrop(antialias) +
        RandomHorizontalFlip, stack, float, normalize; the device is synchronized per batch.

Both give NCHW float32 (x / 255 - mean) / std on the GPU and int labels there, and run as an
endless stream: an epoch is ceil(files / batch) batches of `batch` images (the order wraps into
the next pass like DALI's reader). --epochs epochs run; the last is reported as ONE JSON line on
stdout: images/s (wall clock from the epoch's first batch request to its last batch complete on
the GPU), CPU ms per image (this process, all threads, same interval), and the latency of each
batch request (request -> pixels complete on the GPU): p50, p99, max. "steady" holds the same
figures over every epoch but the first (the warm-up). Progress goes to stderr.
`check` takes one batch of each pipeline and checks its shape, dtype, device and values.
"""

import argparse
import json
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from imagenet_feed import cpu_total, make  # noqa: E402  (same folder)

MEAN = [0.485, 0.456, 0.406]
STD = [0.229, 0.224, 0.225]


def list_files(root):
    """(path, label) for root/<class>/<image>.jpg, labels by sorted class name (as DALI's
    readers.file and torchvision's ImageFolder assign them)."""
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    return [(os.path.join(root, c, f), i) for i, c in enumerate(classes)
            for f in sorted(os.listdir(os.path.join(root, c)))
            if f.lower().endswith((".jpg", ".jpeg"))]


def dali_feed(a, files):
    """A function giving the next (images, labels) batch, complete on the GPU."""
    import torch
    from nvidia.dali import Pipeline, fn, types
    from nvidia.dali.plugin.pytorch import feed_ndarray

    # Plain Pipeline.run() rather than DALIGenericIterator: the reader runs on across epochs
    # and we take exactly ceil(files / batch) batches per epoch ourselves.
    pipe = Pipeline(batch_size=a.batch, num_threads=a.threads, device_id=a.device,
                    prefetch_queue_depth=2)
    with pipe:
        jpegs, labels = fn.readers.file(file_root=a.root, random_shuffle=True, name="Reader")
        images = fn.decoders.image_random_crop(
            jpegs, device="mixed", output_type=types.RGB, hw_decoder_load=a.hw_load,
            random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3])
        images = fn.resize(images, resize_x=a.size, resize_y=a.size)
        images = fn.crop_mirror_normalize(
            images, dtype=types.FLOAT, output_layout="CHW", crop=(a.size, a.size),
            mean=[m * 255 for m in MEAN], std=[s * 255 for s in STD],
            mirror=fn.random.coin_flip())
        pipe.set_outputs(images, labels.gpu())
    pipe.build()
    dev = torch.device("cuda", a.device)

    def next_batch():
        out = []
        for tl, dtype in zip(pipe.run(), (torch.float32, torch.int32)):
            t = tl.as_tensor()  # the batch as one dense GPU tensor (DALI's memory)
            buf = torch.empty(t.shape(), dtype=dtype, device=dev)
            # The copy is queued on torch's stream after DALI's ready event for this batch, so
            # synchronizing that stream means the pixels are in `buf`. (A device-wide
            # synchronize would also wait for DALI's prefetch of the next batches.)
            feed_ndarray(t, buf, cuda_stream=torch.cuda.current_stream(dev))
            out.append(buf)
        torch.cuda.current_stream(dev).synchronize()
        return out[0], out[1].view(-1)

    return next_batch


def tv_feed(a, files):
    """A function giving the next (images, labels) batch, complete on the GPU."""
    from concurrent.futures import ThreadPoolExecutor
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg, read_file
    from torchvision.transforms import v2
    from torchvision.transforms.v2 import functional as F

    dev = torch.device("cuda", a.device)
    pool = ThreadPoolExecutor(a.threads)
    aug = v2.Compose([v2.RandomResizedCrop(a.size, antialias=True), v2.RandomHorizontalFlip()])
    mean255, std255 = [m * 255 for m in MEAN], [s * 255 for s in STD]

    def stream():  # endless shuffled passes over the files
        order = list(files)
        while True:
            random.shuffle(order)
            yield from order

    paths = stream()

    def submit():  # read one batch's bytes in the pool: (futures of uint8 tensors, labels)
        items = [next(paths) for _ in range(a.batch)]
        return [pool.submit(read_file, p) for p, _ in items], [y for _, y in items]

    pending = submit()

    def next_batch():
        nonlocal pending
        (futures, labels), pending = pending, submit()  # next batch's reads overlap this one
        data = [f.result() for f in futures]
        # torchvision's CUDA decode_jpeg allocates its outputs on the caller's stream but
        # writes them from a private stream that does not wait for the caller's stream
        # (pytorch/vision #9606): it can be handed memory that queued kernels still read.
        # Draining the current stream first makes that impossible.
        torch.cuda.current_stream(dev).synchronize()
        imgs = decode_jpeg(data, mode=ImageReadMode.RGB, device=dev)
        x = torch.stack([aug(im) for im in imgs]).to(torch.float32)
        x = F.normalize(x, mean255, std255)  # = (x / 255 - mean) / std, like DALI's output
        y = torch.tensor(labels, dtype=torch.int64).to(dev, non_blocking=True)
        # Device-wide: decode_jpeg's private stream included (nothing else runs on this GPU).
        torch.cuda.synchronize(dev)
        return x, y

    return next_batch


FEEDS = {"dali": dali_feed, "tv_gpu": tv_feed}


def measure(next_batch, batches):
    """One epoch: (images, seconds, CPU seconds, per-batch seconds). imagenet_feed.run_epochs
    iterates whole loaders and keeps no per-batch times, hence this loop; each next_batch()
    returns only once its pixels are complete on the GPU."""
    lat, n = [], 0
    c0, t0 = cpu_total(), time.perf_counter()
    for _ in range(batches):
        b0 = time.perf_counter()
        x, _ = next_batch()
        lat.append(time.perf_counter() - b0)
        n += x.shape[0]
    return n, time.perf_counter() - t0, cpu_total() - c0, lat


def versions(pipeline):
    import torch
    import torchvision
    v = {"python": sys.version.split()[0], "torch": torch.__version__,
         "torchvision": torchvision.__version__, "cuda": torch.version.cuda}
    if pipeline == "dali":
        import nvidia.dali
        v["dali"] = nvidia.dali.__version__
    return v


def bench(a):
    import numpy as np
    import torch
    torch.cuda.set_device(a.device)
    files = list_files(a.root)  # counted once
    batches = math.ceil(len(files) / a.batch)
    next_batch = FEEDS[a.what](a, files)
    steady = {"n": 0, "secs": 0.0, "cpu": 0.0, "lat": []}
    for e in range(a.epochs):
        n, secs, cpu, lat = measure(next_batch, batches)
        print(f"{a.what} epoch {e + 1}: {n} images in {secs:.2f} s = {n / secs:.0f} images/s, "
              f"{cpu / n * 1e3:.3f} CPU ms per image", file=sys.stderr, flush=True)
        if e > 0 or a.epochs == 1:  # the first epoch is the warm-up
            steady["n"] += n
            steady["secs"] += secs
            steady["cpu"] += cpu
            steady["lat"] += lat

    def lat_ms(lat):
        ms = np.array(lat) * 1e3
        return {"p50": round(float(np.percentile(ms, 50)), 3),
                "p99": round(float(np.percentile(ms, 99)), 3),
                "max": round(float(ms.max()), 3)}

    print(json.dumps({
        "pipeline": a.what, "threads": a.threads, "batch": a.batch, "images": n,
        "images_per_s": round(n / secs, 1), "cpu_ms_per_image": round(cpu / n * 1e3, 4),
        "batch_ms": lat_ms(lat),
        "steady": {"epochs": max(a.epochs - 1, 1), "images": steady["n"],
                   "images_per_s": round(steady["n"] / steady["secs"], 1),
                   "cpu_ms_per_image": round(steady["cpu"] / steady["n"] * 1e3, 4),
                   "batch_ms": lat_ms(steady["lat"])},
        "device": torch.cuda.get_device_name(a.device), "versions": versions(a.what)}))


def check(a):
    import torch
    torch.cuda.set_device(a.device)
    files = list_files(a.root)
    nclasses = max(y for _, y in files) + 1
    res = {}
    for name in (FEEDS if a.pipeline == "all" else [a.pipeline]):
        try:
            x, y = FEEDS[name](a, files)()
            means = x.mean(dim=(0, 2, 3)).tolist()
            r = {"shape": list(x.shape), "dtype": str(x.dtype), "device": str(x.device),
                 "finite": bool(torch.isfinite(x).all()), "channel_means": means,
                 "labels_ok": y.shape == (a.batch,) and y.is_cuda
                 and bool(((y >= 0) & (y < nclasses)).all())}
            r["ok"] = (r["shape"] == [a.batch, 3, a.size, a.size] and x.dtype == torch.float32
                       and x.is_cuda and r["finite"] and all(abs(m) < 3 for m in means)
                       and r["labels_ok"])
        except Exception as err:  # e.g. DALI not importable: reported, not raised
            r = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        res[name] = r
    print(json.dumps({"check": res, "ok": all(r["ok"] for r in res.values())}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["dali", "tv_gpu", "make", "check"])
    ap.add_argument("--root", required=True, help="root/<class>/<image>.jpg")
    ap.add_argument("--threads", type=int, help="DALI num_threads / torchvision read threads")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=2, help="the last one is reported")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--hw-load", type=float, default=0.65,
                    help="DALI hw_decoder_load: share of each batch on the hardware JPEG "
                         "decoder (0: none)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--n", type=int, default=5000, help="make: number of JPEGs")
    ap.add_argument("--pipeline", choices=["dali", "tv_gpu", "all"], default="all",
                    help="check: which pipeline(s)")
    a = ap.parse_args()
    if a.what == "make":
        make(a.root, a.n)
        return
    if a.threads is None or a.epochs < 1:
        ap.error("dali, tv_gpu and check need --threads (and --epochs >= 1)")
    if a.what == "check":
        check(a)
    else:
        bench(a)


if __name__ == "__main__":
    main()
