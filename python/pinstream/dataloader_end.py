"""Ending a torch ``DataLoader``'s iteration from ``close()``, even while a loader thread waits
in its ``next()`` for a worker that never answers.

A ``DataLoader``'s ``next()`` waits on its data queue in 5 s slices and only checks that its
workers are alive between them: a worker stuck in the dataset (a read that hangs) keeps it
waiting forever, and the prefetcher's ``close()`` (and the interpreter's exit, which closes
every prefetcher) would wait with it. ``InProcessReader`` is the iterable the prefetcher pulls
when it pulls a ``DataLoader`` in this process; its ``close()`` (the prefetcher's ``on_close``,
called before the loader threads are joined) gives a ``next()`` under way ``seconds`` to end,
then ends the workers and wakes it, and the iteration ends there (``StopIteration``).
``worker_ring.WorkerRingReader`` ends its own iteration with ``end_iteration`` too.
"""

import threading
import time

#: How long ``InProcessReader.close()`` lets a loader thread's ``next()`` go on before its
#: worker is taken for stuck and the workers are ended: torch's own interval between its checks
#: of the workers, so that a batch that is only slow is waited for.
STUCK_SECONDS = 5.0


def end_iteration(it, pulling, seconds):
    """Ends a DataLoader iterator's workers within ``seconds``: asked to stop as torch's own
    shutdown asks them (which then waits 5 s for each one that does not), SIGTERM for those
    that did not; and, where ``pulling``, a ``next()`` still waiting on its data queue woken."""
    workers = [w for w in (getattr(it, "_workers", None) or ()) if _alive(w)]
    interrupted = None
    try:
        if workers and not getattr(it, "_shutdown", True):
            try:
                it._workers_done_event.set()
                for q in it._index_queues:
                    q.put(None)
            except Exception:  # noqa: BLE001 - another torch: SIGTERM below
                pass
            deadline = time.monotonic() + seconds
            for w in workers:
                try:
                    w.join(max(0.0, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001
                    pass
    except BaseException as e:  # noqa: BLE001 - a Ctrl-C meanwhile: the rest runs, then it
        interrupted = e
    finally:
        # Never skipped (a Ctrl-C in the wait above): without them the next() waits forever.
        if any(_alive(w) for w in workers):
            _end_workers(it)
        if pulling:
            # The loader's next() waits on its data queue in 5 s slices (checking its workers
            # between them): a message it cannot take ends it now.
            try:
                it._data_queue.put(None)
            except Exception:  # noqa: BLE001 - another torch: its own check ends it
                pass
    if interrupted is not None:
        raise interrupted


def _alive(w):
    try:
        return w.is_alive()
    except Exception:  # noqa: BLE001 - not ours to ask (a fork's copy)
        return False


def _end_workers(it):
    """Ends a DataLoader iterator's workers (SIGTERM), first telling torch's SIGCHLD handler
    that they are not to be reported (as the iterator's own shutdown does)."""
    try:
        if getattr(it, "_worker_pids_set", False):
            from torch.utils.data._utils import signal_handling

            signal_handling._remove_worker_pids(id(it))
            it._worker_pids_set = False
    except Exception:  # noqa: BLE001 - another torch: its handler may report them
        pass
    for w in list(getattr(it, "_workers", ()) or ()):
        try:
            w.terminate()
        except Exception:  # noqa: BLE001 - already gone
            pass


class InProcessReader:
    """A ``DataLoader`` (or its iterator) pulled in this process, as it is, with a ``close()``
    that does not wait forever for a stuck worker. The workers are left alone unless a
    ``next()`` is still under way ``STUCK_SECONDS`` after ``close()`` began (persistent
    workers stay usable for the next epoch after a normal close)."""

    def __init__(self, loader):
        self._loader = loader
        #: A persistent loader whose iterator this one is (it is let go if its workers end).
        self._persistent = None
        self._it = None
        self._done = False
        self._pulling = False
        self._puller = None

    def __iter__(self):
        if self._it is None and not self._done:
            loader, self._loader = self._loader, None
            self._it = iter(loader)
            if getattr(loader, "persistent_workers", False) is True:
                self._persistent = loader
        return self

    def __next__(self):
        it = self._it
        self._puller = threading.get_ident()
        # Marked before `_done` is read (close() sets `_done`, then reads this): one of the two
        # always sees the other.
        self._pulling = True
        if self._done or it is None:
            self._pulling = False
            raise StopIteration
        try:
            return next(it)
        except StopIteration:
            raise
        except Exception:
            if self._done:
                # close() ended the wait (its workers gone): the iteration is over.
                raise StopIteration from None
            raise
        finally:
            self._pulling = False

    def close(self):
        """The prefetcher is being closed: a loader thread in the loader's ``next()`` gets
        ``STUCK_SECONDS``, then the workers are ended and that ``next()`` woken."""
        self._done = True
        it = self._it
        if it is None or not self._pulling or threading.get_ident() == self._puller:
            return
        deadline = time.monotonic() + STUCK_SECONDS
        try:
            while self._pulling and time.monotonic() < deadline:
                time.sleep(0.005)
        finally:
            if self._pulling:
                # Also when a Ctrl-C ends the wait: the loader thread would wait forever.
                loader, self._persistent = self._persistent, None
                try:
                    end_iteration(it, True, 0.5)
                finally:
                    # A persistent loader would start its next epoch on the ended workers
                    # (torch asserts there): it makes new ones instead.
                    if loader is not None and getattr(loader, "_iterator", None) is it:
                        loader._iterator = None
