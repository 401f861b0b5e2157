"""A hostile caller against the Python package: producers and capsules that lie, odd
``__dlpack__`` arguments, iterables that call back into the prefetcher, drop it, close it, or
make a reference cycle with it, special files for ``load_safetensors``. A test passes when the
package held (a typed exception, the right result, no hang, no crash, no leak).

Tests named ``test_finding_*`` are attacks that broke the package when written (each docstring
names the cause; each passes since its fix). Attacks that could hang or crash the interpreter
run in a child process with a time limit, so that they fail instead.

Without a GPU only the CPU tests run (argument checks, ``load_safetensors`` on special files,
``download`` of lying producers); the rest are skipped (``needs_gpu``).
"""

import array
import ctypes
import gc
import os
import tempfile
import threading
import time

import numpy as np
import pytest

import pinstream

from conftest import run_child as _run_child, GPU_REASON, needs_gpu


def run_child(code, timeout=60):
    """``PRELUDE`` and ``code`` in a fresh interpreter (conftest's ``run_child``): a hang, a
    crash or a non-zero exit fails; the child prints ``ok`` at its end."""
    return _run_child(code, timeout, prelude=PRELUDE)


PRELUDE = """
import ctypes, gc, os, sys, threading, time
import numpy as np
import pinstream

def img(n=2):
    return np.zeros((n, 3, 8, 8), np.uint8)

def capsule_name(cap):
    f = ctypes.pythonapi.PyCapsule_GetName
    f.restype = ctypes.c_char_p
    f.argtypes = [ctypes.py_object]
    return f(cap).decode()

def pinstream_threads():
    # The library's loader and feeder threads, by name (comm keeps 15 characters).
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if name.startswith(("pinstream-loade", "pinstream-feede")):
            n += 1
    return n
"""


# ------------------------------------------------------------------------------------------------
# CPU: load_safetensors on special files, download of lying producers, argument checks.


def test_finding_load_safetensors_on_a_fifo_returns_at_once(tmp_path):
    """FINDING (hang): a FIFO in place of the file. ``load_safetensors`` opened it with a plain
    ``open(O_RDONLY)``, which blocks until a writer comes: the call never returned (the GIL was
    released, but Ctrl-C could not stop it). The library now refuses a FIFO at the open
    (``IoError``), which no longer blocks."""
    fifo = tmp_path / "weights.safetensors"
    os.mkfifo(fifo)
    result = {}

    def call():
        try:
            pinstream.load_safetensors(fifo)
            result["r"] = "returned"
        except BaseException as e:  # noqa: BLE001 - whatever it is, it is the result
            result["r"] = e

    t = threading.Thread(target=call, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(5)
    hung = t.is_alive()
    while t.is_alive():
        # Unblock the open so that the thread ends: a writer that comes and goes.
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass
        t.join(0.1)
        if time.monotonic() - t0 > 30:
            break
    assert not hung, "load_safetensors blocked on a FIFO until a writer opened it"
    assert isinstance(result.get("r"), pinstream.IoError), repr(result.get("r"))


def test_load_safetensors_special_files_are_typed(tmp_path):
    d = tmp_path / "dir"
    d.mkdir()
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    dangling = tmp_path / "dangling.safetensors"
    os.symlink(tmp_path / "nothing", dangling)
    zero = tmp_path / "zero.safetensors"
    os.symlink("/dev/zero", zero)
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\xff" * 7)
    huge_prefix = tmp_path / "huge.safetensors"
    huge_prefix.write_bytes((2**64 - 1).to_bytes(8, "little") + b"{}      ")
    for p in [d, empty, dangling, zero, short, huge_prefix, "/dev/null", "/proc/self/status"]:
        with pytest.raises((pinstream.IoError, pinstream.errors.FormatError)):
            pinstream.load_safetensors(p)
    # Paths of other types.
    with pytest.raises(TypeError):
        pinstream.load_safetensors(42)
    with pytest.raises((pinstream.IoError, ValueError, TypeError)):
        pinstream.load_safetensors("with\0nul")
    # A bytes path names the same file as its str.
    with pytest.raises((pinstream.IoError, pinstream.errors.FormatError, TypeError)):
        pinstream.load_safetensors(os.fsencode(empty))


class Lies:
    """A producer whose ``__dlpack_device__`` is whatever it is told (or raises)."""

    def __init__(self, device, dlpack=None):
        self.device = device
        self.dlpack = dlpack

    def __dlpack_device__(self):
        if isinstance(self.device, BaseException):
            raise self.device
        return self.device

    def __dlpack__(self, **kwargs):
        if self.dlpack is None:
            raise AssertionError("__dlpack__ must not be called for this device")
        return self.dlpack(**kwargs)


@pytest.mark.parametrize(
    "device",
    [
        ValueError("no device"),
        "cuda",
        (2,),
        (2, 0, 0),
        (2, "0"),
        (2, 2**40),
        (2, -1),
        (1, 0),
        (3, 0),
        (-(2**31), 0),
        None,
    ],
)
def test_download_of_lying_device_claims_is_typed(device):
    with pytest.raises(Exception) as e:
        pinstream.download(Lies(device))
    # Never the AssertionError of a __dlpack__ call for a claim that is not CUDA memory.
    assert not isinstance(e.value, AssertionError), repr(e.value)


def test_prefetch_arguments_fail_before_anything_starts():
    with pytest.raises((OverflowError, TypeError, ValueError)):
        pinstream.prefetch([], depth=-1)
    with pytest.raises((OverflowError, TypeError, ValueError)):
        pinstream.prefetch([], loader_threads=-1)
    with pytest.raises(pinstream.InvalidArgumentError):
        pinstream.prefetch([], dtype=object())
    with pytest.raises(pinstream.InvalidArgumentError):
        pinstream.prefetch([], layout="nchw\0")

    class BadIter:
        def __iter__(self):
            raise RuntimeError("no iterator for you")

    with pytest.raises((TypeError, RuntimeError)):
        pinstream.prefetch(BadIter())


def test_upload_device_argument_extremes():
    x = np.arange(4, dtype=np.float32)
    for device in [2**63, 2**70, -(2**70)]:
        with pytest.raises((OverflowError, pinstream.InvalidArgumentError)):
            pinstream.upload(x, device=device)


# ------------------------------------------------------------------------------------------------
# GPU: Tensor.__dlpack__ arguments.


def capsule_name(cap):
    PyCapsule_GetName = ctypes.pythonapi.PyCapsule_GetName
    PyCapsule_GetName.restype = ctypes.c_char_p
    PyCapsule_GetName.argtypes = [ctypes.py_object]
    return PyCapsule_GetName(cap).decode()


@needs_gpu
def test_finding_dlpack_stream_values_never_crash():
    """FINDING (crash): ``__dlpack__(stream=N)`` handed any non-negative N to the runtime as a
    ``cudaStream_t`` (``cudaStreamGetPriority`` dereferences it): ``stream=12345`` or
    ``stream=2**63`` from plain Python crashed the interpreter. Values that cannot be a stream
    object's address (below 4096, not 8-aligned, above the user address space) are now an
    ``InvalidArgumentError``. (A plausible address that is not a live stream still crashes: the
    protocol trusts the consumer's handle, as PyTorch and CuPy do.)"""
    run_child(
        """
        ok_values = [None, -1, 1, 2, pinstream.stream_handle()]
        bad_values = [0, -2, -(2**63), 3, 7, 4095, 12345, 2**63, 2**64 - 8, 2**64, 2**100,
                      1.5, "1", b"1", [], object()]
        for s in ok_values:
            t = pinstream.upload(np.arange(16, dtype=np.float32))
            cap = t.__dlpack__(stream=s, max_version=(1, 3))
            assert capsule_name(cap) == "dltensor_versioned", s
            del cap
        for s in bad_values:
            t = pinstream.upload(np.arange(16, dtype=np.float32))
            try:
                t.__dlpack__(stream=s, max_version=(1, 3))
            except (pinstream.PinstreamError, TypeError, ValueError, OverflowError):
                pass
            else:
                raise AssertionError(f"stream={s!r} accepted")
            # Refused before the handover: the tensor is still there.
            assert not t.handed_over, s
            t.__dlpack__(stream=-1, max_version=(1, 3))
        pinstream.synchronize()
        print("ok")
        """
    )


@needs_gpu
def test_dlpack_max_version_dl_device_copy_and_repeats():
    def fresh():
        return pinstream.upload(np.arange(12, dtype=np.int32).reshape(3, 4))

    for mv, name in [(None, "dltensor"), ((0, 0), "dltensor"), ((0, 99), "dltensor"),
                     ((1, 0), "dltensor_versioned"), ((1, 3), "dltensor_versioned"),
                     ((99, 99), "dltensor_versioned"), ((2**32 - 1, 0), "dltensor_versioned")]:
        cap = fresh().__dlpack__(max_version=mv, stream=-1)
        assert capsule_name(cap) == name, (mv, capsule_name(cap))
    for mv in [(-1, 0), (0, -1), (2**32, 0), ("1", "3"), (1,), (1, 2, 3), 1, "13"]:
        t = fresh()
        with pytest.raises((TypeError, OverflowError, ValueError)):
            t.__dlpack__(max_version=mv)
        assert not t.handed_over
    dev = fresh().device
    for dl_device in [(1, 0), (2, dev + 1), (3, dev), (2, -1)]:
        t = fresh()
        with pytest.raises(BufferError):
            t.__dlpack__(dl_device=dl_device, max_version=(1, 3))
        assert not t.handed_over
    for bad in [(2,), ("2", 0), 2]:
        with pytest.raises((TypeError, ValueError)):
            fresh().__dlpack__(dl_device=bad)
    t = fresh()
    with pytest.raises(BufferError):
        t.__dlpack__(copy=True)
    assert capsule_name(t.__dlpack__(copy=False, dl_device=(2, dev), max_version=(1, 3)))
    # Twice: the second is a BufferError, and so is every later one.
    for _ in range(3):
        with pytest.raises(BufferError):
            t.__dlpack__(max_version=(1, 3))
    assert t.handed_over and "handed over" in repr(t)


@needs_gpu
def test_dlpack_from_many_threads_at_once_hands_over_once():
    for _ in range(20):
        t = pinstream.upload(np.arange(1 << 16, dtype=np.float32))
        barrier = threading.Barrier(16)
        got, errors = [], []

        def take():
            barrier.wait()
            try:
                got.append(t.__dlpack__(stream=-1, max_version=(1, 3)))
            except BufferError as e:
                errors.append(e)

        threads = [threading.Thread(target=take) for _ in range(16)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        assert len(got) == 1 and len(errors) == 15, (len(got), len(errors))
        del got


@needs_gpu
def test_unconsumed_capsules_free_their_memory():
    torch = pytest.importorskip("torch")
    x = np.zeros(16 << 20, np.uint8)
    for _ in range(3):  # warm up: the context, the stager
        pinstream.upload(x).__dlpack__(stream=-1, max_version=(1, 3))
    gc.collect()
    pinstream.synchronize()
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    for i in range(200):
        t = pinstream.upload(x)
        cap = t.__dlpack__(max_version=(1, 3) if i % 2 else None, stream=-1 if i % 3 else None)
        del cap, t
    gc.collect()
    pinstream.synchronize()
    torch.cuda.synchronize()
    free1 = torch.cuda.mem_get_info()[0]
    assert free0 - free1 < 64 << 20, f"{(free0 - free1) >> 20} MiB kept by 200 dropped capsules"


# ------------------------------------------------------------------------------------------------
# GPU: upload sources that lie, capsules of the wrong kind.


class Producer:
    """A CPU producer whose ``__dlpack__`` returns whatever ``make`` gives."""

    def __init__(self, make, device=(1, 0)):
        self.make = make
        self.device = device
        self.calls = 0

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, **kwargs):
        self.calls += 1
        return self.make(**kwargs)


def rename_capsule(cap, name):
    set_name = ctypes.pythonapi.PyCapsule_SetName
    set_name.restype = ctypes.c_int
    set_name.argtypes = [ctypes.py_object, ctypes.c_char_p]
    # The capsule keeps the pointer: the bytes must outlive it.
    keep = ctypes.create_string_buffer(name.encode())
    rename_capsule.keep.append(keep)
    assert set_name(cap, keep) == 0


rename_capsule.keep = []


@needs_gpu
def test_upload_sources_that_return_no_usable_capsule():
    with pytest.raises(TypeError):
        pinstream.upload(Producer(lambda **kw: 42))
    with pytest.raises(TypeError):
        pinstream.upload(Producer(lambda **kw: np.arange(3)))

    def used(**kw):
        cap = np.arange(4, dtype=np.float32).__dlpack__(**kw)
        rename_capsule(cap, "used_dltensor_versioned" if "max_version" in kw else "used_dltensor")
        return cap

    with pytest.raises(BufferError):
        pinstream.upload(Producer(used))

    def wrong_name(**kw):
        cap = np.arange(4, dtype=np.float32).__dlpack__(**kw)
        rename_capsule(cap, "something_else")
        return cap

    with pytest.raises(BufferError):
        pinstream.upload(Producer(wrong_name))

    def raises_type_error(**kw):
        raise TypeError("always")

    p = Producer(raises_type_error)
    with pytest.raises(TypeError):
        pinstream.upload(p)
    assert p.calls == 2  # with max_version, then without (an old producer)

    # Another producer's capsule of device memory behind a CPU claim: refused, and that tensor
    # is given back once (pinstream's own here, so it must show as handed over, not freed twice).
    victim = pinstream.upload(np.arange(64, dtype=np.float32))
    with pytest.raises(pinstream.InvalidArgumentError):
        pinstream.upload(Producer(lambda **kw: victim.__dlpack__(stream=-1, max_version=(1, 3))))
    assert victim.handed_over
    pinstream.synchronize()


@needs_gpu
def test_upload_odd_host_sources():
    cases = [
        np.zeros(0, np.float32),
        np.zeros((0, 2**40), np.uint8),
        np.zeros((2**31, 0, 7), np.float64),
        np.float64(3.5),  # a numpy scalar: as a 0-d array
        np.array(7, np.int16),
        np.arange(10, dtype=np.uint8)[::2].copy(),
        b"",
        b"abc",
        bytearray(b"xyz"),
        memoryview(b"0123456789"),
        memoryview(bytearray(b"0123456789"))[2:7],
        array.array("d", [1.0, 2.0]),
    ]
    ro = np.arange(6, dtype=np.int64).reshape(2, 3)
    ro.setflags(write=False)
    cases.append(ro)
    for x in cases:
        t = pinstream.upload(x)
        back = pinstream.download(t)
        raw = isinstance(x, (bytes, bytearray, memoryview, array.array))
        want = None if raw else np.asarray(x)
        if want is not None:
            assert back.shape == want.shape and back.dtype == want.dtype, (x, back)
            assert np.array_equal(back, want)
        else:
            assert back.tobytes() == bytes(memoryview(x).cast("B")), x
    # Not C-contiguous, straight to the native call (the Python wrapper would copy it first).
    with pytest.raises(pinstream.InvalidArgumentError):
        pinstream._native.upload(np.arange(20, dtype=np.float32)[::2], 0)
    with pytest.raises(pinstream.InvalidArgumentError):
        pinstream._native.upload(np.arange(20, dtype=np.float32).reshape(4, 5).T, 0)
    with pytest.raises(pinstream.InvalidArgumentError):
        pinstream.upload(memoryview(bytearray(64)).cast("B", (8, 8))[::2])


@needs_gpu
def test_upload_many_with_hostile_iterables():
    def broken():
        yield np.arange(3)
        raise ValueError("broken at 1")

    with pytest.raises(ValueError, match="broken at 1"):
        pinstream.upload_many(broken())
    g = (np.arange(i) for i in range(5))
    g.close()
    assert pinstream.upload_many(g) == []
    with pytest.raises(TypeError):
        pinstream.upload_many(42)
    with pytest.raises(pinstream.InvalidArgumentError):
        pinstream.upload_many([np.arange(3), object()])
    # Many arrays, empty ones among odd dtypes and sizes: each comes back right.
    xs = []
    for i in range(2000):
        dt = [np.uint8, np.int16, np.float32, np.float64, np.complex64][i % 5]
        xs.append((np.arange(i % 7) * ((i % 30) + 1)).astype(dt))
    ts = pinstream.upload_many(xs)
    assert len(ts) == len(xs)
    for t, x in zip(ts[::97], xs[::97]):
        back = pinstream.download(t)
        assert back.dtype == x.dtype and np.array_equal(back, x)
    # An iterable that uploads (re-entering the package) while it is iterated.
    def nested():
        for i in range(3):
            inner = pinstream.upload_many([np.arange(4) + i])
            yield pinstream.download(inner[0])

    ts = pinstream.upload_many(nested())
    assert [pinstream.download(t).tolist() for t in ts] == [[i, i + 1, i + 2, i + 3] for i in range(3)]


# ------------------------------------------------------------------------------------------------
# GPU: the prefetcher against its own iterable.


@needs_gpu
def test_finding_close_from_another_thread_while_next_waits():
    """FINDING (deadlock): ``close()`` took the prefetcher's lock holding the GIL, while a
    ``__next__`` on another thread held that lock (without the GIL) waiting for a batch that a
    loader thread could only pull with the GIL. Both waited for ever. ``close`` now takes the
    lock without the GIL."""
    run_child(
        """
        def slow():
            for i in range(1000):
                time.sleep(0.3)
                yield img()

        pf = pinstream.prefetch(slow(), depth=1, loader_threads=1)
        got = []

        def consume():
            try:
                for x in pf:
                    got.append(x.shape)  # the tensor itself released at once
            except Exception as e:
                got.append(e)

        t = threading.Thread(target=consume, daemon=True)
        t.start()
        time.sleep(1.0)  # the consumer now waits in __next__ for the next slow item
        pf.close()
        t.join(20)
        assert not t.is_alive(), "the consumer is still waiting"
        assert all(isinstance(x, tuple) for x in got), got
        with pf:  # closed: __exit__ again is fine
            pass
        print("ok")
        """,
        timeout=60,
    )


@needs_gpu
def test_finding_iterable_calls_next_on_its_own_prefetcher():
    """FINDING (deadlock): an iterable whose ``__next__`` iterates the prefetcher it feeds. That
    call ran on a loader thread and waited for the prefetcher's lock, which the consumer's
    ``__next__`` held while it waited for that very loader. It is now refused (an
    ``InvalidArgumentError``, which ends the iteration with a ``LoaderError`` for that batch)."""
    run_child(
        """
        for what in ["next", "close", "exit"]:
            class Reenter:
                def __init__(self):
                    self.i = 0
                    self.pf = None
                def __iter__(self):
                    return self
                def __next__(self):
                    self.i += 1
                    if self.i == 3:
                        if what == "next":
                            next(self.pf)
                        elif what == "close":
                            self.pf.close()
                        else:
                            self.pf.__exit__(None, None, None)
                    if self.i > 8:
                        raise StopIteration
                    return img()

            it = Reenter()
            pf = pinstream.prefetch(it, loader_threads=1, depth=1)
            it.pf = pf
            seen = 0
            try:
                for x in pf:
                    seen += 1
            except pinstream.LoaderError as e:
                assert e.batch == 2, (what, e.batch)
                assert isinstance(e.__cause__, pinstream.InvalidArgumentError), (what, repr(e.__cause__))
            else:
                raise AssertionError(f"{what}: no error after {seen} batches")
            assert seen == 2, (what, seen)
            it.pf = None
            del pf
        print("ok")
        """,
        timeout=90,
    )


@needs_gpu
def test_finding_iterable_drops_the_last_reference_to_its_prefetcher():
    """FINDING (panic): the last reference to a prefetcher dropped inside its own iterable ran
    the prefetcher's drop on its loader thread, which then joined itself ("failed to join
    thread: Resource deadlock avoided", a PanicException written as unraisable, threads left
    behind). Such a drop now runs on a thread of its own."""
    r = run_child(
        """
        base = pinstream_threads()
        go = threading.Event()

        class Owner:
            def __init__(self):
                self.i = 0
                self.pf = None
            def __iter__(self):
                return self
            def __next__(self):
                self.i += 1
                if self.i == 2:
                    assert go.wait(20), "never told to go"
                    self.pf = None  # the last reference, dropped on the loader thread
                if self.i > 1000:
                    raise StopIteration
                return img()

        it = Owner()
        pf = pinstream.prefetch(it, loader_threads=1, depth=1)
        it.pf = pf
        del pf  # now only the iterable holds it
        go.set()
        t0 = time.monotonic()
        while it.pf is not None and time.monotonic() - t0 < 20:
            time.sleep(0.05)
        assert it.pf is None, "the loader never dropped it"
        t0 = time.monotonic()
        while pinstream_threads() > base and time.monotonic() - t0 < 20:
            time.sleep(0.05)
        assert pinstream_threads() == base, f"{pinstream_threads() - base} threads left"
        print("ok")
        """,
        timeout=60,
    )
    assert "PanicException" not in r.stderr and "panicked" not in r.stderr, r.stderr[-2000:]


@needs_gpu
def test_finding_prefetcher_in_a_reference_cycle_is_collected():
    """FINDING (leak): a prefetcher over an iterable that refers back to it (an object that
    holds its own prefetcher and iterates itself, a generator that closes over it) made a cycle
    the garbage collector could not see (the prefetcher did not report its iterable): its
    threads, pinned slots and device memory lived until the process ended. The prefetcher now
    reports the iterable (``__traverse__``) and closes when the collector clears it."""
    run_child(
        """
        base = pinstream_threads()

        class Pipeline:
            def __init__(self):
                self.pf = pinstream.prefetch(self, loader_threads=2, depth=2)
            def __iter__(self):
                return self
            def __next__(self):
                return img()

        for round in range(3):
            p = Pipeline()
            next(p.pf)
            assert pinstream_threads() > base
            del p
            t0 = time.monotonic()
            while pinstream_threads() > base and time.monotonic() - t0 < 20:
                gc.collect()
                time.sleep(0.1)
            assert pinstream_threads() == base, f"round {round}: {pinstream_threads() - base} threads leaked"

        def make():
            pf = None
            def gen():
                while True:
                    assert pf is not None or True
                    yield img()
            pf = pinstream.prefetch(gen())
            return pf

        pf = make()
        next(pf)
        del pf
        t0 = time.monotonic()
        while pinstream_threads() > base and time.monotonic() - t0 < 20:
            gc.collect()
            time.sleep(0.1)
        assert pinstream_threads() == base, "generator cycle leaked"
        print("ok")
        """,
        timeout=90,
    )


@needs_gpu
def test_iterables_that_raise_block_or_yield_junk():
    run_child(
        """
        def ends_with(exc, k=2):
            def gen():
                for i in range(k):
                    yield img()
                raise exc
            return gen()

        for exc in [KeyboardInterrupt(), SystemExit(3), GeneratorExit(), MemoryError(),
                    RecursionError(), ValueError("x")]:
            pf = pinstream.prefetch(ends_with(exc))
            n = 0
            try:
                for x in pf:
                    n += 1
            except pinstream.LoaderError as e:
                assert n == 2 and e.batch == 2, (exc, n, e.batch)
                assert type(e.__cause__) is type(exc), (exc, repr(e.__cause__))
            else:
                raise AssertionError(f"{exc!r}: no error")

        junk = [None, "pixels", 3.5, (), [], {}, (None,), (img(), "labels"),
                (img(), np.arange(3)), np.zeros((2, 3, 8, 8), np.float32),
                np.zeros((3, 8, 8), np.uint8), np.zeros((2, 3, 8, 8, 1), np.uint8),
                np.zeros((2, 8, 8, 3), np.uint8)[:, :, :, ::-1].transpose(0, 3, 1, 2),
                np.zeros((0, 3, 8, 8), np.uint8), np.zeros((2, 0, 8, 8), np.uint8),
                object()]
        for k, item in enumerate(junk):
            pf = pinstream.prefetch([img(), item, img()])
            got = []
            try:
                for x in pf:
                    got.append(x)
            except pinstream.LoaderError as e:
                assert e.batch == 1 and len(got) == 1, (k, e.batch, len(got))
            # Zero-size batches may be fine; anything else must have been refused.

        closed = (img() for _ in range(3))
        closed.close()
        assert list(pinstream.prefetch(closed)) == []
        assert list(pinstream.prefetch([])) == []
        print("ok")
        """,
        timeout=120,
    )


@needs_gpu
def test_prefetcher_closed_mid_epoch_and_used_again():
    run_child(
        """
        base = pinstream_threads()
        pf = pinstream.prefetch(img() for _ in range(100))
        next(pf)
        pf.close()
        pf.close()
        try:
            next(pf)
        except StopIteration:
            pass
        else:
            raise AssertionError("a closed prefetcher gave a batch")
        with pinstream.prefetch(img() for _ in range(100)) as p2:
            next(p2)
        t0 = time.monotonic()
        while pinstream_threads() > base and time.monotonic() - t0 < 20:
            time.sleep(0.05)
        assert pinstream_threads() == base
        print("ok")
        """
    )


@needs_gpu
def test_exit_with_an_open_prefetcher_is_clean():
    """The interpreter exits (module globals cleared at finalization) with a prefetcher still
    running over a slow, endless iterable: the exit is clean, not a hang or a crash."""
    run_child(
        """
        def endless():
            while True:
                time.sleep(0.01)
                yield img()

        pf = pinstream.prefetch(endless(), loader_threads=2)
        next(pf)
        print("ok")
        """,
        timeout=60,
    )
