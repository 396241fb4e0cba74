"""Drives the job being served through its rounds: opens them, executes what the round machines
decide against the store, the job and the outbox, closes them, and finishes the job.

The round rules are the sans-IO :class:`~protocols.rounds.RoundCoordinator`'s; what to ask whom
and what an answer means are the job's. This module only keeps the order of effects that makes a
crash harmless — every state change is committed before anything that depends on it leaves the
process (the table in ``aggregator/service/loop.py``) — and knows no socket: it sends through the
callables the service gives it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Callable

from protocols import messages as M
from protocols.device_inbox import check_fits_device_inbox, shapes_of
from protocols.envelope import Envelope
from protocols.rounds import (ApplyResult, Declined, DeviceLost, GroupSettled, RecordDeclined, RecordRejected, RefuseTask,
                              ResultArrived, ResultInvalid, RoundClosed, RoundCoordinator, SendAck, Tick)
from protocols.topics import AGGREGATOR_ID

from aggregator.service import reporting
from aggregator.storage.round_log import FILE_NAME as ROUND_LOG, SETTING_PREFIX, RoundLog
from aggregator.service.active_job import ActiveJob
from aggregator.service.canonical import hand_round_sum, reported_job
from aggregator.service.crash_points import CrashPoints
from aggregator.service.end_failures import JobEnd, after_commit, end_failure
from aggregator.service.job_end import JobEndNotices
from aggregator.service.job_outcome import judged_state
from aggregator.jobs.privacy_fields import PrivacyBudgetFields
from aggregator.service.sealed_draws import SealedDraws
from aggregator.service.settings import ServiceSettings
from aggregator.security.fleet import Fleet
from aggregator.service.contribution_writer import ContributionWriter
from aggregator.jobs.base import Job
from aggregator.jobs.registry import KINDS
from aggregator.storage.store import FINAL_JOB_STATES, Store, StoreError
from aggregator.storage.schema import JobState

log = logging.getLogger("fedfleet.aggregator")

CLOSE_ATTEMPTS = 3      # a round's close whose commit fails this many times in a row stops the job


@dataclass(frozen=True)
class RunnerServices:
    """What the service lends the runner of each job it serves: its parts, its outbox, its settings."""

    fleet: Fleet
    store: Store | None
    crash: CrashPoints
    send: Callable[[str, Envelope], None]
    publish_status: Callable[[dict], None]
    bytes_sent: Callable[[], int]
    on_fatal: Callable[..., None]       # (reason, stop=False): rebuild the job from the store, or stop it
    eval_set: tuple | None = None       # (features, labels) the model is evaluated on
    settings: ServiceSettings = ServiceSettings()     # checkpoints, evaluation pace, offline grace
    writer: ContributionWriter | None = None
    job_ends: JobEndNotices | None = None    # told when the job ends: its devices drop their state


class JobRunner:
    def __init__(self, a: ActiveJob, services: RunnerServices):
        s = services
        store = s.store
        self.a, self.fleet, self.store, self.crash = a, s.fleet, store, s.crash
        # large results are stored on the writer's thread (aggregator/service/contribution_writer.py)
        self.writer = s.writer if store is not None and a.job.split_validation else None
        self.draws = SealedDraws(store.sealing_key) if store is not None else None    # the bookkeeping as stored
        self._held_acks: dict[str, list[tuple[SendAck, int]]] = {}   # message id -> its acks, until durable
        self.rebuilt = False                    # a write failed and the job was rebuilt by a new runner
        # an order-free job reports its contributions summed in canonical order (aggregator/service/canonical.py):
        # only then is what it applied worth keeping
        self.canonical = store is not None and a.job.order_free and a.kind in KINDS
        if store is not None and a.job.canonical_round_sums:
            a.job.expect_round_sums()       # each close re-sums its round from the store (hand_round_sum)
        self.on_fatal, self.job_ends = s.on_fatal, s.job_ends
        self.send, self.publish_status_body, self.bytes_sent = s.send, s.publish_status, s.bytes_sent
        self.eval_set, self.checkpoints = s.eval_set, s.settings.checkpoints
        self.end_attempts = s.settings.end_attempts     # tries of an end that fails for now (service/end_failures.py)
        # a device offline for longer than this (or revoked) no longer keeps the job from finishing
        self.offline_grace_s = s.settings.offline_grace_s
        # A job whose model moves only at round close (FedAvg) would evaluate the same model after
        # every contribution; it is evaluated once per round instead.
        self.eval_each = s.settings.evaluate_every_contribution and not a.job.evaluate_at_round_close
        self.events = RoundLog(a.out_dir / ROUND_LOG, a.job_id)     # for people: admin logs --follow
        if store is not None:
            store.set_setting(SETTING_PREFIX + a.job_id, str(self.events.path.resolve()))

    # ------------------------------------------------------------------ events from the service
    def handle(self, coord: RoundCoordinator, event) -> None:
        if isinstance(event, ResultArrived) and self._reused_id(coord, event.message_id):
            # an earlier round's id: applying it would fail its write (ids are unique in a job), the
            # whole batch with it, and rebuild the job, on every re-send of the device
            event = ResultInvalid(event.device, event.message_id, "the message id of a result this job holds already")
        self.execute(coord.handle(event), coord.round)

    def _reused_id(self, coord: RoundCoordinator, message_id: str) -> bool:
        if message_id in coord.seen_ids or self.store is None:      # a redelivery: the round answers it
            return False
        return (self.writer is not None and message_id in self.writer.pending) or \
            self.store.holds_message(self.a.job_id, message_id)

    def device_lost(self, device: str) -> None:
        if self.a.current is None:
            return
        if self.a.job.secure_rounds:      # a secure phase stops waiting for it at once
            self._secure_member_gone(device)
        self.handle(self.a.current, DeviceLost(device))

    def _secure_member_gone(self, device: str) -> None:
        for dev, msg in self.a.job.member_offline(device, time.monotonic()):
            self.send(dev, msg)

    def resend_tasks(self, devices: set[str]) -> None:
        """Re-send the open round's task to those of ``devices`` it still waits for."""
        coord = self.a.current
        if coord is not None:
            for dev in sorted(d for d in devices if coord.is_pending(d)):
                self._send_task(coord.round, dev)

    def tick(self, now: float) -> None:
        try:
            self._tick(now)
        except Exception as exc:        # the job's scheduling broke: this job stops, the service goes on
            log.exception("job %s: its tick raised", self.a.job_id)
            self.on_fatal(f"scheduling failed: {type(exc).__name__}: {exc}", stop=True)

    def _tick(self, now: float) -> None:
        a = self.a
        if a.final_state:
            return
        if a.current is not None and a.job.secure_rounds:
            self._secure_tick(now)
        if a.current is not None:
            expired = a.cancelling or not a.current.pending_count    # cancelled, or a restored round that had everyone
            return self.handle(a.current, Tick(math.inf if expired else now))
        if a.cancelling:
            a.final_state = JobState.CANCELLED
            return
        if a.state == JobState.PAUSED or not self._ready_to_start():
            return
        online = a.drawable(self.fleet.eligible_online())
        reachable = a.drawable(self.fleet.reachable(self.offline_grace_s))
        if a.job.secure_rounds:
            online, reachable = online - a.job.culprits, reachable - a.job.culprits
            a.job.note_reachable(reachable)
        participants = a.job.next_participants(online)
        if participants:
            self._open_round(participants, now)
        elif a.job.finished(online, reachable):
            a.final_state = JobState.DONE

    # ------------------------------------------------------------------ actions of the round machine
    def execute(self, actions: list, round_: int) -> None:
        a = self.a
        for act in actions:
            if isinstance(act, (RecordDeclined, RecordRejected)):
                event = "declined" if isinstance(act, RecordDeclined) else "rejected"
                if self.store is not None:
                    self.store.add_round_event(a.job_id, round_, act.device, event, act.reason)
                self.events.write(event, round_, device=act.device, reason=act.reason)
                if isinstance(act, RecordDeclined):
                    self._declined(act, round_)
            elif isinstance(act, RefuseTask):     # e.g. an older run's late result: logged, counted, not recorded
                a.stats.reject("unknown task")
                log.warning("rejected message from %s: unknown task: %s", act.device, act.reason)
            elif isinstance(act, ApplyResult):
                if not self._apply(round_, act) or self.rebuilt:
                    return                  # quarantined, or a write failed: the job was rebuilt; the rest is void
            elif isinstance(act, SendAck):
                if self.writer is not None and act.ref in self.writer.pending:
                    # accepted, or a redelivery's duplicate: sent once the contribution is durable (on_stored)
                    self._held_acks.setdefault(act.ref, []).append((act, round_))
                else:
                    self._send_ack(act, round_)
            elif isinstance(act, RoundClosed):
                self._close_round(act)
                if self.rebuilt:
                    return                  # its close could not be committed: the job was rebuilt

    def _declined(self, act: RecordDeclined, round_: int) -> None:
        a = self.a
        if a.job.secure_rounds and a.job.secure_round_live(round_):
            # a member that declined its task sends nothing more to the group: its phase stops
            # waiting for it now, as for one gone offline (it held the whole group for the phase's
            # timeout, every round a device declined)
            self._secure_member_gone(act.device)
        if a.clock_ahead.note_decline(act.device, act.reason, round_):
            # it skips the job's later tasks in silence: drawn again, each round would wait for it
            log.warning("job %s: device %s declined round %d saying its clock runs ahead: not asked again "
                        "in this job", a.job_id, act.device, round_)
            self.events.write("clock_ahead", round_, device=act.device)

    def _send_ack(self, act: SendAck, round_: int) -> None:
        a = self.a
        a.stats.late += act.status == "late"
        a.stats.duplicates += act.status == "duplicate"
        self.send(act.device, M.ack_message(AGGREGATOR_ID, act.ref, act.status, act.reason))
        if act.status in ("late", "duplicate"):
            self.events.write(act.status, round_, device=act.device)
        if act.status == "accepted":
            self.crash("ack_sent")

    def on_stored(self) -> None:
        """Collect the contribution writer's finished writes: send the acks they held, or rebuild
        the job from the store after a failed one (the store lacks it; its device sends it again)."""
        if self.writer is None:
            return
        for message_id, error in self.writer.completed():
            held = self._held_acks.pop(message_id, [])
            if error is not None:
                # the error's words as they are (not its repr): the log and the admin CLI escape them once
                why = f"{type(error).__name__}: {error}"
                log.error("job %s: contribution %s not stored: %s", self.a.job_id, message_id, why)
                self._held_acks.clear()
                self.rebuilt = True             # this runner's job is void: it acts no more
                return self.on_fatal(f"a contribution could not be stored: {why}")
            self.crash("contribution_stored")
            for act, round_ in held:
                self._send_ack(act, round_)

    def flush_writes(self) -> bool:
        """Wait until every accepted contribution is durable (and its ack sent): before anything
        reads the stored contributions or freezes state derived from them. False when a write
        failed: the job was rebuilt by another runner and this one must act no more."""
        if self.writer is not None and self.writer.pending:
            self.writer.wait()
            self.on_stored()
        return not self.rebuilt

    def _apply(self, round_: int, act: ApplyResult) -> bool:
        """Store, apply and (per the job's cadence) evaluate one result; False if it was quarantined."""
        a = self.a
        if self.writer is not None:
            self.writer.submit(a.job_id, round_, act.device, act.message_id, act.result.raw)
        elif self.store is not None:
            try:
                self.store.add_contribution(a.job_id, round_, act.device, act.message_id, act.result.raw)
            except StoreError as exc:       # cannot happen while the round machine works; never apply twice
                log.error("not applied: %s", exc)
                return True
            self.crash("contribution_stored")
        try:
            a.job.apply(act.device, act.result.payload)
            if self.canonical:
                a.applied.record(act.device, round_, act.message_id, act.result.payload, len(act.result.raw))
            self.events.write("contribution", round_, device=act.device, message_id=act.message_id)
            if self.eval_each:
                if not self.flush_writes():     # a stored evaluation never counts a contribution the store lacks
                    return False
                self._record_eval()
        except Exception as exc:            # validated, yet it breaks the model (e.g. the solve fails)
            self._quarantine(round_, act, f"{type(exc).__name__}: {exc}")
            return False
        a.stats.results_accepted += 1
        if self.eval_each:
            self.crash("evaluation_stored")
        return True

    def _quarantine(self, round_: int, act: ApplyResult, reason: str) -> None:
        """Keep a contribution that passed validation but broke the job out of the job for good: out
        of the store's replay (a restart never meets it again), rejected to its device, and the job
        rebuilt without it (``on_fatal`` below); without a store the job cannot be rebuilt: it stops."""
        self._quarantine_one(round_, act.device, act.message_id, reason)
        self.on_fatal(f"contribution from {act.device} quarantined: {reason}")

    def _screened(self, job: Job) -> dict[str, str]:
        """What the job's fleet screen named at this round close, less the devices an operator released."""
        screened = job.screened_devices()
        if screened and self.store is not None:
            exempt = self.store.screen_exempt(self.a.job_id)
            screened = {d: why for d, why in screened.items() if d not in exempt}
        return screened

    def _quarantine_screened(self, screened: dict[str, str]) -> None:
        """The job's fleet screen named devices at a round close (``aggregator/strategies/robust_fed3r.py``):
        every contribution of theirs is quarantined and the job rebuilt from the store without them,
        exactly (the round closes again in the rebuilt job)."""
        stored = list(self.store.contributions(self.a.job_id, with_payload=False)) if self.store is not None else []
        for device, reason in screened.items():
            for c in (c for c in stored if c.device == device):
                self._quarantine_one(c.round, device, c.message_id, reason)
            self.a.quarantined.add(device)
        self.rebuilt = self.store is not None       # rebuilt from the store: this runner acts no more
        self.on_fatal(f"screened out: {', '.join(screened)}", stop=self.store is None)

    def _quarantine_one(self, round_: int, device: str, message_id: str, reason: str) -> None:
        a = self.a
        log.error("job %s: contribution %s from %s quarantined: %s", a.job_id, message_id, device, reason)
        a.stats.reject("quarantined")
        a.quarantined.add(device)
        self.send(device, M.ack_message(AGGREGATOR_ID, message_id, "rejected", f"quarantined: {reason}"))
        self.events.write("quarantined", round_, device=device, reason=reason)
        if self.store is not None:
            self.store.quarantine(a.job_id, round_, device, message_id, reason)

    def _close_round(self, act: RoundClosed) -> None:
        a = self.a
        if not self.flush_writes():         # the round's checkpoint must hold only durable contributions
            return
        self.crash("round_closing")
        evaluation = None
        try:
            if self.store is not None:      # DP Fed3R: its round noised as summed canonically
                hand_round_sum(a.job, self.store, a.kind, a.job_id, act.round)
            a.job.close_round(act)
            screened = self._screened(a.job)
            if screened:
                return self._quarantine_screened(screened)
            a.round_log.append(a.round_entry(act, a.opened_at.get(act.round), time.time()))
            if not self.eval_each:
                evaluation = self._evaluation()
        except Exception as exc:            # no single contribution to blame: the job stops, saying why
            log.exception("job %s: round %d cannot close", a.job_id, act.round)
            if isinstance(a.job.config, PrivacyBudgetFields) and a.job.config.dp:
                a.uncommitted = f"round {act.round}'s close"    # the job may hold its draw: publish nothing
            return self.on_fatal(f"round {act.round} cannot close: {type(exc).__name__}: {exc}", stop=True)
        log.info("round %d closed: %d accepted, %d dropped, %d declined", act.round,
                 len(act.accepted), len(act.dropped), len(act.declined))
        if self.store is not None:
            # The round's evaluation is committed with its close, before it leaves the process: the
            # model it measures carries this round's DP noise, and a crash between the two would
            # replay the round with a fresh draw, a second release of the same devices the
            # accountant never counts (tests/test_crash_recovery.py).
            model = a.job.model_arrays() if act.accepted and not a.job.model_held else None
            checkpoint = self._checkpoint(act) if self.checkpoints else None
            metrics = evaluation if evaluation is not None else (a.history[-1] if a.history else {})
            try:
                self.store.close_round(a.job_id, act.round, a.round_log[-1], model, metrics, a.round_bytes[act.round],
                                       a.stats.to_dict(), checkpoint, evaluation=evaluation)
            except Exception as exc:
                return self._close_not_committed(act, exc)
            a.close_failures = 0
        self.crash("round_closed")
        self.events.write("round_close", act.round,
                          **{k: v for k, v in a.round_log[-1].items() if k not in ("round", "t")})
        if a.current is not None and a.current.round == act.round:
            a.current = None
        a.let_go(act.round, time.time())
        if evaluation is not None:
            self._publish_eval(evaluation, stored=True)     # with the status
        else:
            self.publish_status()

    def answer_closed(self, device: str, env, round_: int) -> bool:
        """A result or decline for a round this job closed and let go (``closed_rounds.py``):
        answered as its round machine would have; False when the job never closed such a round."""
        if not self.a.closed.knows(round_) or round_ in self.a.rounds:
            return False
        event = ResultArrived(device, env.id, None) if env.type == M.RESULT else Declined(device, "")
        self.handle(self.a.closed.machine(round_, env.id, time.time()), event)
        return True

    def _close_not_committed(self, act: RoundClosed, exc: Exception) -> None:
        """Nothing of this close has left the process, and its noise must not: the job is rebuilt
        from the store (the round open again, to close with a draw of its own) and this runner acts
        no more; after ``CLOSE_ATTEMPTS`` failures in a row the job stops instead (a store that keeps
        failing rebuilt it at every tick). Stopped, it publishes nothing (finish)."""
        a = self.a
        log.exception("job %s: round %d's close could not be committed", a.job_id, act.round, exc_info=exc)
        a.uncommitted = f"round {act.round}'s close"
        a.close_failures += 1
        self.rebuilt = True
        stop = a.close_failures >= CLOSE_ATTEMPTS
        self.on_fatal(f"round {act.round}'s close could not be committed"
                      f"{f' ({CLOSE_ATTEMPTS} times in a row)' if stop else ''}: {type(exc).__name__}: {exc}", stop=stop)

    def _checkpoint(self, act: RoundClosed) -> tuple:
        """(state_dict, contributed) of the job as this round closes: what a restart resumes from."""
        return self.a.job.state_dict(), self.a.job.contributed

    def _record_eval(self, job: Job | None = None) -> None:
        """Evaluate the live job (or ``job``, the model it reports) and record it in the history."""
        entry = self._evaluation(job)
        if entry is not None:
            self._publish_eval(entry, stored=False)

    def _evaluation(self, job: Job | None = None) -> dict | None:
        """The evaluation entry of the live job (or ``job``), or None when there is nothing new to measure."""
        a = self.a
        entry = {**(job or a.job).evaluate(*self._eval_arrays()), "round": a.job.round}
        entry.update(t=time.time() - a.started_at, bytes_in=a.stats.bytes_in, bytes_out=self.bytes_sent())
        return entry

    def _publish_eval(self, entry: dict, *, stored: bool) -> None:
        """Add ``entry`` to the history, the round log and (unless ``stored`` already) the store."""
        a = self.a
        a.history.append(entry)
        self.events.evaluation(entry["round"], entry)
        if self.store is not None and not stored:
            self.store.add_evaluation(a.job_id, entry)
        self.publish_status()

    def _eval_arrays(self) -> tuple:
        return self.eval_set if self.eval_set is not None else (None, None)

    # ------------------------------------------------------------------ scheduling
    def _ready_to_start(self) -> bool:
        """Enough devices online to open the first round after a (re)start, or waited long enough.
        Only devices that may contribute count: one presence from an id that is not enrolled started
        a job whose first tick then found nobody to ask and ended it failed."""
        a = self.a
        if not a.started:
            now = time.time()
            # The wait starts now, when the job first asks, not when this process took it up: the
            # devices' retained presences wait unread in the queue while the process restores the
            # job and closes a restored round, which took longer than start_timeout_s on a loaded
            # machine; the first presence read then started a job whose whole fleet was online.
            a.waiting_since = now if a.waiting_since is None else a.waiting_since
            online = self.fleet.eligible_online()
            enough = len(online) >= max(1, a.job.config.expected_devices)
            a.started = enough or bool(online and now - a.waiting_since > a.job.config.start_timeout_s)
        return a.started

    def _secure_tick(self, now: float) -> None:
        """Phase timers of the secure sub-protocol; once it settles the round, close it with its survivors."""
        a = self.a
        for dev, msg in a.job.on_protocol_tick(now):
            self.send(dev, msg)
        coord = a.current
        survivors = a.job.settled(coord.round)
        if survivors is not None:
            self.handle(coord, GroupSettled(survivors))
        elif not a.job.secure_round_live(coord.round):
            # restored after a restart: the round's secrets died with the old process, so it can
            # never produce a sum; close it now (nothing applied) instead of at its deadline
            log.warning("secure round %d did not survive the restart: closed, nothing applied", coord.round)
            self.handle(coord, Tick(math.inf))

    def _open_round(self, participants: list[str], now: float) -> None:
        a = self.a
        round_ = a.job.round
        deadline_wall = time.time() + a.job.config.round_timeout_s
        tasks = {dev: os.urandom(16).hex() for dev in participants}
        # every task built before the round is stored: one the job cannot build (a config its task
        # params refuse) fails the scheduling with no round opened, not one left open for ever
        messages = {dev: self._task_message(round_, dev, tasks[dev], deadline_wall) for dev in participants}
        if self.store is not None:
            bookkeeping = self.draws.sealed(a.job.bookkeeping(), a.job_id)     # a keyed draw's key sealed
            self.store.open_round(a.job_id, round_, participants, tasks, bookkeeping, deadline_wall)
        self.crash("round_opened")
        coord = RoundCoordinator(round_, frozenset(participants), now + a.job.config.round_timeout_s, tasks=tasks)
        a.rounds[round_] = a.current = coord
        a.deadlines[round_], a.opened_at[round_] = deadline_wall, time.time()
        self.events.write("round_open", round_, participants=sorted(participants), deadline=deadline_wall)
        for dev in participants:
            self.send(dev, messages[dev])
            self.crash("task_sent")
        self.publish_status()

    def _send_task(self, round_: int, device: str) -> None:
        a = self.a
        self.send(device, self._task_message(round_, device, a.rounds[round_].tasks[device], a.deadlines[round_]))
        self.crash("task_sent")

    def _task_message(self, round_: int, device: str, task_id: str, deadline: float) -> Envelope:
        a = self.a
        params, tensors = a.job.task_for(device)
        # the addressee signed in: re-published on another device's inbox, it is skipped there
        msg = M.task_message(AGGREGATOR_ID, a.job_id, round_, a.job.kind, params, deadline, device=device)
        msg.id = task_id                             # the same id on every re-send: devices dedupe by it
        msg.tensors.update(tensors)
        # what a config cannot declare (a tail program's, a pretrained network's tensors) is held to
        # the devices' bound here: the round does not open (aggregator/jobs/task_size.py checked the rest)
        check_fits_device_inbox(f"job {a.job_id}'s task", shapes_of(msg.tensors))
        return msg

    # ------------------------------------------------------------------ output
    def publish_status(self, state: str | None = None) -> None:
        self.publish_status_body(reporting.status_body(self.a, len(self.fleet.online), len(self.fleet.seen), state))

    def finish(self) -> dict:
        """Write the job's outputs; with a store, commit its final state first (once). A job whose
        end raises (its re-sum, finalize, its finalized state's commit, final evaluation or model, the
        commit of its final state) is taken up again later while the failure may mend
        (``service/end_failures.py``), else ends failed, saying why (a cancelled one stays
        cancelled), its record only: as a round close that raises, it stops its job, never the
        service (no crash loop). A job given up while cancelling (``record_only``) reports its record only."""
        a = self.a
        # a write failed (a result's, a round's close): the job stays running in the store, which
        # resumes it; nothing made from the uncommitted state leaves the process (nor from a given-up one's)
        if a.record_only is None and (not self.flush_writes() or a.uncommitted is not None):
            return {}
        state = a.final_state or JobState.STOPPED
        row = self.store.job(a.job_id) if self.store is not None else None
        failure = a.record_only
        if state == JobState.DONE:                     # ran out of work: done only if some device contributed
            state, failure = judged_state(a, self.store)
            a.final_state = state
            if failure:
                log.warning("job %s failed: %s", a.job_id, failure)
        elif state == JobState.FAILED and row is not None:      # restored: it failed before, for this reason
            failure = (row["summary"] or {}).get("error")
        self.crash("job_finishing")
        try:
            end = self._record_only() if a.record_only is not None else self._job_end(state, row)
            summary = self._committed_end(state, failure, row, end)
        except Exception as exc:
            # Nothing takes the job up again without a store; nor a cancelled one: the operator asked
            # for its end, which its record gives now, saying what it lacks (no model).
            cancelled = state == JobState.CANCELLED
            why = end_failure(exc, retried=self.store is not None and not cancelled,
                              failed_before=a.end_failures, attempts=self.end_attempts)
            if why is None:
                log.exception("job %s: its end failed; it is tried again", a.job_id)
                return self._tried_again()
            failure = failure or why
            if cancelled:       # the operator's cancel stands; its record says what its end lacks
                log.error("job %s cancelled, its end failed: %s", a.job_id, failure, exc_info=exc)
            else:
                log.error("job %s failed: %s", a.job_id, failure, exc_info=exc)
            if state in (JobState.DONE, JobState.FAILED):   # an interrupted or stopped job keeps its state (it says why)
                state = a.final_state = JobState.FAILED
            end = self._record_only()
            try:
                summary = self._committed_end(state, failure, row, end)
            except Exception:       # not even its record: the store fails; the job stays as stored, tried again
                log.exception("job %s: its record could not be committed either; it is tried again", a.job_id)
                return self._tried_again()
        summary["finished_at"] = time.time()        # its final state is durable (the files below are copies)
        self.crash("job_finished")
        accuracy = end.evaluation.get("accuracy")
        steps = [("its files", lambda: reporting.write_job_files(a.out_dir, end.job, summary)),
                 ("its round log's line", lambda: self.events.write("job_end", a.job.round, state=state, accuracy=accuracy))]
        if state in FINAL_JOB_STATES and self.job_ends is not None:     # durable first, then the devices drop its state
            steps.append(("its devices' job-end notice", lambda: self.job_ends.ended(a.job_id, state, a.job)))
        after_commit(a.job_id, steps + [("its status", lambda: self.publish_status(state))])     # each on its own
        return summary

    def _committed_end(self, state: str, failure: str | None, row: dict | None, end: JobEnd) -> dict:
        """The job's summary, its final state committed first (with its model): once, where it is stored."""
        a = self.a
        summary = reporting.job_summary(a, state, end.evaluation, self.bytes_sent())
        if failure:
            summary["error"] = failure
        summary["not_contributed"] = {d: self.fleet.why_missing(d, self.offline_grace_s)
                                      for d in sorted(self.fleet.seen - set(a.job.contributed))}
        # once; one given up while cancelling was stored cancelled before its end, its record not yet. An
        # interrupted job (timeout, SIGTERM) stays "running"/"paused"/"cancelling": the next start resumes it
        if row is not None and state in FINAL_JOB_STATES and (row["state"] not in FINAL_JOB_STATES or a.record_only):
            compact = {k: v for k, v in summary.items() if k not in ("history", "rounds")}
            self.store.finish_job(a.job_id, state, compact, a.stats.to_dict(), end.model, end.evaluation, a.job.round)
        return summary

    def _tried_again(self) -> dict:
        """The job's end failed for now: nothing of it is published; the store takes the job up again
        (``AggregatorService._finish_job``), its failure counted there first, so that a restarted
        service counts on rather than from 0 (a service restarted within every wait tried for ever)."""
        self.a.uncommitted = "the job's end"
        try:
            if self.store is not None:
                self.store.count_end_failure(self.a.job_id)
        except Exception as exc:        # the store fails as the end did: this service's own count goes on
            log.warning("job %s: its end's failure could not be counted in the store: %s", self.a.job_id, exc)
        return {}

    def _job_end(self, state: str, row: dict | None) -> JobEnd:
        if state == JobState.FAILED and row is not None and row["state"] == JobState.FAILED:
            # restored after it failed: its record is committed; its end (what may have failed) is not made again
            return self._record_only()
        return self._final_model(state, commit=row is not None and row["state"] not in FINAL_JOB_STATES)

    def _record_only(self) -> JobEnd:
        """A failed job's end: its last evaluation; no job, no model (nothing made from its state is published)."""
        return JobEnd(None, self.a.history[-1] if self.a.history else {}, None)

    def _final_model(self, state: str, commit: bool) -> JobEnd:
        """The job's end as reported: the job re-summed canonically, finalized (that committed first),
        its last evaluation, and (``commit``) the model to store. Whatever raises here leaves nothing
        made from the job's state (finish: tried again, or the job's record only)."""
        a = self.a
        reports_model = state in FINAL_JOB_STATES and state != JobState.FAILED    # a failed job learnt nothing
        final_job = a.job
        if state in FINAL_JOB_STATES and self.canonical:
            final_job = reported_job(a.applied, a.job, self.store, a.kind, a.job_id)
        changed = False
        if reports_model:
            changed = final_job.finalize()
            if changed and self.store is not None and self.checkpoints:
                # durable before anything made from it leaves this process: a restart (a crash from
                # here on, or the service run again) restores the finalized job rather than
                # finalizing it again (DP's release at the end: fresh noise on the same sums)
                # (a commit that raises: the draw stays in this process; the next try draws its own)
                self.store.replace_checkpoint_state(a.job_id, final_job.state_dict(), final_job.contributed)
                self.crash("job_finalized")
        if changed or not a.history or a.history[-1]["contributions"] != a.job.contributions:
            self._record_eval(final_job)            # the last evaluation is the reported model's
            final_eval = a.history[-1]
        elif final_job is a.job:
            final_eval = a.history[-1]
        else:
            final_eval = {**a.history[-1], **final_job.evaluate(*self._eval_arrays()), "round": a.job.round}
        return JobEnd(final_job, final_eval, final_job.model_arrays() if commit and reports_model else None)
