"""The devices a job stops drawing because their own decline said their clock runs ahead.

A device whose clock runs ahead of the aggregator's by more than the deadline grace receives every
task expired (``protocols/device_session.py``): it declines the first task of each job once, saying
so (``EXPIRED_DECLINE``; ``EXPIRED_AT_WORK_DECLINE`` when the deadline passed during its work), and
skips the job's later tasks in silence. That rate limit is right on the device: a replayed expired
task must not make it talk once per replay. But drawn again, it was a participant that never
answered: a plain round waited for it until its deadline, a secure round's first phase for its
budget, at least half the round (``aggregator/jobs/phase_clock.py``), every round it was drawn into
(``tests/test_fedavg_secure_over_mqtt.py``: a secure FedAvg job of 3 rounds of 120 s, done in
seconds now, was still in its second round after 50 s).

So the job draws such a device no more, for the rest of the job. Not "until it is back in sync":
within the job the only sign of that would be an answer to a task it was drawn for again, and a
device still ahead gives none (its session declines a job's expired tasks once, remembered across
restarts, and skips the rest in silence), so every such probe would cost a round's wait again; a
presence's signed ``ts`` proves nothing either (a replayed old one reads as a clock in sync). The
next job is the probe that costs nothing: it draws the device again, and a clock still ahead
declines its first task there at once. This job goes on with the rest of its fleet, as it does
without a device that went offline. The same holds for an operator starting the job again once it
stopped (``start`` / ``resume`` of a stopped job: the operator may have set the clocks meanwhile):
only the declines recorded since then count (``recovery.open_stored``, the store's
``restarted_at``); a restart of the service, or a pause and resume, keep the exclusion.

Only a decline the round's machine recorded (``RecordDeclined``) counts: the device's own message
(its sender the device its topic names, signed by that device's key where identities are required:
``aggregator/service/loop.py``), from a participant still pending, naming the task it was given in
that open round (``protocols/rounds.py``). So no device can have another one excluded, and a
captured decline replayed later names a task not given in the round it names (refused) or finds
its device answered (ignored). A decline that comes after its round closed (an at-work decline,
usually) does not count: the round let go no longer holds the task ids that tell it is genuine.
The reasons are compared whole: they are fixed words, the Java device's the same.
"""

from __future__ import annotations

from protocols.device_session import EXPIRED_AT_WORK_DECLINE, EXPIRED_DECLINE

CLOCK_AHEAD_DECLINES = (EXPIRED_DECLINE, EXPIRED_AT_WORK_DECLINE)


class ClockAhead:
    """device -> the round whose recorded decline said its clock runs ahead (the first such)."""

    def __init__(self, rounds: dict[str, int] | None = None):
        self.rounds: dict[str, int] = {}
        self._by_round: dict[int, list[str]] = {}     # what a round's close reports, without a scan per close
        for device, round_ in sorted((rounds or {}).items()):
            self._add(device, round_)

    def note_decline(self, device: str, reason: str, round_: int) -> bool:
        """A recorded decline of ``device`` in ``round_``: whether it stops the job drawing the device
        from now on (False: another reason, or a device not drawn already)."""
        if device in self.rounds or reason not in CLOCK_AHEAD_DECLINES:
            return False
        self._add(device, round_)
        return True

    def _add(self, device: str, round_: int) -> None:
        self.rounds[device] = round_
        self._by_round.setdefault(round_, []).append(device)

    def declined_in(self, round_: int) -> list[str]:
        """The devices whose decline in ``round_`` stopped the job drawing them, sorted."""
        return sorted(self._by_round.get(round_, ()))

    def __len__(self) -> int:
        return len(self.rounds)
