"""The fleet a deployment's cohort reads (known, not revoked devices -> the tags the operator gave
them, and each one's enrolment), kept in memory and brought up to date from the store's change rows.

Read in full once; then each :meth:`FleetView.refresh` reads only the devices whose place in the
fleet changed since (``fleet_changes``, kept by triggers in the store: an enrolment, a
revocation or a tag change by any writer, the admin API's thread or another process, is seen at
the next refresh). Nothing changed: one indexed look-up, however large the fleet (a full read cost
~0.6 s a rollout tick at 100,000 devices: bench/deployment_restart.py --steady).
"""

from __future__ import annotations

from aggregator.storage.store import Store


class FleetView:
    def __init__(self, store: Store):
        self.store = store
        members, self._seen = store.operator_fleet()       # the last change seq read
        self.devices = {d: tags for d, (tags, _) in members.items()}                # device -> tags
        # device -> its enrolment (devices.enrolled_at): another one is a new device under the same id
        self.enrolments = {d: enrolled_at for d, (_, enrolled_at) in members.items()}

    def refresh(self) -> dict[str, tuple[tuple[str, ...], float | None] | None]:
        """The changes since the last refresh, applied: device -> (its tags, its enrolment) now,
        None for one that left the fleet (revoked or deleted); {} when nothing changed."""
        changed, self._seen = self.store.fleet_changes_after(self._seen)
        for device, member in changed.items():
            if member is None:
                self.devices.pop(device, None)
                self.enrolments.pop(device, None)
            else:
                self.devices[device], self.enrolments[device] = member
        return changed
