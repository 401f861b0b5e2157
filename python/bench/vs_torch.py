"""pinstream's Python package against PyTorch, side by side in one run on one GPU.

    python3 python/bench/vs_torch.py [--quick] [--only upload,many,download,prefetch,dataloader,cifar,models]

Uploads of 4 MiB - 1 GiB from pageable memory (``.to('cuda')``, ``.to(non_blocking=True)``,
``pin_memory().to(non_blocking=True)``, TensorDict's ``to(non_blocking_pin=True,
num_threads=8)`` where installed, and pinned H2D as the ceiling), 1000 x 4 KB tensors, and the
prefetch loop of 256 x 3x224x224 uint8 batches at 0.5 / 2 / 8 ms steps (DataLoader with
pin_memory=True and 4 workers + an APEX-style data_prefetcher, against pinstream.torch.prefetch
over the same DataLoader without pin_memory, and over a plain generator). Events and host clocks,
warm-up, medians; every result checked.

``--only dataloader`` (issue 32): a DataLoader as pinstream's source at the 0.5 ms step, 4 and 8
workers, with batches that are views of one dataset tensor (``views``, as above) and with a new
shared-memory tensor per batch as ``default_collate`` makes (``fresh``), pin_memory off and on,
the loader threads swept; against a generator source and DataLoader(pin_memory) + APEX; each a
median of rounds after warm-up; one JSON line (``{"bench": "dataloader_source", ...}``).
``--only models`` ends with one JSON line too (``{"bench": "models", ...}``): the step time of
ResNet-18/50 over the ideal for each source.
"""

import argparse
import json
import os
import resource
import statistics
import sys
import threading
import time

import numpy as np
import torch

import pinstream
import pinstream.torch as pt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ratios as ratios_  # noqa: E402

DEV = torch.device("cuda:0")

# The worker_ring readers made, to print how many batches came in the ring (weakly: a reader
# keeps its ring mapped).
_RING_READERS = []
try:
    import weakref

    import pinstream.worker_ring as _wr

    _ring_init = _wr.WorkerRingReader.__init__

    def _record_ring_reader(self, *a, **k):
        _ring_init(self, *a, **k)
        _RING_READERS.append(weakref.ref(self))

    _wr.WorkerRingReader.__init__ = _record_ring_reader
except ImportError:  # an older pinstream
    pass


#: ``--main-cpu``: the CPUs the sources run on (every CPU but the training thread's core), or
#: ``None`` (no pinning).
_OTHERS = [None]
#: ``--trace DIR``: each source's timed steps in the first round under torch.profiler (CUDA
#: activity), its GPU timeline summed up (``gpu_summary``) and saved to DIR; the source's name.
_TRACE = {"dir": None, "source": None, "done": set()}


def pin_main(cpu):
    """Pins this thread (the training thread, and the threads it starts later: the autograd
    engine's) to CPU ``cpu``'s core (it and its SMT siblings) and returns the other CPUs, for the
    sources."""
    with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
        core = set()
        for part in f.read().strip().split(","):
            a, _, b = part.partition("-")
            core.update(range(int(a), int(b or a) + 1))
    others = sorted(os.sched_getaffinity(0) - core)
    os.sched_setaffinity(0, core)
    _OTHERS[0] = others
    print(f"# training thread on CPUs {sorted(core)}, sources on {others}", flush=True)
    return others


def away(make):
    """``make()`` run with this thread on the sources' CPUs, so that what it starts (a
    DataLoader's workers and pin thread, a helper process) runs there; then back."""
    if _OTHERS[0] is None:
        return make()
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, _OTHERS[0])
    try:
        return make()
    finally:
        os.sched_setaffinity(0, mine)


def ring_counts():
    """``{"in_ring": k, "stacked": j, "usual": m}`` of the newest worker_ring reader still
    alive, or ``{}``."""
    r = _RING_READERS[-1]() if _RING_READERS else None
    _RING_READERS.clear()
    return {"in_ring": r.in_ring, "stacked": r.stacked, "usual": r.usual} if r is not None else {}


_GILWAIT = [False]


def gil_waited():
    """This thread's waits in pthread condition variables, ``{condition: (ns, count)}``, where
    python/bench/gilwait.c is preloaded (``LD_PRELOAD``), else ``None``: CPython's GIL waits
    apart from the CUDA driver's."""
    import ctypes

    f = _GILWAIT[0]
    if f is False:
        try:
            f = ctypes.CDLL(None).gilwait_table
        except (AttributeError, OSError):
            f = None
        _GILWAIT[0] = f  # looked up once: this runs every step
    if f is None:
        return None
    cond, ns, n = ((ctypes.c_ulonglong * 16)() for _ in range(3))
    k = f(cond, ns, n, 16)
    return {cond[i]: (ns[i], n[i]) for i in range(k)}


def gil_waits_per_step(before, after, steps):
    """``gil_waited``'s waits between two readings, per step: ``[(ms, count)]``, longest first."""
    out = []
    for c, (ns, n) in after.items():
        ns0, n0 = before.get(c, (0, 0))
        if n > n0:
            out.append((round((ns - ns0) / steps / 1e6, 3), round((n - n0) / steps, 2)))
    return sorted(out, reverse=True)


def critical_tids():
    """The threads a training step runs on: this one (which launches the forward pass and the
    optimizer) and PyTorch's autograd engine threads (``pt_autograd_*``, which launch the
    backward pass)."""
    tids = [threading.get_native_id()]
    try:
        for t in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{t}/comm") as f:
                    if f.read().startswith("pt_autograd"):
                        tids.append(int(t))
            except OSError:
                pass
    except OSError:
        pass
    return tids


def runq_ns(tids):
    """``[(cpu ns, run-queue wait ns)]`` of these threads (``/proc/.../schedstat``): the time
    each waited runnable for a CPU, that is preempted or not yet scheduled after a wake-up."""
    out = []
    for t in tids:
        try:
            with open(f"/proc/self/task/{t}/schedstat") as f:
                cpu, wait, _ = f.read().split()
            out.append((int(cpu), int(wait)))
        except (OSError, ValueError):
            out.append((0, 0))
    return out


#: ``--runq``: each step's run-queue waits of the training step's threads read (two files a
#: step, on the training thread's path from the sync to the next forward pass: off unless told).
_RUNQ = [False]
#: ``--phases``: CUDA events at the forward pass's start and end and around the optimizer's
#: step, each step (four event records a step on the training thread: off unless told).
_PHASES = {"on": False}

#: Garbage collections while a source is timed: ``[(generation, seconds, thread name)]``.
_GC = {"on": False, "start": 0.0, "gen": 0, "runs": []}


def _gc_callback(phase, info):
    if not _GC["on"]:
        return
    if phase == "start":
        _GC["start"], _GC["gen"] = time.perf_counter(), info.get("generation", -1)
    else:
        _GC["runs"].append((_GC["gen"], time.perf_counter() - _GC["start"], time.perf_counter(),
                            threading.current_thread().name))


def gpu_summary(trace_file, steps):
    """A CUDA trace's GPU timeline per step: on the stream with the most kernels (the step's),
    the time it was idle between its first and last kernel and the time its kernels ran; every
    other stream's kernels and copies (a prefetcher's); host-to-device copies' count and mean
    time."""
    import gzip

    with gzip.open(trace_file, "rt") if trace_file.endswith(".gz") else open(trace_file) as f:
        ev = json.load(f)["traceEvents"]
    gpu = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by = {}
    for e in gpu:
        by.setdefault(e.get("args", {}).get("stream"), []).append(e)
    main = max(by, key=lambda k: sum(e["cat"] == "kernel" for e in by[k]))
    ks = sorted(by[main], key=lambda e: e["ts"])
    idle, end = 0.0, ks[0]["ts"]
    gaps = []
    for e in ks:
        if e["ts"] > end:
            idle += e["ts"] - end
            gaps.append(e["ts"] - end)
        end = max(end, e["ts"] + e["dur"])
    span = end - ks[0]["ts"]
    h2d = [e["dur"] for e in gpu if e["cat"] == "gpu_memcpy" and "HtoD" in e.get("name", "")]
    others = {str(k): (len(v), round(sum(e["dur"] for e in v) / 1e3 / steps, 3)) for k, v in by.items() if k != main}
    gaps.sort(reverse=True)
    # The step stream's own work (its kernels do not overlap): the same for every source where
    # a source's cost is the GPU's waits, not slower kernels.
    busy = sum(e["dur"] for e in ks)
    return {"step_gpu_ms": round(span / 1e3 / steps, 3), "idle_ms": round(idle / 1e3 / steps, 3),
            "busy_ms": round(busy / 1e3 / steps, 3),
            "largest_gaps_ms": [round(g / 1e3, 3) for g in gaps[:6]],
            "h2d": (len(h2d), round(sum(h2d) / max(len(h2d), 1) / 1e3, 3)),
            "other_streams_ms": others}


def median_ms(fn, reps, warmup=2):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def row(name, ms, nbytes=None, ref=None):
    gbps = f"{nbytes / ms / 1e6:8.2f} GB/s" if nbytes else " " * 13
    ratio = f"  x{ref / ms:6.2f}" if ref else ""
    print(f"  {name:<44} {ms:9.3f} ms {gbps}{ratio}", flush=True)


def bench_upload(quick):
    print("\n## uploads from pageable memory (ratio: pinstream / peer; >1 = pinstream faster)")
    try:
        from tensordict import TensorDict
    except ImportError:
        TensorDict = None
    sizes = [4 << 20, 64 << 20, 256 << 20] + ([] if quick else [1 << 30])
    for n in sizes:
        reps = 20 if n <= 64 << 20 else 7
        x = torch.from_numpy(np.random.default_rng().integers(0, 256, n, dtype=np.uint8))
        pinned = x.pin_memory()
        print(f"- {n >> 20} MiB")
        ps = median_ms(lambda: pt.upload(x), reps)
        # The result: every byte.
        assert torch.equal(pt.upload(x).cpu(), x)
        ceiling = median_ms(lambda: pinned.to(DEV, non_blocking=True), reps)
        peers = {
            ".to('cuda')": lambda: x.to(DEV),
            ".to(non_blocking=True)": lambda: x.to(DEV, non_blocking=True),
            "pin_memory().to(non_blocking=True)": lambda: x.pin_memory().to(DEV, non_blocking=True),
        }
        if TensorDict is not None:
            td = TensorDict({"x": x}, batch_size=[])
            peers["TensorDict.to(non_blocking_pin, 8 threads)"] = lambda: td.to(
                DEV, non_blocking_pin=True, num_threads=8
            )
        row("pinstream.torch.upload", ps, n)
        row("pinned H2D (the ceiling)", ceiling, n)
        print(f"    pinstream / pinned H2D bandwidth: {ceiling / ps:.2f}")
        for name, fn in peers.items():
            ms = median_ms(fn, reps)
            row(name, ms, n)
            print(f"    pinstream is x{ms / ps:.2f}")
    # The Python layer's cost per call over the same Rust call, timed in Rust in this process.
    for n in (4 << 10, 4 << 20):
        a = np.random.default_rng().integers(1, 256, n, dtype=np.uint8)
        reps = 200 if n <= 4 << 10 else 50
        py = median_ms(lambda: [pinstream.upload(a) for _ in range(10)], reps // 10) / 10
        rs = statistics.median(pinstream._native.rust_upload_times(n, reps)[reps // 10 :]) * 1e3
        pt_ms = median_ms(lambda: [pt.upload(a) for _ in range(10)], reps // 10) / 10
        print(
            f"- {n >> 10} KiB: Rust call {rs * 1e3:.1f} us, pinstream.upload(numpy) {py * 1e3:.1f} us "
            f"(Python adds {(py - rs) * 1e3:.1f} us), pinstream.torch.upload {pt_ms * 1e3:.1f} us"
        )
    small = torch.arange(1024, dtype=torch.float32)
    t = median_ms(lambda: [pinstream.upload(small) for _ in range(100)], 20) / 100
    print(f"- 4 KiB pinstream.upload (pinstream.Tensor, no torch): {t * 1e3:.1f} us per call")
    t = median_ms(lambda: [pt.upload(small) for _ in range(100)], 20) / 100
    print(f"- 4 KiB pinstream.torch.upload (+ torch.from_dlpack): {t * 1e3:.1f} us per call")


def bench_many():
    print("\n## 1000 tensors of 4 KB")
    xs = [torch.randn(1024) for _ in range(1000)]

    def loop():
        return [x.to(DEV, non_blocking=True) for x in xs]

    ys = pt.upload_many(xs)
    assert all(torch.equal(y.cpu(), x) for x, y in zip(xs, ys))
    a = median_ms(loop, 20)
    b = median_ms(lambda: pt.upload_many(xs), 20)
    c = median_ms(lambda: pinstream.upload_many(xs), 20)
    ts = pinstream.upload_many(xs)
    d = median_ms(lambda: [torch.from_dlpack(t) for t in pinstream.upload_many(xs)], 20) - c
    row(".to(non_blocking=True) loop + sync", a)
    row("pinstream.torch.upload_many", b, None, a)
    row("  of which pinstream.upload_many (no torch)", c, None, a)
    row("  of which 1000 torch.from_dlpack", d)
    del ts


class ApexPrefetcher:
    """The data_prefetcher pattern of NVIDIA APEX's ImageNet example (written here): the next
    batch copied on a side stream with non_blocking, normalized there, waited for by the
    consumer's stream."""

    def __init__(self, loader, mean, std):
        self.loader = iter(loader)
        self.stream = torch.cuda.Stream()
        self.mean = torch.tensor(mean, device=DEV).view(1, 3, 1, 1)
        self.std = torch.tensor(std, device=DEV).view(1, 3, 1, 1)
        self.preload()

    def preload(self):
        try:
            self.next_input, self.next_target = next(self.loader)
        except StopIteration:
            self.next_input = None
            return
        with torch.cuda.stream(self.stream):
            self.next_input = self.next_input.to(DEV, non_blocking=True)
            self.next_target = self.next_target.to(DEV, non_blocking=True)
            self.next_input = self.next_input.float().sub_(self.mean).div_(self.std)

    def __iter__(self):
        return self

    def __next__(self):
        torch.cuda.current_stream().wait_stream(self.stream)
        x, y = self.next_input, self.next_target
        if x is None:
            raise StopIteration
        x.record_stream(torch.cuda.current_stream())
        y.record_stream(torch.cuda.current_stream())
        self.preload()
        return x, y


#: One image's shape (C, H, W) in the prefetch and DataLoader sections.
IMAGE = (3, 224, 224)


class Synthetic(torch.utils.data.Dataset):
    """256-image batches of fixed random uint8 pixels (the decode is not what is measured)."""

    def __init__(self, n_batches, n=256):
        self.data = torch.from_numpy(
            np.random.default_rng(1).integers(0, 256, (4, n, *IMAGE), dtype=np.uint8)
        )
        self.n_batches = n_batches

    def __len__(self):
        return self.n_batches

    def __getitem__(self, i):
        return self.data[i % 4], torch.arange(256) + 256 * i


class FreshBatches(Synthetic):
    """The same batches, each a new tensor in shared memory, written by the worker: what
    ``default_collate`` hands over (it stacks the samples into shared memory), so the main
    process maps new pages for every batch."""

    def __getitem__(self, i):
        out = torch.empty(self.data.shape[1:], dtype=torch.uint8)
        out.share_memory_()
        out.copy_(self.data[i % 4])
        return out, torch.arange(256) + 256 * i


class Samples(torch.utils.data.Dataset):
    """``Synthetic``'s batches one image a sample, for ``DataLoader(batch_size=256)``: its
    workers' ``default_collate`` stacks each batch's samples into new shared memory, which the
    training process maps. The usual way a dataset of images is loaded."""

    def __init__(self, synthetic):
        self.data = synthetic.data
        self.n = len(synthetic) * 256

    def __len__(self):
        return self.n

    def __getitem__(self, j):
        b, k = divmod(j, 256)
        return self.data[b % 4][k], j


def spin_cycles_per_ms():
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(50_000_000)
    torch.cuda.synchronize()
    return 50_000_000 / ((time.perf_counter() - t0) * 1e3)


def run_loop(batches, step_cycles, check):
    """Times a training loop: each batch's mean checked on the GPU, then a `step` of GPU work."""
    torch.cuda.synchronize()
    cpu0, t0 = time.process_time(), time.perf_counter()
    ch0 = os.times()
    n = 0
    sums = []
    for x, y in batches:
        sums.append(x[:, :, :2, :2].float().sum())
        if step_cycles:
            torch.cuda._sleep(step_cycles)
        n += 1
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    ch1 = os.times()
    cpu = (time.process_time() - cpu0) + (ch1.children_user + ch1.children_system) - (
        ch0.children_user + ch0.children_system
    )
    if check:
        check(sums)
    return wall / n * 1e3, cpu / n * 1e3


def bench_prefetch(quick):
    print("\n## prefetch: 256 x 3x224x224 uint8 batches, normalized to float32 (ms per batch, CPU ms per batch)")
    per_ms = spin_cycles_per_ms()
    mean, std = pinstream.IMAGENET
    n_batches = 40 if quick else 100
    ds = Synthetic(n_batches)
    want = [((ds[i][0][:, :, :2, :2].double() - torch.tensor(mean).view(1, 3, 1, 1).double())
             / torch.tensor(std).view(1, 3, 1, 1).double()).sum().item() for i in range(4)]

    def check(sums):
        for i, s in enumerate(sums):
            got = s.item()
            assert abs(got - want[i % 4]) <= 1e-3 * abs(want[i % 4]) + 1e-2, (i, got, want[i % 4])

    def loader(pin):
        return torch.utils.data.DataLoader(
            ds, batch_size=None, num_workers=4, pin_memory=pin, persistent_workers=False
        )

    gen_data = [ds[i] for i in range(4)]

    def generator():
        for i in range(n_batches):
            yield gen_data[i % 4][0], gen_data[i % 4][1]

    for step in [0.5, 2.0, 8.0]:
        cycles = int(step * per_ms)
        ideal = step
        print(f"- step {step} ms of GPU work per batch")
        apex = run_loop(ApexPrefetcher(loader(True), mean, std), cycles, check)
        ours_dl = run_loop(pt.prefetch(loader(False), normalize=pinstream.IMAGENET), cycles, check)
        ours_gen = run_loop(pt.prefetch(generator(), normalize=pinstream.IMAGENET), cycles, check)
        print(f"    DataLoader(pin_memory, 4 workers) + APEX prefetcher: {apex[0]:7.2f} ms, CPU {apex[1]:7.2f} ms")
        print(f"    pinstream.torch.prefetch(DataLoader, 4 workers; the ring): {ours_dl[0]:7.2f} ms, CPU {ours_dl[1]:7.2f} ms  x{apex[0] / ours_dl[0]:.2f}  /ideal {ours_dl[0] / ideal:.2f}")
        print(f"    pinstream.torch.prefetch(generator):               {ours_gen[0]:7.2f} ms, CPU {ours_gen[1]:7.2f} ms  x{apex[0] / ours_gen[0]:.2f}  /ideal {ours_gen[0] / ideal:.2f}")


def timed_rounds(make, cycles, check, rounds, n, warm):
    """Median over ``rounds`` of the ms per batch (and CPU ms per batch, worker processes
    included) of ``n`` batches after ``warm`` warm-up batches of ``make()``'s iterator, behind
    a GPU step of ``cycles``; each batch's mean checked. The stats of a pinstream prefetcher
    (the last round's) come back too."""
    walls, cpus, stats = [], [], None
    for _ in range(rounds):
        it = make()
        sums = []
        for _ in range(warm):
            x, y = next(it)
            sums.append(x[:, :, :2, :2].float().sum())
        torch.cuda.synchronize()
        ch0, cpu0, t0 = os.times(), time.process_time(), time.perf_counter()
        for _ in range(n):
            x, y = next(it)
            sums.append(x[:, :, :2, :2].float().sum())
            if cycles:
                torch.cuda._sleep(cycles)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        ch1 = os.times()
        cpu = (time.process_time() - cpu0) + (ch1.children_user + ch1.children_system) - (
            ch0.children_user + ch0.children_system
        )
        check(sums)
        if hasattr(it, "stats"):
            stats = it.stats()
            stats.update(ring_counts())
        if hasattr(it, "close"):
            it.close()
        del it
        walls.append(wall / n * 1e3)
        cpus.append(cpu / n * 1e3)
    return statistics.median(walls), statistics.median(cpus), stats


def bench_dataloader(quick, pick=None, batches=None, warm_batches=None):
    """Issue 32: a DataLoader as pinstream's source at the speed of a generator."""
    print("\n## DataLoader as the source: 256 x 3x224x224 uint8 -> float32, 0.5 ms step (ms per batch, CPU ms per batch)")
    per_ms = spin_cycles_per_ms()
    step = 0.5
    cycles = int(step * per_ms)
    mean, std = pinstream.IMAGENET
    rounds, n, warm = (2, 30, 8) if quick else (3, 60, 10)
    n = batches or n
    warm = warm_batches if warm_batches is not None else warm
    total = warm + n + 4
    views, fresh = Synthetic(total), FreshBatches(total)
    want = [((views[i][0][:, :, :2, :2].double() - torch.tensor(mean).view(1, 3, 1, 1).double())
             / torch.tensor(std).view(1, 3, 1, 1).double()).sum().item() for i in range(4)]

    def check(sums):
        for i, s in enumerate(sums):
            got = s.item()
            assert abs(got - want[i % 4]) <= 1e-3 * abs(want[i % 4]) + 1e-2, (i, got, want[i % 4])

    def dl(ds, workers, pin=False):
        return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers, pin_memory=pin)

    gen_data = [views[i] for i in range(4)]

    def generator():
        for i in range(total):
            yield gen_data[i % 4][0], gen_data[i % 4][1]

    def ours(src, **kw):
        # A configuration's name says whether the workers write the ring (the default for a
        # plain DataLoader): the others pull in this process.
        kw.setdefault("worker_ring", False)
        return lambda: iter(pt.prefetch(src(), normalize=pinstream.IMAGENET, **kw))

    def apex(workers):
        return lambda: ApexPrefetcher(dl(views, workers, pin=True), mean, std)

    def alone(ds, workers):
        # The DataLoader's own rate in this process (no copy, no upload): the source's limit.
        def make():
            it = iter(dl(ds, workers))
            return ((x, y) for x, y in it)
        return make

    def alone_check(sums):
        pass

    configs = {
        "generator": (ours(generator), check),
        "apex_dl4_pin": (apex(4), check),
        "apex_dl8_pin": (apex(8), check),
    }
    for w in (4, 8):
        # The DataLoader (views): the default, and the serial pull it replaced.
        configs[f"dl{w}_views"] = (ours(lambda w=w: dl(views, w)), check)
        configs[f"dl{w}_views_serial"] = (ours(lambda w=w: dl(views, w), fresh=False), check)
        # A new shared-memory tensor per batch: the default, pin_memory (one DMA from the
        # DataLoader's pinned batch), zero_copy (the staging engine copies), the serial pull.
        configs[f"dl{w}_fresh"] = (ours(lambda w=w: dl(fresh, w)), check)
        configs[f"dl{w}_fresh_pin"] = (ours(lambda w=w: dl(fresh, w, pin=True)), check)
        configs[f"dl{w}_fresh_zero_copy"] = (ours(lambda w=w: dl(fresh, w), zero_copy=True), check)
        configs[f"dl{w}_fresh_serial"] = (ours(lambda w=w: dl(fresh, w), fresh=False), check)
    # The DataLoader iterated in a helper process (its per-batch interpreter work off this one).
    configs["dl4_views_process"] = (ours(lambda: dl(views, 4), process=True), check)
    configs["dl8_views_process"] = (ours(lambda: dl(views, 8), process=True), check)
    configs["dl4_fresh_process"] = (ours(lambda: dl(fresh, 4), process=True), check)
    configs["dl4_views_worker_ring"] = (ours(lambda: dl(views, 4), worker_ring=True), check)
    configs["dl4_views_worker_ring_threads2"] = (ours(lambda: dl(views, 4), worker_ring=True, loader_threads=2), check)
    configs["dl8_views_worker_ring"] = (ours(lambda: dl(views, 8), worker_ring=True), check)
    configs["dl4_fresh_worker_ring"] = (ours(lambda: dl(fresh, 4), worker_ring=True), check)
    configs["dl8_fresh_worker_ring"] = (ours(lambda: dl(fresh, 8), worker_ring=True), check)
    configs["dl4_views_process_threads4"] = (ours(lambda: dl(views, 4), process=True, loader_threads=4), check)
    for lt in (2, 4, 8, 12):
        configs[f"dl4_views_threads{lt}"] = (ours(lambda: dl(views, 4), loader_threads=lt), check)
        # The staging engine copies the held batch (its threads and bounce blocks) instead.
        configs[f"dl4_views_zero_copy_threads{lt}"] = (
            ours(lambda: dl(views, 4), loader_threads=lt, zero_copy=True), check)
    if pick:
        configs = {k: v for k, v in configs.items() if k in pick or k == "apex_dl4_pin"}
    results = {}
    for name, (make, chk) in configs.items():
        wall, cpu, st = timed_rounds(make, cycles, chk, rounds, n, warm)
        results[name] = {"ms": round(wall, 3), "cpu_ms": round(cpu, 2)}
        if st:
            k = max(st["items"], 1)
            results[name].update({
                "fresh": st["fresh"],
                "turn_ms_per_item": round(st["pull_seconds"] / k * 1e3, 3),
                "gil_wait_ms_per_item": round(st["gil_wait_seconds"] / k * 1e3, 3),
                "after_ms_per_item": round(st["after_seconds"] / k * 1e3, 3),
                "copies_per_item": round((st["copied_in_turn"] + st["copied_after"]) / k, 2),
                "direct_per_item": round(st["direct"] / k, 2),
                "staged_per_item": round(st["staged"] / k, 2),
                **{k2: st[k2] for k2 in ("in_ring", "usual") if k2 in st},
            })
        print(f"  {name:<28} {wall:7.3f} ms  CPU {cpu:7.2f} ms  {results[name]}", flush=True)
    for w in (4, 8):
        for ds_name, ds in (("views", views), ("fresh", fresh)):
            if pick and f"dl{w}_{ds_name}_alone" not in pick:
                continue
            ms, _, _ = timed_rounds(alone(ds, w), 0, alone_check, rounds, n, warm)
            results[f"dl{w}_{ds_name}_alone"] = {"ms": round(ms, 3)}
            print(f"  DataLoader({w} workers, {ds_name}) alone, no copy: {ms:7.3f} ms", flush=True)
    apex4 = results["apex_dl4_pin"]["ms"]
    line = {
        "bench": "dataloader_source",
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "pinstream": pinstream.__version__,
        "step_ms": step,
        "sharing_strategy": torch.multiprocessing.get_sharing_strategy(),
        "batch": [256, *IMAGE],
        "rounds": rounds,
        "batches_per_round": n,
        "warmup": warm,
        "results": results,
        "x_apex_dl4": {k: round(apex4 / v["ms"], 2) for k, v in results.items() if "alone" not in k},
        "of_generator": {k: round(v["ms"] / results["generator"]["ms"], 3) for k, v in results.items()
                         if k.startswith("dl") and "alone" not in k and "generator" in results},
    }
    print(json.dumps(line), flush=True)


def bench_download():
    print("\n## downloads to the CPU (the data there when the call returns)")
    for n in (64 << 20, 256 << 20):
        x = torch.randint(0, 256, (n,), dtype=torch.uint8, device=DEV)
        assert torch.equal(pt.download(x), x.cpu())
        a = median_ms(lambda: x.cpu(), 7)
        b = median_ms(lambda: x.to("cpu", non_blocking=True), 7)
        c = median_ms(lambda: pt.download(x), 7)
        print(f"- {n >> 20} MiB")
        row(".cpu()", a, n)
        row(".to('cpu', non_blocking=True) + sync (pinned, then read)", b, n)
        row("pinstream.torch.download", c, n, a)


class CifarLike(torch.utils.data.Dataset):
    """torchvision's CIFAR10 as the tutorial uses it: 50 000 uint8 HWC images in memory, each
    item a PIL image through ToTensor + Normalize (random pixels; no download)."""

    def __init__(self, n=50_000):
        rng = np.random.default_rng(2)
        self.data = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
        self.targets = rng.integers(0, 10, n).tolist()
        import torchvision.transforms as T

        self.transform = T.Compose([T.ToTensor(), T.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))])

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        from PIL import Image

        return self.transform(Image.fromarray(self.data[i])), self.targets[i]


def bench_cifar(quick):
    """The CIFAR-10 tutorial's loop (DataLoader(batch_size, shuffle, num_workers=2,
    pin_memory=True), `.to(device, non_blocking=True)`) against pinstream over the same
    in-memory uint8 array (shuffled batches, normalized on the GPU): one epoch, no model."""
    print("\n## CIFAR-10-like epoch, batch 128 (no model: the input pipeline alone)")
    ds = CifarLike(10_000 if quick else 50_000)
    bs = 128

    def tutorial():
        dl = torch.utils.data.DataLoader(ds, batch_size=bs, shuffle=True, num_workers=2, pin_memory=True)
        for x, y in dl:
            yield x.to(DEV, non_blocking=True), y.to(DEV, non_blocking=True)

    def batches(seed):
        order = np.random.default_rng(seed).permutation(len(ds))
        targets = np.asarray(ds.targets)
        for i in range(0, len(order), bs):
            idx = order[i : i + bs]
            yield ds.data[idx], targets[idx]

    half = (127.5, 127.5, 127.5)

    def epoch(it):
        torch.cuda.synchronize()
        cpu0, t0 = time.process_time(), time.perf_counter()
        ch0 = os.times()
        n, total = 0, 0
        sums = []
        for x, y in it:
            n += x.shape[0]
            if len(sums) < 3:
                sums.append((x.float().mean().item(), x.shape))
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        ch1 = os.times()
        cpu = (time.process_time() - cpu0) + (ch1.children_user + ch1.children_system) - (ch0.children_user + ch0.children_system)
        return wall, cpu, n, sums

    a = epoch(tutorial())
    b = epoch(pt.prefetch(batches(0), normalize=(half, half), input_layout="nhwc"))
    # Both are the same transform: (x / 255 - 0.5) / 0.5.
    for (m1, s1), (m2, s2) in zip(a[3], b[3]):
        assert s1 == s2 and abs(m1 - m2) < 0.02, (a[3], b[3])
    for name, r in [("tutorial DataLoader(2 workers, pin_memory) + .to(non_blocking)", a), ("pinstream.torch.prefetch(uint8 batches), normalize on GPU", b)]:
        print(f"  {name:<62} {r[0]:7.3f} s/epoch, {r[2] / r[0]:9.0f} images/s, CPU {r[1]:6.2f} s")
    print(f"    pinstream is x{a[0] / b[0]:.1f} (CPU x{a[1] / max(b[1], 1e-9):.1f} less)")


def bench_models(quick, models=("resnet18", "resnet50"), steps=None, pick=None, warm=None, rounds=1):
    """A real training step: torchvision ResNet-18 / ResNet-50, AMP (float16 autocast with a
    GradScaler), channels_last, batch 256, SGD; the input from DataLoader(pin_memory) + APEX
    prefetcher, from pinstream.torch.prefetch (float16, NHWC viewed as channels_last) over a
    generator and over DataLoaders (in this process with 1, 2, 6 or 12 loader threads, or
    iterated in a helper process with ``process=True``, or written into a ring by the workers with
    ``worker_ring=True``), and the ideal: the same step on a batch already on the GPU. In
    ``rounds`` rounds, the ideal and every source in turn, the ideal once more after each round;
    each source's time is over the faster ideal beside it, and the median over the rounds is
    reported. ``pick``: only these sources (the ideal always)."""
    import torchvision

    print("\n## training step: ResNet, AMP, channels_last, batch 256 (ms per batch, CPU ms per batch)")
    mean, std = pinstream.IMAGENET
    # Each source's first `warm` batches are steps too, untimed: a DataLoader's workers start
    # there (a second or more, which would weigh on 30 batches).
    warm = warm or (3 if quick else 6)
    n_batches = (steps or (12 if quick else 30)) + warm
    ds = Synthetic(n_batches)
    fresh_ds = FreshBatches(n_batches)
    samples_ds = Samples(ds)
    gen_data = [ds[i] for i in range(4)]
    summary = {"bench": "models", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "pinstream": pinstream.__version__, "batch": 256, "batches": n_batches - warm, "warmup": warm}

    def generator():
        for i in range(n_batches):
            yield gen_data[i % 4][0], gen_data[i % 4][1]

    def loader():
        return torch.utils.data.DataLoader(ds, batch_size=None, num_workers=4, pin_memory=True)

    for name in models:
        model = getattr(torchvision.models, name)(num_classes=1000).to(DEV, memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        scaler = torch.amp.GradScaler("cuda")
        crit = torch.nn.CrossEntropyLoss()
        # The training thread's path from the CUDA sync (GradScaler.step's, just before the
        # optimizer's step) to the next forward pass, where the GPU has nothing queued: the
        # optimizer's step, the rest of the step, next() and the forward's start, per step.
        marks = {}
        # (--phases) CUDA events on the step's stream at the same four points, timing each
        # phase on the GPU (its kernels and its waits for the CPU): [(fwd0, fwd1, opt0, opt1)].
        phase_events = []

        def mark(name):
            marks[name] = time.perf_counter()
            if _PHASES["on"]:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                if name == "fwd":
                    phase_events.append({})
                if phase_events:
                    phase_events[-1][name] = ev

        opt.register_step_pre_hook(lambda *a: mark("opt0"))
        opt.register_step_post_hook(lambda *a: mark("opt1"))
        model.register_forward_pre_hook(lambda *a: mark("fwd"))
        model.register_forward_hook(lambda *a: mark("fwd1"))

        def step(x, y):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = crit(model(x), y % 1000)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

        def timed(batches, prep):
            first.clear()
            batches = iter(batches)
            for _ in range(warm):
                step(*prep(*next(batches)))
            torch.cuda.synchronize()
            cpu0, t0 = time.process_time(), time.perf_counter()
            ch0 = os.times()
            # The training thread's own CPU time and its wait in next(): a step slower than the
            # ideal with the same CPU time waited (for its batch, the GIL); one with more CPU time
            # ran slower beside the source (caches, memory).
            main0, waited, native = time.thread_time(), 0.0, 0.0
            gil0 = gil_waited()
            flt0 = (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt,
                    resource.getrusage(resource.RUSAGE_SELF).ru_minflt)
            # pinstream.torch's prefetcher: its native next() and the DLPack conversion timed
            # apart (the same conversion as its __next__, `pt._handed`).
            inner = getattr(batches, "_inner", None)
            n = 0
            import gc

            if _gc_callback not in gc.callbacks:
                gc.callbacks.append(_gc_callback)
            _GC["runs"].clear()
            _GC["on"] = True
            per_step = []  # (end, step seconds, seconds in next(), main GIL ns so far, runq ns)
            crit_tids = critical_tids()
            rq0 = runq_ns(crit_tids) if _RUNQ[0] else []
            prof = None
            if _TRACE["dir"] and _TRACE["source"] not in _TRACE["done"]:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                prof.__enter__()
            while True:
                tw = time.perf_counter()
                try:
                    if inner is None:
                        x, y = next(batches)
                    else:
                        item = next(inner)
                        native += time.perf_counter() - tw
                        streams = {}
                        x, y = (pt._handed(v, streams) if isinstance(v, pinstream.Tensor) else v for v in item)
                except StopIteration:
                    break
                waited += time.perf_counter() - tw
                t_next = time.perf_counter() - tw
                x, y = prep(x, y)
                step(x, y)
                n += 1
                te = time.perf_counter()
                gw = gil_waited()
                per_step.append((te, te - tw, t_next, gw or {}, runq_ns(crit_tids) if _RUNQ[0] else [],
                                 (tw, tw + t_next, marks.get("fwd", 0.0), marks.get("opt0", 0.0),
                                  marks.get("opt1", 0.0))))
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            _GC["on"] = False
            main_cpu = time.thread_time() - main0
            if prof is not None:
                prof.__exit__(None, None, None)
                name = str(_TRACE["source"])
                _TRACE["done"].add(_TRACE["source"])
                path = os.path.join(_TRACE["dir"], f"{name}.json")
                prof.export_chrome_trace(path)
                print(f"    trace {name}: {gpu_summary(path, n)}", flush=True)
            gil1 = gil_waited()
            flt = (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - flt0[0],
                   resource.getrusage(resource.RUSAGE_SELF).ru_minflt - flt0[1])
            ch1 = os.times()
            cpu = (time.process_time() - cpu0) + (ch1.children_user + ch1.children_system) - (
                ch0.children_user + ch0.children_system
            )
            assert all(abs(f - want) <= 1e-2 * abs(want) + 2 for f in first), (first, want)
            st = batches.stats() if hasattr(batches, "stats") else None
            ring = ring_counts()
            close = getattr(batches, "close", None)
            if close is not None:
                close()
            steps_ms = sorted(p[1] * 1e3 for p in per_step)
            slow = []
            # The CUDA sync's condition: the one waited on about once a step, longest; the GIL's:
            # every other.
            last = per_step[-1][3] if per_step else {}
            sync = max((c for c in last if abs(last[c][1] - (gil0 or {}).get(c, (0, 0))[1] - n) <= n // 4),
                       key=lambda c: last[c][0], default=None)

            def gil_ns(g):
                return sum(v[0] for c, v in g.items() if c != sync)

            def runq(j):
                # The step's run-queue waits of the training thread and the autograd threads, ms.
                before = per_step[j - 1][4] if j else rq0
                return [round((a[1] - b[1]) / 1e6, 2) for a, b in zip(per_step[j][4], before)]

            for j in sorted(range(len(per_step)), key=lambda j: -per_step[j][1])[:3]:
                end, dt, tn, g = per_step[j][:4]
                gil = (gil_ns(g) - gil_ns(per_step[j - 1][3])) / 1e6 if j else 0.0
                gcs = [(gen, round(d * 1e3, 2), th[:12]) for gen, d, at, th in _GC["runs"] if end - dt <= at <= end]
                slow.append((j, round(dt * 1e3, 2), round(tn * 1e3, 2), round(gil, 2), gcs, runq(j)))
            rq_steps = [sum(runq(j)) for j in range(len(per_step))] if _RUNQ[0] else []
            # From the previous step's sync to this step's forward, ms: the optimizer's step,
            # the rest of the previous step and the loop, next(), the forward's start (prep,
            # autocast); the median of each over the steps.
            crit_path = {"opt": [], "after_opt": [], "next": [], "to_fwd": [], "sync_to_fwd": []}
            for j in range(1, len(per_step)):
                tw_, tn_, fwd_, _, _ = per_step[j][5]
                _, _, _, o0, o1 = per_step[j - 1][5]
                crit_path["opt"].append(o1 - o0)
                crit_path["after_opt"].append(tw_ - o1)
                crit_path["next"].append(tn_ - tw_)
                crit_path["to_fwd"].append(fwd_ - tn_)
                crit_path["sync_to_fwd"].append(fwd_ - o0)
            crit_path = {k: round(statistics.median(v) * 1e3, 3) for k, v in crit_path.items() if v}
            # (--phases) The GPU's time per phase, the median over the timed steps, ms: the
            # forward pass; the loss, the backward pass and the sync; the optimizer's step; from
            # there to the next forward (the scaler's update, next(), the GPU waiting for both).
            phases = {}
            timed_ev = phase_events[-n:] if _PHASES["on"] else []
            for a, b in zip(timed_ev, timed_ev[1:]):
                if len(a) == 4 and "fwd" in b:
                    for k, (e0, e1) in {"fwd": (a["fwd"], a["fwd1"]), "bwd_sync": (a["fwd1"], a["opt0"]),
                                        "opt": (a["opt0"], a["opt1"]), "to_next_fwd": (a["opt1"], b["fwd"])}.items():
                        phases.setdefault(k, []).append(e0.elapsed_time(e1))
            phases = {k: round(statistics.median(v), 3) for k, v in phases.items()}
            phase_events.clear()
            main = {"step_median_ms": round(statistics.median(steps_ms), 3),
                    "step_mean_ms": round(statistics.mean(steps_ms), 3),
                    "slowest": slow,
                    # (--runq) Run-queue waits of the step's threads: mean a step, steps with
                    # over 1 ms.
                    **({"runq_ms": round(statistics.mean(rq_steps), 3),
                        "runq_over_1ms": sum(r > 1.0 for r in rq_steps)} if rq_steps else {}),
                    "sync_path_ms": crit_path,
                    **({"gpu_phases_ms": phases} if phases else {}),
                    "gc": {g: (sum(1 for r in _GC["runs"] if r[0] == g),
                               round(sum(r[1] for r in _GC["runs"] if r[0] == g) * 1e3, 2)) for g in (0, 1, 2)},
                    "main_cpu_ms": round(main_cpu / n * 1e3, 3), "next_ms": round(waited / n * 1e3, 3),
                    # Minor page faults per step: the training thread's, the whole process's.
                    "main_faults": round(flt[0] / n, 1), "faults": round(flt[1] / n, 1)}
            if gil0 is not None:
                # The training thread's waits in pthread condition variables (CPython's GIL):
                # only with python/bench/gilwait.c preloaded.
                main["main_cond_waits"] = gil_waits_per_step(gil0, gil1, n)
            if inner is not None:
                main["native_next_ms"] = round(native / n * 1e3, 3)
            if st:
                k = max(st["items"], 1)
                st = {"turn_ms": round(st["pull_seconds"] / k * 1e3, 3),
                      "gil_wait_ms": round(st["gil_wait_seconds"] / k * 1e3, 3),
                      "after_ms": round(st["after_seconds"] / k * 1e3, 3), **ring}
            return wall / n * 1e3, cpu / n * 1e3, {**main, **(st or {})}

        resident = [(((gen_data[i][0].to(DEV).float() - torch.tensor(mean, device=DEV).view(1, 3, 1, 1))
                      / torch.tensor(std, device=DEV).view(1, 3, 1, 1)).contiguous(memory_format=torch.channels_last),
                     gen_data[i][1].to(DEV)) for i in range(4)]
        for _ in range(5):  # warm-up: cuDNN's choices, the allocator
            step(*resident[0])
        want = resident[0][0][:, :, :2, :2].double().sum().item()
        first = []

        def keep_first(x, y):
            if not first:
                first.append(x[:, :, :2, :2].float().sum().item())
            return x, y

        def nhwc(x, y):
            return keep_first(x.permute(0, 3, 1, 2), y)

        def cl(x, y):
            return keep_first(x.contiguous(memory_format=torch.channels_last), y)

        def ideal():
            return timed((resident[i % 4] for i in range(n_batches)), lambda x, y: (x, y))

        def ideal_host_copy():
            # The ideal, plus the host memory traffic of a batch's copy (numpy, without the GIL)
            # every 15 ms on another thread: what the host side of a source costs the step
            # without its GIL, its GPU work or its data.
            src = gen_data[0][0].numpy() if hasattr(gen_data[0][0], "numpy") else gen_data[0][0]
            dst = np.empty_like(src)
            stop = threading.Event()

            def copier():
                while not stop.is_set():
                    t = time.perf_counter()
                    np.copyto(dst, src)
                    stop.wait(max(0.0, 0.015 - (time.perf_counter() - t)))

            th = threading.Thread(target=copier, daemon=True)
            th.start()
            try:
                return ideal()
            finally:
                stop.set()
                th.join()

        def ideal_gpu_work():
            # The ideal, plus the GPU work a prefetched batch brings, with none of the host's:
            # each step a 256 x 3x224x224 uint8 copy from page-locked memory and its cast to
            # float16 NHWC, on a side stream, the step's stream waiting for it (as for a batch).
            side = torch.cuda.Stream()
            src = gen_data[0][0].contiguous().pin_memory()
            dst = torch.empty(src.shape, dtype=torch.uint8, device=DEV)
            out = torch.empty(src.shape, dtype=torch.float16, device=DEV)

            def batches():
                # Two batches ahead, as the prefetcher's depth: the step waits for the copy and
                # cast queued two steps before (the buffers are the step's to ignore).
                evs = []
                for i in range(n_batches):
                    ev = torch.cuda.Event()
                    with torch.cuda.stream(side):
                        dst.copy_(src, non_blocking=True)
                        out.copy_(dst)
                        ev.record(side)
                    evs.append(ev)
                    if len(evs) > 2:
                        torch.cuda.current_stream().wait_event(evs.pop(0))
                    yield resident[i % 4]

            return timed(batches(), lambda x, y: (x, y))

        def ideal_beside(make_loader):
            # The ideal beside a DataLoader whose batches a thread takes and drops at the step's
            # pace (at most two ahead, as the prefetcher's depth): what the user's DataLoader
            # itself costs the step (its workers' CPUs and memory traffic, its batches' IPC under
            # this process's GIL), with nothing of pinstream. train_feed's `discard`, for a
            # DataLoader: a source's ratio can be no lower than this one's.
            def run():
                room, stop, err = threading.Semaphore(2), threading.Event(), []

                def drain():
                    try:
                        for _ in make_loader():
                            while not room.acquire(timeout=0.1):
                                if stop.is_set():
                                    return
                            if stop.is_set():
                                return
                    except BaseException as e:  # reported by the training thread
                        err.append(e)

                th = threading.Thread(target=drain, daemon=True)
                th.start()

                def batches():
                    for i in range(n_batches):
                        if err:
                            raise RuntimeError("the DataLoader beside the ideal failed") from err[0]
                        room.release()
                        yield resident[i % 4]

                try:
                    return timed(batches(), lambda x, y: (x, y))
                finally:
                    stop.set()
                    th.join()

            return run

        def ideal_beside_child(make_loader):
            # `ideal_beside`, the DataLoader iterated in a forked child instead (as
            # `process=True` does): the workers' own cost, without this process's share of the
            # iteration (its GIL, unpickling, mapping). The child takes a batch per byte on a
            # pipe, at most two ahead; the pipe's end (EOF) ends it.
            def run():
                r, w = os.pipe()
                cr, cw = os.pipe()  # the child's report: batches taken, or its error
                pid = os.fork()
                if pid == 0:
                    code, said = 0, b""
                    try:
                        os.close(w)
                        os.close(cr)
                        it = iter(make_loader())
                        taken = 0
                        for _ in it:
                            taken += 1
                            if not os.read(r, 1):
                                break
                        del it  # the workers shut down
                        said = b"%d" % taken
                    except BaseException as e:  # noqa: BLE001 - reported through the pipe
                        code, said = 1, repr(e).encode()[:2000]
                    try:
                        os.write(cw, said)
                    finally:
                        os._exit(code)
                os.close(r)
                os.close(cw)
                os.write(w, b"xx")

                status = []  # the child's exit status, once reaped

                def reap(flags):
                    if not status:
                        done, st = os.waitpid(pid, flags)
                        if done:
                            status.append(st)
                    return bool(status)

                def report():
                    return os.read(cr, 4096).decode(errors="replace") if status else "(killed)"

                def batches():
                    for i in range(n_batches):
                        if reap(os.WNOHANG) and status[0]:
                            raise RuntimeError(f"the DataLoader beside the ideal failed in its child: {report()}")
                        try:
                            os.write(w, b"x")
                        except BrokenPipeError:
                            pass
                        yield resident[i % 4]

                try:
                    ms, cpu, extra = timed(batches(), lambda x, y: (x, y))
                finally:
                    os.close(w)
                    for _ in range(100):
                        if reap(os.WNOHANG):
                            break
                        time.sleep(0.05)
                    else:
                        os.kill(pid, 9)
                        reap(0)
                    said = report()
                    os.close(cr)
                # The batches the child took (about the steps), else what it said: a child that
                # took none measured the plain ideal.
                extra["child_took"] = said
                if not said.isdigit() or int(said) < n_batches // 2:
                    raise RuntimeError(f"the DataLoader's child took too few batches: {said}")
                return ms, cpu, extra

            return run

        def ring_setting(name, value, f):
            # `f` with `pinstream.worker_ring.<name>` set to `value` (read at `iter()` or when
            # the ring is made), then as it was.
            def run():
                import pinstream.worker_ring as ring_mod

                old = getattr(ring_mod, name)
                setattr(ring_mod, name, value)
                try:
                    return f()
                finally:
                    setattr(ring_mod, name, old)

            return run

        def worker_copy_threads(k, f):
            # `f` with each worker copying into the ring with `k` threads.
            return ring_setting("WORKER_COPY_THREADS", k, f)

        def ours(src, **kw):
            # A source's name says whether the workers write the ring (the default for a plain
            # DataLoader): the others pull in this process.
            kw.setdefault("worker_ring", False)
            if _OTHERS[0] is not None:
                kw.setdefault("cpus", _OTHERS[0])
            return lambda: timed(away(lambda: pt.prefetch(src(), normalize=pinstream.IMAGENET,
                                                          dtype=torch.float16, layout="nhwc", **kw)), nhwc)

        def with_child(f):
            # A forked child that only sleeps while `f` runs: the parent's pages are shared
            # copy-on-write with it, as with a DataLoader's workers or a helper process, so each
            # first write to one in the parent copies it.
            def run():
                pid = os.fork()
                if pid == 0:
                    time.sleep(600)
                    os._exit(0)
                try:
                    return f()
                finally:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)

            return run

        def dl(dataset, workers):
            return lambda: torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=workers)

        def dls(workers, pin=False):
            # One image a sample, batches of 256 collated by the workers (`Samples`).
            return lambda: torch.utils.data.DataLoader(samples_ds, batch_size=256, num_workers=workers,
                                                       pin_memory=pin)

        def ring_alone(workers, pinned=False):
            # The ring's reader over `dls(workers)` in this process, as pt.prefetch makes it, its
            # batches handed to nobody: the DataLoader's and the ring's share of a ring source,
            # without pinstream's DMA, cast or next(); `pinned`: the ring page-locked, as there.
            def make():
                import pinstream.worker_ring as ring_mod

                r = ring_mod.WorkerRingReader(dls(workers)(), None, 2 * workers + 5,
                                              torch.cuda.current_device() if pinned else None)
                try:
                    yield from r
                finally:
                    r.close()

            return make

        def unregistered(f):
            # `f` with the ring left pageable: the loader threads copy each batch into the
            # staging pool.
            return ring_setting("REGISTER", False, f)

        def unstacked(f):
            # `f` with the workers collating, then copying into the ring (the way before
            # `worker_ring.STACK_SAMPLES`).
            return ring_setting("STACK_SAMPLES", False, f)

        sources = {
            "apex_dl4_pin": ("DataLoader(pin_memory, 4 workers) + APEX prefetcher",
                             lambda: timed(away(lambda: ApexPrefetcher(loader(), mean, std)), cl)),
            "generator": ("pinstream.torch.prefetch(generator), f16 NHWC", ours(generator)),
            "ideal_host_copy": ("the ideal plus a thread copying a batch on the host each 15 ms", ideal_host_copy),
            "ideal_gpu_work": ("the ideal plus a batch's copy and cast on a side stream", ideal_gpu_work),
            "ideal_fork": ("the ideal beside a forked child that sleeps", with_child(ideal)),
            "ideal_again": ("the ideal as a source (the method's own spread)", ideal),
            "ideal_dl4_discard": ("the ideal beside DataLoader(4 workers), its batches dropped",
                                  ideal_beside(dl(ds, 4))),
            "generator_fork": ("... generator, beside a forked child that sleeps", with_child(ours(generator))),
            "generator_process": ("... generator, process=True", ours(generator, process=True)),
            "dl4_views": ("pinstream.torch.prefetch(DataLoader, 4 workers)", ours(dl(ds, 4))),
            "dl4_views_threads12": ("... 4 workers, 12 loader threads", ours(dl(ds, 4), loader_threads=12)),
            "dl4_views_threads1": ("... 4 workers, 1 loader thread", ours(dl(ds, 4), loader_threads=1)),
            "dl4_views_threads2": ("... 4 workers, 2 loader threads", ours(dl(ds, 4), loader_threads=2)),
            "dl8_views": ("pinstream.torch.prefetch(DataLoader, 8 workers)", ours(dl(ds, 8))),
            "dl8_fresh": ("... 8 workers, a new shared tensor per batch", ours(dl(fresh_ds, 8))),
            "dl4_views_process": ("... 4 workers, process=True (a helper process, 1 thread)",
                                  ours(dl(ds, 4), process=True)),
            "dl4_views_process_threads2": ("... 4 workers, process=True, 2 loader threads",
                                           ours(dl(ds, 4), process=True, loader_threads=2)),
            "dl4_fresh_process": ("... 4 workers, process=True, a new shared tensor per batch",
                                  ours(dl(fresh_ds, 4), process=True)),
            "dl4_views_worker_ring": ("... 4 workers, worker_ring=True (1 thread)",
                                      ours(dl(ds, 4), worker_ring=True)),
            "dl4_views_worker_ring_threads2": ("... 4 workers, worker_ring=True, 2 loader threads",
                                               ours(dl(ds, 4), worker_ring=True, loader_threads=2)),
            "ideal_dl4_discard_child": ("the same, the DataLoader iterated in a forked child",
                                        ideal_beside_child(dl(ds, 4))),
            "dl4_views_worker_ring_copy1": ("... 4 workers, worker_ring=True, 1 copy thread a worker",
                                            worker_copy_threads(1, ours(dl(ds, 4), worker_ring=True))),
            "dl8_views_worker_ring": ("... 8 workers, worker_ring=True", ours(dl(ds, 8), worker_ring=True)),
            "dl4_fresh_worker_ring": ("... 4 workers, worker_ring=True, a new shared tensor per batch",
                                      ours(dl(fresh_ds, 4), worker_ring=True)),
            # A dataset of single images, DataLoader(batch_size=256): the workers' default_collate
            # stacks each batch into new shared memory.
            "apex_dl4s_pin": ("samples: DataLoader(batch_size=256, pin_memory, 4 workers) + APEX",
                              lambda: timed(away(lambda: ApexPrefetcher(dls(4, pin=True)(), mean, std)), cl)),
            "ideal_dl4s_discard": ("samples: the ideal beside DataLoader(batch_size=256, 4 workers), dropped",
                                   ideal_beside(dls(4))),
            "ideal_dl4s_discard_child": ("samples: the same, iterated in a forked child",
                                         ideal_beside_child(dls(4))),
            "ideal_dl4s_ring_discard": ("samples: the ideal beside the ring's reader, dropped (no DMA)",
                                        ideal_beside(ring_alone(4))),
            "ideal_dl4s_ring_pinned_discard": ("samples: the same, the ring page-locked",
                                               ideal_beside(ring_alone(4, pinned=True))),
            "dl4s": ("samples: pinstream.torch.prefetch(DataLoader(batch_size=256, 4 workers))", ours(dls(4))),
            "dl4s_process": ("samples: ... process=True", ours(dls(4), process=True)),
            "dl4s_worker_ring": ("samples: ... worker_ring=True (stacked into the ring)",
                                 ours(dls(4), worker_ring=True)),
            "dl4s_worker_ring_unkept": ("samples: ... worker_ring=True, the ring not kept (KEEP_RING=False)",
                                        ring_setting("KEEP_RING", False, ours(dls(4), worker_ring=True))),
            "dl4s_worker_ring_copy1": ("samples: ... worker_ring=True, 1 copy thread a worker",
                                       worker_copy_threads(1, ours(dls(4), worker_ring=True))),
            "dl4s_worker_ring_staged": ("samples: ... worker_ring=True, the ring not page-locked (copied)",
                                        unregistered(ours(dls(4), worker_ring=True))),
            "dl4s_worker_ring_unstacked": ("samples: ... worker_ring=True, collated then copied",
                                           unstacked(ours(dls(4), worker_ring=True))),
        }
        if pick:
            sources = {k: v for k, v in sources.items() if k in pick}
        # Rounds of the ideal and every source in turn, each source's time over the faster of the
        # ideals just before and after it, the median over the rounds: a machine whose speed
        # drifts within a run (up to 10 % on these) moves both alike.
        _TRACE["source"] = "ideal"
        ideals = [ideal()]
        per = {k: [] for k in sources}
        for _ in range(rounds):
            for k, (_, f) in sources.items():
                _TRACE["source"] = k
                per[k].append(f())
            _TRACE["source"] = "ideal_between"
            ideals.append(ideal())
        ratios = {k: [r[0] / min(ideals[j][0], ideals[j + 1][0]) for j, r in enumerate(v)]
                  for k, v in per.items()}
        # Over the mean of the two ideals beside it: the faster of two is biased (one sample
        # against the least of two, so the ideal itself comes out above 1).
        adjacent = {k: [ratios_.adjacent(r[0], ideals[j][0], ideals[j + 1][0]) for j, r in enumerate(v)]
                    for k, v in per.items()}
        results = {k: v[sorted(range(len(v)), key=lambda j: ratios[k][j])[len(v) // 2]]
                   for k, v in per.items()}
        assert all(abs(f - want) <= 1e-2 * abs(want) + 2 for f in first), (first, want)
        print(f"- {name}")
        print("    ideal (input already on the GPU), between the rounds: "
              + " / ".join(f"{t[0]:.2f}" for t in ideals) + f" ms, CPU {ideals[0][1]:7.2f} ms, "
              + " / ".join(f"{t[2]['main_cpu_ms']:.2f}" for t in ideals) + " training-thread CPU ms")
        for k, (label, _) in sources.items():
            r = results[k]
            print(f"    {label + ':':<52} {r[0]:7.2f} ms, CPU {r[1]:7.2f} ms  /ideal {statistics.median(ratios[k]):.3f}"
                  f"  /adjacent {statistics.median(adjacent[k]):.3f}"
                  f" [≈90 % {'–'.join(f'{x:.3f}' for x in ratios_.interval(adjacent[k]))}]"
                  f" ({' '.join(f'{x:.3f}' for x in adjacent[k])})"
                  f"  rounds {' '.join(f'{x:.3f}' for x in ratios[k])}  {r[2] or ''}")
        summary[name] = {
            "ideal_ms": [round(t[0], 2) for t in ideals],
            "rounds": rounds,
            "of_ideal": {k: round(statistics.median(v), 3) for k, v in ratios.items()},
            "of_ideal_rounds": {k: [round(x, 3) for x in v] for k, v in ratios.items()},
            "of_adjacent": {k: round(statistics.median(v), 3) for k, v in adjacent.items()},
            "of_adjacent_rounds": {k: [round(x, 3) for x in v] for k, v in adjacent.items()},
            # The median's 90 % distribution-free interval (order statistics; ratios.py).
            "of_adjacent_90": {k: [round(x, 3) for x in ratios_.interval(v)] for k, v in adjacent.items()},
            "cpu_ms": {"ideal": round(ideals[0][1], 1), **{k: round(r[1], 1) for k, r in results.items()}},
        }
        del model, opt, resident
    print(json.dumps(summary), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="upload,many,download,prefetch,dataloader,cifar,models")
    ap.add_argument("--configs", default="", help="dataloader: only these configurations (apex_dl4_pin always)")
    ap.add_argument("--worker-copy-threads", type=int, default=None,
                    help="dataloader, models: pinstream.worker_ring.WORKER_COPY_THREADS (threads a worker copies with)")
    ap.add_argument("--dl-batches", type=int, default=None, help="dataloader: timed batches per round (default 60)")
    ap.add_argument("--dl-warm", type=int, default=None, help="dataloader: untimed batches per round first (default 10)")
    ap.add_argument("--sharing", default=None,
                    help="torch.multiprocessing's sharing strategy for every DataLoader (file_descriptor, file_system)")
    ap.add_argument("--models", default="resnet18,resnet50", help="models: which models")
    ap.add_argument("--model-steps", type=int, default=None, help="models: timed steps per source (default 30)")
    ap.add_argument("--model-sources", default="", help="models: only these sources (the ideal always)")
    ap.add_argument("--main-cpu", type=int, default=None,
                    help="models: the training thread on this CPU's core, every source on the other CPUs")
    ap.add_argument("--model-rounds", type=int, default=1,
                    help="models: rounds of the ideal and every source in turn (the median ratio is reported)")
    ap.add_argument("--model-warmup", type=int, default=None,
                    help="models: untimed steps per source first (default 6; a DataLoader's or a helper's "
                         "fork makes the training process copy its pages on first write for a while)")
    ap.add_argument("--process-copy-threads", type=int, default=None,
                    help="process=True: the helper's copy threads (pinstream.process.COPY_THREADS)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval (seconds) for the whole run: how long a thread "
                         "waiting for the GIL lets the holder run before asking for it")
    ap.add_argument("--runq", action="store_true",
                    help="models: each step's run-queue waits of the training thread and the autograd "
                         "engine's (/proc schedstat), and those of the slowest steps")
    ap.add_argument("--phases", action="store_true",
                    help="models: each step's phases timed on the GPU with CUDA events (forward, backward "
                         "and sync, optimizer, to the next forward)")
    ap.add_argument("--trace", default=None,
                    help="models: each source's first round under torch.profiler, its GPU timeline "
                         "summed up and the trace saved in this folder")
    a = ap.parse_args()
    _TRACE["dir"] = a.trace
    _RUNQ[0] = a.runq
    _PHASES["on"] = a.phases
    if a.process_copy_threads is not None:
        from pinstream import process as process_mod

        process_mod.COPY_THREADS = a.process_copy_threads
    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)
    if a.sharing:
        torch.multiprocessing.set_sharing_strategy(a.sharing)
    if a.worker_copy_threads is not None:
        from pinstream import worker_ring as ring_mod

        ring_mod.WORKER_COPY_THREADS = a.worker_copy_threads
    print(f"# pinstream {pinstream.__version__} vs torch {torch.__version__} on {torch.cuda.get_device_name(0)}")
    only = a.only.split(",")
    if "upload" in only:
        bench_upload(a.quick)
    if "many" in only:
        bench_many()
    if "prefetch" in only:
        bench_prefetch(a.quick)
    if "dataloader" in only:
        bench_dataloader(a.quick, [c for c in a.configs.split(",") if c], a.dl_batches, a.dl_warm)
    if "download" in only:
        bench_download()
    if "cifar" in only:
        bench_cifar(a.quick)
    if "models" in only:
        if a.main_cpu is not None:
            pin_main(a.main_cpu)
        bench_models(a.quick, a.models.split(","), a.model_steps, [c for c in a.model_sources.split(",") if c],
                     a.model_warmup, a.model_rounds)


if __name__ == "__main__":
    main()
