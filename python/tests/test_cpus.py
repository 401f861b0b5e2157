"""``cpus=``: the CPUs a prefetcher's or an image feed's threads run on, whatever the calling
thread's own mask (a training thread pinned to a CPU of its own must not drag the loaders onto
it). The prefetcher is checked without a GPU (``dry_run``: its loader threads call the
iterable, which records their mask); the feed's threads, on a GPU, through /proc. Bad lists are
``InvalidArgumentError``s on any machine and change nothing."""

import contextlib
import itertools
import os

import numpy as np
import pytest

import pinstream

from conftest import GPU_REASON, make_jpegs, needs_gpu


@contextlib.contextmanager
def pinned_to_first():
    """The calling thread on its first CPU (as a training thread pinned by its user); its mask
    comes back afterwards. Yields (first, last, all)."""
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[0]})
    try:
        yield cpus[0], cpus[-1], cpus
    finally:
        os.sched_setaffinity(0, set(cpus))


def pinstream_threads():
    """{thread id: (name, CPUs allowed)} of this process's ``pinstream…`` threads."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if name.startswith("pinstream"):
            out[tid] = (name, os.sched_getaffinity(int(tid)))
    return out


def batches(n, seen):
    rng = np.random.default_rng(3)
    for i in range(n):
        seen.append(os.sched_getaffinity(0))
        yield rng.integers(1, 256, (2, 3, 8, 8), dtype=np.uint8), np.arange(2) + 10 * i


@pytest.mark.parametrize("given", ["list", "set", "range", "generator"])
def test_prefetch_loaders_run_on_the_cpus_given(given):
    with pinned_to_first() as (first, last, _):
        make = {
            "list": lambda: [last],
            "set": lambda: {last},
            "range": lambda: range(last, last + 1),
            "generator": lambda: (c for c in [last, last]),
        }[given]
        seen = []
        p = pinstream.prefetch(batches(6, seen), dry_run=True, loader_threads=3, cpus=make())
        assert os.sched_getaffinity(0) == {first}
        labels = [list(y) for _, y in p]
        assert labels == [[10 * i, 10 * i + 1] for i in range(6)]
        assert len(seen) >= 6 and all(s == {last} for s in seen), seen
        assert os.sched_getaffinity(0) == {first}
        p.close()


def test_prefetch_without_cpus_inherits_the_callers():
    """The default is unchanged: loaders start with the caller's mask (here one CPU)."""
    with pinned_to_first() as (first, _, _):
        seen = []
        p = pinstream.prefetch(batches(3, seen), dry_run=True, loader_threads=2)
        assert len(list(p)) == 3
        assert seen and all(s == {first} for s in seen), seen
        p.close()


BAD = [
    [],
    [-1],
    [pinstream.MAX_CPUS],
    [0, 2**64],
    [True],
    [0.0],
    ["0"],
    "0",
    b"\x00",
    3,
    object(),
    [0] * (pinstream.MAX_CPUS + 1),
    itertools.count(),
    iter([None]),
    {1: "a"},
    bytearray(b"\x00"),
    memoryview(b"\x00"),
]


@pytest.mark.parametrize("bad", BAD, ids=lambda b: repr(b)[:30])
def test_bad_cpus_are_typed_errors_and_change_nothing(bad, tmp_path):
    before = os.sched_getaffinity(0)
    with pytest.raises(pinstream.InvalidArgumentError, match="cpus"):
        pinstream.prefetch(batches(3, []), dry_run=True, cpus=bad)
    assert os.sched_getaffinity(0) == before
    items = make_jpegs(tmp_path, 2)
    with pytest.raises(pinstream.InvalidArgumentError, match="cpus"):
        pinstream.ImageFeed(items, 2, rank=0, world_size=1, cpus=bad)
    assert os.sched_getaffinity(0) == before


def test_cpus_none_of_which_exist_is_a_typed_error():
    """A CPU number below MAX_CPUS that this machine does not have: the OS refuses it."""
    have = os.sched_getaffinity(0)
    absent = pinstream.MAX_CPUS - 1
    if absent in have:
        pytest.skip("this machine has every CPU")
    with pytest.raises(pinstream.InvalidArgumentError, match="may run on"):
        pinstream.prefetch(batches(3, []), dry_run=True, cpus=[absent])
    assert os.sched_getaffinity(0) == have
    # The feed refuses it before it walks the folder or makes the device's context.
    with pytest.raises(pinstream.InvalidArgumentError, match="may run on"):
        pinstream.ImageFeed("/nonexistent-folder", 2, rank=0, world_size=1, cpus=[absent])
    assert os.sched_getaffinity(0) == have


@needs_gpu
@pytest.mark.parametrize("decode", ["auto", "cpu"])
def test_feed_threads_run_on_the_cpus_given(tmp_path, decode):
    items = make_jpegs(tmp_path, 24)
    with pinned_to_first() as (first, last, _):
        before = set(pinstream_threads())
        feed = pinstream.ImageFeed(items, 8, size=32, decode=decode, rank=0, world_size=1, cpus=[last])
        assert os.sched_getaffinity(0) == {first}
        got = [tuple(x.shape) for x, _ in feed]
        assert got == [(8, 3, 32, 32)] * 3
        new = {t: v for t, v in pinstream_threads().items() if t not in before}
        assert new, "no pinstream threads"
        for name, cpus in new.values():
            assert cpus == {last}, (name, cpus)
        # A second epoch (and a rebuilt feed after load_state_dict) keeps them there.
        state = feed.state_dict()
        feed.load_state_dict(state)
        assert len(list(feed)) == 3
        for tid, (name, cpus) in pinstream_threads().items():
            if tid not in before:
                assert cpus == {last}, (name, cpus)
        assert os.sched_getaffinity(0) == {first}
        feed.close()


@pytest.mark.skipif(GPU_REASON is None, reason="the GPU case is the test above")
def test_feed_cpus_checked_before_the_device(tmp_path):
    """Without a GPU a good list gets as far as the device (never an InvalidArgumentError)."""
    items = make_jpegs(tmp_path, 2)
    with pytest.raises(pinstream.PinstreamError) as got:
        pinstream.ImageFeed(items, 2, rank=0, world_size=1, cpus=sorted(os.sched_getaffinity(0)))
    assert not isinstance(got.value, pinstream.InvalidArgumentError), got.value


class RecordsIter:
    """An iterable whose ``__iter__`` notes the mask it runs with (a DataLoader forks its
    workers there, and they keep that mask)."""

    def __init__(self):
        self.at_iter = None
        self.seen = []

    def __iter__(self):
        self.at_iter = os.sched_getaffinity(0)
        return batches(3, self.seen)


def test_prefetch_starts_the_iterable_on_the_cpus_given():
    with pinned_to_first() as (first, last, _):
        src = RecordsIter()
        p = pinstream.prefetch(src, dry_run=True, cpus=[last])
        assert src.at_iter == {last}
        assert os.sched_getaffinity(0) == {first}
        assert len(list(p)) == 3
        p.close()
        src = RecordsIter()
        p = pinstream.prefetch(src, dry_run=True)
        assert src.at_iter == {first}
        p.close()


class Index:
    """An entry whose ``__index__`` raises what it was given."""

    def __init__(self, exc):
        self.exc = exc

    def __index__(self):
        raise self.exc


def test_what_the_list_raises_reaches_the_caller():
    """Ctrl-C (or any error) raised while ``cpus`` is read is not turned into a bad list."""
    before = os.sched_getaffinity(0)
    with pytest.raises(KeyboardInterrupt):
        pinstream.prefetch(batches(3, []), dry_run=True, cpus=[Index(KeyboardInterrupt())])

    def midway():
        yield 0
        raise TypeError("the user's own")

    with pytest.raises(TypeError, match="the user's own"):
        pinstream.prefetch(batches(3, []), dry_run=True, cpus=midway())
    with pytest.raises(pinstream.InvalidArgumentError, match="cpus"):
        pinstream.prefetch(batches(3, []), dry_run=True, cpus=[Index(ValueError("no"))])
    assert os.sched_getaffinity(0) == before


class IterRaises:
    def __init__(self, exc):
        self.exc = exc
        self.calls = 0

    def __iter__(self):
        self.calls += 1
        raise self.exc


def test_what_iter_raises_reaches_the_caller_and_settings_come_first():
    """``iter()`` (where a DataLoader starts its workers) runs only once every setting passed,
    and what it raises comes out as it is, the caller's mask restored."""
    with pinned_to_first() as (first, last, _):
        src = IterRaises(KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            pinstream.prefetch(src, dry_run=True, cpus=[last])
        assert os.sched_getaffinity(0) == {first} and src.calls == 1
        src = IterRaises(RuntimeError("workers failed"))
        with pytest.raises(RuntimeError, match="workers failed"):
            pinstream.prefetch(src, dry_run=True, cpus=[last])
        for bad in [dict(depth=0), dict(loader_threads=0), dict(cpus=[])]:
            src = IterRaises(RuntimeError("must not run"))
            with pytest.raises(pinstream.InvalidArgumentError):
                pinstream.prefetch(src, dry_run=True, **bad)
            assert src.calls == 0, bad
        assert os.sched_getaffinity(0) == {first}
    with pytest.raises(TypeError, match="not iterable"):
        pinstream.prefetch(5, dry_run=True)


class LookupRaises:
    """Not iterable, and its attribute lookup raises Ctrl-C."""

    def __getattr__(self, name):
        raise KeyboardInterrupt


def test_settings_before_iter_and_the_walk_and_lookups_propagate():
    src = IterRaises(RuntimeError("must not run"))
    with pytest.raises(pinstream.InvalidArgumentError, match="device"):
        pinstream.prefetch(src, device=-1)
    assert src.calls == 0
    with pytest.raises(KeyboardInterrupt):
        pinstream.prefetch(LookupRaises(), dry_run=True)
    for bad in [dict(dtype="int7"), dict(device=-1)]:
        with pytest.raises(pinstream.InvalidArgumentError):
            pinstream.ImageFeed("/nonexistent-folder", 2, rank=0, world_size=1, **bad)
