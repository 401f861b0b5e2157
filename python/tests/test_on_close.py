"""The prefetcher's ``on_close`` hook (a DataLoader reader's ``close``: the ring's, the helper's,
the in-process reader's) and Ctrl-C: a ``KeyboardInterrupt`` it raises is not swallowed. From
``close()`` (and ``__exit__``) it is raised once the close is done; from a drop, where nothing
can be raised, it is raised again in the main thread."""

from test_hostile import run_child

#: The native constructor with an ``on_close`` hook of the test's own (``pinstream.prefetch``
#: passes a DataLoader reader's ``close``), a dry run over a few images.
MAKE = """
        import pinstream._native as _native

        def make(hook, n=50):
            it = iter([np.full((2, 3, 4, 4), i, np.uint8) for i in range(n)])
            return _native.prefetch(it, 0, 2, None, None, "uint8", "nchw", "nchw", 1, False, True,
                                    False, None, None, hook, False)
"""


def test_close_raises_a_ctrl_c_of_the_hook_once_closed():
    run_child(
        MAKE
        + """
        base = pinstream_threads()
        calls = []

        def hook():
            calls.append(1)
            raise KeyboardInterrupt

        p = make(hook)
        assert int(next(p)[0, 0, 0, 0]) == 0
        try:
            p.close()
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("close() swallowed the KeyboardInterrupt")
        assert calls == [1]
        assert list(p) == [], "the prefetcher still yields after close()"
        p.close()  # the hook runs once
        assert calls == [1]
        t0 = time.monotonic()
        while pinstream_threads() > base and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        assert pinstream_threads() == base, f"{pinstream_threads() - base} threads left"

        # The same through `with`: the block's own exception is not replaced by the hook's
        # unless the hook was interrupted.
        p = make(hook)
        try:
            with p:
                next(p)
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("__exit__ swallowed the KeyboardInterrupt")
        assert calls == [1, 1]

        # Any other exception of the hook is reported, and close() returns.
        def bad():
            calls.append(2)
            raise ValueError("hook failed")

        p = make(bad)
        next(p)
        p.close()
        assert calls == [1, 1, 2]
        print("ok")
        """,
        timeout=90,
    )


def test_a_ctrl_c_of_the_hook_in_a_drop_reaches_the_main_thread():
    run_child(
        MAKE
        + """
        def hook():
            raise KeyboardInterrupt

        p = make(hook)
        next(p)
        got = "none"
        try:
            del p
            for _ in range(20_000):  # the interrupt comes at the next check
                time.sleep(0.001)
        except KeyboardInterrupt:
            got = "interrupted"
        assert got == "interrupted", "a Ctrl-C during the drop's hook was lost"

        # From a drop on another thread, too.
        p = make(hook)
        next(p)
        box = [p]
        del p
        t = threading.Thread(target=box.clear)
        got = "none"
        try:
            t.start()
            t.join()
            for _ in range(20_000):
                time.sleep(0.001)
        except KeyboardInterrupt:
            got = "interrupted"
        assert got == "interrupted", "a Ctrl-C during a drop's hook on another thread was lost"
        print("ok")
        """,
        timeout=90,
    )


def test_a_ctrl_c_of_the_hook_in_a_drop_comes_after_the_iterables_clean_up():
    """The drop lets the iterable go before the Ctrl-C is raised again: its clean-up (a
    generator's ``finally``, a DataLoader iterator's workers ended) runs whole instead of being
    cut short by the interrupt. (Found by review: the interrupt fired inside that clean-up, was
    swallowed there, and the Ctrl-C was lost.)"""
    run_child(
        MAKE
        + """
        cleanup = []

        def gen():
            try:
                for i in range(50):
                    yield np.full((2, 3, 4, 4), i, np.uint8)
            finally:
                cleanup.append("started")
                for _ in range(200):
                    sum(range(100))  # Python code, where a pending interrupt would fire
                cleanup.append("finished")

        def hook():
            raise KeyboardInterrupt

        p = _native.prefetch(gen(), 0, 2, None, None, "uint8", "nchw", "nchw", 1, False, True,
                             False, None, None, hook, False)
        next(p)
        got = "lost"
        try:
            del p
            for _ in range(20_000):
                time.sleep(0.001)
        except KeyboardInterrupt:
            got = "interrupted"
        assert cleanup == ["started", "finished"], cleanup
        assert got == "interrupted", "the Ctrl-C was lost"
        print("ok")
        """,
        timeout=90,
    )


def test_the_exit_handler_closes_every_prefetcher_after_a_ctrl_c_in_one():
    """pinstream's exit handler closes every live prefetcher; a Ctrl-C during one's close (a
    reader waiting for a stuck worker) does not leave the others running into the
    interpreter's finalization. (Found by review: it stopped at the first.)"""
    r = run_child(
        MAKE
        + """
        import atexit

        def after():
            print("live after the handler:", pinstream.memory_stats()["prefetchers"], flush=True)

        # Handlers run last registered first: pinstream's again after this one, to run before.
        atexit.unregister(pinstream._close_live_prefetchers)
        atexit.register(after)
        atexit.register(pinstream._close_live_prefetchers)
        first = [True]

        def hook():
            if first[0]:
                first[0] = False
                raise KeyboardInterrupt

        keep = []
        for _ in range(4):
            p = make(hook)
            pinstream._LIVE.add(p)  # as pinstream.prefetch does
            next(p)
            keep.append(p)
        print("ok")
        """,
        timeout=90,
    )
    assert "live after the handler: 0" in r.stdout.splitlines(), r.stdout
