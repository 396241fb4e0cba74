"""Telling devices that a job ended, so they drop the state they keep for it (protocols/payloads/job_end.py).

A job whose devices keep state between its rounds (``aggregator/jobs/device_state_fields.py``: a
run id in every task) leaves personal parts, controls or duals on its devices; when it reaches a
final state (done, failed, cancelled) :class:`JobEndNotices` adds it, with its run, to the list
of lately ended jobs and publishes that list, signed and retained, on ``Topics.job_ends``.

Once, durably: the list is stored (the store's settings) before it is published, and published
again whenever the service (re)connects to its broker, so a restart or a broker that lost its
retained messages costs nothing; publishing it twice is harmless (a device drops a job's state
only for the run it holds). A job that ended while a crash stopped the service between its final
state and the stored list is not announced: its devices keep its state until its horizon.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from typing import Callable

from protocols.envelope import Envelope
from protocols.payloads.job_end import REASONS, JobEnded, job_ended_message, with_ended
from protocols.topics import AGGREGATOR_ID

from aggregator.jobs.device_state_fields import RUN_KEY, StatefulDevicesJob
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


class JobEndNotices:
    """The lately ended stateful jobs: kept in ``store`` (when there is one), published with ``publish``;
    and, in memory, the ids of the last ``MAX_ENDED_REMEMBERED`` jobs of any kind that ended (an
    answer to one is a straggler's, counted late, not a stranger's to be warned of)."""

    def __init__(self, store: Store | None, publish: Callable[[Envelope], None]):
        self.store, self._publish = store, publish
        self.notices = self._stored()
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

    def ended(self, job_id: str, state: str, job=None) -> JobEnded | None:
        """The job reached a final state: add it (stored first), publish the list; the notice, or
        None when its devices keep nothing."""
        self._ended_ids.append(job_id)
        run = run_of(job_id, job, self.store) if str(state) in REASONS else None
        if run is None:
            return None
        notice = JobEnded(job_id, run, str(state))
        self.notices = with_ended(self.notices, notice)
        if self.store is not None:
            self.store.set_setting(SETTING, json.dumps([n.to_wire() for n in self.notices]))
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
