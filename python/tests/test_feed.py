"""pinstream.ImageFeed (issue 32): the Rust image feed from Python.

Labels are the files' indices here, so each batch's labels say which files it holds: the order,
the shares of the ranks and a resume are checked through them, and the pixels through their
checksums. The tests that need a GPU are skipped without one; argument errors and the
distributed defaults are checked anywhere.
"""

import os
import signal
import threading

import numpy as np
import pytest

import pinstream
from pinstream.feed import distributed_defaults

from conftest import GPU_REASON, make_jpegs, needs_gpu


def batches(feed):
    """One epoch as a list of (labels, pixels as float64 numpy)."""
    out = []
    for x, y in feed:
        out.append((pinstream.download(y).tolist(), _host(x)))
    return out


def _host(x):
    a = pinstream.download(x)
    if a.dtype == np.uint16:  # bfloat16's bits
        a = (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float64)


# --- anywhere ---------------------------------------------------------------------------------


def test_distributed_defaults_from_env(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert distributed_defaults() == (0, 1)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert distributed_defaults() == (2, 4)
    assert distributed_defaults(rank=1) == (1, 4)
    assert distributed_defaults(rank=0, world_size=1) == (0, 1)
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(pinstream.InvalidArgumentError, match="rank 4 of world size 4"):
        distributed_defaults()
    monkeypatch.delenv("RANK")
    with pytest.raises(pinstream.InvalidArgumentError, match="no RANK"):
        distributed_defaults()  # torchrun sets both; one alone would duplicate rank 0's share
    assert distributed_defaults(rank=3) == (3, 4)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(pinstream.InvalidArgumentError, match="RANK"):
        distributed_defaults()
    with pytest.raises(pinstream.InvalidArgumentError):
        distributed_defaults(rank=0, world_size=0)
    with pytest.raises(pinstream.InvalidArgumentError):
        distributed_defaults(rank=True, world_size=2)


def test_bad_arguments_are_typed_before_any_gpu(tmp_path, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    items = [(str(tmp_path / "a.jpg"), 0)]
    for kwargs, kind in [
        (dict(layout="CHWN"), pinstream.InvalidArgumentError),
        (dict(decode="tpu"), pinstream.InvalidArgumentError),
        (dict(bad_files="ignore"), pinstream.InvalidArgumentError),
        (dict(batch_size=0), pinstream.InvalidArgumentError),
        (dict(threads=0), pinstream.InvalidArgumentError),
        (dict(size=(224,)), pinstream.InvalidArgumentError),
        (dict(normalize=(1, 2)), pinstream.InvalidArgumentError),
        (dict(rank=3, world_size=2), pinstream.InvalidArgumentError),
        (dict(seed=-1), pinstream.InvalidArgumentError),
        (dict(seed=2**64), pinstream.InvalidArgumentError),
        (dict(batch_size=2**64), pinstream.InvalidArgumentError),
        (dict(threads=2**70), pinstream.InvalidArgumentError),
        # Integers only, numpy's too (accepted in the test below), never a bool, float or str.
        (dict(threads=True), pinstream.InvalidArgumentError),
        (dict(threads=np.bool_(True)), pinstream.InvalidArgumentError),
        (dict(threads=2.0), pinstream.InvalidArgumentError),
        (dict(threads="2"), pinstream.InvalidArgumentError),
        (dict(depth=np.float64(2)), pinstream.InvalidArgumentError),
        (dict(threads=np.int64(-1)), pinstream.InvalidArgumentError),
        (dict(cache_bytes=-1), pinstream.InvalidArgumentError),
        (dict(cache_bytes=2.5e9), pinstream.InvalidArgumentError),
        (dict(cache_bytes=1 << 20, decode="cpu"), pinstream.InvalidArgumentError),
    ]:
        with pytest.raises(kind):
            pinstream.ImageFeed(items, **{"batch_size": 4, **kwargs})
    with pytest.raises(pinstream.InvalidArgumentError, match="negative"):
        pinstream.ImageFeed([(str(tmp_path / "a.jpg"), -1)], 4)
    with pytest.raises(pinstream.InvalidArgumentError):
        pinstream.ImageFeed([("a.jpg",)], 4)
    with pytest.raises(pinstream.IoError):
        pinstream.ImageFeed(str(tmp_path / "no such folder"), 4)


def test_default_settings_are_valid(tmp_path, monkeypatch):
    """Every default the binding picks passes the Rust feed's checks, on any machine: without a
    GPU the device is what fails (never an InvalidArgumentError); with one, the feed starts."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    items = make_jpegs(tmp_path, 4, seed=7)
    for kwargs in [{}, dict(decode="cpu"), dict(train=False), dict(threads=16, depth=16),
                   dict(threads=np.int64(2), depth=np.int32(3), seed=np.uint64(7))]:
        if GPU_REASON is None:
            pinstream.ImageFeed(items, 2, **kwargs).close()
            continue
        with pytest.raises(pinstream.PinstreamError) as got:
            pinstream.ImageFeed(items, 2, **kwargs)
        assert not isinstance(got.value, pinstream.InvalidArgumentError), got.value


# --- on a GPU ---------------------------------------------------------------------------------


@needs_gpu
@pytest.mark.parametrize("decode", ["auto", "cpu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "uint8"])
def test_shapes_labels_and_epochs(tmp_path, decode, dtype):
    items = make_jpegs(tmp_path, 40)
    with pinstream.ImageFeed(items, 16, size=64, decode=decode, dtype=dtype, rank=0, world_size=1) as feed:
        assert len(feed) == 3
        for epoch in range(2):
            got = batches(feed)
            assert [len(y) for y, _ in got] == [16, 16, 8]
            assert [x.shape for _, x in got] == [(16, 3, 64, 64), (16, 3, 64, 64), (8, 3, 64, 64)]
            assert sorted(sum((y for y, _ in got), [])) == list(range(40))
            assert feed.position == (epoch + 1, 0)
            if dtype != "uint8":
                x = np.concatenate([x for _, x in got])
                assert np.isfinite(x).all() and x.std() > 0.3  # normalized, not constant
        assert feed.decoding in ("gpu", "cpu")


@needs_gpu
def test_loader_threads_default_by_route_and_explicit_kept(tmp_path):
    """``threads=None`` runs 2 loaders decoding on the GPU (more contend with a training step
    for the GPU) and 4 on the CPU; an explicit count is kept on both routes."""
    items = make_jpegs(tmp_path, 8, seed=5)
    common = dict(size=32, rank=0, world_size=1)
    with pinstream.ImageFeed(items, 4, decode="cpu", **common) as c:
        assert c.threads == 4
        assert len(batches(c)) == 2
    with pinstream.ImageFeed(items, 4, decode="cpu", threads=3, **common) as c:
        assert c.threads == 3
    with pinstream.ImageFeed(items, 4, decode="auto", **common) as a:
        assert a.threads == (2 if a.decoding == "gpu" else 4)
        assert len(batches(a)) == 2
    with pinstream.ImageFeed(items, 4, decode="auto", threads=5, **common) as a:
        assert a.threads == 5
        assert len(batches(a)) == 2


@needs_gpu
def test_gpu_and_cpu_decoding_agree(tmp_path):
    items = make_jpegs(tmp_path, 24, seed=3)
    common = dict(size=96, train=False, resize=110, dtype="float32", rank=0, world_size=1)
    with pinstream.ImageFeed(items, 8, decode="auto", **common) as g:
        if g.decoding != "gpu":
            pytest.skip("nvJPEG or a JPEG engine is missing here")
        gpu = batches(g)
    with pinstream.ImageFeed(items, 8, decode="cpu", **common) as c:
        cpu = batches(c)
    for (ly, x), (lc, xc) in zip(gpu, cpu):
        assert ly == lc
        # The decoders differ by about a level of 255 on average (std ~58 on that scale).
        assert np.abs(x - xc).mean() < 2.0 / 58.0


@needs_gpu
def test_resume_twice_in_one_epoch_replays_the_same_batches(tmp_path):
    items = make_jpegs(tmp_path, 50, seed=5)
    kw = dict(size=48, seed=11, dtype="float32", rank=0, world_size=1)
    with pinstream.ImageFeed(items, 6, **kw) as ref:
        ref.set_epoch(2)
        want = batches(ref)
    assert len(want) == 9
    got = []
    a = pinstream.ImageFeed(items, 6, **kw)
    a.set_epoch(2)
    it = iter(a)
    for _ in range(3):
        x, y = next(it)
        got.append((pinstream.download(y).tolist(), _host(x)))
    state = a.state_dict()
    a.close()
    assert (state["epoch"], state["batch"]) == (2, 3)
    b = pinstream.ImageFeed(items, 6, **dict(kw, seed=0))  # the state brings its seed
    b.load_state_dict(state)
    b.set_epoch(2)  # at the top of the epoch's loop: keeps the resumed position
    it = iter(b)
    for _ in range(4):
        x, y = next(it)
        got.append((pinstream.download(y).tolist(), _host(x)))
    state = b.state_dict()
    b.close()
    c = pinstream.ImageFeed(items, 6, **kw)
    c.load_state_dict(state)
    got += batches(c)
    assert c.position == (3, 0)
    c.close()
    assert [y for y, _ in got] == [y for y, _ in want]
    for (_, x), (_, w) in zip(got, want):
        np.testing.assert_array_equal(x, w)


@needs_gpu
def test_cache_gives_the_same_batches_and_decodes_once(tmp_path):
    """``cache_bytes``: three epochs equal, bit for bit, to a feed whose cache holds nothing
    (``cache_bytes=1``: every image decoded whole, as with any cache), and within float rounding
    to one without a cache; the third epoch decodes nothing; a jump (``set_epoch``) starts over
    with an empty cache and the same batches. Half the files 4:4:4 (which a feed without a cache
    decodes as the crop's region only), half 4:2:0."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    items = make_jpegs(tmp_path / "a", 20, seed=9, subsampling=0) + make_jpegs(tmp_path / "b", 20, seed=8)
    items = [(p, i) for i, (p, _) in enumerate(items)]
    kw = dict(size=40, seed=3, dtype="float32", rank=0, world_size=1)
    with pinstream.ImageFeed(items, 8, **kw) as plain:
        if plain.decoding != "gpu":
            pytest.skip("nvJPEG or a JPEG engine is missing here")
        nocache = [batches(plain) for _ in range(3)]
    with pinstream.ImageFeed(items, 8, cache_bytes=1, **kw) as empty:
        want = [batches(empty) for _ in range(3)]
        assert empty.stats()["cache_images"] == 0
    for e in range(3):
        assert len(nocache[e]) == len(want[e]) == 5
        for (ly, x), (lw, w) in zip(nocache[e], want[e]):
            assert ly == lw
            np.testing.assert_allclose(x, w, rtol=0, atol=1e-3)
    with pinstream.ImageFeed(items, 8, cache_bytes=64 << 20, **kw) as feed:
        decoded = []
        for e in range(3):
            got = batches(feed)
            assert len(got) == len(want[e]) and [y for y, _ in got] == [y for y, _ in want[e]]
            for (_, x), (_, w) in zip(got, want[e]):
                np.testing.assert_array_equal(x, w)
            st = feed.stats()
            decoded.append(st["hardware"] + st["cuda"] + st["cpu"])
        assert st["cache_budget"] == 64 << 20 and st["cache_images"] == 40, st
        assert 0 < st["cache_used"] <= 64 << 20 and st["cache_hits"] >= 40, st
        assert st["cache_failures"] == 0, st
        # The loaders run ahead of the consumer: epoch 2 may decode a few again, epoch 3 none.
        assert decoded[2] == decoded[1] < 80, decoded
        feed.set_epoch(0)  # a new native feed, its cache made again
        again = batches(feed)
        assert len(again) == 5 and [y for y, _ in again] == [y for y, _ in want[0]]
        for (_, x), (_, w) in zip(again, want[0]):
            np.testing.assert_array_equal(x, w)


@needs_gpu
def test_cache_larger_than_the_device_is_refused(tmp_path):
    items = make_jpegs(tmp_path, 4, seed=9)
    with pytest.raises(pinstream.InvalidArgumentError, match="gpu_cache_bytes"):
        pinstream.ImageFeed(items, 2, cache_bytes=1 << 50, decode="gpu", rank=0, world_size=1)


@needs_gpu
def test_epochs_differ_and_set_epoch(tmp_path):
    items = make_jpegs(tmp_path, 30, seed=6)
    with pinstream.ImageFeed(items, 10, size=32, rank=0, world_size=1) as feed:
        e0 = [y for y, _ in batches(feed)]
        e1 = [y for y, _ in batches(feed)]
        assert e0 != e1
        feed.set_epoch(0)
        assert [y for y, _ in batches(feed)] == e0


@needs_gpu
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_are_disjoint_equal_and_cover_the_list(tmp_path, drop_last):
    items = make_jpegs(tmp_path, 41, seed=7)
    shares = []
    for r in range(4):
        with pinstream.ImageFeed(items, 4, size=32, rank=r, world_size=4, drop_last=drop_last) as f:
            assert (f.rank, f.world_size) == (r, 4)
            shares.append(sum((y for y, _ in batches(f)), []))
    lengths = {len(s) for s in shares}
    assert len(lengths) == 1, lengths
    every = sum(shares, [])
    if drop_last:
        # 10 files a rank (41 // 4), in whole batches of 4: 8 each, no file twice.
        assert len(every) == 32 and len(set(every)) == 32
    else:
        # DistributedSampler: padded to 44 by wrapping around; every file at least once.
        assert len(every) == 44 and set(every) == set(range(41))


@needs_gpu
def test_state_of_another_world_is_refused(tmp_path):
    items = make_jpegs(tmp_path, 12, seed=8)
    with pinstream.ImageFeed(items, 4, size=32, rank=0, world_size=2) as a:
        state = a.state_dict()
    with pinstream.ImageFeed(items, 4, size=32, rank=0, world_size=1) as b:
        with pytest.raises(pinstream.InvalidArgumentError, match="world_size"):
            b.load_state_dict(state)
        with pytest.raises(pinstream.InvalidArgumentError):
            b.load_state_dict(dict(b.state_dict(), batch=99))
        with pytest.raises(pinstream.InvalidArgumentError):
            b.load_state_dict({"epoch": 1})
        with pytest.raises(pinstream.InvalidArgumentError, match="version"):
            b.load_state_dict(dict(b.state_dict(), version=True))
        assert len(batches(b)) == 3  # still usable


@needs_gpu
@pytest.mark.parametrize("decode", ["auto", "cpu"])
def test_bad_file_is_named_or_skipped(tmp_path, decode):
    items = make_jpegs(tmp_path, 10, seed=9)
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 this is not a jpeg")
    items.append((str(bad), 10))
    with pinstream.ImageFeed(items, 11, size=32, decode=decode, rank=0, world_size=1) as feed:
        with pytest.raises(pinstream.PinstreamError, match="broken.jpg"):
            batches(feed)
    with pinstream.ImageFeed(items, 11, size=32, decode=decode, bad_files="skip", rank=0, world_size=1) as feed:
        (labels, x), = batches(feed)
        assert sorted(labels) == list(range(10)) and x.shape[0] == 10
        # Counted each time the file is met; the loaders may have met it in later epochs too.
        stats = feed.stats()
        assert stats["skipped"] >= 1 and stats["skipped_files"][0][0].endswith("broken.jpg")


@needs_gpu
def test_ctrl_c_while_waiting_loses_nothing_and_a_fifo_is_refused(tmp_path):
    from PIL import Image

    # Eight large JPEGs decoded by one CPU loader: seconds of waiting for the first batch.
    rng = np.random.default_rng(10)
    items = []
    for i in range(8):
        small = rng.integers(0, 256, (400, 400, 3), dtype=np.uint8)
        img = np.kron(small, np.ones((8, 8, 1), np.uint8))
        path = tmp_path / f"big{i}.jpg"
        Image.fromarray(img).save(path, quality=95)
        items.append((str(path), i))
    fifo = tmp_path / "pipe.jpg"
    os.mkfifo(fifo)  # not a regular file: refused without blocking on it
    items.append((str(fifo), 8))
    feed = pinstream.ImageFeed(items, 8, size=32, threads=1, decode="cpu", depth=1,
                               rank=0, world_size=1, shuffle=False)
    timer = threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        next(iter(feed))
    timer.join()
    x, y = next(iter(feed))  # the batch that was on its way
    assert pinstream.download(y).tolist() == list(range(8))
    with pytest.raises(pinstream.PinstreamError, match="pipe.jpg"):
        next(iter(feed))
    feed.close()


@needs_gpu
def test_closed_feed_raises_and_batches_outlive_it(tmp_path):
    items = make_jpegs(tmp_path, 8, seed=12)
    feed = pinstream.ImageFeed(items, 4, size=32, dtype="float32", rank=0, world_size=1)
    x, y = next(iter(feed))
    feed.close()
    feed.close()
    with pytest.raises(pinstream.InvalidArgumentError, match="closed"):
        next(iter(feed))
    a = _host(x)
    assert a.shape == (4, 3, 32, 32) and np.isfinite(a).all()
    assert set(pinstream.download(y).tolist()) <= set(range(8))


@needs_gpu
def test_torch_feed_on_another_stream(tmp_path):
    torch = pytest.importorskip("torch")
    import pinstream.torch as pt

    items = make_jpegs(tmp_path, 20, seed=13)
    side = torch.cuda.Stream()
    sums = []
    with torch.cuda.stream(side):
        with pt.image_feed(items, 8, size=40, rank=0, world_size=1, train=False) as feed:
            for x, y in feed:
                assert x.is_cuda and x.dtype == torch.bfloat16 and x.shape[1:] == (3, 40, 40)
                assert y.dtype == torch.int64 and y.is_cuda
                sums.append(float(x.float().sum()))
    with pinstream.ImageFeed(items, 8, size=40, rank=0, world_size=1, train=False, dtype="bfloat16") as ref:
        want = [float(x.sum()) for _, x in batches(ref)]
    np.testing.assert_allclose(sums, want, rtol=1e-3)


@needs_gpu
@pytest.mark.parametrize("decode", ["cpu", "auto"])
def test_released_batches_are_rewritten_only_after_the_consumer_read_them(tmp_path, decode):
    """Each batch is released at once while the consumer's stream is still busy (a sleep
    queued before its reads): the feed must reuse its memory only after those reads ran. Every
    batch's sum, computed on the busy stream, matches a reference. With CPU decoding the feed
    also keeps going meanwhile (`depth + threads` batches)."""
    torch = pytest.importorskip("torch")
    import pinstream.torch as pt

    items = make_jpegs(tmp_path, 48, seed=21)
    kw = dict(size=32, rank=0, world_size=1, train=False, threads=1, depth=3, decode=decode)
    with pinstream.ImageFeed(items, 4, dtype="bfloat16", **kw) as ref:
        want = [float(x.sum()) for _, x in batches(ref)]
    stream = torch.cuda.current_stream()
    sums, busy = [], []
    with pt.image_feed(items, 4, **kw) as feed:
        it = iter(feed)
        x, y = next(it)  # the feed is up: its loaders have claimed the next batches
        torch.cuda._sleep(10_000_000_000)  # seconds of GPU clocks on the consumer's stream
        while True:
            busy.append(not stream.query())
            sums.append(x.float().sum())  # queued behind the sleep
            del x, y  # released at once: its memory's reuse must wait for the sum
            if len(sums) == len(want):
                break
            x, y = next(it)
        torch.cuda.synchronize()
    np.testing.assert_allclose([float(s) for s in sums], want, rtol=1e-3)
    ahead = all(busy[:4])
    if decode == "cpu":
        assert ahead, f"the feed waited for the consumer's stream: {busy}"
    elif not ahead:
        # Seen on an H200, 2026-11-27: the first CUDA call on the host after the sleep, made
        # while a loader is decoding with nvJPEG, waits for the sleep (BENCHMARKS.md, third
        # session). Not yet explained; the batches are right all the same (checked above).
        pytest.xfail(f"GPU decoding waits for the consumer's queued work: {busy}")


class _FakeNative:
    """A stand-in for the native feed (no GPU): records what it was made with; making it at an
    epoch in ``fail`` raises."""

    fail = set()
    made = []

    def __init__(self, **kw):
        if kw["start_epoch"] in _FakeNative.fail:
            raise MemoryError(f"no room at epoch {kw['start_epoch']}")
        self.kw = kw
        self.pos = (kw["start_epoch"], kw["start_batch"])
        self.closed = False
        self.batches_per_epoch = 10
        self.files = 40
        _FakeNative.made.append(self)

    def position(self):
        return self.pos

    def close(self):
        self.closed = True


def _fake_feed(tmp_path, monkeypatch, fail=()):
    monkeypatch.setattr(pinstream.feed._native, "ImageFeed", _FakeNative)
    _FakeNative.fail, _FakeNative.made = set(fail), []
    items = [(str(tmp_path / f"{i}.jpg"), 0) for i in range(40)]
    return pinstream.ImageFeed(items, 4, cache_bytes=1 << 20, seed=7, rank=0, world_size=1)


def test_cache_jump_that_fails_keeps_the_old_seed_and_position(tmp_path, monkeypatch):
    """With a cache, a jump closes the old native feed first. Where the new one cannot be made,
    the old one is made again at its position with its own seed (not the state's), and the
    error is the new one's (no GPU: a stand-in native feed)."""
    f = _fake_feed(tmp_path, monkeypatch, fail={5})
    f._native.pos = (1, 3)
    state = dict(f.state_dict(), epoch=5, batch=0, seed=99)
    with pytest.raises(MemoryError, match="epoch 5"):
        f.load_state_dict(state)
    assert _FakeNative.made[0].closed and f._native is _FakeNative.made[-1]
    assert f._native.kw["seed"] == 7 and f._native.pos == (1, 3)
    assert f.state_dict()["seed"] == 7 and f.position == (1, 3)
    # A jump that works takes the state's seed.
    f.load_state_dict(dict(state, epoch=2))
    assert f._native.kw["seed"] == 99 and f.state_dict()["seed"] == 99 and f.position == (2, 0)


def test_cache_jump_whose_restore_fails_says_where_it_was(tmp_path, monkeypatch):
    f = _fake_feed(tmp_path, monkeypatch, fail={5})
    f._native.pos = (1, 3)
    _FakeNative.fail.add(1)  # the old position cannot be made again either
    with pytest.raises(MemoryError, match="epoch 5") as e:
        f.set_epoch(5)
    assert any("epoch 1, batch 3" in n for n in getattr(e.value, "__notes__", []))
    with pytest.raises(pinstream.InvalidArgumentError, match="epoch 1, batch 3"):
        f.stats()


def test_failed_jump_without_a_cache_keeps_the_running_feed(tmp_path, monkeypatch):
    """Without a cache the new native feed is made first: where it cannot be, the running one is
    left open at its position with its seed (no GPU: a stand-in native feed)."""
    monkeypatch.setattr(pinstream.feed._native, "ImageFeed", _FakeNative)
    _FakeNative.fail, _FakeNative.made = {5}, []
    items = [(str(tmp_path / f"{i}.jpg"), 0) for i in range(40)]
    f = pinstream.ImageFeed(items, 4, seed=7, rank=0, world_size=1)
    first = f._native
    first.pos = (1, 3)
    with pytest.raises(MemoryError, match="epoch 5"):
        f.load_state_dict(dict(f.state_dict(), epoch=5, batch=0, seed=99))
    assert f._native is first and not first.closed and len(_FakeNative.made) == 1
    assert f.state_dict()["seed"] == 7 and f.position == (1, 3)
