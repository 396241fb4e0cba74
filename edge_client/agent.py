"""The device agent: runs tasks from the aggregator over MQTT.

One agent = one device identity and one MQTT connection. The paho network thread only posts
raw payloads to the agent's :class:`~protocols.message_loop.MessageLoop`; the loop's thread (or a
device host pumping it) decodes them, drives the sans-IO
:class:`protocols.device_session.DeviceSession` and executes its actions (start work, send result,
retry). Work itself is done by *task handlers* registered per ``kind`` (e.g. ``fed3r.stats``),
so the agent knows nothing about any algorithm. Given the device's state store (``state``), it also
follows the aggregator's retained ``job.ended`` list and drops an ended job's state for the run
that ended (protocols/payloads/job_end.py), and keeps the session's replay guard in the store's
folder across restarts (edge_client/session_memory.py).

``AgentHooks`` is how the environment shapes behaviour without the agent knowing about it: the
emulated fleet uses it for compute slowdown, upload bandwidth caps, mid-task drop-outs and
availability windows; a real device uses the defaults (no shaping).
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Protocol

import numpy as np

from protocols import messages as M
from protocols.chunking import DEFAULT_CHUNK_SIZE, encode_parts
from protocols.device_inbox import DEVICE_INBOX_BOUND     # the bound: what its topics hold unread
from protocols.device_session import (AckArrived, DeviceSession, DeviceState, ResultSent, SendDecline, SendResult,
                                      SkipTask, StartWork, TaskArrived, Tick, WorkFailed, WorkFinished, WorkStopped)
from protocols.envelope import Envelope, EnvelopeError, encode
from protocols.message_loop import ENDS_THE_LOOP, MessageLoop
from protocols.mqtt_link import BrokerConfig, MqttLink
from protocols.payloads.job_end import JOB_ENDED, MAX_NOTICES, parse_job_ended
from protocols.payloads.stateful import bound_run, foreign_job
from protocols.identity import sender_verifier
from protocols.topics import AGGREGATOR_ID, Topics

from edge_client.inbox import aggregator_inbox
from edge_client.session_memory import SESSION_FILE, SessionMemoryFile
from edge_client.state import DeviceStateStore
from edge_client.work_deadline import PastDeadline, wall_clock, working_until

log = logging.getLogger("fedfleet.device")

MAX_REASON_CHARS = 200          # of a decline reason or a tick's error, as logged


class FirstTimes:
    """Which keys were seen, to log a thing once per key; at most ``limit`` keys are ever held (past
    them nothing new is logged), so a peer that words every message differently cannot grow it."""

    def __init__(self, limit: int = 64):
        self.limit, self._seen = limit, set()

    def first(self, key: str) -> bool:
        if key in self._seen or len(self._seen) >= self.limit:
            return False
        self._seen.add(key)
        return True


class TaskDeclined(Exception):
    """Raised by a handler that cannot do a task (wrong backbone, no data, ...)."""


class Unsendable(Exception):
    """A task's result that cannot be encoded (over the wire's limits, past the memory): declined."""


class DroppedOut(Exception):
    """Raised (via hooks) when the device drops out mid-task: nothing is sent."""


def _defines(cls: type, method: str):
    """For an interface's ``__subclasshook__``: a class defining ``method`` (callable) is one of its
    kind, as ``collections.abc`` takes a class with ``__iter__`` for an Iterable, so a handler need
    not inherit the interface (an application's, a test's); anything else is left to inheritance."""
    return True if any(callable(vars(base).get(method)) for base in cls.__mro__) else NotImplemented


class SecureTaskHandler(ABC):
    """A task kind that starts a protocol of messages instead of producing a result (a secure
    aggregation's round): registered in the agent's ``protocol_handlers`` under the kind."""

    @classmethod
    def __subclasshook__(cls, candidate: type):
        return _defines(candidate, "on_task") if cls is SecureTaskHandler else NotImplemented

    @abstractmethod
    def on_task(self, job: str, round_: int, params: dict[str, Any],
                tensors: dict[str, np.ndarray] | None = None) -> list[Envelope]:
        """The protocol's first messages for this task (TaskDeclined: the device does not run it)."""


class MessageHandler(ABC):
    """The messages of a protocol's type (``secagg``): registered in the agent's
    ``protocol_handlers`` under the message type."""

    @classmethod
    def __subclasshook__(cls, candidate: type):
        return _defines(candidate, "on_message") if cls is MessageHandler else NotImplemented

    @abstractmethod
    def on_message(self, env: Envelope) -> list[Envelope]:
        """The answers to one message of its type."""

    # A protocol whose rounds end on the clock (a SecAgg session's deadline) defines these two:
    # the agent calls ``expire`` on every tick, and ticks an idle device while ``expiring``.
    expiring: bool = False

    def expire(self, now: float) -> None:
        """End what is held for rounds over by ``now`` (unix s, this device's clock)."""

    def unsendable(self, env: Envelope, exc: EnvelopeError) -> None:
        """The answers to ``env`` cannot be sent (``exc``: the outbox refused one, before any went).
        A protocol whose round cannot go on without them ends it here (a SecAgg session at once)."""
        log.warning("the answers to a %s message cannot be sent: %s", env.type, exc)


class KeepsState(ABC):
    """A plain task kind that keeps per-job state on the device and saves it before its result
    goes out (the stateful head kinds, Scaffold on the tail): the agent runs the task, and builds
    and encodes its result, within ``state_put_back_on_failure(params)``, so a task that then sends
    nothing (declined, failed, stopped, its result unsendable) leaves the job's state as it was."""

    @classmethod
    def __subclasshook__(cls, candidate: type):
        return _defines(candidate, "state_put_back_on_failure") if cls is KeepsState else NotImplemented

    @abstractmethod
    def state_put_back_on_failure(self, params: dict[str, Any]) -> ContextManager[None]:
        """A context that puts the task's job state back if anything within it raises."""


class TaskHandler(Protocol):
    """params: the task's JSON parameters; tensors: the task's tensors (e.g. a global model)."""

    def __call__(self, params: dict[str, Any],
                 tensors: dict[str, np.ndarray]) -> tuple[dict[str, Any], dict[str, np.ndarray]]: ...


@dataclass
class AgentHooks:
    """Behaviour shaping; defaults = a real device that is always on and never throttled."""

    after_compute: Callable[[float], None] = lambda elapsed: None     # may sleep, may raise DroppedOut
    # seconds of the task just run that it spent queued for a compute slot shared with other devices
    # (an emulation host's): neither the device's compute (stats) nor what a slower device stretches
    queued_s: Callable[[], float] = lambda: 0.0
    before_upload: Callable[[int], None] = lambda nbytes: None        # may sleep (bandwidth cap)
    is_available: Callable[[], bool] = lambda: True
    # is_available never turns False: an idle device that is online has nothing to do on a tick
    # (a host of 100,000 emulated devices then ticks only those with something pending)
    always_available: bool = False
    offline_after_dropout_s: float = 5.0                              # emulated outage after a drop-out
    info: dict[str, Any] = field(default_factory=dict)                # published with presence


@dataclass
class AgentStats:
    tasks_done: int = 0
    tasks_declined: int = 0
    tasks_skipped: int = 0          # tasks not run: their round was over (expired, replayed) or another device's
    tasks_stopped: int = 0          # tasks whose work stopped when their round was surely over (nothing sent)
    dropouts: int = 0
    bytes_up: int = 0
    compute_s: float = 0.0
    acks: dict[str, int] = field(default_factory=dict)
    by_kind: dict[str, dict[str, float]] = field(default_factory=dict)   # kind -> tasks, compute_s, bytes_up

    def count(self, kind: str, tasks: int = 0, compute_s: float = 0.0, bytes_up: int = 0) -> None:
        entry = self.by_kind.setdefault(kind, {"tasks": 0, "compute_s": 0.0, "bytes_up": 0})
        entry["tasks"] += tasks
        entry["compute_s"] += compute_s
        entry["bytes_up"] += bytes_up


class DeviceAgent:
    _warned_unverified = False
    def __init__(self, device_id: str, broker: BrokerConfig, handlers: dict[str, TaskHandler],
                 topics: Topics = Topics(), hooks: AgentHooks | None = None,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, retry_after_s: float = 10.0, tick_s: float = 0.5,
                 protocol_handlers: dict[str, Any] | None = None,
                 signer: Callable[[bytes], bytes] | None = None,
                 link_factory: Callable[..., MqttLink] = MqttLink,
                 aggregator_key: bytes | None = None, state: DeviceStateStore | None = None,
                 clock: Callable[[], float] = wall_clock):
        self.device_id = device_id
        # the device's wall clock (unix s): what a task's arrival, its work's end and its protocol
        # rounds' ends are read on against the aggregator's deadlines (a test sets one ahead)
        self.clock = clock
        # the device's per-job state (the stateful handlers' store): a job's goes when the aggregator
        # says the job ended (``job.ended`` on the retained Topics.job_ends, signed like its tasks)
        self.state = state
        # the (job, run)s whose end this device handled, oldest first: a task of one of them that
        # arrives later (queued behind the notice, redelivered) is skipped, or it would write that
        # run's state again, kept until the job's horizon (a review's finding)
        self._ended_runs: dict[tuple[str, str], None] = {}
        # Ed25519 signing of every envelope (DeviceIdentity.sign) when the aggregator requires it.
        self.signer = signer
        # Multi-message protocols (secure aggregation): task kind or message type -> an object with
        # on_task(job, round, params, tensors) / on_message(env), each returning envelopes to publish.
        self.protocol_handlers = protocol_handlers or {}
        # the handlers on the MessageHandler interface (``expire``, ``expiring``), found once: a host asks
        # every device's wants_tick every tick (a plain callable registered for a type ends no rounds;
        # bench/host_tick_check.py: a secure fleet's idle device 1.24x a plain one's)
        self._message_handlers = tuple(handler for handler in self.protocol_handlers.values()
                                       if isinstance(handler, MessageHandler))
        self.topics = topics
        self.handlers = handlers
        self.hooks = hooks or AgentHooks()
        self.chunk_size = chunk_size
        self.tick_s = tick_s
        self.session = DeviceSession(retry_after_s=retry_after_s)
        # the session's replay guard outlives the process where the device has a state folder
        self.memory_file = SessionMemoryFile(state.root / SESSION_FILE) if state is not None else None
        if self.memory_file is not None:
            self.memory_file.load_into(self.session, clock())
        self.stats = AgentStats()
        # With the aggregator's public key (from enrolment) only messages it signed are accepted;
        # without it (open development broker) anything on the inbox is taken: said once, loudly.
        self.assembler = aggregator_inbox(sender_verifier(AGGREGATOR_ID, aggregator_key) if aggregator_key else None)
        if aggregator_key is None and not DeviceAgent._warned_unverified:
            DeviceAgent._warned_unverified = True
            log.warning("devices are not verifying the aggregator's messages (no aggregator key): "
                        "development mode only")
        # what the link receives, handled on the agent's thread (or when a device host pumps it)
        self.loop = MessageLoop(self._handle, self._tick, tick_s, name=f"agent-{device_id}", failed=self._failed,
                                bound=DEVICE_INBOX_BOUND, on_end=self._ended)
        offline = M.presence_message(device_id, "offline")
        # The link is the agent's only I/O: a threaded paho link on a real device, a link on a shared
        # event loop when one process hosts thousands of emulated devices (fedfleet.emulation.host).
        self.link = link_factory(
            client_id=device_id, broker=broker, on_message=lambda t, p: self.loop.post((t, p), t, len(p)),
            subscriptions=[(topics.inbox(device_id), 1)] + [(topics.job_ends, 1)] * (state is not None),
            on_connect=self._announce,
            will=(topics.presence(device_id), encode(offline, signer=signer), True))
        self.online = False
        # going online or offline is one step at a time: the loop's thread (its tick, its on_end)
        # and stop() on another both went offline at once, and said 'offline' twice
        self._presence_lock = threading.Lock()
        self._outage_until = 0.0
        self._declined_for = FirstTimes()           # decline reasons already logged
        self._skipped_for = FirstTimes()            # (job, reason) of skipped tasks already logged
        self._tick_errors = FirstTimes()            # the tick's errors already logged

    # lifecycle
    def start(self, own_thread: bool = True) -> "DeviceAgent":
        """Connect and run. ``own_thread=False``: the caller drives the agent by calling
        :meth:`pump` whenever its link queued messages and every ``tick_s`` (a device host)."""
        if self.hooks.is_available():
            self._go_online()
        if own_thread:
            self.loop.start()
        return self

    def stop(self) -> None:
        self.loop.stop()
        self._go_offline()

    @property
    def ended_by(self) -> BaseException | None:
        """What ended the agent's loop on its own (a KeyboardInterrupt, a SystemExit on its thread:
        ENDS_THE_LOOP), or None; the device then said it is offline and handles nothing more, and the
        application restarts it (the Java device's MqttAgent.stoppedBy)."""
        return self.loop.ended_by

    def _ended(self, exc: BaseException) -> None:
        """The loop ended (logged by it): presence ``offline``, not an online device answering nothing."""
        self._go_offline()

    def pump(self) -> None:
        """Handle every queued message, then one tick (retries, availability); never blocks on
        the inbox. Must not run concurrently with itself. Once the loop ended (``ended_by``) it does
        nothing: following availability would bring the ended device online again."""
        if self.ended_by is not None:
            return
        self._follow_availability()
        self.loop.serve_pending()

    @property
    def wants_tick(self) -> bool:
        """Whether a tick may do anything: a result awaiting its ack (retries), an outage to end,
        an availability to follow, a secure session to end at its deadline. An idle, online, always
        available device's tick is a no-op, and so is an ended agent's (:meth:`pump`)."""
        if self.ended_by is not None:
            return False
        if not (self.hooks.always_available and self.online and time.monotonic() >= self._outage_until):
            return True
        state = self.session.state
        # REPORTED without a resend pending is idle too: a secure task's result expects no ack, and its
        # session stayed REPORTED until the next task, so a host ticked every device of a secure fleet
        # for ever after its first secure round
        if state is not DeviceState.IDLE and (state is not DeviceState.REPORTED or self.session.resend_pending):
            return True
        for handler in self._message_handlers:
            if handler.expiring:
                return True
        return False

    def _go_online(self) -> None:
        with self._presence_lock:
            if self.loop.stopping:      # stopped: a host's pump that ran as stop() did must not connect it again
                return
            self.link.start()
            self.online = True

    def _go_offline(self) -> None:
        # the whole step under the lock: a second caller returns once the device is offline, not before
        with self._presence_lock:
            if not self.online:
                return
            self.link.publish(self.topics.presence(self.device_id),
                              encode(M.presence_message(self.device_id, "offline"), signer=self.signer),
                              retain=True, wait=True)
            self.link.stop()
            self.online = False

    def _announce(self) -> None:
        info = {"kinds": sorted(self.handlers), **self.hooks.info}
        self.link.publish(self.topics.presence(self.device_id),
                          encode(M.presence_message(self.device_id, "online", info), signer=self.signer), retain=True)

    # the agent's loop (protocols/message_loop.py)
    def _handle(self, item: tuple[str, bytes]) -> None:
        self._on_payload(item[1])

    def _tick(self, now: float) -> None:
        """After each message and every ``tick_s`` of quiet: retries and deadlines, then availability
        (which the next wait follows)."""
        # partial chunked messages past their TTL (an aggregator that stopped mid-send, or forged
        # first chunks) would otherwise hold the sender's slots, and refuse its later tasks, for ever
        self.assembler.reassembler.expire()
        wall = self.clock()         # protocol rounds end at a task's deadline: wall-clock time
        for handler in self._message_handlers:
            handler.expire(wall)
        self._execute(self.session.handle(Tick(now)))
        self._follow_availability()

    def _failed(self, item: tuple[str, bytes] | None, exc: BaseException) -> None:
        if item is None:        # the device goes on: the tick's next run may succeed (a link back)
            if self._tick_errors.first(f"{type(exc).__name__}: {exc}"[:MAX_REASON_CHARS]):
                log.error("%s: the tick raised (logged once per error; the agent goes on)", self.device_id,
                          exc_info=exc)
            return
        if isinstance(exc, EnvelopeError):        # cut: a schema error quotes the field, as long as a forger likes
            log.warning("%s: dropped malformed message on %s: %s", self.device_id, item[0][:120],
                        str(exc)[:MAX_REASON_CHARS])
        else:                   # one bad message never stops the device
            log.error("%s: dropped a message on %s that raised an unexpected error", self.device_id, item[0],
                      exc_info=exc)

    def _follow_availability(self) -> None:
        available = self.hooks.is_available() and time.monotonic() >= self._outage_until
        if available and not self.online:
            self._go_online()
        elif not available and self.online:
            self._go_offline()

    def _on_payload(self, payload: bytes) -> None:
        env = self.assembler.feed(payload)
        if env is None:
            return
        if env.sender != AGGREGATOR_ID:
            raise EnvelopeError(f"message from {env.sender!r}, expected the aggregator")
        if env.type == M.TASK:
            ref, kind, params, deadline = M.parse_task(env)
            addressee = M.task_addressee(env)
            if addressee is not None and addressee != self.device_id:
                self._execute([SkipTask(ref, f"addressed to {addressee[:64]!r}, not to this device")])
                return
            if (ref.job, bound_run(params)) in self._ended_runs:
                self._execute([SkipTask(ref, "its job ended: this device dropped the run's state and keeps none")])
                return
            self._execute(self.session.handle(TaskArrived(ref, kind, params, deadline, dict(env.tensors),
                                                          received_at=self.clock(), sent_at=env.ts)))
        elif self._protocol(env.type, MessageHandler) is not None:
            self._answer(self.protocol_handlers[env.type], env)
        elif env.type == JOB_ENDED:
            self._on_job_ended(env)
        elif env.type == M.ACK:
            ref_id, status, reason = M.parse_ack(env)
            self.stats.acks[status] = self.stats.acks.get(status, 0) + 1
            if status == "rejected":
                log.warning("%s: result %s rejected: %s", self.device_id, ref_id[:64], reason[:MAX_REASON_CHARS])
            self.session.handle(AckArrived(ref_id, status))
        else:
            log.info("%s: ignoring message type %s", self.device_id, env.type)

    def _answer(self, handler: MessageHandler, env: Envelope) -> None:
        """Publish a protocol message's answers, every one encoded (chunked at this agent's chunk size,
        signed) before any is sent: where one cannot be (over the envelope's limits, more chunks than a
        reassembler takes), none is, and the handler is told then (``unsendable``): a secure round whose
        answer cannot travel ends at once, its secrets erased, instead of waiting for its deadline (the
        Java device's SecAggSessions.onMessage(env, encoder) alike)."""
        outs = handler.on_message(env)
        try:
            payloads = [encode_parts(out, self.signer, self.chunk_size) for out in outs]
        except EnvelopeError as exc:
            handler.unsendable(env, exc)
            return
        outbox = self.topics.outbox(self.device_id)
        for out, parts in zip(outs, payloads):
            # a decline among the answers: the device leaves a secure round its task opened
            self.stats.tasks_declined += out.type == M.DECLINE
            self.stats.bytes_up += self.link.publish_parts(outbox, parts, before_each=self.hooks.before_upload)

    def _protocol(self, name: str, role: type):
        """The protocol handler registered under ``name`` if it is a ``role`` (SecureTaskHandler: a
        secure task kind; MessageHandler: a message type), else None. One table holds both: a task of
        kind ``secagg`` reached the session registry's missing on_task, and a message typed as a
        secure kind an Unsupported handler's missing on_message, each an unexpected error with a
        traceback where the Java device says "unsupported task kind" or ignores the type."""
        handler = self.protocol_handlers.get(name)
        return handler if isinstance(handler, role) else None

    def _on_job_ended(self, env) -> None:
        """Drop the state of each ended job this device holds for the run that ended, and remember
        the run (its later tasks are skipped); say once per (job, run) that a notice changed nothing
        (the retained list comes on every connect)."""
        if self.state is None:
            return
        for notice in parse_job_ended(env):
            key = (notice.job, notice.run)
            new = key not in self._ended_runs
            if new and len(self._ended_runs) >= 4 * MAX_NOTICES:     # bounded, whoever sends notices
                del self._ended_runs[next(iter(self._ended_runs))]
            self._ended_runs[key] = None
            if self.state.drop_run(notice.job, notice.run):
                log.info("%s: job %s %s: its state dropped", self.device_id, notice.job, notice.reason)
            elif new:
                log.info("%s: job %s (run %s) %s: no state of that run here, nothing dropped",
                         self.device_id, notice.job, notice.run, notice.reason)

    def _execute(self, actions: list) -> None:
        if self.memory_file is not None:        # before any work starts: a device killed mid-task remembers it
            self.memory_file.save_if_changed(self.session)
        for act in actions:
            if isinstance(act, StartWork):
                self._do_work(act)
            elif isinstance(act, SendResult):
                if self.online:
                    self._send_result(act)
            elif isinstance(act, SkipTask):
                self.stats.tasks_skipped += 1
                if self._skipped_for.first(f"{act.ref.job} {act.reason}"):
                    log.warning("%s: skipped task %s of job %s round %d: %s (logged once per job and reason)",
                                self.device_id, act.ref.task, act.ref.job, act.ref.round, act.reason)
            elif isinstance(act, SendDecline):
                self.stats.tasks_declined += 1
                self._log_decline(act)
                self.link.publish_envelope(self.topics.outbox(self.device_id),
                                           M.decline_message(self.device_id, act.ref, act.reason), signer=self.signer)

    def _send_result(self, act: SendResult) -> None:
        """Publish a result's payloads, encoded once when the work finished (a retry resends the same
        bytes). A link that fails now is logged: the session's next retry sends them again."""
        kind, messages = act.message           # a result, or a secure task's protocol messages
        try:
            sent = sum(self.link.publish_parts(self.topics.outbox(self.device_id), parts,
                                               before_each=self.hooks.before_upload) for parts in messages)
        except Exception as exc:
            log.warning("%s: sending a %s result failed (attempt %d): %s", self.device_id, kind, act.attempt, exc)
            return
        self.stats.bytes_up += sent
        self.stats.count(kind, bytes_up=sent)
        self.session.handle(ResultSent(time.monotonic()))

    def _log_decline(self, act: SendDecline) -> None:
        reason = act.reason[:MAX_REASON_CHARS]
        if self._declined_for.first(reason):      # a device's owner learns why, once per reason
            log.warning("%s: declined a task of job %s: %s (logged once per reason)",
                        self.device_id, act.ref.job, reason)

    def _encoded_work(self, act: StartWork, handler, secure) -> tuple[list, float, str]:
        """The task's messages (a plain handler's result, or a secure task's first protocol
        messages), each encoded now, once (a retry resends the same bytes), the compute time and
        the id of the message whose ack the session waits for.
        A result that cannot be encoded raises :class:`Unsendable`: a decline, not an error per retry."""
        t0 = time.perf_counter()
        if secure is not None:
            outs = list(secure.on_task(act.ref.job, act.ref.round, act.params, act.tensors))
        else:
            body, tensors = handler(act.params, act.tensors)
        elapsed = max(0.0, time.perf_counter() - t0 - self.hooks.queued_s())
        self.stats.compute_s += elapsed
        self.hooks.after_compute(elapsed)       # an emulated slower device's extra time: within the deadline too
        if secure is None:
            outs = [M.result_message(self.device_id, act.ref, act.kind, body, tensors)]
        try:
            payloads = [encode_parts(m, self.signer, self.chunk_size) for m in outs]
        except (EnvelopeError, ValueError, MemoryError) as exc:
            raise Unsendable(str(exc)) from exc
        return payloads, elapsed, f"{act.ref.task}:protocol" if secure is not None else outs[0].id

    def _do_work(self, act: StartWork) -> None:
        """Run a task's handler; a secure task's handler starts its protocol (``on_task``) instead of
        producing a result: its messages go through the same session (redelivered task = the same
        messages again, never a second key pair), but are not retried for an ack that never comes."""
        secure = self._protocol(act.kind, SecureTaskHandler)
        handler = self.handlers.get(act.kind)
        if handler is None and secure is None:
            self._execute(self.session.handle(WorkFailed(act.ref, f"unsupported task kind {act.kind!r}")))
            return
        foreign = foreign_job(act.params, act.ref.job)
        if foreign is not None:             # a stateful task's state is keyed by it: never another job's
            self._execute(self.session.handle(WorkFailed(act.ref, foreign)))
            return
        kept = handler.state_put_back_on_failure if secure is None and isinstance(handler, KeepsState) else None
        try:
            # the work stops once the round is surely over: the arrival check's moment (work_deadline.py)
            with working_until(act.deadline + self.session.deadline_grace_s, task=act.ref, clock=self.clock), \
                    (nullcontext() if kept is None else kept(act.params)):
                payloads, elapsed, sent_id = self._encoded_work(act, handler, secure)
        except PastDeadline as exc:          # nobody waits for the answer any more
            self.stats.tasks_stopped += 1
            if self._skipped_for.first(f"{act.ref.job} stopped"):
                log.warning("%s: stopped task %s of job %s round %d: %s (logged once per job)", self.device_id,
                            act.ref.task, act.ref.job, act.ref.round, exc)
            self._execute(self.session.handle(WorkStopped(act.ref, round_over=True)))
            return
        except DroppedOut:
            self.stats.dropouts += 1
            log.info("%s: dropped out during %s round %d", self.device_id, act.kind, act.ref.round)
            self.session.handle(WorkStopped(act.ref, round_over=False))     # back to idle, nothing sent
            self._outage_until = time.monotonic() + self.hooks.offline_after_dropout_s
            self._go_offline()
            return
        except Unsendable as exc:
            log.warning("%s: a %s result cannot be sent: %s", self.device_id, act.kind, exc)
            self._execute(self.session.handle(WorkFailed(act.ref, f"result cannot be sent: {exc}")))
            return
        except TaskDeclined as exc:
            self._execute(self.session.handle(WorkFailed(act.ref, str(exc))))
            return
        except ENDS_THE_LOOP:
            raise
        except BaseException as exc:  # a handler bug (a BaseException of its own too) must not kill the agent; tell the server
            log.exception("%s: task %s/%d/%s (%s) failed; declined, the agent goes on", self.device_id,
                          act.ref.job, act.ref.round, act.ref.task, act.kind)
            self._execute(self.session.handle(WorkFailed(act.ref, f"error: {exc}")))
            return
        self.stats.tasks_done += 1
        self.stats.count(act.kind, tasks=1, compute_s=elapsed)
        self._execute(self.session.handle(WorkFinished(act.ref, (act.kind, payloads), sent_id,
                                                       expects_ack=secure is None)))

