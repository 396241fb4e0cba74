"""Parallel ingest: large results are decoded and validated in worker processes.

Profiled on one 6.6 MB Fed3R contribution (d = 1280, float64, 2-core machine), the service thread
spent ~30 ms factorising the Gram matrix (the positive semi-definite check), ~4 ms per sha256 of
the payload, ~25 ms committing it to SQLite and ~1 ms adding it to the sums. The first two are
pure functions of the message's bytes, so they run here, in ``workers`` processes (forks of the
service's fork server, never of the service: it has threads), while the service thread goes on
receiving: a worker decodes the whole message (payload sha256, the sender's Ed25519 signature,
tensor layout) and runs the job's ``check_payload`` on it (the checks that need the message
alone: a worker's copy of the job has none of its state), and answers only its verdict (a few
bytes).

What orders effects stays on the service thread, unchanged: the round machine, the durable store
write before the ack, the sum into the job (``job.parse_accepted`` reads the tensors as views on
the same bytes, skips only the checks the worker ran, and runs those that need the job's state).
So the sums, the store and crash recovery are exactly those of inline ingest, and an order-free
job's final model is still re-summed in canonical order. A verdict that never comes back (the process stops) leaves nothing
behind: nothing was stored or acknowledged, and the device re-sends.

A message reaches a worker through shared memory, not the pool's pipe: pickling 6.6 MB, the pipe's
two kernel copies and the unpickling made the round trip 3.5x slower (``bench/ingest_steps.py``,
hand-off: ~16 ms against ~4.5 ms on the development VM). The service copies the message into a
reused segment (:class:`TransferBuffers`) and sends its name; the worker decodes it in place. The
segment goes back to the free list with the verdict: the service keeps its own bytes of the message.

Memory is bounded: at most ``max_pending`` messages are in the workers at once, and one per
device; beyond that the service thread validates the message itself (back-pressure, never a drop).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory

from protocols.envelope import Envelope, EnvelopeError, decode, decode_checked
from protocols.identity import InvalidSignature, verify_signature

from aggregator.compute.fork_server import fork_server_context
from aggregator.jobs.registry import build_job


@dataclass(frozen=True)
class Verdict:
    """A worker's answer: ``None`` reason when the message is a valid result for the job; else the
    rejection class ("malformed", "bad signature": the message itself; "invalid payload": a
    well-formed result whose statistics are refused) and the detail."""
    reason_class: str | None
    detail: str = ""


class IngestWorkers:
    def __init__(self, workers: int, max_pending: int | None = None):
        if workers < 1:
            raise ValueError("ingest workers must be >= 1")
        threads = max(1, (os.cpu_count() or 1) // workers)      # the workers share the cores, never oversubscribe
        # a multiprocessing Pool, not a ProcessPoolExecutor: its terminate() ends the workers at once
        # (they hold nothing), where an executor's shutdown can wait on a worker at interpreter exit
        self._pool = fork_server_context(__name__).Pool(workers, _init_worker, (threads,))
        self.workers = workers
        self.max_pending = max_pending or 16 * workers
        self._pending: dict[str, int] = {}       # device -> messages of it in the workers
        self.warming: list[Future] = []
        self.buffers = TransferBuffers(keep=4 * workers)

    @staticmethod
    def accepts(job) -> bool:
        """Whether results of ``job`` can be validated here: its message-only checks
        (``check_payload``) can run on a copy, and it can re-parse bytes that passed them."""
        return job.split_validation

    def has_room(self, device: str) -> bool:
        return sum(self._pending.values()) < self.max_pending and device not in self._pending

    def warm_up(self, kind: str, config: dict) -> None:
        """Start the processes and build the job in each now, not on the first large result."""
        self.warming = [self._call(_warm_up, kind, json.dumps(config, sort_keys=True)) for _ in range(self.workers)]

    def submit(self, device: str, kind: str, config: dict, whole: bytes, public_key: bytes | None,
               max_bytes: int) -> Future:
        """Validate ``whole`` (a reassembled result from ``device``) for the job ``kind``/``config``;
        the future's result is a :class:`Verdict`."""
        self._pending[device] = self._pending.get(device, 0) + 1
        segment = self.buffers.put(whole)
        future = self._call(validate_shared, kind, json.dumps(config, sort_keys=True), segment.name, len(whole),
                            public_key, max_bytes)
        future.add_done_callback(lambda _: self.buffers.release(segment))
        return future

    def _call(self, fn, *args) -> Future:
        future: Future = Future()
        future.set_running_or_notify_cancel()
        self._pool.apply_async(fn, args, callback=future.set_result, error_callback=future.set_exception)
        return future

    def done(self, device: str) -> None:
        """The service has taken the verdict on one of ``device``'s messages (its thread only, as
        every other call here: the bookkeeping needs no lock)."""
        left = self._pending.pop(device, 1) - 1
        if left > 0:
            self._pending[device] = left

    def close(self) -> None:
        self._pool.terminate()
        self.buffers.close()


class TransferBuffers:
    """Shared memory segments that carry messages to the workers, reused: a new segment's pages
    cost a fault each on first touch, a reused one's nothing. Segments come back with their verdict
    (on the pool's result thread, hence the lock); at most ``keep`` idle ones are kept."""

    GRAIN = 1 << 20

    def __init__(self, keep: int):
        self.keep = keep
        self._free: list[SharedMemory] = []
        self._segments: dict[str, SharedMemory] = {}   # every one not destroyed, idle or in flight
        self._lock = threading.Lock()

    def put(self, data: bytes) -> SharedMemory:
        """A segment holding ``data`` at its start."""
        with self._lock:
            fits = [s for s in self._free if s.size >= len(data)]
            segment = min(fits, key=lambda s: s.size) if fits else None
            if segment is not None:
                self._free.remove(segment)
        if segment is None:
            segment = SharedMemory(create=True, size=max(1, -(-len(data) // self.GRAIN)) * self.GRAIN)
            with self._lock:
                self._segments[segment.name] = segment
        segment.buf[:len(data)] = data
        return segment

    def release(self, segment: SharedMemory) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(segment)
                return
            self._segments.pop(segment.name, None)
        _destroy(segment)

    def close(self) -> None:
        """Destroy every segment, idle or still in flight (call once the workers are stopped)."""
        with self._lock:
            segments, self._segments, self._free = list(self._segments.values()), {}, []
        for segment in segments:
            _destroy(segment)


def _destroy(segment: SharedMemory) -> None:
    segment.close()
    segment.unlink()


def refusal(future: Future, revoked: bool) -> tuple[str, str] | None:
    """The refusal (class, detail) a worker's verdict means on its own, or None: what raised in a
    worker would have raised on the service thread, and a device revoked meanwhile is refused alike."""
    if future.exception() is not None:
        return "malformed", f"ingest worker: {future.exception()!r}"[:300]
    if revoked:
        return "revoked device", ""
    verdict = future.result()
    if verdict.reason_class in ("malformed", "bad signature"):
        return verdict.reason_class, verdict.detail
    return None


def accepted_parser(verdict: Verdict, job, raw: bytes) -> Callable[[], object]:
    """The service's parse of a result a worker checked: its refusal, or the tensors without
    repeating the worker's checks (``SplitValidation.parse_accepted``)."""
    def parse():
        if verdict.reason_class is not None:
            raise EnvelopeError(verdict.detail)
        return job.parse_accepted(decode_checked(raw))
    return parse


# ---------------------------------------------------------------------- in the worker processes
_JOBS: dict[tuple[str, str], object] = {}


def _init_worker(threads: int) -> None:
    import threading
    import time

    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(threads)
    threadpool_limits(threads)          # LAPACK's (the Gram check) too: workers share the cores

    # A SIGKILLed service must not leave its workers behind: a worker's parent is the service's
    # fork server, which exits with the service (its end of the server's pipe closes).
    parent = os.getppid()

    def exit_with_parent() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(0)

    threading.Thread(target=exit_with_parent, daemon=True, name="exit-with-parent").start()


def _job_for(kind: str, config_json: str):
    key = (kind, config_json)
    if key not in _JOBS:
        _JOBS.clear()                   # one job at a time: a new job's config replaces the last one's
        _JOBS[key] = build_job(kind, json.loads(config_json))
    return _JOBS[key]


def _warm_up(kind: str, config_json: str) -> None:
    import time

    _job_for(kind, config_json)
    time.sleep(0.5)             # hold this process so that the next warm-up lands on another one


def validate_shared(kind: str, config_json: str, name: str, length: int, public_key: bytes | None,
                    max_bytes: int) -> Verdict:
    """:func:`validate_result` of the first ``length`` bytes of the service's segment ``name``,
    read in place (the service neither writes nor reuses it before this returns). The mapping is
    closed again at once: one kept for a segment the service has destroyed would hold its memory."""
    # Attaching registers the name with the resource tracker, which a spawned worker shares with
    # the service (one registration per name): the service's unlink unregisters it.
    segment = SharedMemory(name=name)
    try:
        with segment.buf[:length] as whole:
            return validate_result(kind, config_json, whole, public_key, max_bytes)
    finally:
        segment.close()


def validate_result(kind: str, config_json: str, whole: bytes | memoryview, public_key: bytes | None,
                    max_bytes: int) -> Verdict:
    """Decode ``whole`` in full (signature required when ``public_key`` is given) and validate it
    as a result of the job; anything wrong with the message becomes a :class:`Verdict`, never an
    exception (only a job config this process cannot build raises)."""
    def verify(sender: str, signed: bytes, signature: bytes) -> None:
        try:
            verify_signature(public_key, signed, signature)
        except InvalidSignature as exc:
            raise _BadSignature(f"signature rejected for {sender!r}: {exc}") from None

    job = _job_for(kind, config_json)       # a config this process cannot build raises, before any view exists
    try:
        env: Envelope = decode(whole, verify if public_key is not None else None, max_bytes=max_bytes)
    except _BadSignature as exc:
        return Verdict("bad signature", str(exc))
    except EnvelopeError as exc:
        return Verdict("bad signature" if str(exc).startswith("unsigned") else "malformed", str(exc))
    try:
        job.check_payload(env)
    except EnvelopeError as exc:
        return Verdict("invalid payload", str(exc))
    except Exception as exc:
        # A check that breaks on this message (a bug) refuses the message, as the service's own
        # last resort does. Raised instead, its traceback would keep ``env``'s views of a shared
        # segment alive, and closing the segment would report a BufferError in its place.
        return Verdict("malformed", f"checking the result raised {exc!r}"[:300])
    return Verdict(None)


class _BadSignature(EnvelopeError):
    pass
