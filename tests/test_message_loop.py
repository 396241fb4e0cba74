"""protocols/message_loop.py without a broker: order, call(), errors, stop."""

from __future__ import annotations

import threading
import time

import pytest

from protocols.message_loop import MessageLoop


class Recorder:
    """A loop's handler that records (thread, item) and raises on items it is told to."""

    def __init__(self, raise_on=(), block_on=None):
        self.seen: list = []
        self.threads: set[int] = set()
        self.raise_on, self.block_on = set(raise_on), block_on
        self.entered, self.release = threading.Event(), threading.Event()
        self.done = threading.Event()

    def __call__(self, item) -> None:
        self.threads.add(threading.get_ident())
        if item == self.block_on:
            self.entered.set()
            self.release.wait(5)
        if item in self.raise_on:
            raise ValueError(f"bad item {item}")
        self.seen.append(item)
        if item == "last":
            self.done.set()


def test_items_are_handled_in_order_on_the_loops_own_thread():
    rec = Recorder()
    loop = MessageLoop(rec, tick_s=0.01, name="t-order").start()
    try:
        items = [("mqtt", f"topic/{i}", bytes([i])) for i in range(200)]
        posters = [threading.Thread(target=lambda chunk=items[k::4]: [loop.post(x) for x in chunk]) for k in range(4)]
        for i in items[:50]:
            loop.post(i)
        loop.post("last")
        assert rec.done.wait(5)
        assert rec.seen == [*items[:50], "last"]      # one poster: its order exactly
        rec.done.clear()
        for p in posters:
            p.start()
        for p in posters:
            p.join()
        loop.post("last")
        assert rec.done.wait(5)
        # several posters: each poster's items in its own order, none lost or doubled
        later = rec.seen[51:-1]
        assert sorted(later) == sorted(items)
        for k in range(4):
            assert [x for x in later if x in items[k::4]] == items[k::4]
        assert rec.threads == {loop._thread.ident} and threading.get_ident() not in rec.threads
    finally:
        loop.stop()


def test_call_returns_the_result_or_raises_the_error_and_runs_after_what_is_queued():
    rec = Recorder()
    loop = MessageLoop(rec, tick_s=0.01, name="t-call").start()
    try:
        for i in range(20):
            loop.post(i)
        # run on the loop's thread, after the 20 items queued before it
        seen, thread = loop.call(lambda: (list(rec.seen), threading.get_ident()))
        assert seen == list(range(20)) and thread == loop._thread.ident
        with pytest.raises(KeyError, match="no such thing"):
            loop.call(lambda: {}["no such thing"])
        assert loop.call(lambda: 6 * 7) == 42          # an error in one call leaves the loop serving
    finally:
        loop.stop()


def test_a_call_that_times_out_never_runs_and_one_begun_is_waited_for():
    """A review's finding: the admin API answered 503 "not answering" to a call still queued behind
    a busy loop, and the call ran later anyway (a device enrolled whose password nobody saw; the
    retry refused as "already enrolled"). A call that times out in the queue is withdrawn; one the
    loop has begun is waited for, and its outcome is the answer."""
    loop = MessageLoop(lambda item: None, tick_s=0.01, name="t-timeout").start()
    release, ran = threading.Event(), []
    try:
        busy = threading.Thread(target=lambda: loop.call(lambda: release.wait(10), timeout=20))
        busy.start()
        time.sleep(0.1)                                # the loop is inside the first call now
        with pytest.raises(TimeoutError):
            loop.call(lambda: ran.append("queued"), timeout=0.2)
        release.set()
        busy.join(10)
        assert loop.call(lambda: 1) == 1 and ran == []          # served since: the withdrawn one never ran
        # begun before its time is up, it is waited for past the timeout
        assert loop.call(lambda: time.sleep(0.5) or "done", timeout=0.2) == "done"
    finally:
        release.set()
        loop.stop()


def test_call_from_the_loops_own_thread_runs_at_once():
    box = {}
    loop = MessageLoop(lambda item: box.update(inner=loop.call(lambda: threading.get_ident(), timeout=1)),
                       tick_s=0.01, name="t-inline").start()
    try:
        loop.post("x")
        assert loop.call(lambda: box.get("inner")) == loop._thread.ident      # no wait on itself
    finally:
        loop.stop()


def test_a_raising_handler_or_tick_does_not_stop_the_loop_by_default():
    rec = Recorder(raise_on={"bad-1", "bad-2"})
    ticks = []

    def tick(now: float) -> None:
        ticks.append(now)
        if len(ticks) == 1:
            raise RuntimeError("a tick that fails once")

    failed = []
    loop = MessageLoop(rec, tick, tick_s=0.01, name="t-errors",
                       failed=lambda item, exc: failed.append((item, type(exc))))
    loop.start()
    try:
        for item in ("a", "bad-1", "b", "bad-2", "last"):
            loop.post(item)
        assert rec.done.wait(5)
        assert rec.seen == ["a", "b", "last"]
        assert ("bad-1", ValueError) in failed and ("bad-2", ValueError) in failed
        assert (None, RuntimeError) in failed and len(failed) == 3
        assert loop.call(lambda: len(ticks)) >= 5 and ticks == sorted(ticks)
    finally:
        loop.stop()
    # the default policy: logged, and the loop goes on
    rec2 = Recorder(raise_on={"bad"})
    loop2 = MessageLoop(rec2, tick_s=0.01, name="t-default").start()
    try:
        loop2.post("bad")
        loop2.post("last")
        assert rec2.done.wait(5) and rec2.seen == ["last"]
    finally:
        loop2.stop()


def test_failed_may_end_the_loop_by_re_raising():
    def failed(item, exc):
        raise exc

    loop = MessageLoop(Recorder(raise_on={"fatal"}), tick_s=0.01, name="t-fatal", failed=failed)
    loop.post("fatal")
    with pytest.raises(ValueError, match="bad item fatal"):
        loop.run()                               # on the caller's thread, as the service serves
    own = MessageLoop(Recorder(raise_on={"fatal"}), tick_s=0.01, name="t-fatal-own", failed=failed).start()
    assert own.alive
    own.post("fatal")
    own._thread.join(5)
    assert not own.alive                         # its own thread ended (as a device's on a failing tick)


def test_stop_while_busy_finishes_the_item_in_hand_and_joins():
    rec = Recorder(block_on="slow")
    loop = MessageLoop(rec, tick_s=0.01, name="t-stop").start()
    loop.post("slow")
    loop.post("never")
    assert rec.entered.wait(5)
    stopper = threading.Thread(target=loop.stop)
    stopper.start()
    stopper.join(0.05)
    assert stopper.is_alive()                     # stop waits for the item in hand...
    rec.release.set()
    stopper.join(5)
    assert not stopper.is_alive() and not loop.alive
    assert rec.seen == ["slow"]                   # ...and takes nothing after it
    with pytest.raises(TimeoutError):
        loop.call(lambda: 1, timeout=0.05)        # a stopped loop runs no call


def test_the_tick_runs_when_quiet():
    ticks = threading.Event()
    loop = MessageLoop(lambda item: None, lambda now: ticks.set(), tick_s=0.01, name="t-quiet").start()
    try:
        assert ticks.wait(5)
    finally:
        loop.stop()


def test_a_pumped_loop_handles_what_is_queued_then_ticks_once_without_waiting():
    rec, ticks = Recorder(raise_on={"bad"}), []
    loop = MessageLoop(rec, ticks.append, tick_s=60.0, name="t-pump", failed=lambda item, exc: None)
    for item in ("a", "bad", "b"):
        loop.post(item)
    t0 = time.monotonic()
    loop.serve_pending()
    assert rec.seen == ["a", "b"] and len(ticks) == 1
    loop.serve_pending()                          # nothing queued: a tick only, still no wait for tick_s
    assert rec.seen == ["a", "b"] and len(ticks) == 2 and time.monotonic() - t0 < 5


def test_what_waits_unread_is_bounded_per_source_and_in_all_and_its_room_comes_back_when_taken():
    """A review's finding: while the loop's thread was busy (a device training), everything
    published to its topics waited in memory unread: 800 forged 1 MiB messages, 808 MB. A message
    costs its bytes plus O, what its queue entry holds besides."""
    from protocols.message_loop import MESSAGE_OVERHEAD_BYTES as O, QueueBound

    rec = Recorder(block_on=("t/in", b"first"))
    loop = MessageLoop(rec, tick_s=0.01, name="t-bound", bound=QueueBound(source_bytes=10 + 2 * O,
                                                                          total_bytes=15 + 3 * O)).start()
    try:
        assert loop.post(("t/in", b"first"), "t/in", 5)
        assert rec.entered.wait(5)                              # taken: its 5 + O bytes are free again
        posted = [loop.post(("t/in", i), "t/in", 4) for i in range(4)]          # 2 (4 + O) fit in 10 + 2 O, the rest not
        assert posted == [True, True, False, False] and loop.dropped == 2
        assert loop.post(("t/other", "x"), "t/other", 7)                        # another source: its own room
        assert not loop.post(("t/third", "y"), "t/third", 1)                    # 15 + 3 O in all: full
        assert not loop.post(("t/other", "big"), "t/other", 11)                 # beyond any room
        loop.post("unbounded")                                                  # what names no source is never dropped
        assert loop.dropped == 4
        rec.release.set()
        loop.post("last")
        assert rec.done.wait(5)
        assert rec.seen == [("t/in", b"first"), ("t/in", 0), ("t/in", 1), ("t/other", "x"), "unbounded", "last"]
        assert all(loop.post(("t/in", i), "t/in", 5) for i in range(2))        # the room came back
    finally:
        rec.release.set()
        loop.stop()
    with pytest.raises(ValueError, match="source_bytes <= total_bytes"):
        QueueBound(source_bytes=20, total_bytes=10)


def test_a_flood_of_empty_messages_is_bounded_too():
    """A review's finding: a message was charged its payload alone, so empty ones cost nothing and
    queued without end while the loop's thread was busy (each still holds an entry and its topic)."""
    from protocols.message_loop import MESSAGE_OVERHEAD_BYTES as O, QueueBound

    loop = MessageLoop(lambda item: None, bound=QueueBound(10 * O, 10 * O))     # not started: nothing is taken
    assert sum(loop.post(("t/in", b""), "t/in", 0) for _ in range(100)) == 10 and loop.dropped == 90


def test_a_tick_with_work_left_is_called_again_without_waiting_for_quiet():
    """``tick_soon``: a tick doing long work in slices (the deployment controller's re-delivery at
    start) is called again at once, an item queued meanwhile served between two slices; once it
    asks no more, ticks come after ``tick_s`` of quiet again."""
    rec, slices = Recorder(), []

    def tick(now: float) -> None:
        if len(slices) < 20:
            slices.append(time.monotonic())
            if len(slices) == 10:
                loop.post("between")
            loop.tick_soon()

    loop = MessageLoop(rec, tick, tick_s=2.0, name="t-soon")
    t0 = time.monotonic()
    loop.post("first")                  # the first tick: after it
    loop.start()
    try:
        deadline = time.monotonic() + 3
        while len(slices) < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(slices) == 20 and slices[-1] - t0 < 1.0       # not 20 waits of 2 s
        assert rec.seen == ["first", "between"]
    finally:
        loop.stop()
