"""Telling devices that a job ended, so they drop the state they keep for it (protocols/payloads/job_end.py).

A job whose devices keep state between its rounds (``aggregator/jobs/device_state_fields.py``: a
run id in every task) leaves personal parts, controls or duals on its devices; when it reaches a
final state (done, failed, cancelled) :class:`JobEndNotices` adds it, with its run, to the list
of lately ended jobs and publishes that list, signed and retained, on ``Topics.job_ends``.

Durably: the list is stored (the store's settings) before it is published, and published again
whenever the service (re)connects to its broker, so a restart or a broker that lost its retained
messages costs nothing; publishing it twice is harmless (a device drops a job's state only for the
run it holds). A list the store cannot take now (its disk fails) is published all the same (the
devices learn the end) and the error logged, never raised: the job's final state is committed
before its notice, and a failing notice stopped the service after it (``JobRunner.finish``). What
the stored list lacks — that notice, or one a crash cut off between the job's final state and the
list — is made again at the next start from the store's lately finished jobs (``restored_notices``).
"""

from __future__ import annotations

import json
import logging
from collections import deque
from typing import Callable

from protocols.envelope import Envelope
from protocols.payloads.job_end import MAX_NOTICES, REASONS, JobEnded, job_ended_message, with_ended
from protocols.topics import AGGREGATOR_ID

from aggregator.jobs.device_state_fields import RUN_KEY, StatefulDevicesJob
from aggregator.jobs.registry import KINDS
from aggregator.service.end_failures import after_commit
from aggregator.storage.store import Store

log = logging.getLogger("fedfleet.aggregator")

SETTING = "job_end_notices"
MAX_ENDED_REMEMBERED = 64      # ended jobs whose late answers are counted late, not rejected


def run_of(job_id: str, job, store: Store | None) -> str | None:
    """The run whose device state the job left, else None (a job whose devices keep nothing). The
    served job knows it; a job cancelled while not served has it in its last round's bookkeeping
    (a device holds state only from a task, and a task only goes out from a round the store opened)."""
    if isinstance(job, StatefulDevicesJob):
        return job.device_state.run
    if store is not None:
        for stored in reversed(store.rounds(job_id)):
            if stored.bookkeeping.get(RUN_KEY):
                return str(stored.bookkeeping[RUN_KEY])
    return None


def restored_notices(stored: list[JobEnded], store: Store) -> list[JobEnded]:
    """``stored`` with the notice of every stateful job among the last ``MAX_NOTICES`` to finish
    that it lacks (its list could not be stored, or a crash came first), in the order the jobs
    finished. Each of those jobs finished after every job of ``stored`` not among them, so the
    older entries keep their place ahead of them and the list stays newest last."""
    recent = store.lately_finished(MAX_NOTICES)
    listed = {n.job: n for n in stored}
    recent_ids = {row["job_id"] for row in recent}
    notices = [n for n in stored if n.job not in recent_ids]
    for row in recent:
        if row["job_id"] in listed:
            notices.append(listed[row["job_id"]])
        elif row["kind"] in KINDS and issubclass(KINDS[row["kind"]].job_cls, StatefulDevicesJob):
            run = run_of(row["job_id"], None, store)
            if run is not None:
                notices.append(JobEnded(row["job_id"], run, str(row["state"])))
    return notices[-MAX_NOTICES:]


class JobEndNotices:
    """The lately ended stateful jobs: kept in ``store`` (when there is one), published with ``publish``;
    and, in memory, the ids of the last ``MAX_ENDED_REMEMBERED`` jobs of any kind that ended (an
    answer to one is a straggler's, counted late, not a stranger's to be warned of)."""

    def __init__(self, store: Store | None, publish: Callable[[Envelope], None]):
        self.store, self._publish = store, publish
        self.notices = self._restored()
        self._ended_ids: deque[str] = deque(maxlen=MAX_ENDED_REMEMBERED)     # the newest push out the oldest

    def ended_lately(self, job_id: str) -> bool:
        return job_id in self._ended_ids

    def _stored(self) -> list[JobEnded]:
        text = self.store.setting(SETTING) if self.store is not None else None
        try:
            return [JobEnded.from_wire(e) for e in json.loads(text)] if text else []
        except (ValueError, TypeError) as exc:       # never fatal: the devices' horizon still drops the state
            log.error("stored job-end notices unreadable, starting a new list: %s", exc)
            return []

    def _restored(self) -> list[JobEnded]:
        """The stored list, with what it lacks of the jobs that finished lately (``restored_notices``)."""
        stored = self._stored()
        if self.store is None:
            return stored
        try:
            notices = restored_notices(stored, self.store)
        except Exception as exc:    # never fatal: the stored list still goes out
            log.error("job-end notices: the lately finished jobs could not be read: %s", exc)
            return stored
        made = sorted({n.job for n in notices} - {n.job for n in stored})
        if not made:
            return stored
        log.warning("job-end notices of %s were not stored (a failing store, or a crash at their job's end): "
                    "listed again", ", ".join(made))
        self._store(notices)
        return notices

    def _store(self, notices: list[JobEnded]) -> None:
        try:
            self.store.set_setting(SETTING, json.dumps([n.to_wire() for n in notices]))
        except Exception as exc:    # published all the same; the next start lists what this lacks again
            log.error("job-end notices not stored (%s): published all the same, listed again at the next "
                      "start", exc)

    def ended_safely(self, job_id: str, state: str, job=None) -> None:
        """:meth:`ended`, what it raises logged, never fatal (a job given up as cancelled, its cancel
        standing, tells its devices as a cancel of a job not served does; the next start lists a
        notice the store lacks)."""
        after_commit(job_id, [("its devices' job-end notice", lambda: self.ended(job_id, state, job))])

    def ended(self, job_id: str, state: str, job=None) -> JobEnded | None:
        """The job reached a final state: add it (stored first, where the store can), publish the
        list; the notice, or None when its devices keep nothing. Raises only where its run cannot
        be read (from the store: a job cancelled while not served), the list unchanged."""
        self._ended_ids.append(job_id)
        run = run_of(job_id, job, self.store) if str(state) in REASONS else None
        if run is None:
            return None
        notice = JobEnded(job_id, run, str(state))
        self.notices = with_ended(self.notices, notice)
        if self.store is not None:
            self._store(self.notices)
        self.publish()
        log.info("job %s (run %s) %s: devices told to drop its state", job_id, run, state)
        return notice

    def publish(self) -> None:
        """(Re)publish the retained list (after every connect: the broker may have lost it)."""
        if not self.notices:
            return
        try:
            self._publish(job_ended_message(AGGREGATOR_ID, self.notices))
        except Exception as exc:        # no broker now: the stored list goes out on the next connect
            log.warning("job-end notices not published (%s): sent again on the next connect", exc)
