"""Randomized faults against the Python prefetcher, like the crate's tests/faults.rs.

Each schedule draws an iterable that may raise in ``__iter__``, ``__next__`` or ``__del__``,
stall, reuse (refill) its array, yield a wrong shape, a wrong dtype or junk, or be closed
from another thread, iterated in the training process or in a helper process (``process=True``);
and a consumer that may break out of the loop, get a Ctrl-C
(``KeyboardInterrupt``, a real SIGINT from a timer thread) while it waits, and hold or drop
the batches. Invariants, for every schedule:

- it ends within a watchdog (``faulthandler`` kills the run with every thread's stack);
- every batch delivered is the next item's, equal to a numpy reference;
- an error is a ``LoaderError`` whose ``batch`` (and message) names the item at fault;
- afterwards no prefetcher is alive, no array is held, pinstream's threads are gone, and on a
  GPU the page-locked bytes in use and the device pool (after ``empty_cache``) are back to
  where they began.

``PINSTREAM_FAULT_SCHEDULES`` sets the number of schedules per mode (default 200: the CPU
run takes a few seconds); ``PINSTREAM_FAULT_SEED`` replays one run (the seed is in every
failure message). The ``dry_run`` mode runs everywhere; the ``device`` mode needs a GPU.
"""

import faulthandler
import gc
import multiprocessing
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

import pinstream

from conftest import needs_gpu

SCHEDULES = int(os.environ.get("PINSTREAM_FAULT_SCHEDULES", "200"))
SEED = int(os.environ.get("PINSTREAM_FAULT_SEED", str(int.from_bytes(os.urandom(4), "little"))))
WATCHDOG = 120  # seconds per schedule; generous: a hang, not a slow machine, trips it


class Fault(Exception):
    pass


def pinstream_threads():
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                # A prefetcher's own threads (the kernel keeps 15 bytes of a name). The
                # context's threads (the staging engine's, the release reaper) live on.
                if f.read().startswith(("pinstream-load", "pinstream-feed", "pinstream-clos")):
                    n += 1
        except OSError:
            pass
    return n


def reference(px, nhwc_in, nhwc_out, norm, dtype):
    x = px.astype(np.float64)
    if not nhwc_in:
        x = x.transpose(0, 2, 3, 1)
    if norm is not None:
        x = (x - np.array(norm[0])) / np.array(norm[1])
    return x if nhwc_out else x.transpose(0, 3, 1, 2)


class Source:
    """The iterable of one schedule; ``items`` are the reference pixels of what it yielded."""

    def __init__(self, rng, plan):
        self.rng, self.plan = rng, plan
        self.items = []
        self.buf = None
        self.stalled = threading.Event()
        self.release = threading.Event()
        # In a helper process the items are made there: their pixels come from a seed of
        # their own, which this process uses again for the reference.
        self.pix_seed = int(rng.integers(1 << 32)) if plan["process"] else None

    def pixels(self, i):
        if self.pix_seed is None:
            return self.items[i]
        return np.random.default_rng((self.pix_seed, i)).integers(0, 256, self.plan["shape"], dtype=np.uint8)

    def __iter__(self):
        if self.plan["fault"] == "iter":
            raise Fault("no iterator")
        return Iter(self)


class Iter:
    def __init__(self, src):
        self.src, self.i = src, 0

    def __iter__(self):
        return self

    def __next__(self):
        s, p = self.src, self.src.plan
        i = self.i
        self.i += 1
        if i >= p["n"]:
            raise StopIteration
        if i == p["k"]:
            f = p["fault"]
            if f == "raise":
                raise Fault(f"broke at {i}")
            if f == "shape":
                return s.rng.integers(0, 256, (2, 3, 4), dtype=np.uint8)
            if f == "channels":
                return np.zeros((1, 5, 2, 2) if not p["nhwc"] else (1, 2, 2, 5), np.uint8)
            if f == "empty":
                return np.zeros((0, 3, 2, 2), np.uint8)
            if f == "dtype":
                return s.rng.random(p["shape"]).astype(np.float32)
            if f == "junk":
                return None
            if f == "stall":
                if p["process"]:
                    time.sleep(0.2)  # no event reaches the helper: a stall of its own
                else:
                    s.stalled.set()
                    if not s.release.wait(WATCHDOG):
                        raise Fault("never released")
        if p["sleep"]:
            time.sleep(s.rng.random() * 0.01)
        px = s.pixels(i) if p["process"] else s.rng.integers(0, 256, p["shape"], dtype=np.uint8)
        if p["reuse"]:
            if s.buf is None:
                s.buf = np.empty(p["shape"], np.uint8)
            s.buf[...] = px
            px = s.buf
        s.items.append(px.copy())
        labels = np.arange(p["shape"][0], dtype=np.int64) + 1000 * i
        return (px, labels) if p["labels"] else px

    def __del__(self):
        if self.src.plan["del_raises"]:
            raise Fault("__del__")


def draw(rng):
    nhwc = bool(rng.integers(2))
    n, c, h, w = int(rng.integers(1, 4)), int(rng.choice([1, 3, 4])), int(rng.integers(1, 9)), int(rng.integers(1, 9))
    fault = str(rng.choice(["none", "none", "raise", "shape", "channels", "empty", "dtype", "junk",
                            "stall", "iter", "close"]))
    reuse = bool(rng.integers(2))
    return {
        "n": int(rng.integers(0, 9)),
        "k": int(rng.integers(0, 9)),
        "fault": fault,
        "shape": (n, h, w, c) if nhwc else (n, c, h, w),
        "nhwc": nhwc,
        "out_nhwc": bool(rng.integers(2)),
        "labels": bool(rng.integers(2)),
        "reuse": reuse,
        "zero_copy": (not reuse) and bool(rng.integers(2)),
        "del_raises": bool(rng.integers(4) == 0),
        "sleep": bool(rng.integers(2)),
        "dtype": str(rng.choice(["float32", "float16", "uint8"])),
        "normalize": bool(rng.integers(2)),
        "depth": int(rng.integers(1, 4)),
        "threads": int(rng.integers(1, 4)),
        "break_at": int(rng.integers(0, 12)),
        "interrupt": fault == "stall" and bool(rng.integers(2)),
        "hold": bool(rng.integers(2)),
        "close_after": float(rng.random() * 0.05),
        # Drawn last, so the schedules drawn before it stay as they were.
        "cpus": bool(rng.integers(2)),
        "process": bool(rng.integers(4) == 0),
    }


def host(x):
    return x if isinstance(x, np.ndarray) else pinstream.download(x)


def run_schedule(rng, plan, dry, where):
    src = Source(rng, plan)
    norm = None
    if plan["normalize"] and plan["dtype"] != "uint8":
        c = plan["shape"][3] if plan["nhwc"] else plan["shape"][1]
        norm = (list(rng.uniform(0, 255, c)), list(rng.uniform(1, 80, c)))
    kwargs = dict(
        normalize=norm,
        dtype=plan["dtype"],
        layout="nhwc" if plan["out_nhwc"] else "nchw",
        input_layout="nhwc" if plan["nhwc"] else "nchw",
        depth=plan["depth"],
        loader_threads=plan["threads"],
        zero_copy=plan["zero_copy"],
        dry_run=dry,
        process=plan["process"],
    )
    mask = os.sched_getaffinity(0)
    if plan["cpus"]:
        # The loaders (and `iter()`) on one CPU, whatever the fault: the caller's mask stays.
        kwargs["cpus"] = [max(mask)]
    if plan["process"]:
        # Nothing reaches the helper's copy of the source: no Ctrl-C timed to its stall.
        plan["interrupt"] = False
    if plan["fault"] == "iter":
        # From prefetch() itself, also with `process=True` (the helper's iter() is waited for).
        with pytest.raises((TypeError, Fault)):
            pinstream.prefetch(src, **kwargs)
        assert os.sched_getaffinity(0) == mask, where
        return
    pf = pinstream.prefetch(src, **kwargs)
    assert os.sched_getaffinity(0) == mask, where
    timers = []
    if plan["fault"] == "close":
        timers.append(threading.Timer(plan["close_after"], pf.close))
    waiting, done = threading.Event(), threading.Event()
    if plan["interrupt"]:
        def interrupt():
            # Only while the consumer waits in next() (it stops calling next at break_at).
            while not src.stalled.wait(0.05):
                if done.is_set():
                    return
            while not done.is_set():
                if waiting.wait(0.05):
                    time.sleep(0.1)
                    if waiting.is_set() and not done.is_set():
                        os.kill(os.getpid(), signal.SIGINT)
                    return
        timers.append(threading.Thread(target=interrupt, daemon=True))
    elif plan["fault"] == "stall":
        timers.append(threading.Timer(0.05, src.release.set))
    for t in timers:
        t.start()
    held, got, error, interrupted = [], 0, None, False
    tol = {"float32": 1e-5, "float16": 2e-3, "uint8": 0}[plan["dtype"]]
    try:
        while True:
            if got == plan["break_at"]:
                break
            try:
                waiting.set()
                try:
                    item = next(pf)
                finally:
                    waiting.clear()
            except StopIteration:
                break
            except KeyboardInterrupt:
                assert plan["interrupt"] and not src.release.is_set(), where
                interrupted = True
                src.release.set()
                continue
            except pinstream.LoaderError as e:
                error = e
                break
            x, y = (item if plan["labels"] else (item, None))
            want = reference(src.pixels(got), plan["nhwc"], plan["out_nhwc"], norm, plan["dtype"])
            have = host(x).astype(np.float64)
            assert have.shape == want.shape, (where, have.shape, want.shape)
            assert np.abs(have - want).max() <= tol * max(1.0, np.abs(want).max()), f"{where}: batch {got} differs"
            if y is not None:
                assert np.array_equal(host(y), np.arange(plan["shape"][0]) + 1000 * got), where
            if plan["hold"]:
                held.append(item)
            got += 1
    except KeyboardInterrupt:
        # A Ctrl-C that landed outside next() (in the checks): the schedule ends here.
        assert plan["interrupt"], where
        src.release.set()
        interrupted = True
    finally:
        done.set()
        src.release.set()
    faulty = plan["fault"] in ("raise", "shape", "channels", "empty", "dtype", "junk")
    if error is not None:
        assert faulty and error.batch == plan["k"] == got, (where, error.batch, got, repr(error))
        assert f"batch {plan['k']}" in str(error), (where, str(error))
    elif faulty and plan["k"] < plan["n"] and got < plan["break_at"] and plan["fault"] != "close":
        raise AssertionError(f"{where}: no error for the fault at item {plan['k']} ({got} batches)")
    if plan["fault"] not in ("close",) and error is None and not interrupted and got < plan["break_at"]:
        assert got == (min(plan["n"], plan["k"]) if faulty else plan["n"]), (where, got)
    for t in timers:
        t.join(WATCHDOG)
    pf.close()
    del pf, held, src
    assert os.sched_getaffinity(0) == mask, where


def settle(base, where):
    """Waits (bounded) until pinstream holds what it held at the start."""
    # A watchdog against a leak that never returns (not a speed bound): bounded by polls.
    for _ in range(WATCHDOG * 25):  # polls, 20 ms apart (under the schedule watchdog)
        gc.collect()
        stats = pinstream.memory_stats()
        helpers = [c for c in multiprocessing.active_children() if c.name == "pinstream-helper"]
        if (stats["prefetchers"] == 0 and stats["held_arrays"] == 0 and pinstream_threads() <= base
                and not helpers):
            return stats
        time.sleep(0.02)
    raise AssertionError(f"{where}: left behind: {stats}, threads {pinstream_threads()} > {base}, "
                         f"helpers {helpers}")


@pytest.mark.parametrize("dry", [pytest.param(True, id="dry_run"),
                                 pytest.param(False, id="device", marks=needs_gpu)])
def test_random_fault_schedules(dry):
    rng = np.random.default_rng(SEED)
    threads0 = pinstream_threads()
    if not dry:
        # Warm up (contexts, pools), then the baseline.
        list(pinstream.prefetch([rng.integers(0, 256, (1, 3, 2, 2), dtype=np.uint8)]))
        # The device's context keeps threads of its own (the staging engine's, the release
        # reaper): the thread baseline is taken after the warm-up.
        settle(1 << 30, "warm-up")
        pinstream.synchronize()
        pinstream.empty_cache()
    threads0 = pinstream_threads()
    base = pinstream.memory_stats()
    for s in range(SCHEDULES):
        plan = draw(rng)
        where = f"seed {SEED} schedule {s}: {plan}"
        faulthandler.dump_traceback_later(WATCHDOG, exit=True, file=sys.__stderr__)
        try:
            run_schedule(rng, plan, dry, where)
            settle(threads0, where)
        finally:
            faulthandler.cancel_dump_traceback_later()
    if not dry:
        pinstream.synchronize()
        pinstream.empty_cache()
        end = pinstream.memory_stats()
        assert end["pinned_in_use_bytes"] <= base["pinned_in_use_bytes"], (SEED, base, end)
        assert end["device_reserved_bytes"] <= base["device_reserved_bytes"], (SEED, base, end)
