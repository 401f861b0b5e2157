"""End to end: a ResNet-50 training loop (AMP float16 autocast + GradScaler, channels_last, SGD,
batch 256) fed from a folder of JPEGs, against the same step on a batch already on the GPU.

    python3 train_feed.py --root DIR [--steps 60] [--warmup 10] [--threads 4] [--workers 8]
                          [--only ideal,pinstream,torch,dali] [--model resnet50] [--timeline]
                          [--pin CPU] [--graph]

Pipelines, in the order `--only` names them, repeats allowed (each `--steps` timed steps after
`--warmup` untimed ones, a fresh model each):
  ideal      one batch of random pixels, normalized, already on the GPU (the step alone)
  pinstream  pinstream.torch.image_feed(DIR, 256, threads=N, layout="NHWC", dtype=float16):
             JPEGs decoded by the GPU's engines (nvJPEG), RandomResizedCrop + flip + normalize
             in one kernel; NHWC viewed as channels_last NCHW without a copy
  torch      torchvision ImageFolder + RandomResizedCrop + flip + PILToTensor (uint8) in
             DataLoader(num_workers=W, pin_memory=True), APEX's data_prefetcher (side-stream
             copy, float, normalize on the GPU), channels_last
  discard    the feed runs and its batches are taken and dropped; the step trains on the ideal's
             batch (what running the feed beside the step costs)
  replay     one batch of the feed, copied, replayed (the feed's tensors alone)
  ipc        an experiment: the feed in a helper process (its own CUDA context), each batch
             copied into a torch tensor there and handed over by CUDA IPC
  ideal_spinN / ideal_memN   the ideal beside N processes spinning a CPU each / copying 64 MB
             over and over (what busy neighbour CPUs cost the step)
  ideal_kernproc   the ideal beside another process running a tiny kernel KERNPROC_HZ (1000)
             times a second (what sharing the GPU by time slices costs)
  ideal_decloop[yuv][@RATE]   the ideal beside `decode_loop` (vision/examples): nvJPEG decoding
             alone in a process of its own at RATE images/s
  ideal_smallops_{copies,kernels,both,none}[@RATE]   the ideal beside a thread queueing the
             feed's pattern of small GPU operations (no nvJPEG) on 8 side streams (`none`: the
             thread's own Python, no GPU work)
  dali       NVIDIA DALI, if importable (decode_peers.py's pipeline: mixed decoder with the
             hardware decoder, resize, crop_mirror_normalize to float16 HWC, viewed as
             channels_last NCHW), copied into torch tensors on torch's stream

Reports per pipeline: images/s, ratio of the step time to the fastest ideal of the run (biased
upwards) and to the mean of the ideals just before and after it (`ratio_adjacent`, and an
ADJACENT line per pipeline: alternate `ideal,X,ideal,X,ideal` for it), CPU
seconds per image (this process and its worker processes over the timed steps), and the GPU's
SM clock, power and temperature sampled while the timed steps ran. One JSON line per pipeline on
stdout (TRAIN_JSON), progress on stderr.
"""

import argparse
import json
import os
import re
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ratios  # noqa: E402

MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


def cpu_total():
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class Pinning:
    """`--pin CPU`: the training thread alone on one CPU, and every thread or process it starts
    kept off that CPU and its hyperthread sibling: the feed through its own `cpus=`, the rest
    (the driver's threads, DataLoader workers, DALI, nvidia-smi) started inside `spawning()`.
    Without `--pin`, nothing changes."""

    def __init__(self, cpu):
        self.cpu = cpu
        if cpu is None:
            return
        path = f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"
        sib = set()
        for part in open(path).read().strip().split(","):
            lo, _, hi = part.partition("-")
            sib.update(range(int(lo), int(hi or lo) + 1))
        self.main = {cpu}
        self.rest = set(os.sched_getaffinity(0)) - sib - {cpu}
        if not self.rest:
            raise SystemExit(f"--pin {cpu}: no CPU is left for the rest (siblings {sorted(sib)})")
        print(f"pin: training thread on {sorted(self.main)}, the rest on {sorted(self.rest)}",
              file=sys.stderr, flush=True)

    def spawning(self):
        import contextlib

        @contextlib.contextmanager
        def cm():
            if self.cpu is None:
                yield
                return
            os.sched_setaffinity(0, self.rest)
            try:
                yield
            finally:
                os.sched_setaffinity(0, self.main)

        return cm()

    def others(self):
        """The CPUs for everything but the training thread (None without --pin)."""
        return None if self.cpu is None else sorted(self.rest)


PIN = Pinning(None)


def green_stream(torch, sm_count):
    """A non-blocking stream of a CUDA green context holding about ``sm_count`` SMs (the driver
    rounds to its partition granularity): kernels queued on it run on those SMs only. Returns
    (the torch stream, SMs it got, SMs left to everything else, the handles to keep alive).
    Driver API through ctypes (CUDA 12.4+; ``CUdevResource`` is 144 bytes up to 13.0)."""
    import ctypes
    cu = ctypes.CDLL("libcuda.so.1")

    def ok(r, what):
        if r != 0:
            raise RuntimeError(f"{what}: CUresult {r}")

    torch.cuda.synchronize()  # the primary context made and current on this thread
    dev = ctypes.c_int()
    ok(cu.cuCtxGetDevice(ctypes.byref(dev)), "cuCtxGetDevice")
    whole, part, rest = (ctypes.create_string_buffer(144) for _ in range(3))
    ok(cu.cuDeviceGetDevResource(dev, whole, 1), "cuDeviceGetDevResource")  # CU_DEV_RESOURCE_TYPE_SM
    groups = ctypes.c_uint(1)
    ok(cu.cuDevSmResourceSplitByCount(part, ctypes.byref(groups), whole, rest, 0, ctypes.c_uint(sm_count)),
       "cuDevSmResourceSplitByCount")
    desc = ctypes.c_void_p()
    ok(cu.cuDevResourceGenerateDesc(ctypes.byref(desc), part, 1), "cuDevResourceGenerateDesc")
    g = ctypes.c_void_p()
    ok(cu.cuGreenCtxCreate(ctypes.byref(g), desc, dev, 1), "cuGreenCtxCreate")  # CU_GREEN_CTX_DEFAULT_STREAM
    st = ctypes.c_void_p()
    ok(cu.cuGreenCtxStreamCreate(ctypes.byref(st), g, 1, 0), "cuGreenCtxStreamCreate")  # non-blocking

    def sms(b):
        return int.from_bytes(b.raw[96:100], "little")  # CUdevSmResource.smCount

    return torch.cuda.ExternalStream(st.value), sms(part), sms(rest), (cu, g, st)


def make_graphed(model, opt, crit, torch, like_x, like_y):
    """`--graph`: the whole step (bfloat16 autocast, no GradScaler: a graph cannot hold its
    host sync) captured once in a CUDA graph, as PyTorch's whole-network capture recipe does;
    each step copies the batch into the graph's input and replays it. The host then launches
    one graph per step instead of hundreds of kernels."""
    static_x, static_y = torch.empty_like(like_x), torch.empty_like(like_y)
    static_x.copy_(like_x)
    static_y.copy_(like_y)

    def body():
        # No autocast cache inside a capture (PyTorch's graph recipe).
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            loss = crit(model(static_x), static_y)
        loss.backward()
        opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    # thread_local: the feed's own threads keep calling CUDA while this thread captures.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        body()

    def step(x, y):
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()

    return step


def make_model(name, torch, torchvision, graph_like=None):
    model = getattr(torchvision.models, name)(num_classes=1000).cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda")
    crit = torch.nn.CrossEntropyLoss()
    if graph_like is not None:
        return make_graphed(model, opt, crit, torch, *graph_like)

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = crit(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step


class GpuSampler:
    """nvidia-smi sampling the SM clock, power and temperature every 250 ms while the timed
    steps run (the clocks drift as the GPU warms, and fall when it idles): `stop()` gives the
    medians and the hottest reading, or None where nvidia-smi is missing."""

    def __init__(self):
        import subprocess
        try:
            self.p = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                 "--format=csv,noheader,nounits", "-lms", "250"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.p = None

    def stop(self):
        if self.p is None:
            return None
        self.p.terminate()
        try:
            out, _ = self.p.communicate(timeout=10)
        except Exception:  # noqa: BLE001 - a diagnosis only
            self.p.kill()
            return None
        rows = []
        for line in out.splitlines():
            try:
                rows.append([float(v) for v in line.split(",")])
            except ValueError:
                pass
        if not rows:
            return None
        med = lambda i: statistics.median(r[i] for r in rows)  # noqa: E731
        return {"samples": len(rows), "sm_mhz_median": med(0), "power_w_median": med(1),
                "temp_c_max": max(r[2] for r in rows)}


_BURN = {
    "spin": "x = 0\nwhile True:\n    x = (x * 1103515245 + 12345) & 0xffffffff\n",
    "mem": "import numpy as np\na = np.ones(64 << 20, np.uint8)\nb = np.empty_like(a)\nwhile True:\n    np.copyto(b, a)\n",
}


def beside(what, cmds, settle, **popen):
    """A context: the processes `cmds` (argument lists) started off the training thread's CPU,
    `settle` seconds to get going, checked to be still running before and after the body (a
    measurement beside a helper that died would be the plain ideal under another name), and
    killed on leaving, whatever happened."""
    import contextlib
    import subprocess

    @contextlib.contextmanager
    def cm():
        ps = []
        try:
            with PIN.spawning():
                for cmd in cmds:
                    ps.append(subprocess.Popen(cmd, **popen))
            time.sleep(settle)
            for p in ps:
                alive(p, what)
            yield
            for p in ps:
                alive(p, what)
        finally:
            for p in ps:
                p.kill()
                p.wait()

    return cm()


#: The switches of the diagnostic build (`experiments/diag_decode.patch`) a pipeline name may
#: carry (`discard+yuv+nocrop`), and their values when the run started.
#: `cpuNN` (valued): PINSTREAM_DIAG_CPU_SHARE=0.NN, that share of the engines' images decoded on
#: the CPU instead. Not switches: `tN`, the feed's threads for this pipeline; `cacheN`, its
#: `cache_bytes` (N GiB), one epoch drained first so that the timed steps find it filled.
DIAG_FLAGS = ("yuv", "nocrop", "roi_all", "cpu_share")
DIAG_ENV = {f"PINSTREAM_DIAG_{fl.upper()}": os.environ[f"PINSTREAM_DIAG_{fl.upper()}"]
            for fl in DIAG_FLAGS if f"PINSTREAM_DIAG_{fl.upper()}" in os.environ}


def pipeline_flags(flags):
    """`(env, opts)` for a pipeline's name flags: `env` maps the PINSTREAM_DIAG_* variables to
    set; `opts["threads"]` is the `tN` flag's N or None, `opts["cache_gib"]` the `cacheN`
    flag's N or 0. Refuses an unknown or malformed flag."""
    env, threads, cache = {}, None, 0
    for fl in flags:
        if m := re.fullmatch(r"cpu(\d{1,3})", fl):
            if int(m[1]) > 100:
                raise SystemExit(f"pipeline flag {fl}: a share of at most 100 (per cent)")
            env["PINSTREAM_DIAG_CPU_SHARE"] = str(int(m[1]) / 100)
        elif m := re.fullmatch(r"t(\d{1,3})", fl):
            if int(m[1]) < 1:
                raise SystemExit(f"pipeline flag {fl}: at least one thread")
            threads = int(m[1])
        elif m := re.fullmatch(r"cache(\d{1,4})", fl):
            if int(m[1]) < 1:
                raise SystemExit(f"pipeline flag {fl}: at least 1 GiB")
            cache = int(m[1])
        elif fl in DIAG_FLAGS and fl != "cpu_share":
            env[f"PINSTREAM_DIAG_{fl.upper()}"] = "1"
        else:
            raise SystemExit(f"unknown pipeline flag {fl!r}: yuv, nocrop, roi_all, cpuNN, tN, cacheN")
    return env, {"threads": threads, "cache_gib": cache}


def alive(p, what):
    """Raises unless the helper process `p` is still running (a measurement beside a helper
    that died would be the plain ideal under another name)."""
    if p.poll() is not None:
        raise RuntimeError(f"{what} exited with {p.returncode} before the measurement ended")


def small_ops(torch, kind, rate, stop, done):
    """`ideal_smallops`'s thread: `kind` ("copies", "kernels", "both"; "none": the same loop
    with no GPU work, the control for its own Python) on 8 non-blocking streams, `rate`
    operations of each kind a second, in groups of 64 that it waits for (events). Puts the rate
    reached, or the exception, in `done`."""
    try:
        _small_ops(torch, kind, rate, stop, done)
    except BaseException as e:  # noqa: BLE001 - re-raised by the measuring thread
        done["error"] = e


def _small_ops(torch, kind, rate, stop, done):
    streams = [torch.cuda.Stream() for _ in range(8)]
    src = torch.ones(110_000, dtype=torch.uint8).pin_memory()
    dsts = [torch.empty(110_000, dtype=torch.uint8, device="cuda") for _ in range(8)]
    imgs = [torch.ones(500 * 375 * 3, dtype=torch.uint8, device="cuda") for _ in range(8)]
    t0, n = time.perf_counter(), 0
    while not stop.is_set():
        evs = []
        for k in range(64):
            s = streams[k % 8]
            with torch.cuda.stream(s):
                if kind in ("copies", "both"):
                    dsts[k % 8].copy_(src, non_blocking=True)
                if kind in ("kernels", "both"):
                    imgs[k % 8].add_(1)
                if k >= 56 and kind != "none":
                    ev = torch.cuda.Event()
                    ev.record(s)
                    evs.append(ev)
        for ev in evs:
            ev.synchronize()
        n += 64
        done["rate"] = round(n / (time.perf_counter() - t0))
        wait = n / rate - (time.perf_counter() - t0)
        if wait > 0:
            stop.wait(wait)


def endless(make_epoch):
    while True:
        yield from make_epoch()


def sync(torch):
    """Everything queued so far has run: the device's primary context, and the current stream
    (which may belong to a green context, which `torch.cuda.synchronize` does not wait for)."""
    torch.cuda.synchronize()
    torch.cuda.current_stream().synchronize()


def run(name, batches, step, a, torch):
    """`warmup` then `steps` timed steps over `batches` (an iterator of (x, y) on the GPU)."""
    for _ in range(a.warmup):
        x, y = next(batches)
        step(x, y)
    sync(torch)
    with PIN.spawning():
        sampler = GpuSampler()
    c0, t0 = cpu_total(), time.perf_counter()
    main0, waited = time.thread_time(), 0.0
    n = 0
    marks = []
    for _ in range(a.steps):
        if a.max_ahead and len(marks) >= a.max_ahead:
            marks.pop(0).synchronize()  # the host at most `max_ahead` steps ahead of the GPU
        tw = time.perf_counter()
        x, y = next(batches)
        waited += time.perf_counter() - tw
        step(x, y)
        if a.max_ahead:
            ev = torch.cuda.Event()
            ev.record()
            marks.append(ev)
        n += y.shape[0]
    sync(torch)
    # The CPU before the sampler is reaped: its time is not this process's.
    secs, cpu = time.perf_counter() - t0, cpu_total() - c0
    r = {"pipeline": name, "images": n, "secs": round(secs, 4), "images_per_s": round(n / secs, 1),
         "step_ms": round(secs / a.steps * 1e3, 3), "cpu_s_per_image": round(cpu / n, 6),
         "main_cpu_ms": round((time.thread_time() - main0) / a.steps * 1e3, 3),
         "next_ms": round(waited / a.steps * 1e3, 3),
         "gpu": sampler.stop()}
    print(f"{name}: {n / secs:.0f} images/s, {secs / a.steps * 1e3:.2f} ms per step, "
          f"{cpu / n * 1e3:.3f} CPU ms per image", file=sys.stderr, flush=True)
    return r


def union(iv):
    """Sorted, merged `(start, end)` intervals."""
    iv = sorted(iv)
    out, cur = [], None
    for s0, s1 in iv:
        if cur and s0 <= cur[1]:
            cur[1] = max(cur[1], s1)
        else:
            cur = [s0, s1]
            out.append(cur)
    return out


def total(iv):
    """Their summed length (of merged intervals)."""
    return sum(b - a for a, b in iv)


def overlap(u, v):
    """How long two merged interval lists overlap."""
    i = j = 0
    got = 0
    while i < len(u) and j < len(v):
        lo, hi = max(u[i][0], v[j][0]), min(u[i][1], v[j][1])
        if hi > lo:
            got += hi - lo
        if u[i][1] < v[j][1]:
            i += 1
        else:
            j += 1
    return got


def gpu_timeline(name, batches, step, a, torch, n=16):
    """`n` steps under torch.profiler: where the step's time goes on the GPU. Reports the span
    from the first to the last kernel, the busy time of the step's stream (the union of its
    kernels), the busy time of every other stream (the feed's), their overlap, and the host time
    spent in `next(batches)` per step."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        x, y = next(batches)
        step(x, y)
    torch.cuda.synchronize()
    host_next = 0.0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            t = time.perf_counter()
            x, y = next(batches)
            host_next += time.perf_counter() - t
            step(x, y)
        torch.cuda.synchronize()
    streams, names, api = {}, {}, {}
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != torch.autograd.DeviceType.CUDA or e.duration_ns() <= 0:
            if e.duration_ns() > 0 and e.name().startswith("cu"):
                api.setdefault(e.name()[:40], []).append(e.duration_ns())
            continue
        nm = e.name()
        if nm.startswith("Memcpy") or nm.startswith("Memset"):
            kind = "copy"
        else:
            kind = "kernel"
        streams.setdefault((e.device_resource_id(), kind), []).append((e.start_ns(), e.start_ns() + e.duration_ns()))
        names.setdefault((e.device_resource_id(), nm[:60]), []).append(e.duration_ns())

    kernels = {k: v for k, v in streams.items() if k[1] == "kernel"}
    main = max(kernels, key=lambda k: total(kernels[k]))
    mu = union(kernels[main])
    others = union([iv for k, v in streams.items() if k != main for iv in v])
    other_kernels = union([iv for k, v in kernels.items() if k != main for iv in v])
    span = mu[-1][1] - mu[0][0]
    r = {
        "pipeline": name, "steps": n,
        "span_ms_per_step": round(span / n / 1e6, 3),
        "step_stream_busy_ms_per_step": round(total(mu) / n / 1e6, 3),
        "step_stream_idle_ms_per_step": round((span - total(mu)) / n / 1e6, 3),
        "other_kernels_ms_per_step": round(total(other_kernels) / n / 1e6, 3),
        "other_kernels_overlapping_step_ms_per_step": round(overlap(mu, other_kernels) / n / 1e6, 3),
        "other_streams_all_ms_per_step": round(total(others) / n / 1e6, 3),
        "host_next_ms_per_step": round(host_next / n * 1e3, 3),
        "step_kernels_per_step": round(len(kernels[main]) / n, 1),
        # How many other streams ran GPU work (the feed's and nvJPEG's internal ones): more
        # streams than CUDA_DEVICE_MAX_CONNECTIONS share hardware queues.
        "other_streams": len({sid for (sid, _) in names if sid != main[0]}),
        # The other streams' work by stream and name: GPU ms and launches per step, the 16 largest.
        "other_top": sorted(([sid, nm, round(sum(d) / n / 1e6, 3), round(len(d) / n, 1)]
                             for (sid, nm), d in names.items() if sid != main[0]),
                            key=lambda t: -t[2])[:16],
        # CUDA runtime / driver calls on the host, every thread: ms and calls per step.
        "api_top": sorted(([nm, round(sum(d) / n / 1e6, 3), round(len(d) / n, 1)]
                           for nm, d in api.items()), key=lambda t: -t[1])[:12],
    }
    print("TIMELINE_JSON " + json.dumps(r), flush=True)
    return r


def _ipc_producer(root, batch, threads, q, stop):
    """`ipc`'s decode process: the feed in its own process (its own CUDA context and driver
    locks), each batch copied into a torch tensor (CUDA IPC shares only torch's allocations)
    and sent over a queue; torch keeps it alive until the consumer lets it go."""
    import queue as _q

    import torch

    import pinstream.torch as pt

    f = pt.image_feed(root, batch, threads=threads, layout="NHWC", dtype=torch.float16,
                      rank=0, world_size=1, drop_last=True)
    while not stop.is_set():
        for x, y in f:
            item = (x.clone(), y.clone())
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.5)
                    break
                except _q.Full:
                    pass
            if stop.is_set():
                break
    f.close()


def ipc_batches(a, torch):
    """An experiment: the feed in a helper process, batches handed over by CUDA IPC."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(maxsize=4), ctx.Event()
    p = ctx.Process(target=_ipc_producer, args=(a.root, a.batch, a.threads, q, stop), daemon=True)
    p.start()

    def batches():
        while True:
            x, y = q.get(timeout=120)
            yield x.permute(0, 3, 1, 2), y

    def close():
        stop.set()
        p.join(timeout=30)
        if p.is_alive():
            p.kill()

    return batches(), close


def apex_channels_last(loader, torch):
    """vs_torch.py's APEX data_prefetcher, the batch also made channels_last on its side
    stream."""
    from vs_torch import ApexPrefetcher

    class ChannelsLast(ApexPrefetcher):
        def preload(self):
            super().preload()
            if self.next_input is not None:
                with torch.cuda.stream(self.stream):
                    self.next_input = self.next_input.contiguous(memory_format=torch.channels_last)

    return ChannelsLast(loader, MEAN, STD)


def dali_batches(a, torch):
    """DALI's training pipeline (decode_peers.py's, float16 output): each batch copied into a
    torch tensor on torch's current stream, after DALI's ready event, without a host wait."""
    from nvidia.dali import Pipeline, fn, types
    from nvidia.dali.plugin.pytorch import feed_ndarray

    pipe = Pipeline(batch_size=a.batch, num_threads=a.threads or 4, device_id=torch.cuda.current_device(),
                    prefetch_queue_depth=2)
    with pipe:
        jpegs, labels = fn.readers.file(file_root=a.root, random_shuffle=True, name="Reader")
        images = fn.decoders.image_random_crop(
            jpegs, device="mixed", output_type=types.RGB, hw_decoder_load=0.65,
            random_area=[0.08, 1.0], random_aspect_ratio=[3 / 4, 4 / 3])
        images = fn.resize(images, resize_x=224, resize_y=224)
        images = fn.crop_mirror_normalize(
            images, dtype=types.FLOAT16, output_layout="HWC", crop=(224, 224), mean=MEAN, std=STD,
            mirror=fn.random.coin_flip())
        pipe.set_outputs(images, labels.gpu())
    pipe.build()

    def next_batch():
        out = []
        for tl, dtype in zip(pipe.run(), (torch.float16, torch.int32)):
            t = tl.as_tensor()
            buf = torch.empty(t.shape(), dtype=dtype, device="cuda")
            feed_ndarray(t, buf, cuda_stream=torch.cuda.current_stream())
            out.append(buf)
        # NHWC viewed as channels_last NCHW, as for pinstream.
        return out[0].permute(0, 3, 1, 2), out[1].view(-1).long()

    return next_batch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None,
                    help="pinstream's and DALI's threads (default: pinstream's own, 2 decoding on the GPU; DALI 4)")
    ap.add_argument("--workers", type=int, default=8, help="the DataLoader's workers")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--decode", default="auto", help="pinstream's decode=: auto, gpu, cpu")
    ap.add_argument("--only", default="ideal,pinstream,torch,dali",
                    help="pipelines in order, repeats allowed (ideal, pinstream, discard, replay, torch, dali)")
    ap.add_argument("--timeline", action="store_true", help="after each, a few steps under torch.profiler")
    ap.add_argument("--graph", action="store_true",
                    help="every pipeline's step captured in a CUDA graph (bfloat16, no GradScaler)")
    ap.add_argument("--decodes-at-once", type=int, default=0,
                    help="the feed's decodes_at_once (0: its default, 4)")
    ap.add_argument("--max-ahead", type=int, default=0,
                    help="the training loop waits for step i - K before step i (0: it never waits)")
    ap.add_argument("--sched", choices=["spin", "yield", "blocking"], default=None,
                    help="the CUDA context's scheduling flag (default: the driver's choice)")
    ap.add_argument("--green-step", type=int, default=0,
                    help="the pinstream pipeline's step (and an 'ideal_green' pipeline) on a green "
                         "context of about this many SMs, the rest left to the feed (0: off); with "
                         "--graph only (cuDNN's eager kernels fail on a green-context stream)")
    ap.add_argument("--side-stream", action="store_true",
                    help="every pipeline's step on a stream of its own, not the legacy default stream")
    ap.add_argument("--step-priority", type=int, default=None,
                    help="the step on a stream of its own of this priority (0 least, negative greater)")
    ap.add_argument("--pin", type=int, default=None,
                    help="the training thread alone on this CPU, everything it starts off it and its sibling")
    a = ap.parse_args()
    if a.green_step and not a.graph:
        # BENCHMARKS.md, sixth session: CUDNN_STATUS_EXECUTION_FAILED_CUDART, eager, every size.
        ap.error("--green-step needs --graph: cuDNN's eager kernels fail on a green-context stream")
    global PIN
    PIN = Pinning(a.pin)
    if a.sched:
        # The primary context's scheduling flag, set before anything makes the context. The
        # cuInit below would come before pinstream's import: import it first, so that its
        # CUDA_DEVICE_MAX_CONNECTIONS default applies here as on every other path.
        import pinstream  # noqa: F401
        import ctypes
        cu = ctypes.CDLL("libcuda.so.1")
        dev = ctypes.c_int()
        flag = {"spin": 1, "yield": 2, "blocking": 4}[a.sched]
        assert cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
        assert cu.cuDevicePrimaryCtxSetFlags(dev, flag) == 0, "cuDevicePrimaryCtxSetFlags"
    spawn = PIN.spawning()
    spawn.__enter__()
    import torch
    import torchvision

    import pinstream.torch as pt

    torch.backends.cudnn.benchmark = True
    out = []
    device = torch.cuda.get_device_name()
    versions = {"torch": torch.__version__, "torchvision": torchvision.__version__}
    x_res = torch.randn(a.batch, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    y_res = torch.randint(0, 100, (a.batch,), device="cuda")
    torch.cuda.synchronize()
    spawn.__exit__(None, None, None)
    if a.step_priority is not None:
        torch.cuda.stream(torch.cuda.Stream(priority=a.step_priority)).__enter__()
    elif a.side_stream:
        # Work other code queues on the legacy default stream (stream 0) waits for everything
        # queued on it before, the training step's included, unless the step runs elsewhere.
        torch.cuda.stream(torch.cuda.Stream()).__enter__()

    green = None
    if a.green_step:
        g_stream, g_sms, g_rest, g_keep = green_stream(torch, a.green_step)
        green = g_stream
        print(f"GREEN step on {g_sms} SMs, {g_rest} left", flush=True)

    def on_green(f):
        # The pipeline's steps, and the feed's batches ordered on it, on the green stream.
        if green is None:
            return f()
        with torch.cuda.stream(green):
            r = f()
        torch.cuda.synchronize()
        return r

    def resident():
        while True:
            yield x_res, y_res

    def feed():
        # drop_last as the DataLoader's below: a short last batch is a new shape, which
        # cudnn.benchmark would tune for in the timed steps.
        # With --pin, the feed's own `cpus=` keeps its threads off the training thread's CPU.
        f = pt.image_feed(a.root, a.batch, threads=a.threads, layout="NHWC", dtype=torch.float16,
                          decodes_at_once=a.decodes_at_once, cache_bytes=cache_bytes,
                          rank=0, world_size=1, drop_last=True, decode=a.decode, cpus=PIN.others())
        if cache_bytes:
            for _ in f:  # one epoch: every image decoded once and kept
                pass

        def batches():
            for x, y in endless(lambda: iter(f)):
                yield x.permute(0, 3, 1, 2), y

        return f, batches()

    def measure(name, batches, extra=None, bare=False):
        if bare:
            def step(x, y):  # no training: the feed alone, as fast as it goes
                pass
        else:
            step = make_model(a.model, torch, torchvision, (x_res, y_res) if a.graph else None)
        r = run(name, batches, step, a, torch)
        if extra:
            r.update(extra)
        if a.timeline:
            try:
                r["timeline"] = gpu_timeline(name, batches, step, a, torch)
            except Exception as e:  # a diagnosis: the measurement above stands without it
                print(f"TIMELINE_JSON {json.dumps({'pipeline': name, 'error': repr(e)})}", flush=True)
        out.append(r)

    threads0 = a.threads
    for name in a.only.split(","):
        # Flags of a diagnostic build (`experiments/diag_decode.patch`), for one pipeline:
        # `discard+yuv+nocrop` runs `discard` with PINSTREAM_DIAG_YUV and PINSTREAM_DIAG_NOCROP
        # set (nvJPEG writes YUV; no resized crop); `+roi_all`: the engines decode only the
        # crop's region of subsampled files too; `+cpu50`: half the engines' images decoded on
        # the CPU; `+t8`: 8 feed threads for this pipeline. `@N`: a rate, for `ideal_decloop`.
        name, _, rate = name.partition("@")
        name, *flags = name.split("+")
        flag_env, opts = pipeline_flags(flags)
        a.threads = threads0 if opts["threads"] is None else opts["threads"]
        cache_bytes = opts["cache_gib"] << 30
        # Each pipeline sees the environment the run started with, plus its own flags.
        for fl in DIAG_FLAGS:
            var = f"PINSTREAM_DIAG_{fl.upper()}"
            if var in DIAG_ENV:
                os.environ[var] = DIAG_ENV[var]
            else:
                os.environ.pop(var, None)
        os.environ.update(flag_env)
        name_suffix = "".join(f"+{fl}" for fl in flags)
        if name == "ideal":
            measure("ideal", resident())
        elif name == "ideal_kernproc":
            # The ideal beside another process (its own CUDA context) that runs a tiny kernel
            # KERNPROC_HZ times a second: what sharing the GPU by time slices costs.
            hz = os.environ.get("KERNPROC_HZ", "1000")
            code = ("import torch, time\nx = torch.ones(1, device='cuda')\nwhile True:\n"
                    f"    x.add_(1); torch.cuda.synchronize(); time.sleep(1.0 / {hz})\n")
            with beside("the tiny-kernel process", [[sys.executable, "-c", code]], 4):
                measure(f"ideal_kernproc{hz}", resident())
        elif name.startswith("ideal_smallops"):
            # The ideal beside the pattern of GPU work the feed's decoding brings, without
            # nvJPEG or its engines: a thread queues 110 kB page-locked-to-device copies
            # (`_copies`), kernels over 560 kB (`_kernels`, as a colour conversion of one image)
            # or both (`_both`) on 8 side streams, RATE (`@RATE`, default 13 000) a second,
            # waiting for each group of 64. Is it the engines, or the many small operations?
            kind = name[len("ideal_smallops"):].lstrip("_") or "both"
            if kind not in ("copies", "kernels", "both", "none"):
                raise SystemExit(f"ideal_smallops_{kind}: copies, kernels, both or none")
            stop, done = threading.Event(), {}
            th = threading.Thread(target=small_ops, args=(torch, kind, int(rate or 13000), stop, done),
                                  daemon=True)
            with PIN.spawning():  # the thread off the training thread's CPU under --pin
                th.start()
            try:
                time.sleep(1)
                measure(f"ideal_smallops_{kind}" + (f"@{rate}" if rate else ""), resident())
            finally:
                stop.set()
                th.join()
            if "error" in done:
                raise RuntimeError("ideal_smallops' thread failed") from done["error"]
            out[-1]["small_ops_per_s"] = done.get("rate")
        elif name.startswith("ideal_spin") or name.startswith("ideal_mem"):
            # The ideal beside N other processes that keep a CPU each busy: `spin` on registers
            # alone, `mem` copying 64 MB over and over (host memory and the shared cache): how
            # much a step slows when its neighbours' CPUs are busy, with no GIL, GPU or data.
            kind, k = ("spin", name[len("ideal_spin"):]) if name.startswith("ideal_spin") else ("mem", name[len("ideal_mem"):])
            with beside(f"a {kind} burner", [[sys.executable, "-c", _BURN[kind]]] * int(k or 1), 0.5):
                measure(name, resident())
        elif name == "ideal_green":
            on_green(lambda: measure("ideal_green", resident(), {"green_sms": a.green_step}))
        elif name.startswith("ideal_decloop"):
            # The ideal beside `vision/examples/decode_loop` (a diagnostic, not a pipeline): JPEG
            # decoding on the engines in a process of its own, about the step's rate, nothing
            # handed over. `ideal_decloopyuv`: nvJPEG writing YUV (a diagnostic build's
            # PINSTREAM_DIAG_YUV), no colour conversion kernels.
            here = os.path.dirname(os.path.abspath(__file__))
            binary = os.environ.get("PINSTREAM_DECODE_LOOP",
                                    os.path.join(here, "..", "..", ".gpu", "bin", "decode_loop"))
            env = dict(os.environ)
            if name.endswith("yuv"):
                env["PINSTREAM_DIAG_YUV"] = "1"
            with open(f"/tmp/{name}.log", "w") as log, \
                    beside("decode_loop", [[binary, a.root, str(a.threads or 2), rate or "17000"]], 3,
                           env=env, stderr=log):
                measure(name + (f"@{rate}" if rate else ""), resident())
            rates = [ln.split()[1] for ln in open(f"/tmp/{name}.log") if ln.startswith("decode_loop: ") and ln.endswith("images/s\n")]
            out[-1]["decode_loop_images_per_s"] = rates[-12:]
        elif name == "pinstream":
            f, b = feed()
            on_green(lambda: measure(f"pinstream_{a.decode}{name_suffix}", b, {"threads": f.threads,
                                                                  "green_sms": a.green_step}))
            out[-1]["decoding"] = f.decoding
            if cache_bytes:
                out[-1]["cache"] = {k: v for k, v in f.stats().items() if k.startswith("cache")}
            f.close()
        elif name == "bare":
            f, b = feed()
            measure(f"bare_{a.decode}{name_suffix}", b, {"threads": f.threads}, bare=True)
            f.close()
        elif name == "discard":
            # The feed runs, its batches are taken and dropped; the step trains on the resident
            # batch: what running the feed beside the step costs, without its data.
            f, b = feed()

            def discard(b=b):
                while True:
                    next(b)
                    yield x_res, y_res

            measure(f"discard_{a.decode}{name_suffix}", discard(), {"threads": f.threads})
            f.close()
        elif name == "ipc":
            b, close = ipc_batches(a, torch)
            try:
                measure("pinstream_ipc", b, {"threads": a.threads or "default"})
            finally:
                close()
        elif name == "replay":
            # One batch from the feed (its own DLPack tensors, which outlive the feed), the feed
            # closed, the batch replayed: the feed's tensors alone.
            f, b = feed()
            x, y = next(b)
            f.close()

            def replay():
                while True:
                    yield x, y

            measure("replay", replay())
        elif name == "torch":
            from torchvision import transforms as T
            tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.PILToTensor()])
            ds = torchvision.datasets.ImageFolder(a.root, tf)
            loader = torch.utils.data.DataLoader(ds, batch_size=a.batch, shuffle=True, num_workers=a.workers,
                                                 pin_memory=True, drop_last=True, persistent_workers=True,
                                                 prefetch_factor=4)
            def apex_epoch():
                with PIN.spawning():
                    it = apex_channels_last(loader, torch)
                    first = next(it, None)
                if first is not None:
                    yield first
                    yield from it

            measure("torch_dataloader_apex", endless(apex_epoch),
                    {"workers": a.workers})
            del loader
        elif name == "dali":
            try:
                import nvidia.dali
            except ImportError as e:
                print(f"dali: skipped ({e})", file=sys.stderr)
                continue
            with PIN.spawning():
                next_batch = dali_batches(a, torch)

            def batches():
                while True:
                    yield next_batch()

            versions["dali"] = nvidia.dali.__version__
            measure("dali", batches(), {"threads": a.threads or 4})
        else:
            raise SystemExit(f"unknown pipeline {name!r}")

    ideals = [r["step_ms"] for r in out if r["pipeline"] == "ideal"]
    ideal = {"step_ms": min(ideals)} if ideals else None
    for i, r in enumerate(out):
        if ideal:
            # To the fastest ideal of the run (the GPU's clocks drift as it warms). Biased
            # upwards: one sample against the least of several, so an ideal against the others
            # comes out above 1.
            r["ratio_to_ideal"] = round(r["step_ms"] / ideal["step_ms"], 4)
        # To the mean of the nearest ideal before it and the nearest after (either alone at an
        # end): unbiased for a pipeline as fast as the ideal, and the drift of the machine
        # moves both alike. Run `--only ideal,X,ideal,X,ideal,...` for it.
        before = ([q["step_ms"] for q in out[:i] if q["pipeline"] == "ideal"] or [None])[-1]
        after = ([q["step_ms"] for q in out[i + 1:] if q["pipeline"] == "ideal"] or [None])[0]
        if before is not None or after is not None:
            r["ratio_adjacent"] = round(ratios.adjacent(r["step_ms"], before, after), 4)
        r.update(model=a.model, batch=a.batch, device=device, versions=versions, graph=a.graph,
                 side_stream=a.side_stream, max_ahead=a.max_ahead, sched=a.sched,
                 pin=a.pin)
        print("TRAIN_JSON " + json.dumps(r), flush=True)
    by = {}
    for r in out:
        if r["pipeline"] != "ideal" and "ratio_adjacent" in r:
            by.setdefault(r["pipeline"], []).append(r["ratio_adjacent"])
    for k, v in by.items():
        lo, hi = ratios.interval(v)
        print(f"ADJACENT {k}: median {statistics.median(v):.4f} of {len(v)}: "
              + " ".join(f"{x:.3f}" for x in v) + f" (≈90 % interval {lo:.3f}–{hi:.3f})", flush=True)


if __name__ == "__main__":
    main()
