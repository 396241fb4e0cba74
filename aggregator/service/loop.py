"""The aggregator process as a thin I/O loop: receive, route, send, tick.

Threading: paho's network thread, a shard's reader (receipts, refusals, forwarded device messages:
``pool.py``), the ingest workers and the store's writer only post items (``_dispatch``) to the
service's :class:`~protocols.message_loop.MessageLoop`; one service thread (the caller of :meth:`run`)
does everything else, so job state has a single writer. The admin API (another thread) reads the
store and ``live``, and runs every change (enrol, revoke, create, ...) there through :meth:`call`.

Every inbound message is checked before it can touch state: revoked sender, envelope structure and
size, signature (when identities are required), sender == the device named by the topic, device
enrolled (a presence topic: presence only), job and round ids (``stray_results.py``), the task id
(the round's machine), then the job's payload checks. What fails is logged and counted under one of
a fixed set of reasons (``active_job.REJECTION_CLASSES``) and, for results, acknowledged
``rejected`` (``late`` for a job that ended).

The decisions live elsewhere, each in a module of its own: the round rules in the sans-IO
:class:`~protocols.rounds.RoundCoordinator` (it emits the actions this loop executes, record
actions before what depends on them); what to ask whom and what to do with answers in the job
(``aggregator/jobs/``, built from the registry ``jobs/registry.py``); who is enrolled and online
in :class:`~aggregator.security.fleet.Fleet`; recovery in ``recovery.py``; what is reported in
``reporting.py``; the operator's job lifecycle in ``job_lifecycle.py``.

Durability (with a :class:`aggregator.storage.store.Store`): every state change is committed before
anything that depends on it leaves the process::

    step                                   committed first                      then
    open round                             participants, task ids, bookkeeping  publish tasks
    accept result                          raw envelope bytes + message id      apply, evaluate, ack
    decline / invalid result               round event (RecordDeclined/...)     (ack for invalid)
    close round                            outcome, evaluation, model version,  status, next round
                                           checkpoint
    finish job                             final model + summary + state        write files

An open round continues after a restart with its stored deadline; its pending participants get
their task again (same task id, so a device that already answered just re-sends the same
result). Tasks are also re-sent when the aggregator reconnects and when a pending participant
announces itself online (a broker restart loses in-flight messages). For an ``order_free`` job
(Fed3R) the final model is re-summed from the stored contributions in canonical order, so it
depends only on *which* devices contributed, never on arrival order, crashes or restarts.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from protocols import messages as M
from protocols.chunking import MessageAssembler
from protocols.envelope import Envelope, EnvelopeError, decode, encode
from protocols.identity import DeviceIdentity
from protocols.message_loop import MessageLoop
from protocols.mqtt_link import BrokerConfig, MqttLink
from protocols.payloads.artifacts import GET as ARTIFACT_GET
from protocols.payloads.secagg import SECAGG_TYPE
from protocols.rounds import Declined, ResultArrived, ResultInvalid
from protocols.topics import AGGREGATOR_ID

from aggregator.service import job_lifecycle, reporting
from aggregator.service.active_job import ActiveJob, ServiceStats, ValidatedResult
from aggregator.service.artifacts import ArtifactShelf, artifact_reply
from aggregator.service.async_runner import AsyncJobRunner
from aggregator.service.backoff import Backoff
from aggregator.security.broker import BrokerSecurity
from aggregator.service.crash_points import CrashPoints
from aggregator.security.fleet import Fleet
from aggregator.service.contribution_writer import ContributionWriter
from aggregator.service.ingest import IngestWorkers, accepted_parser, refusal
from aggregator.service.operator_actions import OperatorActions
from aggregator.jobs.base import Job
from aggregator.service.job_end import JobEndNotices
from aggregator.service.job_runner import JobRunner, RunnerServices
from aggregator.jobs.registry import KINDS, build_job, job_kind_name
from aggregator.jobs.secure_rounds import protocol_refusal
from aggregator.service.recovery import open_stored
from aggregator.service.stray_results import StrayResults
from aggregator.service.settings import ServiceSettings
from aggregator.shards.shard import RECEIPT
from aggregator.shards.pool import ShardPool
from aggregator.storage.store import Store
from aggregator.storage.schema import JobState

log = logging.getLogger("fedfleet.aggregator")


class AggregatorService(OperatorActions):
    def __init__(self, job: Job | None, broker: BrokerConfig, out_dir: Path,
                 settings: ServiceSettings = ServiceSettings(), *, enrolled: set[str] | None = None,
                 eval_set: tuple[np.ndarray, np.ndarray] | None = None, store: Store | None = None,
                 security: BrokerSecurity | None = None, artifacts: ArtifactShelf | None = None,
                 identity: DeviceIdentity | None = None, shards: ShardPool | None = None):
        """``settings``: the knobs and policies (``service/settings.py``); the keywords: what the service is lent."""
        self.settings = settings
        self.topics = topics = settings.topics
        self.artifacts, self.eval_set = artifacts, eval_set
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.store = store
        # the aggregator's Ed25519 identity signs all it sends: devices with its key refuse injected messages
        self._signer = identity.sign if identity is not None else None
        self.crash = CrashPoints.from_env()
        self.fleet = Fleet(store, security, enrolled, settings.require_signatures,
                           identity.public_key_bytes if identity is not None else None)
        self.assembler = MessageAssembler(verifier=self.fleet.verify if settings.require_signatures else None,
                                          max_message_bytes=settings.max_message_bytes, may_chunk=self.fleet.may_contribute)
        self.stats = ServiceStats()             # messages that belong to no job (bad topic, malformed, ...)
        self._device_bytes: dict[str, int] = {}  # bytes of a device's message being reassembled (_tick: expired)
        self._expired_at = 0.0
        self.loop = MessageLoop(self._dispatch, self._tick, settings.tick_s, "aggregator", self._refused, settings.inbound_bound)
        self.live: dict = {}                     # snapshot for the admin API, replaced atomically
        self._live_pacing = reporting.Pacing()
        self.shards = shards        # aggregator/shards/: they take the outboxes and hand this loop receipts
        self.link = MqttLink(AGGREGATOR_ID, broker, on_message=lambda t, p: self.loop.post(("mqtt", t, p), t, len(p)),
                             subscriptions=[(topics.all_outboxes, 1)] * (shards is None) + [(topics.all_presence, 1)],
                             on_connect=lambda: self.loop.post(("connected",)))
        if shards is not None:
            self._tell_shards_the_fleet(keys=settings.require_signatures)      # before they read anything
            shards.start(lambda item: self.loop.post(("mqtt", *item[1:]) if item[0] == "forward" else item),
                         settings.shard_start_timeout_s)
        # large results are validated in these processes (service/ingest.py), stored on the writer's thread
        self.ingest = IngestWorkers(settings.ingest_workers) if settings.ingest_workers else None
        self.writer = ContributionWriter(store, lambda: self.loop.post(("stored",))) if store is not None else None
        # the jobs that ended lately, retained for every device to drop their state (service/job_end.py)
        self.job_ends = JobEndNotices(store, lambda env: self.link.publish(     # waited for: a stop may follow
            topics.job_ends, encode(env, signer=self._signer), retain=True, wait=True))
        self.strays = StrayResults(store, self.job_ends)     # what answers a result for no open round
        self.held_back = Backoff()      # stored jobs whose end could not be committed lately
        self.last_finished, self.active, self.runner = None, None, None   # the job served, the last finished; its runner
        if job is not None:
            self._activate(job, self.out_dir)
        self._update_live(force=True)

    @property
    def job(self) -> Job | None:
        """The job being served, else the last one finished by this service."""
        a = self.active or self.last_finished
        return a.job if a else None

    online = property(lambda self: self.fleet.online)              # devices seen online
    registry = property(lambda self: self.fleet.registry)          # enrolled keys (identities required)

    # ------------------------------------------------------------------ lifecycle
    def run(self, timeout_s: float | None = None) -> dict:
        if self.active is not None and self.active.final_state:     # finished before a restart
            return self._finish_job()
        summary: dict = {}
        self.link.start()
        t0 = time.monotonic()
        try:
            while not self.loop.stopping:
                if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                    log.error("service timed out after %.0fs", timeout_s)
                    break
                if self.active is None and not self._start_next_job() and not self.settings.keep_serving:
                    break
                self.loop.serve_one()          # one item (or tick_s of quiet), then _tick
                if self.active is not None and self.active.final_state:
                    summary = self._finish_job()
                    if not self.settings.keep_serving:
                        break
                self._update_live()
        finally:
            if self.active is not None:
                summary = self._finish_job()
            self.link.stop()
            for part in (part for part in (self.ingest, self.writer, self.shards) if part is not None):
                part.close()
        return summary

    def stop(self) -> None:
        self.loop.stop()

    def call(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run ``fn`` on the service thread (the only writer) and return its result or raise its error."""
        return self.loop.call(fn, timeout)

    def _dispatch(self, item: tuple) -> None:
        if item[0] in ("mqtt", "receipt"):
            (self._on_payload if item[0] == "mqtt" else self._on_receipt)(item[1], item[2])
        elif item[0] == "refused":      # a device's message its shard refused: counted as if refused here
            self._reject(self.topics.device_of(item[1]) or "?", item[3], item[2])
        elif item[0] == "validated":
            self._on_validated(*item[1:])
        elif item[0] == "stored" and self.runner is not None:
            self.runner.on_stored()
        elif item[0] == "connected":
            self.job_ends.publish()
            if self.runner is not None:
                self.runner.resend_tasks(self.fleet.online)

    def _refused(self, item: tuple | None, exc: Exception) -> None:
        """Last resort: what one inbound message (or a worker's verdict on one) causes is its refusal;
        anything else that raises (its own tick, the writer's) ends :meth:`run`."""
        if item is None or item[0] not in ("mqtt", "receipt", "validated"):
            raise exc
        log.error("%s from %s refused: it raised an unexpected error", item[0], str(item[1])[:120], exc_info=exc)
        self._stats().reject("malformed")

    def _activate(self, job: Job, out_dir: Path) -> None:
        kind = job_kind_name(job)
        if self.shards is not None:         # its sums are the shards'
            self.shards.set_job(job, kind)
            job = self.shards.coordinator_job(job, kind)
        a = ActiveJob(job, kind, Path(out_dir), end_failures=self.held_back.failures(job.config.job_id))  # end_failures.py
        a.out_dir.mkdir(parents=True, exist_ok=True)
        if self.store is not None:
            open_stored(a, self.store, self.settings.checkpoints, self.crash)
        self.active = a
        if self._signer is None and job.secure_rounds:
            self._signer = job.identity.sign      # a secure job's identity is the aggregator's: sign with it
        if self.ingest is not None and self.ingest.accepts(job):
            self.ingest.warm_up(a.kind, job.config.to_dict())
        runner_cls = AsyncJobRunner if job.asynchronous else JobRunner
        self.runner = runner_cls(a, RunnerServices(
            fleet=self.fleet, store=self.store, crash=self.crash, send=self._send, publish_status=self._publish_status,
            bytes_sent=lambda: self.link.bytes_sent, on_fatal=self._job_broken, eval_set=self.eval_set,
            settings=self.settings, writer=self.writer, job_ends=self.job_ends))

    def _job_broken(self, reason: str, stop: bool = False) -> None:
        """The job cannot go on as it is: rebuild it from the store (which no longer replays what
        broke it), or, when that is impossible, give it up durably with the reason (never a crash loop)."""
        a = self.active
        if self.writer is not None:             # what is being written belongs in the rebuilt job
            self.writer.settle()
        if not stop and self.store is not None and a.kind in KINDS:
            try:    # its input files may be gone since (a review's finding: it raised, the change made)
                job = build_job(a.kind, self.store.job(a.job_id)["config"])
            except Exception as exc:
                return self._job_broken(f"{reason}, and it cannot be rebuilt: {exc}", stop=True)
            log.warning("job %s: rebuilt from the store after: %s", a.job_id, reason)
            self._activate(job, a.out_dir)
            self.active.stats, self.active.started, self.active.close_failures = a.stats, a.started, a.close_failures
            return
        # stopped, or cancelled with its record only where the operator cancelled it (the cancel stands)
        ended = job_lifecycle.give_up(self.store, a.job_id, JobState.CANCELLING if a.cancelling else a.state, reason, a)
        log.error("job %s %s: %s", a.job_id, ended, reason)

    def _start_next_job(self) -> bool:
        """With a store: resume an interrupted job, else start the oldest queued one."""
        row = job_lifecycle.job_to_serve(self.store, self.held_back.waiting(time.monotonic())) if self.store else None
        if row is None:
            return False
        try:
            job = build_job(row["kind"], row["config"])
            if row["state"] == JobState.QUEUED:
                job_lifecycle.take_up(self.store, row["job_id"])
            self._activate(job, self.out_dir / row["job_id"])
        except Exception as exc:  # a stored job that cannot be built must not stop the service
            log.error("cannot start job %s: %s", row["job_id"], exc)
            if job_lifecycle.give_up(self.store, row["job_id"], row["state"], str(exc)) == JobState.CANCELLED:
                self.job_ends.ended_safely(row["job_id"], JobState.CANCELLED)    # the cancel stands: devices told
            return False
        return True

    # ------------------------------------------------------------------ inbound
    def _on_payload(self, topic: str, payload: bytes) -> None:
        self._stats().bytes_in += len(payload)
        device = self.topics.device_of(topic)
        if device is None:
            return self._reject("?", "bad topic", topic[:80])
        if not payload and topic == self.topics.presence(device):
            return              # a retained presence cleared (OperatorActions._clear_retained_presence): no message
        if device in self.fleet.revoked:
            return self._reject(device, "revoked device")
        if topic.endswith("/out"):
            self._device_bytes[device] = self._device_bytes.get(device, 0) + len(payload)
        try:
            got = self.assembler.feed_lazy(payload, lazy=self.ingest is not None, topic_sender=device)
            if got is not None and not got[2] and not self._to_workers(device, got[0]):
                got = (decode(got[1], self.assembler.verifier, max_bytes=self.assembler.max_message_bytes), got[1], True)
        except EnvelopeError as exc:
            self._device_bytes.pop(device, None)
            signature = str(exc).startswith(("signature", "unsigned"))
            return self._reject(device, "bad signature" if signature else "malformed", str(exc))
        if got is not None and RECEIPT in got[0].body:      # only our shards' pipe carries receipts (_on_receipt)
            return self._reject(device, "malformed", "a device's message carries a shard receipt")
        if got is not None:
            self._on_envelope(device, topic, *got, self._device_bytes.pop(device, 0))

    def _on_receipt(self, topic: str, raw: bytes) -> None:
        """A shard's receipt for a result it validated and stored (it came over our own pipe)."""
        env = decode(raw)
        self._stats().bytes_in += env.body[RECEIPT]["bytes"]
        if env.sender in self.fleet.revoked:
            return self._reject(env.sender, "revoked device")
        self._on_envelope(env.sender, topic, env, raw, True, env.body[RECEIPT]["bytes"])

    def _on_envelope(self, device: str, topic: str, env: Envelope, raw: bytes, checked: bool, nbytes: int) -> None:
        outbox = topic.endswith("/out")
        if env.sender != device:
            return self._reject(device, "wrong sender", f"sender {env.sender!r} does not own topic {topic}")
        if not outbox and env.type != M.PRESENCE:           # a presence topic skips the outbox's enrolment check
            return self._reject(device, "unexpected type", f"{env.type[:40]!r} on a presence topic")
        if outbox and not self.fleet.may_contribute(device):
            return self._reject(device, "not enrolled")
        self.fleet.heard_from(device)
        if env.type == M.PRESENCE:
            self._on_presence(device, env)
        elif env.type in (M.RESULT, M.DECLINE):
            self._on_result(device, env, raw, nbytes, checked)
        elif env.type == ARTIFACT_GET:
            self._on_artifact_get(device, env)
        elif env.type == SECAGG_TYPE and self.active is not None and self.active.job.secure_rounds:
            self._on_protocol(device, env)
        else:
            self._reject(device, "unexpected type", repr(env.type)[:80])

    def _on_presence(self, device: str, env: Envelope) -> None:
        # every device heard from is shown to the operator (enrolled or not); only those the fleet
        # mode allows are given tasks (Fleet.eligible_online)
        try:
            online, info = M.parse_presence(env)
        except EnvelopeError as exc:
            return self._reject(device, "presence", str(exc))
        self.fleet.presence(device, online, info)
        self.crash("presence")
        if not online:
            self._device_lost(device)
        elif self.runner is not None:
            self.runner.resend_tasks({device})

    def _to_workers(self, device: str, env: Envelope) -> bool:
        """Whether a large message (its header so far) goes to the ingest workers, else is decoded here."""
        return (env.type == M.RESULT and self.active is not None and self.ingest.accepts(self.active.job)
                and self.ingest.has_room(device))

    def _on_result(self, device: str, env: Envelope, raw: bytes, nbytes: int, checked: bool = True) -> None:
        a = self.active
        try:
            ref, kind = M.parse_result_ref(env)
        except EnvelopeError as exc:
            return self._reject(device, "result", str(exc))
        if a is None or ref.job != a.job_id:
            return self._answer_stray(device, env, ref)
        coord = a.rounds.get(ref.round)
        if coord is None:       # a round closed and let go still answers (JobRunner.answer_closed)
            return self.runner.answer_closed(device, env, ref.round) or self._answer_stray(device, env, ref)
        a.round_bytes[ref.round] += nbytes
        if env.type == M.RESULT and not coord.applies(device, env.id, ref.task):    # duplicate, late, another task's: not read
            return self.runner.handle(coord, ResultArrived(device, env.id, None, ref.task))
        if not checked:         # a large result, its header only: decoded and validated by a worker
            return self._submit(device, env, raw, ref, kind)
        if env.type == M.DECLINE:
            log.info("device %s declined round %d: %s", device, ref.round, why := str(env.body.get("reason", ""))[:500])
            return self.runner.handle(coord, Declined(device, why, ref.task))
        self._accept(coord, ref, device, env.id, kind, raw, lambda: a.job.parse_result(env))

    def _answer_stray(self, device: str, env: Envelope, ref: M.TaskRef) -> None:
        """A result or decline for no open round (``stray_results.py``); late: the service's count."""
        answer = self.strays.answer(ref, self.active.job_id if self.active is not None else None)
        if answer.rejection:
            self._reject(device, answer.rejection, answer.detail)
        else:
            self.stats.count_late()
        if answer.ack and env.type == M.RESULT:
            self._send(device, M.ack_message(AGGREGATOR_ID, env.id, answer.ack, answer.reason))

    def _accept(self, coord, ref: M.TaskRef, device: str, message_id: str, kind: str, raw: bytes,
                parse: Callable[[], Any]) -> None:
        """Feed the round machine a result ``parse`` validates, or its refusal."""
        a = self.active
        try:
            if kind != a.job.kind:
                raise EnvelopeError(f"result kind {kind!r} does not match the job's {a.job.kind!r}")
            payload = parse()
        except EnvelopeError as exc:
            a.stats.reject("invalid payload")
            log.warning("rejected result from %s: %s", device, exc)
            return self.runner.handle(coord, ResultInvalid(device, message_id, str(exc), ref.task))
        self.crash("result_received")
        self.runner.handle(coord, ResultArrived(device, message_id, ValidatedResult(payload, raw), ref.task))

    def _submit(self, device: str, header: Envelope, raw: bytes, ref: M.TaskRef, kind: str) -> None:
        a = self.active
        key = self.fleet.registry.public_key(device) if self.fleet.registry is not None else None
        future = self.ingest.submit(device, a.kind, a.job.config.to_dict(), raw, key, self.assembler.max_message_bytes)
        future.add_done_callback(lambda f: self.loop.post(("validated", device, header, raw, ref, kind, f)))

    def _on_validated(self, device: str, header: Envelope, raw: bytes, ref: M.TaskRef, kind: str, future) -> None:
        """A worker's verdict on a large result: on from where ``_on_result`` left it, if its round is still open."""
        a = self.active
        self.ingest.done(device)
        refused = refusal(future, device in self.fleet.revoked)
        if refused is not None:
            return self._reject(device, *refused)
        if a is None or ref.job != a.job_id or ref.round not in a.rounds:   # closed meanwhile: its answer
            return (a is not None and ref.job == a.job_id and self.runner.answer_closed(device, header, ref.round)
                    or self._answer_stray(device, header, ref))
        self._accept(a.rounds[ref.round], ref, device, header.id, kind, raw, accepted_parser(future.result(), a.job, raw))

    def _on_artifact_get(self, device: str, env: Envelope) -> None:
        reply, refused = artifact_reply(self.artifacts, device, env)
        if refused:
            self._reject(device, "artifact", refused)
        if reply is not None:
            self._send(device, reply)

    def _on_protocol(self, device: str, env: Envelope) -> None:
        """A message of the job's secure-aggregation sub-protocol."""
        try:
            sends = self.active.job.on_protocol(device, env, time.monotonic())
        except EnvelopeError as exc:      # a shard hosting the group counts its refusals alike (shard_groups.py)
            return self._reject(device, protocol_refusal(exc), str(exc))
        for dev, msg in sends:
            self._send(dev, msg)

    def _device_lost(self, device: str) -> None:
        if self.runner is not None:
            self.runner.device_lost(device)

    def _reject(self, device: str, reason_class: str, detail: str = "") -> None:
        level = self._stats().count_refusal(reason_class)      # "late" (a secure-aggregation message's): info
        log.log(level, "rejected message from %s: %s%s", device, reason_class, f": {detail}" if detail else "")

    def _stats(self) -> ServiceStats:
        return self.active.stats if self.active is not None else self.stats

    # ------------------------------------------------------------------ output
    def _send(self, device: str, env: Envelope) -> None:
        self.link.publish_envelope(self.topics.inbox(device), env, chunk_size=self.settings.chunk_size, signer=self._signer)

    def _publish_status(self, body: dict) -> None:
        env = Envelope(type=M.STATUS, sender=AGGREGATOR_ID, body=body)
        self.link.publish(self.topics.status, encode(env, signer=self._signer), retain=True)

    def _tick(self, now: float) -> None:
        if now - self._expired_at >= 1.0:      # partial chunked messages of vanished senders
            self._expired_at = now
            self._device_bytes = self.assembler.expire(now, self._device_bytes, log)
        if self.runner is not None:
            self.runner.tick(now)
        if self.shards is not None:
            self.shards.watch()

    def _update_live(self, force: bool = False) -> None:
        if force or self._live_pacing.due():
            with self._live_pacing.timed():
                self.live = reporting.live_snapshot(self.active, self.fleet, self.stats.to_dict())

    def _finish_job(self) -> dict:
        summary, job_id = self.runner.finish(), self.active.job_id
        # the store resumes the job after a wait (service/backoff.py); ended (or interrupted), its next end counts from 0
        if (wait := self.held_back.settle(job_id, self.active.uncommitted is not None, time.monotonic())) is not None:
            log.warning("job %s: resumed in %.0f s", job_id, wait)
        self.last_finished, self.active, self.runner = self.active, None, None
        self._update_live(force=True)
        return summary
