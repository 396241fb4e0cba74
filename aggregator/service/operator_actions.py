"""What an operator does to a running aggregator (enrol, revoke, fleet mode, forget a device,
create and control jobs), as methods of the service that the admin API runs on the service thread
through :meth:`AggregatorService.call`: the mutations of fleet and store have one writer."""

from __future__ import annotations

import contextlib

from aggregator.service import job_lifecycle

from aggregator.service import unlearning
from aggregator.service.artifacts import with_served_bundle
from aggregator.security.enrollment import DeviceCredentials
from aggregator.storage.store import StoreError
from aggregator.storage.schema import JobState


class OperatorActions:
    """Mixed into :class:`aggregator.service.loop.AggregatorService`, whose state (``fleet``, ``store``,
    ``active``, ``eval_set``, ``artifacts``, ``job_ends``) and hooks (``_device_lost``, ``_job_broken``, ``_update_live``) it uses."""

    def enroll(self, device_id: str, public_key: bytes | None = None) -> DeviceCredentials:
        was_revoked = device_id in self.fleet.revoked
        if was_revoked:
            # a presence retained under this id is the revoked device's (one an earlier version left,
            # or a revocation whose clearing never reached the broker): cleared before the new account
            # exists, never read as the new device's
            self._clear_retained_presence(device_id)
        with self._admission():
            creds = self.fleet.enroll(device_id, public_key)
            if self.shards is not None:         # the shards hold its chunks and verify with its key at once
                self.shards.admission_changed(device_id, True)
                if self.settings.require_signatures:
                    self.shards.key_changed(device_id, bytes.fromhex(creds.public_key))
        if device_id not in self.fleet.online and not was_revoked:
            # its presence may have been forgotten with the strangers (Fleet.MAX_STRANGERS) while it
            # stayed connected: its retained presence, read again, makes it eligible now
            self.link.fetch_retained(self.topics.presence(device_id))
        return creds

    def revoke(self, device_id: str) -> str | None:
        """Revoke now: the broker refuses it after the reload, this service (and its shards) ignore it
        at once. A warning when the broker could not reload (``Enrollment._sync_broker``)."""
        with self._admission():
            warning = self.fleet.revoke(device_id)
            if self.shards is not None:
                self.shards.admission_changed(device_id, False)
                if self.settings.require_signatures:
                    self.shards.key_changed(device_id, None)
        self._device_lost(device_id)
        self._clear_retained_presence(device_id)
        return warning

    def _clear_retained_presence(self, device_id: str) -> None:
        """Remove the device's retained presence from the broker (an empty retained message): its
        "offline" last will is refused once the reload took its ACL away, so its retained "online"
        stayed, and a device enrolled later under its id was marked online, read back at its
        enrolment, before it ever connected. Its retained deployment assignment stays: the
        deployment controller's record of what each id was sent (``DeploymentStore``) counts on it."""
        self.link.publish(self.topics.presence(device_id), b"", retain=True)

    def set_fleet_mode(self, mode: str) -> str:
        with self._admission():
            self.fleet.set_mode(mode)
            self._tell_shards_the_fleet()
        if mode == "open":          # every retained presence again: strangers forgotten while connected come back
            self.link.fetch_retained(self.topics.all_presence)
        self._update_live(force=True)
        return self.fleet.mode

    def _admission(self):
        """The shards' admission lock (``ShardPool.admission``), or none without shards."""
        return self.shards.admission() if self.shards is not None else contextlib.nullcontext()

    def _tell_shards_the_fleet(self, keys: bool = False) -> None:
        """Who may contribute (never a revoked device, in either fleet mode), to the shards (they hold
        only those devices' chunks), and with ``keys`` the enrolled keys every shard verifies messages
        with (before the shards start only)."""
        if self.shards is None:
            return
        if keys:
            self.shards.require_signatures(self.fleet.enrolled_keys())
        self.shards.admit(self.fleet.admitted(), self.fleet.revoked)

    def forget_device(self, device_id: str, job_id: str | None = None) -> list[dict]:
        """Remove a device's data from every job that holds it (or ``job_id`` only), where that can be
        exact (plaintext Fed3R); each job's line says what was done or why not (``unlearning.py``)."""
        if self.store is None:
            raise StoreError("forgetting needs the aggregator's store")
        if self.runner is not None:
            self.runner.flush_writes()          # a pending write of the device's data must not land after
        report = []
        for job in unlearning.jobs_to_forget(self.store, device_id, job_id):
            active = self.active is not None and self.active.job_id == job["job_id"]
            line = unlearning.forget_stored(self.store, {**job, "state": JobState.RUNNING} if active else job,
                                            device_id, self.eval_set)
            if active and line["forgotten"]:
                self._job_broken(f"device {device_id} forgotten")      # rebuilt from what the store still holds
            report.append(line)
        if job_id is not None and not report:
            raise KeyError(f"job {job_id!r} holds no data of {device_id!r}")
        return report

    def release_quarantine(self, job_id: str, device_id: str) -> list[dict]:
        """Reverse a quarantine (e.g. a fleet screen's): the device may be asked again, and the job's
        screen spares it from now on; a running job is rebuilt from the store to see it. Returns the
        job's remaining quarantine."""
        if self.store is None:
            raise StoreError("releasing a quarantine needs the aggregator's store")
        if not self.store.release_quarantine(job_id, device_id):
            raise KeyError(f"job {job_id!r} has no quarantined contribution of {device_id!r}")
        if self.active is not None and self.active.job_id == job_id and not self.active.final_state:
            self._job_broken(f"quarantine of {device_id} released")
        return self.store.quarantined(job_id)

    def create_job(self, kind: str, config: dict) -> dict:
        """Store a new job; its bundle is the one this service serves unless the config names one."""
        return job_lifecycle.create_job(self.store, kind, with_served_bundle(kind, config, self.artifacts))

    def control_job(self, job_id: str, action: str) -> dict:
        """start / pause / resume / cancel."""
        row = job_lifecycle.control_job(self.store, self.active, job_id, action)
        served = self.active is not None and self.active.job_id == job_id and not self.active.final_state
        # a job not served ends now; the served one when its open round closes (the runner tells its
        # devices then: told now, a device of that round would drop its state and then save it again)
        if row["state"] == JobState.CANCELLED and not served:
            self.job_ends.ended(job_id, JobState.CANCELLED)
        return row

    # ------------------------------------------------------------------ jobs
