"""Hostile review of issue 32 (branch wt32h): ``pinstream.ImageFeed`` and sharded
``load_safetensors`` attacked as a hostile caller would. Labels are the files' indices, so a
batch's labels say which files it holds. GPU tests are skipped without one.
"""

import gc
import json
import math
import os
import signal
import struct
import threading

import numpy as np
import pytest

import pinstream
from pinstream.errors import FormatError, InvalidArgumentError, PinstreamError

from conftest import make_jpegs, needs_gpu


def labels_of(batch):
    return pinstream.download(batch[1]).tolist()


def feed(items, batch, **kw):
    kw.setdefault("size", 32)
    kw.setdefault("rank", 0)
    kw.setdefault("world_size", 1)
    return pinstream.ImageFeed(items, batch, **kw)


def task_count():
    return len(os.listdir("/proc/self/task"))


def fd_count():
    return len(os.listdir("/proc/self/fd"))


def write_st(path, tensors):
    header, data, at = {}, b"", 0
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + len(raw)]}
        at += len(raw)
        data += raw
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return path


def host(t):
    return pinstream.download(t).tobytes()


# ----- any machine ------------------------------------------------------------------------------


def test_h32_labels_must_be_integers(tmp_path):
    """A label of 1.5 was truncated to 1 (``int(label)``), and one of 2**63 an OverflowError from
    the binding: both an InvalidArgumentError naming the file, before the GPU."""
    for bad in [1.5, float("nan"), "3", 2**63, -1]:
        with pytest.raises(InvalidArgumentError):
            pinstream.ImageFeed([(str(tmp_path / "a.jpg"), bad)], 2)
    # numpy integers are integers.
    try:
        pinstream.ImageFeed([(str(tmp_path / "a.jpg"), np.int64(3))], 2, rank=0, world_size=1)
    except (pinstream.NoDeviceError, PinstreamError) as e:
        assert not isinstance(e, InvalidArgumentError), e


def test_h32_load_safetensors_takes_bytes_paths(tmp_path):
    """``os.fspath(b"...")`` is bytes, which the binding refused with a TypeError; the path is
    taken as ImageFeed takes it (os.fsdecode)."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(FormatError, match="no \\*.safetensors"):
        pinstream.load_safetensors(os.fsencode(str(tmp_path / "empty")))


@needs_gpu
def test_h32_one_shard_spelled_two_ways(tmp_path):
    """``./a.safetensors`` and ``a.safetensors`` in one index: one file, read once, both tensors
    loaded, as transformers takes it. (It was refused, first with a message that contradicted
    itself, then naming both spellings.)"""
    write_st(tmp_path / "a.safetensors", [("x", "U8", [3], b"\1\2\3"), ("y", "U8", [2], b"\4\5")])
    write_st(tmp_path / "b.safetensors", [("z", "U8", [1], b"\6")])
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text(json.dumps({"weight_map": {"x": "a.safetensors", "y": "./a.safetensors",
                                              "z": ".//b.safetensors"}}))
    got = pinstream.load_safetensors(idx)
    assert sorted(got) == ["x", "y", "z"]
    assert [host(got[k]) for k in ("x", "y", "z")] == [b"\1\2\3", b"\4\5", b"\6"]


# ----- ImageFeed on a GPU -----------------------------------------------------------------------


@needs_gpu
@pytest.mark.parametrize("decode", ["cpu", "auto"])
def test_h32_held_batches_then_released_the_feed_goes_on(tmp_path, decode):
    """The CPU-decoding feed lends at most depth + 2 batches through DLPack; one more is an
    error saying to release one and call again. The feed latched it as fatal: after the
    release every later call raised 'the feed stopped at an earlier error'."""
    items = make_jpegs(tmp_path, 24, seed=1, side=(48, 120))
    with feed(items, 2, decode=decode, shuffle=False) as f:
        held, err = [], None
        for _ in range(8):
            try:
                held.append(f._native.next())
            except PinstreamError as e:
                err = e
                break
        got = [labels_of(b) for b in held]
        del held
        gc.collect()
        for x, y in f:
            got.append(pinstream.download(y).tolist())
        flat = sum(got, [])
        assert sorted(flat) == list(range(24)), (err, got)
        # And the next epoch too.
        assert sorted(sum((pinstream.download(y).tolist() for _, y in f), [])) == list(range(24))


@needs_gpu
def test_h32_loader_threads_and_depth_checked_on_every_path(tmp_path):
    """The GPU-decoding path started whatever number of loaders (each an nvJPEG state and a
    stream) and any depth: refused as the CPU path refuses them."""
    items = make_jpegs(tmp_path, 4, seed=2, side=(48, 120))
    for kw in [dict(depth=17), dict(threads=257), dict(depth=10**6)]:
        for decode in ["auto", "cpu"]:
            with pytest.raises(InvalidArgumentError):
                feed(items, 2, decode=decode, **kw)


@needs_gpu
def test_h32_drop_last_shares_are_disjoint(tmp_path):
    """drop_last as DistributedSampler's (the docstring): 5 files, 4 ranks, batches of 1: one
    file per rank, none twice. Padded anyway, two ranks got a second, duplicated file."""
    items = make_jpegs(tmp_path, 5, seed=3, side=(48, 120))
    seen = []
    for r in range(4):
        with feed(items, 1, rank=r, world_size=4, drop_last=True, shuffle=False) as f:
            assert len(f) == 1
            seen += sum((pinstream.download(y).tolist() for _, y in f), [])
    assert len(seen) == len(set(seen)) == 4, seen


@needs_gpu
@pytest.mark.parametrize("decode", ["auto", "cpu"])
def test_h32_batch_size_beyond_the_share(tmp_path, decode):
    """A batch size above the files of a rank is one short batch (as a DataLoader gives): the GPU
    path sized its buffers for batch_size samples (2**36 of them: OutOfMemoryError)."""
    items = make_jpegs(tmp_path, 6, seed=4, side=(48, 120))
    for bs in [2**36, 2**62]:
        with feed(items, bs, decode=decode) as f:
            assert len(f) == 1
            (x, y), = list(f)
            assert sorted(pinstream.download(y).tolist()) == list(range(6))
            assert tuple(x.shape) == (6, 3, 32, 32)
    with pytest.raises((InvalidArgumentError, OverflowError)):
        feed(items, 2**64, decode=decode)


@needs_gpu
def test_h32_junk_state_and_epochs_are_typed_and_harmless(tmp_path):
    items = make_jpegs(tmp_path, 12, seed=5, side=(48, 120))
    with feed(items, 4, shuffle=True) as f:
        good = f.state_dict()
        first = labels_of(f._native.next())
        f.load_state_dict(good)
        junk = []
        for k, v in [("epoch", -1), ("epoch", float("nan")), ("epoch", True), ("epoch", "1"),
                     ("epoch", 2**64), ("epoch", 2**63), ("epoch", 2**62), ("batch", -1),
                     ("batch", 3), ("batch", 2**70), ("seed", -1), ("seed", 2**64),
                     ("seed", 1.0), ("version", 2), ("files", 13), ("world_size", 2)]:
            junk.append(dict(good, **{k: v}))
        junk += [None, [], {}, {"version": 1}, "state"]
        for s in junk:
            with pytest.raises((InvalidArgumentError, OverflowError)):
                f.load_state_dict(s)
        for e in [-1, 1.5, True, None, 2**64, 2**63, 2**62]:
            with pytest.raises((InvalidArgumentError, OverflowError)):
                f.set_epoch(e)
        assert f.state_dict() == good
        assert labels_of(f._native.next()) == first


@needs_gpu
def test_h32_two_threads_share_one_feed(tmp_path):
    """Two threads pulling the native feed at once: every batch of two epochs exactly once."""
    items = make_jpegs(tmp_path, 30, seed=6, side=(48, 120))
    with feed(items, 3, seed=7) as ref:
        want = sorted(tuple(labels_of(b)) for b in list(ref) + list(ref))
    with feed(items, 3, seed=7) as f:
        n = 2 * len(f)
        got, lock, errors = [], threading.Lock(), []

        def pull():
            try:
                while True:
                    with lock:
                        if len(got) >= n:
                            return
                    b = f._native.next()
                    if b is not None:
                        with lock:
                            got.append(tuple(labels_of(b)))
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        ts = [threading.Thread(target=pull) for _ in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert not any(t.is_alive() for t in ts), "a puller hangs"
        assert not errors, errors
        # Every batch of two epochs once; the other puller may take one of the third.
        from collections import Counter

        assert not Counter(want) - Counter(got) and n <= len(got) <= n + 1, (want, got)


@needs_gpu
def test_h32_close_from_another_thread_while_next_waits(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(8)
    items = []
    for i in range(6):
        img = np.kron(rng.integers(0, 256, (300, 300, 3), dtype=np.uint8), np.ones((8, 8, 1), np.uint8))
        p = tmp_path / f"big{i}.jpg"
        Image.fromarray(img).save(p, quality=95)
        items.append((str(p), i))
    base = task_count()
    for delay in [0.0, 0.05, 0.3]:
        f = feed(items, 6, decode="cpu", threads=1, depth=1)
        t = threading.Timer(delay, f.close)
        t.start()
        try:
            list(f)
        except InvalidArgumentError as e:
            assert "closed" in str(e)
        t.join(60)
        assert not t.is_alive()
        with pytest.raises(InvalidArgumentError, match="closed"):
            next(iter(f))
    gc.collect()
    assert task_count() <= base + 2


@needs_gpu
@pytest.mark.parametrize("decode", ["auto", "cpu"])
def test_h32_batches_outlive_set_epoch_close_and_the_feed(tmp_path, decode):
    torch = pytest.importorskip("torch")
    import pinstream.torch as pt

    items = make_jpegs(tmp_path, 16, seed=9, side=(48, 120))
    f = pt.image_feed(items, 4, size=32, rank=0, world_size=1, decode=decode, dtype=torch.float32)
    kept = [next(iter(f)) for _ in range(3)]
    copies = [(x.clone(), y.clone()) for x, y in kept]
    f.set_epoch(5)
    for _ in range(3):
        for x, y in f:
            x.mul_(0)
    f.close()
    del f
    gc.collect()
    torch.cuda.synchronize()
    for (x, y), (cx, cy) in zip(kept, copies):
        assert torch.equal(x, cx) and torch.equal(y, cy)
    del kept
    gc.collect()
    torch.cuda.synchronize()


@needs_gpu
def test_h32_dlpack_twice_is_refused_not_a_double_free(tmp_path):
    torch = pytest.importorskip("torch")
    items = make_jpegs(tmp_path, 4, seed=10, side=(48, 120))
    with feed(items, 4, dtype="float32") as f:
        x, y = next(iter(f))
        a = torch.from_dlpack(x)
        with pytest.raises(Exception):
            torch.from_dlpack(x)
        s = float(a.sum())
        del a
        gc.collect()
        torch.cuda.synchronize()
        assert math.isfinite(s)


@needs_gpu
def test_h32_forked_child_is_refused_and_exits(tmp_path):
    items = make_jpegs(tmp_path, 8, seed=11, side=(48, 120))
    f = feed(items, 2)
    x, y = next(iter(f))
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(60)
            try:
                f._native.next()
            except pinstream.ForkedError:
                code = 0
            for op in (f._native.position, f._native.stats, f._native.close):
                try:
                    op()
                    code = 2
                except pinstream.ForkedError:
                    pass
            del f
            gc.collect()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert len(list(f)) >= 1
    f.close()


@needs_gpu
def test_h32_ctrl_c_storm_keeps_the_feed_in_order(tmp_path):
    """SIGINT every few ms while pulling: KeyboardInterrupt at the waits, never a crash or a
    hang, and the feed goes on from its position in order (a batch the native side took is
    returned: the batches after the storm start exactly at the position)."""
    import time

    items = make_jpegs(tmp_path, 40, seed=12, side=(200, 400))
    f = feed(items, 4, decode="cpu", threads=1, depth=1, shuffle=False)
    got, interrupts = [], 0
    old = signal.signal(signal.SIGALRM, lambda *a: os.kill(os.getpid(), signal.SIGINT))
    signal.setitimer(signal.ITIMER_REAL, 0.003, 0.003)
    try:
        for _ in range(300):
            try:
                b = f._native.next()
                if b is None:
                    break
                got.append(labels_of(b))
            except KeyboardInterrupt:
                interrupts += 1
    finally:
        for _ in range(100):
            try:
                signal.setitimer(signal.ITIMER_REAL, 0, 0)
                signal.signal(signal.SIGALRM, old)
                time.sleep(0.02)
                break
            except KeyboardInterrupt:
                pass
    epoch, k = f.position
    assert epoch == 0 or (epoch, k) == (1, 0)
    before = sum(got, [])
    assert before == sorted(set(before)) and all(l < 4 * k or epoch == 1 for l in before)
    if epoch == 0:
        rest = sum((pinstream.download(y).tolist() for _, y in f), [])
        assert rest == list(range(4 * k, 40)), (interrupts, got, (epoch, k), rest)
    f.close()
    # Open finding: a SIGINT that lands in the slice in which the batch arrives is raised by
    # CPython as the call returns, after the batch was taken: the batch is dropped and the
    # position has moved on. On an H200 all 10 batches of the epoch were lost so (10
    # interrupts, nothing received, position (1, 0)).
    if before != list(range(4 * k if epoch == 0 else 40)):
        pytest.xfail(f"batches lost to Ctrl-C after they were taken: got {before}, at {(epoch, k)}")


@needs_gpu
def test_h32_feeds_leak_no_threads_or_descriptors(tmp_path):
    items = make_jpegs(tmp_path, 8, seed=13, side=(48, 120))
    for decode in ["auto", "cpu"]:
        with feed(items, 4, decode=decode) as f:
            list(f)
    gc.collect()
    tasks, fds = task_count(), fd_count()
    for i in range(6):
        for decode in ["auto", "cpu"]:
            f = feed(items, 4, decode=decode)
            list(f)
            if i % 2:
                f.close()
            del f
            gc.collect()
    assert task_count() <= tasks + 1 and fd_count() <= fds + 1, (tasks, task_count(), fds, fd_count())


@needs_gpu
def test_h32_normalize_dtype_size_junk(tmp_path):
    items = make_jpegs(tmp_path, 2, seed=14, side=(48, 120))
    for kw in [dict(normalize=((1, 2), (1, 2, 3))), dict(normalize=((0, 0, 0), (1, 0, 1))),
               dict(normalize=((0, 0, 0), (1, float("inf"), 1))), dict(normalize=((1e39, 0, 0), (1, 1, 1))),
               dict(dtype="int7"), dict(dtype=None), dict(size=(0, 32)),
               dict(layout="CHWN"), dict(decode="tpu"), dict(bad_files="ignore"), dict(flip=2.0),
               dict(scale=(0.5, 0.1)), dict(ratio=(0, 1)), dict(train=False, size=(32, 16)),
               dict(train=False, resize=10**9)]:
        with pytest.raises((InvalidArgumentError, TypeError)):
            feed(items, 2, **kw)
    # A side of 10**6 is within the kernel's limit (65535 x 16): made, and the first batch's
    # 12 TB are a typed error (OutOfMemoryError), not a crash. (Not validated before the
    # loaders start: that the feed is made was seen on an H200; the error at the first batch
    # was not run there.)
    try:
        f = feed(items, 2, size=10**6)
    except PinstreamError:
        return
    with f, pytest.raises(PinstreamError):
        next(iter(f))


@needs_gpu
def test_h32_huge_labels_come_back_exact(tmp_path):
    items = make_jpegs(tmp_path, 2, seed=15, side=(48, 120))
    items = [(items[0][0], 2**63 - 1), (items[1][0], 0)]
    with feed(items, 2, shuffle=False) as f:
        (x, y), = list(f)
        assert pinstream.download(y).tolist() == [2**63 - 1, 0]


# ----- sharded checkpoints on a GPU -------------------------------------------------------------


@needs_gpu
def test_h32_zero_tensor_shards(tmp_path):
    d = tmp_path / "mixed"
    d.mkdir()
    write_st(d / "a.safetensors", [])
    write_st(d / "b.safetensors", [("w", "U8", [5], b"\1\2\3\4\5")])
    write_st(d / "c.safetensors", [])
    got = pinstream.load_safetensors(d)
    assert list(got) == ["w"] and host(got["w"]) == b"\1\2\3\4\5"
    e = tmp_path / "empty"
    e.mkdir()
    write_st(e / "a.safetensors", [])
    write_st(e / "b.safetensors", [])
    try:
        assert pinstream.load_safetensors(e) == {}
    except PinstreamError:
        pass  # a typed refusal is fine too


@needs_gpu
def test_h32_same_checkpoint_from_many_threads(tmp_path):
    rng = np.random.default_rng(16)
    wm, want = {}, {}
    for s in range(4):
        ts = []
        for k in range(5):
            raw = rng.integers(0, 256, int(rng.integers(1, 300000)), dtype=np.uint8).tobytes()
            ts.append((f"s{s}.t{k}", "U8", [len(raw)], raw))
            wm[f"s{s}.t{k}"] = f"s{s}.safetensors"
            want[f"s{s}.t{k}"] = raw
        write_st(tmp_path / f"s{s}.safetensors", ts)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    errors, results = [], []

    def load():
        try:
            for _ in range(3):
                got = pinstream.load_safetensors(tmp_path)
                results.append({k: host(v) for k, v in got.items()})
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    fds = fd_count()
    ts = [threading.Thread(target=load) for _ in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(180)
    assert not any(t.is_alive() for t in ts) and not errors, errors
    assert len(results) == 18 and all(r == want for r in results)
    gc.collect()
    assert fd_count() <= fds


@needs_gpu
def test_h32_thousand_tiny_shards(tmp_path):
    wm = {}
    for s in range(1000):
        write_st(tmp_path / f"s{s:04d}.safetensors", [(f"t{s}", "I32", [1], struct.pack("<i", s * 7))])
        wm[f"t{s}"] = f"s{s:04d}.safetensors"
    fds = fd_count()
    got = pinstream.load_safetensors(tmp_path)
    assert len(got) == 1000
    assert all(struct.unpack("<i", host(got[f"t{s}"]))[0] == s * 7 for s in range(1000))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    got = pinstream.load_safetensors(tmp_path / "model.safetensors.index.json")
    assert all(struct.unpack("<i", host(got[f"t{s}"]))[0] == s * 7 for s in range(1000))
    del got
    gc.collect()
    assert fd_count() <= fds
