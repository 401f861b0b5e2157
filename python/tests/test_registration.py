"""A page-locked ring (``worker_ring``'s, ``process=True``'s) is unpinned without the GIL: it
takes milliseconds for hundreds of megabytes, and the training thread needs the GIL meanwhile."""

import mmap
import sys
import threading
import time

import pinstream

from conftest import needs_gpu


@needs_gpu
def test_a_page_locked_ring_is_unpinned_without_the_gil():
    """The ring of ``worker_ring`` / ``process=True`` is page-locked by ``HostRegistration``;
    unpinning hundreds of megabytes takes milliseconds, and the training thread must run
    meanwhile. The thread that drops the registration keeps the GIL between its own bytecodes
    (a switch interval of seconds), so the main thread can only see ``dropping`` set if the
    drop itself lets the GIL go."""
    buf = mmap.mmap(-1, 1 << 30)
    holder = [pinstream._native.HostRegistration(buf, 0)]
    state = {"dropping": False, "seen": 0, "done": False}

    def dropper():
        state["dropping"] = True
        holder.clear()  # the last reference: unregistered here
        state["dropping"] = False
        state["done"] = True

    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    try:
        th = threading.Thread(target=dropper)
        th.start()
        deadline = time.monotonic() + 120
        while not state["done"] and time.monotonic() < deadline:
            if state["dropping"]:
                state["seen"] += 1
            time.sleep(0.0001)
        th.join(60)
    finally:
        sys.setswitchinterval(old)
    assert state["done"]
    assert state["seen"] > 0, "the main thread never ran while the ring was unpinned"
    buf.close()  # no export left: the registration released the buffer
