"""One thread that owns a party's state, fed by a queue: the aggregator service, the deployment
controller, the device agent and the device's deployment follower each run on one.

paho calls back on its network thread, which must not block and must not touch the party's state:
the link's callback only :meth:`MessageLoop.post` s what arrived. The loop's thread takes the items
in order, hands each to ``handle``, and calls ``tick(now)`` after each item and after every
``tick_s`` of quiet (at once when the tick asked for it: :meth:`tick_soon`), so the state has a
single writer and needs no locks. Any other thread (the admin API) runs code on that thread with
:meth:`MessageLoop.call` and gets its result or its error.

What raises in ``handle`` or ``tick`` goes to ``failed(item, exc)`` (``item`` is None for the
tick), which decides: log and go on (the default: one bad message never stops the loop), or
re-raise to end the loop. That is any BaseException but ENDS_THE_LOOP's (an asyncio
CancelledError, an application's own BaseException too: they ended the loop's thread, the party
silent). KeyboardInterrupt and SystemExit end the loop; a loop ended by an exception says so once
(log), keeps it (:attr:`MessageLoop.ended_by`) and calls ``on_end`` (a device says it is offline).
A ``call``'s error always goes back to its caller.

The loop runs on a thread of its own (:meth:`start`, :meth:`stop`), or on the caller's, one item
at a time (:meth:`serve_one`: the service interleaves its job lifecycle between items), or is
pumped (:meth:`serve_pending`: a device host drives thousands of device agents on a few threads).

What waits in the queue is bounded (:class:`QueueBound`): a message is checked (decoded, its
signature verified) only when the loop's thread takes it, so while that thread is busy (a device
training for minutes, a service closing a round) whatever anyone publishes to the party's topics
would sit in memory unread: a review's flood of 800 forged 1 MiB messages grew a device by 808 MB.
Each message is posted with its source (its topic: one sender) and its size; one whose source, or
the whole queue, is past its bytes is dropped on arrival and counted (:attr:`MessageLoop.dropped`).
A message is charged its size plus MESSAGE_OVERHEAD_BYTES (its queue entry, the payload object, the
topic), so a flood of empty messages is bounded too (a review's finding: charged their payload
alone, they cost nothing and queued without end).
The bound per source keeps one flooding sender from taking the others' room; honest traffic stays
far below both (a party takes its messages faster than its senders send them, except in bursts
the bound is sized for).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger("fedfleet.loop")


@dataclass(frozen=True)
class _Call:
    fn: Callable[[], Any]
    result: Future


@dataclass(frozen=True)
class _Sourced:
    item: Any
    source: str
    nbytes: int


@dataclass(frozen=True)
class QueueBound:
    """The most a loop's queue holds of messages not yet taken: from one source, and in all."""
    source_bytes: int
    total_bytes: int

    def __post_init__(self):
        if not 0 < self.source_bytes <= self.total_bytes:
            raise ValueError(f"a queue bound needs 0 < source_bytes <= total_bytes, got {self}")


# What ends a loop rather than failing the item in hand: the process asked to end (Ctrl-C, a
# sys.exit on the loop's thread). The Java device's MqttAgent.endsTheLoop is the same in kind.
ENDS_THE_LOOP = (KeyboardInterrupt, SystemExit)

MESSAGE_OVERHEAD_BYTES = 256   # what a queued message holds beyond its payload (Java's InboxQueue: the same)
DROP_LOG_S = 10.0            # drops are logged at most once per this (a flood must not flood the log)


class MessageLoop:
    def __init__(self, handle: Callable[[Any], None], tick: Callable[[float], None] | None = None,
                 tick_s: float = 0.2, name: str = "message-loop",
                 failed: Callable[[Any, BaseException], None] | None = None, bound: QueueBound | None = None,
                 on_end: Callable[[BaseException], None] | None = None):
        self._handle, self._tick, self.tick_s, self.name = handle, tick, tick_s, name
        self._failed = failed or self.log_failure
        self._on_end = on_end
        self.ended_by: BaseException | None = None     # what ended :meth:`run` (None: running, or stopped)
        self._q: queue.Queue = queue.Queue()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._owner: int | None = None           # the thread serving the loop (calls from it run at once)
        self._tick_soon = False                  # the tick has work left: no waiting for quiet before the next
        self.bound = bound
        self._queued: dict[str, int] = {}        # source -> bytes queued from it (with a bound)
        self._queued_total = 0
        self._bytes_lock = threading.Lock()
        self.dropped = 0                         # messages refused at the door: their source or the queue was full
        self._drop_logged = -DROP_LOG_S

    # ------------------------------------------------------------------ any thread
    def post(self, item: Any, source: str | None = None, nbytes: int = 0) -> bool:
        """Queue ``item`` (not None) for ``handle`` (never blocks: safe on paho's network thread).
        A message names its ``source`` and size: beyond the loop's bound it is dropped (False)."""
        if self.bound is None or source is None:
            self._q.put(item)
            return True
        nbytes += MESSAGE_OVERHEAD_BYTES
        if not self._admit(source, nbytes):
            return False
        self._q.put(_Sourced(item, source, nbytes))
        return True

    def _admit(self, source: str, nbytes: int) -> bool:
        with self._bytes_lock:
            held = self._queued.get(source, 0)
            if held + nbytes > self.bound.source_bytes or self._queued_total + nbytes > self.bound.total_bytes:
                self.dropped += 1
                now, first = time.monotonic(), self.dropped == 1
                if first or now - self._drop_logged >= DROP_LOG_S:
                    self._drop_logged = now
                    log.warning("%s: a message of %d bytes from %s dropped unread: %d bytes queued from it, %d in "
                                "all (bound %s); %d dropped so far", self.name, nbytes, source[:120], held,
                                self._queued_total, self.bound, self.dropped)
                return False
            self._queued[source] = held + nbytes
            self._queued_total += nbytes
            return True

    def _taken(self, source: str, nbytes: int) -> None:
        with self._bytes_lock:
            left = self._queued.get(source, 0) - nbytes
            if left > 0:
                self._queued[source] = left
            else:
                self._queued.pop(source, None)
            self._queued_total -= nbytes

    def call(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run ``fn`` on the loop's thread, after what is queued, and return its result or raise its
        error. TimeoutError when the loop does not get to it within ``timeout``: the call is then
        withdrawn and never runs (an admin told "not answering" must not see the change happen
        later, nor be refused a retry of it); one the loop began meanwhile is waited for, and its
        outcome is the answer. On the loop's own thread it runs at once: queued behind itself it
        would wait for ever."""
        if threading.get_ident() == self._owner:
            return fn()
        fut: Future = Future()
        self._q.put(_Call(fn, fut))
        try:
            return fut.result(timeout)
        except FutureTimeout:
            if fut.cancel():            # still queued: ``_serve`` skips a cancelled call
                raise
        return fut.result()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def alive(self) -> bool:
        """Whether the loop's own thread (:meth:`start`) is serving (not ended by ``failed``)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, join_s: float = 10.0) -> None:
        """Stop after the item in hand; join the loop's own thread (if :meth:`start` made one)."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(join_s)

    # ------------------------------------------------------------------ the loop's thread
    def tick_soon(self) -> None:
        """From ``tick``: tick again after the next item, or at once when none is queued, not after
        ``tick_s`` of quiet: a tick that does long work in slices (the deployment controller's
        re-delivery at start) has the items that arrive served between its slices and loses no
        time when none do."""
        self._tick_soon = True

    def start(self) -> "MessageLoop":
        """Serve on a thread of the loop's own until :meth:`stop`."""
        self._thread = threading.Thread(target=self._run_own, name=self.name, daemon=True)
        self._thread.start()
        return self

    def run(self) -> None:
        """Serve on this thread until :meth:`stop` (or until ``failed`` re-raises, or ENDS_THE_LOOP)."""
        try:
            while not self._stopping.is_set():
                self.serve_one()
        except BaseException as exc:
            self._ended(exc)
            raise

    def _run_own(self) -> None:
        try:
            self.run()
        except BaseException:       # said and kept by run (ended_by): the loop's own thread just ends
            pass

    def _ended(self, exc: BaseException) -> None:
        self.ended_by = exc
        log.critical("%s: the loop ended (%s: %s): it handles nothing more", self.name, type(exc).__name__,
                     str(exc)[:200], exc_info=exc)
        if self._on_end is not None:
            try:
                self._on_end(exc)
            except Exception:
                log.exception("%s: on_end raised", self.name)

    def serve_one(self) -> None:
        """Handle the next item (waiting at most ``tick_s`` for one), then tick."""
        self._owner = threading.get_ident()
        soon, self._tick_soon = self._tick_soon, False
        try:
            item = self._q.get(timeout=0 if soon else self.tick_s)
        except queue.Empty:
            item = None
        if item is not None:
            self._serve(item)
        self._tick_once()

    def serve_pending(self) -> None:
        """Handle every item queued now, never waiting, then tick once: for a party pumped by a host
        that drives many (``fedfleet/emulation/host.py``); must not run concurrently with itself.
        What ends :meth:`run` ends a pumped loop alike (said, kept in ``ended_by``, ``on_end``, then
        re-raised to the host); an ended loop serves nothing more."""
        if self.ended_by is not None:
            return
        self._owner = threading.get_ident()
        try:
            while True:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                self._serve(item)
            self._tick_once()
        except BaseException as exc:    # a host's pool held it unseen: the party online, answering nothing
            self._ended(exc)
            raise
        finally:                # the host's next pump may come on another of its threads
            self._owner = None

    def _serve(self, item: Any) -> None:
        if isinstance(item, _Sourced):         # its room is free again
            self._taken(item.source, item.nbytes)
            item = item.item
        if isinstance(item, _Call):
            if item.result.set_running_or_notify_cancel():
                try:
                    item.result.set_result(item.fn())
                except BaseException as exc:    # the caller's error (the API makes it a 4xx)
                    item.result.set_exception(exc)
                    if isinstance(exc, ENDS_THE_LOOP):
                        raise
        else:
            try:
                self._handle(item)
            except ENDS_THE_LOOP:
                raise
            except BaseException as exc:
                self._failed(item, exc)

    def _tick_once(self) -> None:
        if self._tick is not None:
            try:
                self._tick(time.monotonic())
            except ENDS_THE_LOOP:
                raise
            except BaseException as exc:
                self._failed(None, exc)

    def log_failure(self, item: Any, exc: BaseException) -> None:
        what = "the tick" if item is None else repr(item)[:120]
        log.error("%s: %s raised; the loop goes on", self.name, what, exc_info=exc)
