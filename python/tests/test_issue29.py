"""Issue 29, the Python package: a zero-size batch that aborted the interpreter (finding 2), a
forked child that aborted or hung on ``next()`` (3), Ctrl-C ignored while ``next()`` waits
(4), silent corruption from an iterable that reuses its array (5), and freeing a source's
memory while pinstream reads it (6).

The prefetcher tests run on the CPU through ``dry_run=True`` (the same loader threads, pulls,
checks and pipeline, with the CPU reference in place of the kernel) and again on a GPU where
there is one. Each attack that could crash or hang the interpreter runs in a child process
with a generous time limit (``run_child``), so that it fails instead.
"""

import os
import signal
import threading

import numpy as np
import pytest

import pinstream

from conftest import GPU_REASON, needs_gpu
from test_hostile import run_child

MODES = [
    pytest.param(True, id="dry_run"),
    pytest.param(False, id="device", marks=needs_gpu),
]


def host(x):
    """A batch's array on the host, whether it came from a dry run or the device."""
    return x if isinstance(x, np.ndarray) else pinstream.download(x)


# ------------------------------------------------------------------------------------------
# Finding 2: sizes from the shape were allocated before the shape was checked.


@pytest.mark.parametrize("dry", MODES)
def test_finding_zero_size_batches_are_typed_errors_not_aborts(dry):
    """FINDING (abort): ``prefetch([np.zeros((1, 2**40, 1, 0), np.uint8)])`` made a
    per-channel vector of 2**40 floats before anything was checked, and the allocation
    aborted the interpreter; with ``normalize=``, a ``(2**26, 3, 0, 1)`` batch allocated
    4 GiB of per-sample records before it was refused. The shape is now checked first (1 to
    4 channels, no empty dimension, as many bytes as it says): a ``LoaderError`` naming the
    batch, whose cause is an ``InvalidArgumentError``."""
    r = run_child(
        f"""
        dry = {dry!r}
        rng = np.random.default_rng()
        good = rng.integers(0, 256, (2, 3, 4, 5), dtype=np.uint8)
        cases = [
            ((1, 2**40, 1, 0), None),
            ((2**26, 3, 0, 1), pinstream.IMAGENET),
            ((2**26, 3, 0, 1), None),
            ((0, 3, 8, 8), None),
            ((2, 0, 8, 8), None),
            ((2, 5, 4, 4), None),
            ((2, 1, 4, 4), pinstream.IMAGENET),
            ((2**40, 0, 2**10, 2**10), None),
        ]
        for shape, norm in cases:
            # Zero-size arrays cost nothing; the others are small.
            px = np.zeros(shape, np.uint8) if 0 in shape else rng.integers(0, 256, shape, dtype=np.uint8)
            pf = pinstream.prefetch([good, px, good], normalize=norm, dry_run=dry)
            first = next(pf)
            want = good.astype(np.float64)
            if norm is not None:
                want = (want - np.array(norm[0])[:, None, None]) / np.array(norm[1])[:, None, None]
            assert np.allclose(pinstream.download(first) if not dry else first, want, atol=1e-4), shape
            try:
                next(pf)
            except pinstream.LoaderError as e:
                assert e.batch == 1, (shape, e.batch)
                assert "batch 1" in str(e), str(e)
                assert isinstance(e.__cause__, pinstream.InvalidArgumentError), repr(e.__cause__)
            else:
                raise AssertionError(f"{{shape}}: no error")
            del pf
        print("ok")
        """,
        timeout=120,
    )
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


# ------------------------------------------------------------------------------------------
# Finding 3: fork.


@pytest.mark.parametrize("dry", MODES)
def test_finding_forked_child_gets_typed_errors(dry):
    """FINDING (abort, hang): a child forked after a prefetcher started died with SIGABRT on
    ``next()`` (the dry run's hung: it waited for loader threads the child does not have).
    Every call in the child now raises ``ForkedError`` (``close``, ``__exit__`` and the drop
    leave the parent's threads and memory alone); the parent goes on as before."""
    run_child(
        f"""
        dry = {dry!r}
        rng = np.random.default_rng()
        data = [rng.integers(0, 256, (2, 3, 4, 4), dtype=np.uint8) for _ in range(6)]
        def slow():
            for x in data:
                time.sleep(0.05)
                yield x
        pf = pinstream.prefetch(slow(), dtype="uint8", dry_run=dry)
        first = next(pf)
        t = None if dry else pinstream.upload(data[0])
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                try:
                    next(pf)
                except pinstream.ForkedError as e:
                    assert "forked" in str(e), str(e)
                else:
                    raise AssertionError("next() in the child gave a batch")
                if not dry:
                    for call in [lambda: pinstream.upload(data[0]),
                                 lambda: t.__dlpack__(),
                                 lambda: pinstream.synchronize()]:
                        try:
                            call()
                        except pinstream.ForkedError:
                            pass
                        else:
                            raise AssertionError("a CUDA call in the child went through")
                pf.close()
                with pf:
                    pass
                del pf, t
                gc.collect()
                # A new dry run in the child works: it has threads of its own.
                got = list(pinstream.prefetch(data[:2], dtype="uint8", dry_run=True))
                assert all(np.array_equal(g, d) for g, d in zip(got, data)), "child dry run"
                code = 0
            except BaseException as e:
                print("child:", repr(e), flush=True)
            finally:
                os._exit(code)
        # A watchdog against a hang (not a speed bound): the child does a few calls and exits.
        for _ in range(2400):  # 2400 polls, 50 ms apart
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            raise AssertionError("the child hung (still running after 2400 polls)")
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {{status}}"
        # On the device, each batch is downloaded as it comes: holding every batch of the epoch
        # would hold more slots than depth + export_spares (an error by design).
        fetch = (lambda x: x) if dry else pinstream.download
        got = [fetch(first)] + [fetch(x) for x in pf]
        assert len(got) == 6 and all(np.array_equal(g, d) for g, d in zip(got, data))
        print("ok")
        """,
        timeout=120,
    )


# ------------------------------------------------------------------------------------------
# Finding 4: Ctrl-C.


@pytest.mark.parametrize("dry", MODES)
def test_finding_ctrl_c_interrupts_a_waiting_next(dry):
    """FINDING (ignored signal): a ``next()`` waiting for a stalled iterable ignored SIGINT
    until the iterable yielded (7.2 s late in the review). It now waits in slices and checks
    for signals between them: ``KeyboardInterrupt`` while the iterable is still stalled, and
    the prefetcher goes on correctly afterwards (then closes with nothing left behind)."""
    run_child(
        f"""
        dry = {dry!r}
        rng = np.random.default_rng()
        data = [rng.integers(0, 256, (2, 3, 4, 4), dtype=np.uint8) for _ in range(5)]
        stalled, release = threading.Event(), threading.Event()
        def gen():
            for i, x in enumerate(data):
                if i == 2:
                    stalled.set()
                    assert release.wait(120), "never released"
                yield x
        pf = pinstream.prefetch(gen(), dtype="uint8", depth=1, loader_threads=1, dry_run=dry)
        # On the device, each batch is downloaded as it comes (holding them all would hold more
        # slots than depth + export_spares, an error by design).
        fetch = (lambda x: x) if dry else pinstream.download
        got = [fetch(next(pf)), fetch(next(pf))]
        def interrupt():
            stalled.wait(60)
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGINT)
        import signal
        threading.Thread(target=interrupt, daemon=True).start()
        try:
            got.append(fetch(next(pf)))
        except KeyboardInterrupt:
            assert not release.is_set()
        else:
            raise AssertionError("next() returned through a stall")
        release.set()
        got += [fetch(x) for x in pf]
        assert len(got) == 5 and all(np.array_equal(g, d) for g, d in zip(got, data))
        del pf
        gc.collect()
        assert pinstream.memory_stats()["prefetchers"] == 0, pinstream.memory_stats()
        print("ok")
        """,
        timeout=120,
    )


# ------------------------------------------------------------------------------------------
# Finding 5: an iterable that reuses its array.


def refilling(n_items, shape, seed):
    """Yields one array, refilled with new random pixels for every item (the allocation-free
    loader); returns the generator and the list the reference copies go to."""
    rng = np.random.default_rng(seed)
    buf = np.empty(shape, np.uint8)
    ref = []

    def gen():
        for i in range(n_items):
            buf[...] = rng.integers(0, 256, shape, dtype=np.uint8)
            ref.append(buf.copy())
            yield buf, np.arange(shape[0], dtype=np.int64) + 10 * i

    return gen(), ref


@pytest.mark.parametrize("dry", MODES)
@pytest.mark.parametrize("threads,depth", [(1, 1), (2, 2), (3, 4)])
def test_finding_an_iterable_that_reuses_its_array_gets_its_own_pixels(dry, threads, depth):
    """FINDING (silent corruption): an iterable that refills one preallocated array and
    yields it again delivered 299 of 300 batches with another item's pixels (the labels were
    right): the pixels were read outside the GIL after the iterable had been asked for its
    next item. They are now copied when the item is pulled, before that."""
    gen, ref = refilling(60, (3, 3, 7, 5), seed=threads * 10 + depth)
    pf = pinstream.prefetch(gen, dtype="uint8", loader_threads=threads, depth=depth, dry_run=dry)
    n = 0
    for i, (x, y) in enumerate(pf):
        assert np.array_equal(host(y), np.arange(3) + 10 * i)
        assert np.array_equal(host(x), ref[i]), f"batch {i} has another item's pixels"
        n += 1
    assert n == 60


@pytest.mark.parametrize("dry", MODES)
def test_zero_copy_reads_fresh_arrays(dry):
    """``zero_copy=True`` holds each array until the upload read it: right for iterables that
    yield fresh arrays, and the arrays are let go once read."""
    rng = np.random.default_rng()
    data = [rng.integers(0, 256, (2, 4, 5, 3), dtype=np.uint8) for _ in range(8)]
    pf = pinstream.prefetch(iter(data), dtype="uint8", input_layout="nhwc", layout="nhwc",
                            zero_copy=True, dry_run=dry)
    got = [host(x) for x in pf]
    assert len(got) == 8 and all(np.array_equal(g, d) for g, d in zip(got, data))
    del pf
    assert pinstream.memory_stats()["held_arrays"] == 0


# ------------------------------------------------------------------------------------------
# Finding 6: the source's memory freed or resized while pinstream reads it.


@pytest.mark.parametrize("dry", MODES)
def test_numpy_arrays_cannot_be_resized_while_held(dry):
    """A numpy array is exported (the buffer protocol) while pinstream reads it: numpy
    refuses to resize it then. The default prefetcher lets it go as soon as it is copied (so
    the iterable may resize it afterwards), ``zero_copy`` holds it until the upload read it."""
    rng = np.random.default_rng()
    a = rng.integers(0, 256, (2, 3, 4, 4), dtype=np.uint8)
    ref = a.copy()
    held = threading.Event()

    def gen():
        yield a
        held.set()
        yield ref  # the first is held by the zero-copy batch until it is uploaded

    pf = pinstream.prefetch(gen(), dtype="uint8", zero_copy=True, depth=1, loader_threads=1,
                            dry_run=dry)
    held.wait(30)
    # Until the batch was read the array must not move; numpy refuses while it is exported.
    try:
        a.resize((4, 3, 4, 4), refcheck=False)
        resized = True
    except ValueError:
        resized = False
    got = [host(x) for x in pf]
    assert np.array_equal(got[0], ref) or resized, "read a resized array"
    if not resized:
        assert np.array_equal(got[0], ref)

    # The default: copied at the pull, so the iterable may resize (or free) its array then.
    def resizing():
        b = rng.integers(0, 256, (2, 3, 4, 4), dtype=np.uint8)
        for i in range(6):
            b[...] = i * 40
            yield b
            b.resize((2, 3, 4, 4), refcheck=False)  # not exported any more: allowed
            b = np.ascontiguousarray(b)
    got = [host(x) for x in pinstream.prefetch(resizing(), dtype="uint8", dry_run=dry)]
    assert [int(g[0, 0, 0, 0]) for g in got] == [i * 40 for i in range(6)]


@needs_gpu
def test_torch_storage_resized_after_upload_and_after_the_pull():
    """torch has no export lock: ``x.untyped_storage().resize_(0)`` on another thread while
    ``pinstream.upload(x)`` reads ``x`` frees memory under the copy, as it would under
    ``x.to("cuda", non_blocking=True)`` (torch's rule: do not modify a tensor while another
    operation uses it; docs/python.md). What pinstream guarantees: the source is free again
    when ``upload`` returns, and a prefetcher copies an item's pixels before it pulls the next,
    so an iterable may resize or free its tensor then."""
    torch = pytest.importorskip("torch")
    x = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8)
    ref = x.clone()
    t = pinstream.upload(x)
    x.untyped_storage().resize_(0)
    assert torch.equal(torch.from_dlpack(t).cpu(), ref)

    def gen():
        for i in range(8):
            y = torch.full((2, 3, 8, 8), i * 30, dtype=torch.uint8)
            yield y
            y.untyped_storage().resize_(0)  # freed once the prefetcher pulls the next item

    got = [pinstream.download(b) for b in pinstream.prefetch(gen(), dtype="uint8")]
    assert [int(g[0, 0, 0, 0]) for g in got] == [i * 30 for i in range(8)]
