"""The lock held across every fork of this process, shared by the modules that keep tables of
descriptors a fork must close (``process``: the helpers' pipes and rings; ``worker_ring``: the
workers' rings). A descriptor leaves its table under it before it is closed, so a fork never
sees a closed (and maybe reused) number in a table.

One lock for all of them, reentrant: a fork made while holding it (a helper started under it)
takes it again in the before-fork hook, and a cleanup run by a garbage collection that starts
while it is held takes it again on the same thread. Two locks would deadlock, each thread
holding one and waiting for the other.
"""

import os
import threading

LOCK = threading.RLock()


def _before_fork():
    LOCK.acquire()


def _after_fork_in_parent():
    LOCK.release()


def _after_fork_in_child():
    # Held by the forking thread, the only one here: a fresh lock for the child.
    global LOCK
    LOCK = threading.RLock()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)
