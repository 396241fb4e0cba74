"""Rebuild a job being served from the store after a restart (crash, SIGKILL, deploy).

What is replayed, in this order (``restore_job``):

1. the checkpoint of the last closed round (``job.state_dict()``, exact float64 sums), if the
   service keeps checkpoints;
2. every stored round: a :class:`RoundCoordinator` whose ``seen_ids`` hold the round's applied
   message ids (so every QoS 1 redelivery or device retry is an idempotent ``duplicate``), the
   job's scheduling bookkeeping as it was when the round opened (its participant draw's key
   opened: ``sealed_draws.py``), and the contributions the
   checkpoint lacks, through ``parse_result``/``apply`` in commit order (the same float64
   additions in the same order);
3. closed rounds are closed again (late answers are acknowledged ``late``) and, past the
   checkpoint, ``job.close_round`` runs again; an open round gets its recorded declines and
   rejections back and continues with its stored deadline.

A secure round stores no per-device contribution (the aggregator only ever held the group's
sum): what survives a restart is the job state checkpointed at each round close, which is why a
secure job needs checkpoints. A restored open secure round can never produce a sum (its secrets
died with the old process); the service closes it at its next tick.
"""

from __future__ import annotations

import json
import logging
import math
import time

from protocols.envelope import decode
from protocols.rounds import Declined, ResultInvalid, RoundClosed, RoundCoordinator, RoundState, Tick

from aggregator.jobs.privacy_fields import PrivacyBudgetFields
from aggregator.jobs.recent_log import RecentLog
from aggregator.service.active_job import ActiveJob, ServiceStats
from aggregator.service.canonical import hand_round_sum
from aggregator.service.clock_ahead import CLOCK_AHEAD_DECLINES, ClockAhead
from aggregator.service.sealed_draws import SealedDraws
from aggregator.storage.store import FINAL_JOB_STATES, Store, StoreError
from aggregator.storage.schema import JobState

log = logging.getLogger("fedfleet.aggregator")


def open_stored(a: ActiveJob, store: Store, checkpoints: bool, crash) -> None:
    """Create the job's row, or restore the job from it (same kind and config only)."""
    job = a.job
    if job.secure_rounds and not checkpoints:
        # A secure round's secrets are never persisted: what survives a restart is the job
        # state checkpointed at each round close (there are no per-device results to replay).
        raise TypeError(f"{type(job).__name__} (secure aggregation) needs checkpoints to run with a store")
    if isinstance(job.config, PrivacyBudgetFields) and job.config.dp and not checkpoints:
        # without checkpoints a restart replays the stored contributions, closing each round again:
        # every DP release would happen twice, with fresh noise the accountant never saw
        raise TypeError(f"{type(job).__name__} with differential privacy needs checkpoints to run with a store")
    row = store.job(a.job_id)
    config = job.config.to_dict()
    if row is None:
        store.create_job(a.job_id, a.kind, config, state=JobState.RUNNING)
        store.set_job_state(a.job_id, JobState.RUNNING)
        a.started_at = store.job(a.job_id)["started_at"]
        return
    if row["kind"] != a.kind or json.loads(json.dumps(config)) != row["config"]:
        raise StoreError(f"job {a.job_id!r} is stored with a different kind/config; use a new job_id")
    restore_job(a, row, store, checkpoints)
    crash("restored")


def restore_job(a: ActiveJob, row: dict, store: Store, checkpoints: bool) -> None:
    """Bring ``a`` (a freshly built job) to where the stored job was; see the module docstring."""
    t0 = time.perf_counter()
    a.applied.invalidate()          # the live job starts from stored state: its sums are not canonical
    a.stats = ServiceStats.from_dict(row.get("counters") or {})
    a.started_at = row["started_at"] or row["created_at"]
    a.end_failures = max(a.end_failures, row["end_failures"])     # a restart counts on (service/end_failures.py)
    done_round = _load_checkpoint(a, store) if checkpoints else 0
    ids = store.contributions(a.job_id, with_payload=False)                  # every round: message ids
    payloads = store.contributions(a.job_id, after_round=done_round)         # only what the state lacks
    draws = SealedDraws(store.sealing_key)
    replay = _RoundReplay(a, store, draws, done_round, next(ids, None), next(payloads, None), ids, payloads)
    rounds = restorable(f"job {a.job_id!r}'s rounds", store.rounds, a.job_id)
    for r in rounds:
        replay.round(r)
    if replay.next_id is not None or replay.next_payload is not None:
        raise StoreError(f"job {a.job_id} has contributions that belong to no stored round")
    if rounds:
        restore_bookkeeping(a, draws, rounds[-1])
    a.history = RecentLog(store.evaluations(a.job_id))
    # quarantined and forgotten devices are never asked again
    a.quarantined = {q["device"] for q in store.quarantined(a.job_id)} | set(store.forgotten(a.job_id))
    # nor are those whose decline said their clock runs ahead (clock_ahead.py): their declines recorded
    # since an operator last started the stopped job again (the moment to ask them again)
    a.clock_ahead = ClockAhead(store.first_declines(a.job_id, CLOCK_AHEAD_DECLINES, since=store.restarted_at(a.job_id)))
    if row["state"] in FINAL_JOB_STATES:
        a.final_state = row["state"]
    elif row["state"] == JobState.PAUSED:
        a.state = JobState.PAUSED
    elif row["state"] == JobState.CANCELLING:    # the operator's cancel: its restored round closes, then it is over
        a.cancelling = True
    else:
        store.set_job_state(a.job_id, JobState.RUNNING)
    log.warning("job %s restored: %d rounds, checkpoint of round %d, %d contributions replayed in %.3fs",
                a.job_id, len(rounds), done_round, replay.replayed, time.perf_counter() - t0)


def restorable(what: str, fn, *args):
    """``fn(*args)``, a stored row it cannot read or take back reported as one StoreError naming
    ``what`` (a damaged or tampered store): the job stops with that reason, once, where it raised
    whatever the row's parser raised (a KeyError of a checkpoint entry's name, a zip error)."""
    try:
        return fn(*args)
    except StoreError:
        raise
    except Exception as exc:
        raise StoreError(f"{what} cannot be restored: {type(exc).__name__}: {exc}") from exc


def restore_bookkeeping(a: ActiveJob, draws: SealedDraws, stored) -> None:
    """The job as it was right after round ``stored`` opened: its stored bookkeeping, opened."""
    restorable(f"round {stored.round}'s bookkeeping",
               lambda: a.job.restore_bookkeeping(draws.opened(stored.bookkeeping, a.job_id)))


def _load_checkpoint(a: ActiveJob, store: Store) -> int:
    checkpoint = restorable(f"job {a.job_id!r}'s checkpoint", store.checkpoint, a.job_id)
    if checkpoint is None:
        return 0
    done_round, state, contributed = checkpoint
    restorable(f"job {a.job_id!r}'s checkpoint of round {done_round}", a.job.load_state_dict, state)
    a.job.contributed = dict(contributed)
    return done_round


class _RoundReplay:
    """Walks the stored rounds with two cursors over the stored contributions (ids, payloads)."""

    def __init__(self, a: ActiveJob, store: Store, draws: SealedDraws, done_round: int, next_id, next_payload, ids,
                 payloads):
        self.a, self.store, self.draws, self.done_round = a, store, draws, done_round
        self.next_id, self.next_payload, self._ids, self._payloads = next_id, next_payload, ids, payloads
        self.replayed = 0
        self._wall, self._mono = time.time(), time.monotonic()

    def round(self, r) -> None:
        a, job = self.a, self.a.job
        coord = RoundCoordinator(r.round, frozenset(r.participants), self._mono + (r.deadline - self._wall),
                                 tasks=dict(r.tasks))
        while self.next_id is not None and self.next_id.round == r.round:
            coord.restore(self.next_id.device, self.next_id.message_id)
            self.next_id = next(self._ids, None)
        if r.round > self.done_round:                 # the job as it was right after this round opened
            restore_bookkeeping(a, self.draws, r)
        while self.next_payload is not None and self.next_payload.round == r.round:
            c = self.next_payload
            restorable(f"contribution {c.seq} of job {a.job_id!r} ({c.device}, round {c.round})",
                       lambda: job.apply(c.device, job.parse_result(decode(c.payload))))
            self.replayed += 1
            self.next_payload = next(self._payloads, None)
        a.rounds[r.round] = coord
        a.deadlines[r.round], a.opened_at[r.round] = r.deadline, r.opened_at
        a.round_bytes[r.round] = r.bytes_in
        if r.state == "closed":
            self._closed(r, coord)
        else:
            for ev in self.store.round_events(a.job_id, r.round):
                coord.handle(Declined(ev["device"], ev["reason"]) if ev["event"] == "declined"
                             else ResultInvalid(ev["device"], "restored", ev["reason"]))
            a.current = coord if coord.state is RoundState.OPEN else None    # the acks/closure: the next tick

    def _closed(self, r, coord: RoundCoordinator) -> None:
        coord.handle(Tick(math.inf))                  # CLOSED: later answers are acknowledged "late"
        closed = RoundClosed(r.round, *(tuple(r.outcome[k]) for k in ("accepted", "dropped", "declined", "rejected")))
        if r.round > self.done_round:       # past the checkpoint: closed again as the live close did
            hand_round_sum(self.a.job, self.store, self.a.kind, self.a.job_id, r.round)
            self.a.job.close_round(closed)
        self.a.round_log.append(self.a.round_entry(closed, r.opened_at, r.closed_at))
        self.a.let_go(r.round, r.closed_at or time.time())
