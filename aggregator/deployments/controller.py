"""The deployment controller: the I/O around :class:`~aggregator.deployments.machine.Deployment`.

It runs beside the aggregator service on its own thread and MQTT connection (deployment traffic
has its own topics, ``protocols/payloads/deployment.py``), with one active deployment at a time:

* each tick it publishes a signed, retained ``run`` assignment to every device of the current
  stage that was not sent one yet (known, not revoked devices; offline ones get it on reconnect),
  and feeds the machine the reports of that stage's devices. It looks at every device of the fleet
  only when the deployments or the stage changed; else at the devices that changed since the last
  tick (enrolled, revoked, tagged: ``FleetView``; sent an assignment; reported), as every other
  device's answer is the one it had then: nothing to send. A stage with too few reports halfway
  through its patience has its devices that never reported sent their run again, once. An id revoked
  and enrolled again is a new device: sent the run afresh, its predecessor's report never counted;
* it answers head fetches (``artifact.get`` on a device's deploy outbox) with the head's bytes;
* it stores each report, each assignment sent and each state change (``DeploymentStore``) before
  acting on it, so a restarted aggregator resumes the same deployment and re-sends nothing (each
  device's last assignment is published again as it was, the same sequence: a re-delivery, in
  slices between which commands and reports are served);
* on a rollback it publishes a retained ``rollback`` to every device it had sent ``run``;
* every assignment names its device and carries a sequence above any that device was sent before
  (``DeploymentStore.mark_sent``): devices refuse a lower one, so a replayed capture is refused. A
  report is taken only about the device's last assignment (its deployment and sequence); any other
  (a late report on a finished deployment, a replay) is refused and counted per deployment, as are
  the refusals devices report, by class.

Operator actions (deploy, promote, rollback) run on its thread through :meth:`call`.
"""

from __future__ import annotations

import hashlib
import logging
import time
import zipfile
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from protocols.envelope import EnvelopeError, decode
from protocols.files import read_npz
from protocols.message_loop import QueueBound
from protocols.mqtt_link import BrokerConfig, LinkWorker, MqttLink
from protocols.payloads import deployment as D
from protocols.payloads.artifacts import GET as ARTIFACT_GET, artifact_message, parse_get
from protocols.topics import AGGREGATOR_ID, CONTROLLER_ROLE, Topics

from aggregator.deployments.cohort import CohortRule, parse_stages
from aggregator.deployments.fleet_view import FleetView
from aggregator.deployments.guard import DEFAULT_GUARD, DEFAULT_MIN_REPORTS, DeviceReport, Guard
from aggregator.jobs.config_limits import JOB_ID_RE
from aggregator.deployments.machine import (ACTIVE, Assign, Deployment, DeploymentState, Halt, Promote, RollBack,
                                            RolledBack, Start, Tick)
from aggregator.security.repeat_limit import RepeatLimiter
from aggregator.storage.deployments import DeploymentStore
from aggregator.storage.store import Store, StoreError, arrays_sha256

log = logging.getLogger("fedfleet.aggregator.deployments")
MAX_DEVICE_MESSAGE_BYTES = 64 * 1024        # an artifact.get or a report: a few hundred bytes
MEDIAN_WEIGHTS = 2                          # a device weighs at most this many median devices in pooled guards
HEAD_RESEND_S = 5.0                         # a head is sent to a device at most twice per this (RepeatLimiter)
# last assignments published again per slice of the start's re-delivery: ~0.1 s of signing and
# publishing (bench/deployment_restart.py); in one go, 100,000 devices held the thread 14-18 s
REDELIVERY_BATCH = 1000
_ID = JOB_ID_RE          # a deployment's id follows a job id's rule (never "." or "..": unreachable in a path)


class CorruptModel(StoreError):
    """A stored model whose bytes no longer match its hash."""


@dataclass
class Served:
    """A deployment the controller serves: its machine, its head file, and per device what it was
    sent, to which of its enrolments, and reported (``{sent, sent_at, enrolled_at, report}``, as stored)."""
    dep: Deployment
    head: bytes
    sent: dict[str, dict]

    def has_run(self, device: str) -> bool:
        return (self.sent.get(device) or {}).get("sent") == D.RUN

    def runs_on(self, device: str, enrolled_at: float | None) -> bool:
        """Whether the device's enrolment ``enrolled_at`` was sent the run: a revoked id enrolled again
        is a new device, sent nothing yet, and the report under its id is its predecessor's."""
        return self.has_run(device) and self.sent[device]["enrolled_at"] == enrolled_at


class DeploymentController(LinkWorker):
    def __init__(self, store: Store, broker: BrokerConfig, topics: Topics = Topics(),
                 signer: Callable[[bytes], bytes] | None = None, verifier=None, tick_s: float = 0.5,
                 client_id: str | None = None, max_device_n: int = 1000):
        # unread, a device's outbox holds a few of its small messages here, the fleet's a burst of reports
        super().__init__(thread_name="deployments", tick_s=tick_s,
                         bound=QueueBound(16 * MAX_DEVICE_MESSAGE_BYTES, 256 * 2 ** 20))
        self.store, self.table, self.topics, self.signer = store, DeploymentStore(store), topics, signer
        self.tick_s = tick_s
        # a device's weight in the guard: at most the held-out size it reported in earlier deployments,
        # never above max_device_n (a device's counts are its claim, not a fact)
        self.max_device_n, self._known_n = int(max_device_n), {}
        # what devices send here (an artifact.get, a report) is one small message, never chunks: a
        # reassembler would let one device's outbox hold partial messages under invented senders
        self.verifier = verifier
        self._head_answers = RepeatLimiter(HEAD_RESEND_S)
        self._reassignments = RepeatLimiter(HEAD_RESEND_S, answers=1)
        # a device adds to one counter of a deployment at most once per window: the counters are
        # the operator's view of refusals and late reports, which one device could otherwise inflate
        # on any deployment as fast as it sends reports (a review's finding)
        self._counted = RepeatLimiter(HEAD_RESEND_S, answers=1)
        self._next_tick = 0.0
        # the last assignments still to publish again, (device, deployment, seq, message); None: not planned yet
        self._redelivery: deque[tuple[str, str, int, Callable[[str, int], Any]]] | None = None
        self.active: Served | None = None        # in canary or widening
        self.settled: Served | None = None       # the last completed: the version of every device not in a canary
        self.last = self.table.last_assignments()   # device -> (deployment, seq) it was last sent
        self._counts: dict[tuple[str, str], int] = {}    # counters not yet stored: (deployment, name) -> n
        self.fleet = FleetView(store)
        # the rollout's view since its last pass over the whole fleet (_roll_out): what it was for
        # (active, settled, stage; None: a pass over the whole fleet is due), the devices that changed
        # since the last tick, and the active stage's members and those of them whose reports it reads
        self._planned: tuple[Served | None, Served | None, int] | None = None
        self._dirty: set[str] = set()
        self._members: set[str] = set()
        self._reporting: set[str] = set()
        self._asked_again: tuple[str, int] | None = None     # (deployment, stage) whose silent devices were asked again
        # its own account when the broker has them (BrokerConfig.for_role): one MQTT identity per connection
        broker = broker.for_role(CONTROLLER_ROLE)
        self.link = MqttLink(client_id or broker.username or AGGREGATOR_ID + ".deployments", broker, on_message=self._post,
                             subscriptions=[(topics.all_deploy_outs, 1)])
        self._resume()

    # ------------------------------------------------------------------ lifecycle (start, stop, call: LinkWorker;
    # what raises is logged and the thread goes on: one bad message or a failed write never stops the rollout)
    def _handle(self, item: tuple[str, bytes]) -> None:
        self._on_payload(*item)

    def _tick(self, now: float) -> None:
        if self._redelivery is None:
            self._redelivery = self._plan_redelivery()
        if self._redelivery:                # the rollout follows it, as when it was one call
            self._redeliver_some()
            self.loop.tick_soon()
        elif now >= self._next_tick:        # not once per message: a fleet's reports come in bursts
            self._next_tick = now + self.tick_s
            self._flush_counts()
            self._roll_out(time.time())

    def _resume(self) -> None:
        """At start: the active and the settled deployment, their heads, and who was sent what
        (a restart re-sends nothing)."""
        active = [r for r in self.table.list() if r["state"] in ACTIVE]
        self.active = self._load(active[-1]["deployment_id"]) if active else None
        self._known_n = self.table.reported_sizes(exclude=self.active.dep.deployment_id if self.active else "")
        self.settled = self._latest_complete()
        if self.active is not None:
            log.warning("deployment %s resumed in state %s, stage %d", self.active.dep.deployment_id,
                        self.active.dep.state, self.active.dep.stage)

    def _latest_complete(self) -> Served | None:
        complete = [r for r in self.table.list() if r["state"] == DeploymentState.COMPLETE]
        return self._load(complete[-1]["deployment_id"]) if complete else None

    def _load(self, deployment_id: str) -> Served | None:
        """The deployment as served; None when its model's stored head is corrupt: the deployment is
        halted with the reason (its devices keep what they run) and the model marked corrupt, and
        nothing else stops (a fault in one artifact is not a reason to take the service down)."""
        dep = Deployment.from_dict(self.table.get(deployment_id)["spec"])
        try:
            head = self._head_bytes(dep.model_id)
            if hashlib.sha256(head).hexdigest() != dep.model_sha256:
                raise CorruptModel(f"model {dep.model_id}'s head no longer hashes to deployment {deployment_id}'s")
        except (CorruptModel, KeyError) as exc:
            reason = f"halted: {exc.args[0] if exc.args else exc}"
            self.store.set_setting(f"model.{dep.model_id}.corrupt", reason)
            dep.handle(Halt(time.time(), reason))
            self.table.save(deployment_id, dep.state, dep.to_dict())
            log.error("deployment %s %s; the service and every other deployment go on", deployment_id, reason)
            return None
        return Served(dep, head, self.table.devices(deployment_id))

    def _head_bytes(self, model_id: int) -> bytes:
        """The head file of a stored model; CorruptModel when its stored arrays are unreadable or no
        longer hash to the sha256 recorded when it was stored."""
        raw, row = self.store.model_bytes(model_id), self.store.model(model_id)
        if raw is None or row is None:
            raise KeyError(f"no model {model_id}")
        try:
            arrays = read_npz(raw)
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
            raise CorruptModel(f"model {model_id}'s stored arrays are unreadable ({type(exc).__name__}: {exc})") from None
        if arrays_sha256(arrays) != row["sha256"]:
            raise CorruptModel(f"model {model_id}'s stored arrays no longer hash to the sha256 recorded with them")
        return D.head_npz(*D.head_arrays(arrays))

    @staticmethod
    def _check_devices_take(model_id: int, head: bytes) -> None:
        """ValueError when every device would refuse the head file (``head_from_npz``, the device's
        own check: a NaN or infinity, e.g. from diverged training, or a weight past float32's range,
        which the file's float32 makes infinite): such a rollout could only roll back, after a
        canary's worth of refusals."""
        try:
            D.head_from_npz(head, hashlib.sha256(head).hexdigest())
        except EnvelopeError as exc:
            raise ValueError(f"model {model_id} cannot be deployed: devices refuse its head ({exc})") from None

    # ------------------------------------------------------------------ operator actions
    def deploy(self, model_id: int, cohort: str = "5%", stages: str = "100%", guard: str = DEFAULT_GUARD,
               bake_s: float = 600.0, min_reports: int = DEFAULT_MIN_REPORTS, patience_s: float = 600.0, deployment_id: str = "",
               seed: int = 0) -> dict:
        if self.active is not None:
            raise StoreError(f"deployment {self.active.dep.deployment_id} is {self.active.dep.state}: "
                             "promote it to the end or roll it back first")
        head = self._head_bytes(model_id)
        self._check_devices_take(model_id, head)
        # a second default of one model within a second: the next free m<model>-<second>-<n>
        deployment_id = deployment_id or self.table.unused_id(f"m{model_id}-{int(time.time())}")
        if not _ID.fullmatch(deployment_id):
            raise ValueError(f"deployment id {deployment_id!r}: use 1-64 of [A-Za-z0-9_.-], not '.' or '..'")
        if self.table.get(deployment_id) is not None:
            raise StoreError(f"deployment {deployment_id!r} already exists")
        fractions = parse_stages(stages)
        dep = Deployment(deployment_id, model_id, hashlib.sha256(head).hexdigest(), CohortRule.parse(cohort, seed),
                         fractions, Guard.parse(guard), float(bake_s), int(min_reports), float(patience_s),
                         self.settled.dep.model_id if self.settled else None)
        if dep.cohort.kind == "tags" and not dep.cohort.canary(self._fleet()):
            raise ValueError(f"cohort {dep.cohort.text()}: no device carries these tags (the tags the operator gives: "
                             "fedfleet admin device tag ID --tags ...); an empty canary would only roll back")
        if dep.cohort.kind == "devices" and (unknown := sorted(set(dep.cohort.names) - set(self._fleet()))):
            # a typo was dropped silently, and a list of none rolled back at once (a review's finding)
            raise ValueError(f"cohort names devices not in the fleet (unknown or revoked): {', '.join(unknown[:10])}"
                             + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else ""))
        actions = dep.handle(Start(time.time()))
        self.table.create(deployment_id, model_id, dep.state, dep.to_dict())
        self._known_n = self.table.reported_sizes(exclude=deployment_id)
        self.active = Served(dep, head, {})
        log.info("deployment %s of model %d started: canary %s", deployment_id, model_id, dep.cohort.text())
        self._apply(self.active, actions)
        return self.show(deployment_id)

    def promote(self, deployment_id: str) -> dict:
        served = self._operated(deployment_id, (self.active,))
        self._apply(served, served.dep.handle(Promote(time.time())))
        return self.show(deployment_id)

    def rollback(self, deployment_id: str, reason: str = "rolled back by the operator") -> dict:
        """Roll back the active deployment, or the settled one (every device it reached)."""
        served = self._operated(deployment_id, (self.active, self.settled))
        self._apply(served, served.dep.handle(RollBack(time.time(), reason)))
        return self.show(deployment_id)

    def _operated(self, deployment_id: str, candidates) -> Served:
        row = self.table.get(deployment_id)
        if row is None:
            raise KeyError(f"no deployment {deployment_id!r}")
        for served in candidates:
            if served is not None and served.dep.deployment_id == deployment_id:
                return served
        raise StoreError(f"deployment {deployment_id} is {row['state']}: not one this action applies to")

    def show(self, deployment_id: str) -> dict:
        return deployment_view(self.table, deployment_id, self._fleet())

    # ------------------------------------------------------------------ the rollout
    def _roll_out(self, now: float) -> None:
        """Assign the current stage's devices that were not sent one yet, and feed the machine their reports."""
        active = self.active
        if active is None and self.settled is None:
            return                      # nothing to assign: no reading the whole fleet every tick
        fleet = self._fleet()
        plan, planned = (active, self.settled, active.dep.stage if active else 0), self._planned
        whole = planned is None or planned[0] is not active or planned[1] is not self.settled or planned[2] != plan[2]
        # every device's answer when the deployments or the stage changed, else the changed devices'
        # (every other one's is what it was at the last tick: nothing to send); a tick that raises
        # midway leaves None: the next one looks at every device again
        self._planned, dirty, self._dirty = None, self._dirty, set()
        looked_at = fleet if whole else [d for d in dirty if d in fleet]
        if self.settled is not None:
            # every device outside the canary whose last assignment is not the settled version's run:
            # new to the fleet, or told to roll back a deployment. A rollback alone reverts a device
            # to the one version it kept, which after two rollbacks (or the settled version's own,
            # during a canary) is not the settled one, or nothing; the run names the version to hold.
            # A device the candidate let go (rolled back on it when it left the stage) gets it too, and
            # so does one whose last message of the settled version was its rollback (released before
            # that version completed).
            settled_id = self.settled.dep.deployment_id
            self._send_run(self.settled, sorted(d for d in looked_at if (self.last.get(d, ("",))[0] != settled_id
                                                                         or not self.settled.has_run(d))
                                                and (active is None or not active.has_run(d))))
        if active is not None:
            self._update_members(active, fleet, None if whole else dirty)
            members = self._members
            self._release(active, sorted(d for d in looked_at if active.has_run(d) and d not in members
                                         and self.last.get(d, ("",))[0] == active.dep.deployment_id))
            enrolments = self.fleet.enrolments
            self._send_run(active, sorted(d for d in (members if whole else looked_at)
                                          if d in members and not active.runs_on(d, enrolments.get(d))))
            reporting = {d for d in (members if whole else dirty) if d in members and
                         active.runs_on(d, enrolments.get(d)) and active.sent[d]["report"] is not None}
            self._reporting = reporting if whole else (self._reporting - dirty) | reporting
        self._planned = plan
        if active is not None:
            reports = {d: report_of(active.sent[d]["report"]) for d in self._reporting}
            tick = Tick(now, reports, self._weight_caps(reports))
            self._ask_silent_again(active, tick)
            self._apply(active, active.dep.handle(tick))

    def _ask_silent_again(self, active: Served, tick: Tick) -> None:
        """Once per stage, when it still has too few reports halfway through its patience: its devices
        sent the run that never reported are sent it again, under a new sequence, which a device
        running the head judges and reports (the first half: time for the first ask's answer; the
        second: for this one's). A device's report is lost when its process ends between the swap
        (durable) and the report leaving; the device then runs the candidate under that assignment's
        sequence, takes the retained copy as a re-delivery and sends nothing, and the stage rolled
        back for too few reports from devices that could give them (a review's finding)."""
        dep = active.dep
        if self._asked_again == (dep.deployment_id, dep.stage) or not dep.half_patience_spent(tick):
            return
        self._asked_again = (dep.deployment_id, dep.stage)
        silent = sorted(d for d in self._members if active.has_run(d) and active.sent[d]["report"] is None)
        if silent:
            log.info("deployment %s: stage %d has too few reports halfway through its patience: asking %d silent "
                     "device(s) again", dep.deployment_id, dep.stage, len(silent))
            self._send_run(active, silent)

    def _update_members(self, active: Served, fleet: dict[str, tuple[str, ...]], devices: set[str] | None) -> None:
        """The active stage's members (``CohortRule.stage``): of the whole fleet, or ``devices``'
        memberships again (a device's membership reads its own id and tags only)."""
        cohort, fraction = active.dep.cohort, active.dep.stage_fraction
        if devices is None:
            self._members = cohort.stage(fraction, fleet)
            return
        for d in devices:
            if d in fleet and cohort.stage(fraction, {d: fleet[d]}):
                self._members.add(d)
            else:
                self._members.discard(d)

    def _release(self, served: Served, devices: list[str]) -> None:
        """Devices running the candidate that left its stage (the operator took away the tag that put
        them in a ``tags:`` canary): the candidate is rolled back on them, so each goes back to the
        version it kept (the settled one, when it ran that before), and the settled version's run
        follows wherever a device does not run the candidate (``_roll_out``). They ran the candidate
        until promotion or rollback before. Their reports no longer count (the guard reads devices
        running the candidate), and should they come back to the stage they are sent it again. One
        transaction (``_send``): a restart finds them released or not, never half."""
        if devices:
            log.info("deployment %s: %d device(s) left its stage: %s", served.dep.deployment_id, len(devices),
                     devices[:5])
            self._release_message(served, devices)

    def _release_message(self, served: Served, devices: list[str]) -> None:
        self._send(served, devices, D.ROLLBACK, _rollback_of(served.dep.deployment_id,
                                                             "the device left the deployment's cohort"))

    def _weight_caps(self, reports: dict[str, DeviceReport]) -> dict[str, int]:
        """Each judged device's weight in the pooled ``wma_*``: at most max_device_n, at most the
        smallest held-out size it reported before, and at most twice the stage's median claimed size
        (the lower median), so a device claiming a huge split, new or not, weighs no more than two
        typical ones, while honest devices' splits of ordinary spread keep their own weights."""
        sizes = sorted(r.n for r in reports.values() if not r.refused and r.n > 0)
        most = MEDIAN_WEIGHTS * sizes[(len(sizes) - 1) // 2] if sizes else self.max_device_n
        return {d: min(self.max_device_n, self._known_n.get(d, self.max_device_n), most) for d in reports}

    def _apply(self, served: Served, actions: list) -> None:
        dep = served.dep
        if actions:             # a change of state: durable before anything leaves
            self.table.save(dep.deployment_id, dep.state, dep.to_dict())
        for act in actions:
            if isinstance(act, Assign):
                log.info("deployment %s: stage %d (%s)", dep.deployment_id, act.stage, dep.history[-1]["why"])
            elif isinstance(act, RolledBack):
                log.warning("deployment %s rolled back: %s", dep.deployment_id, act.reason)
                # to the devices it still assigns: the settled version's canary devices run the
                # candidate now (a rollback of the settled one there broke the canary: its retained
                # message replaced their run of the candidate, their reports then refused as late)
                self._send(served, sorted(d for d in served.sent if served.has_run(d)
                                          and self.last.get(d, ("",))[0] == dep.deployment_id), D.ROLLBACK,
                           _rollback_of(dep.deployment_id, act.reason))
        if dep.state is DeploymentState.COMPLETE and served is self.active:
            self.active, self.settled = None, served
        elif dep.state is DeploymentState.ROLLED_BACK and served is self.active:
            self.active = None
        elif dep.state is DeploymentState.ROLLED_BACK:         # the settled version rolled back: the one before is again
            self.settled = self._latest_complete()
        if dep.state not in ACTIVE and actions:
            log.info("deployment %s is %s", dep.deployment_id, dep.state)

    def _send_run(self, served: Served, devices: list[str]) -> None:
        if devices:
            self._send(served, devices, D.RUN, self._run_of(served))

    def _run_of(self, served: Served) -> Callable[[str, int], Any]:
        """``message(device, seq)``: the deployment's run assignment."""
        dep, bundle = served.dep, self._bundle_of(served.dep.model_id)
        return lambda d, seq: D.run_message(AGGREGATOR_ID, dep.deployment_id, dep.model_sha256, len(served.head),
                                            dep.model_id, bundle, device=d, seq=seq)

    def _plan_redelivery(self) -> deque[tuple[str, str, int, Callable[[str, int], Any]]]:
        """At start: each device's last assignment, to publish again as it was (deployment, action,
        sequence: a device takes it as a re-delivery, as it takes the broker's retained copy at every
        reconnect), and a run of a deployment rolled back meanwhile followed by its rollback, as
        ``_apply`` sends it. An assignment is recorded before it is published, and a state before its
        assignments are recorded: a process that ended between the two (or with publishes still in
        its MQTT client, the broker unreachable) left a device told nothing, and with no settled
        version to follow a canary device ran the rolled-back candidate for good (a review's finding).
        A run of a halted deployment is not sent again (nothing more is), nor of an older complete
        one (the settled version's run follows, ``_roll_out``). The rollback is sent now, in one go
        as the rollback it completes; the rest is returned for ``_redeliver_some``."""
        pending: deque[tuple[str, str, int, Callable[[str, int], Any]]] = deque()
        by_deployment: dict[str, list[tuple[str, int]]] = {}
        for device, (deployment_id, seq) in sorted(self.last.items()):
            by_deployment.setdefault(deployment_id, []).append((device, seq))
        served = {s.dep.deployment_id: s for s in (self.active, self.settled) if s is not None}
        for deployment_id, assigned in by_deployment.items():
            row = self.table.get(deployment_id)
            sent = served[deployment_id].sent if deployment_id in served else self.table.devices(deployment_id)
            run = self._run_of(served[deployment_id]) if deployment_id in served else None
            rollback = _rollback_of(deployment_id, row["spec"]["reason"] or "rolled back")
            for device, seq in assigned:
                message = rollback if sent[device]["sent"] == D.ROLLBACK else run
                if message is not None:
                    pending.append((device, deployment_id, seq, message))
            if row["state"] == DeploymentState.ROLLED_BACK:
                runs = [d for d, _ in assigned if sent[d]["sent"] == D.RUN]
                if runs:
                    log.warning("deployment %s: its rollback not recorded for %d device(s): sent now", deployment_id,
                                len(runs))
                    self._send(Served(Deployment.from_dict(row["spec"]), b"", sent), runs, D.ROLLBACK, rollback)
        return pending

    def _redeliver_some(self) -> None:
        """The next REDELIVERY_BATCH of the start's re-delivery: one slice of the thread, so an
        operator's command or a device's report waits for a slice, not for the whole fleet (14-18 s at
        100,000 devices in one go). A device sent a newer assignment meanwhile (a rollback between
        slices) is skipped: that one was published, and the older, retained, would replace it."""
        for _ in range(min(REDELIVERY_BATCH, len(self._redelivery))):
            device, deployment_id, seq, message = self._redelivery.popleft()
            if self.last.get(device) == (deployment_id, seq):
                self.link.publish_envelope(self.topics.deploy(device), message(device, seq), signer=self.signer,
                                           retain=True)

    def _bundle_of(self, model_id: int) -> str:
        """The exported bundle whose features the model's head reads: its job's (``""``: the devices' own)."""
        job = self.store.job(self.store.model(model_id)["job_id"])
        return str((job or {}).get("config", {}).get("bundle_sha256") or "")

    def _send(self, served: Served, devices: list[str], what: str, message: Callable[[str, int], Any]) -> None:
        """Publish ``message(device, seq)`` to each device, retained, under a new sequence."""
        if not devices:
            return
        seq, enrolments = self.table.mark_sent(served.dep.deployment_id, devices, what)   # a restart re-sends none
        for d in devices:
            sent = served.sent.setdefault(d, {"report": None})
            if what == D.RUN and (sent.get("sent") != D.RUN or sent.get("enrolled_at") != enrolments[d]):
                sent["report"] = None       # a run after a rollback, or to a new enrolment: judged anew (as mark_sent)
            sent["sent"], sent["enrolled_at"] = what, enrolments[d]
            self.last[d] = (served.dep.deployment_id, seq)
            self._dirty.add(d)          # the next rollout tick looks at it again
            self.link.publish_envelope(self.topics.deploy(d), message(d, seq), signer=self.signer, retain=True)

    def _fleet(self) -> dict[str, tuple[str, ...]]:
        """Known, not revoked devices -> the tags the operator gave them (never the tags a device
        announces: with those, devices could choose to be in a tags: canary and outvote it), as the
        store has them now: the devices that changed since the last look (``FleetView``), which the
        next rollout tick looks at again. Not to be changed by the caller."""
        self._dirty.update(self.fleet.refresh())
        return self.fleet.devices

    def _known(self, device: str) -> bool:
        """A known, not revoked device: one row read (the whole fleet's rows per message, as
        ``_fleet`` reads them, cost 95 ms a message at 10,000 devices: one device's junk stalled the
        operator's rollback behind it, a review found)."""
        row = self.store.device(device)
        return row is not None and row["status"] != "revoked"

    # ------------------------------------------------------------------ inbound
    def _on_payload(self, topic: str, payload: bytes) -> None:
        device = self.topics.deploy_device_of(topic)
        try:
            env = decode(payload, self.verifier, max_bytes=MAX_DEVICE_MESSAGE_BYTES) if device is not None else None
        except EnvelopeError as exc:
            return log.warning("deployment message on %s refused: %s", topic[:120], exc)
        if env is None:
            return
        if env.sender != device or not self._known(device):
            return log.warning("deployment message from %s on %s refused: not that known device", env.sender, topic)
        try:
            if env.type == ARTIFACT_GET:
                self._on_fetch(device, parse_get(env))
            elif env.type == D.REPORT:
                self._on_report(device, D.parse_report(env))
            else:
                log.warning("deployment message of type %s from %s ignored", env.type[:40], device)
        except EnvelopeError as exc:
            log.warning("deployment message from %s refused: %s", device, exc)

    def _on_fetch(self, device: str, sha: str) -> None:
        last = self.last.get(device, ("",))[0]
        served = next((s for s in (self.active, self.settled) if s is not None and s.dep.model_sha256 == sha
                       and s.has_run(device) and s.dep.deployment_id == last), None)
        if served is None:
            return log.warning("head %s… asked by %s: not the head assigned to it", sha[:16], device)
        if not self._head_answers.allow(device, sha):
            return log.info("head %s… asked again by %s within %g s: the last answer stands", sha[:16], device,
                            self._head_answers.window_s)
        self.link.publish_envelope(self.topics.deploy_in(device), artifact_message(
            AGGREGATOR_ID, sha, f"{served.dep.deployment_id}.npz", served.head), signer=self.signer)

    def _on_report(self, device: str, report: dict) -> None:
        """Stored when it is about the device's last assignment, a run of a deployment still served
        (the guard reads the active one's); any other is refused and counted. A refusal is counted
        by class, and never replaces counts the device already reported (a forged message the
        device refuses later says nothing about the head it judged)."""
        dep_id = report["deployment"]
        served = next((s for s in (self.active, self.settled) if s is not None and s.dep.deployment_id == dep_id), None)
        if served is None and self.table.get(dep_id) is None:      # counted only for a deployment that exists
            return log.info("report from %s on unknown deployment %s ignored", device, dep_id)
        if report.get("refused"):
            self._count_from(device, dep_id, f"refused:{report['reason']}")
        sent = served.sent.get(device) if served is not None else None
        if (sent is None or sent["sent"] != D.RUN or report["sha256"] != served.dep.model_sha256
                or self.last.get(device) != (dep_id, report["seq"])):
            self._count_from(device, dep_id, "late_reports")
            log.warning("report from %s on %s (assignment %d) refused: not about its last assignment %s",
                        device, dep_id, report["seq"], self.last.get(device))
            return self._reassign(device)
        if report.get("refused"):
            if sent["report"] is not None and not sent["report"].get("refused"):
                return log.warning("deployment %s: %s reports a %s refusal after judging the head: %s", dep_id,
                                   device, report["reason"], report["refused"])
            log.warning("deployment %s: %s refused the head (%s): %s", dep_id, device, report["reason"],
                        report["refused"])
        self.table.record_report(dep_id, device, report)
        sent["report"] = report
        self._dirty.add(device)         # the next rollout tick reads its report

    def _reassign(self, device: str) -> None:
        """A device judging an assignment that is not its last may run something it was not told to
        (its state lost, a captured assignment replayed to it): its current assignment again, under
        a new sequence it will take over the other. At most once per device per window; an honest
        late report costs the device one assignment it already holds."""
        if not self._reassignments.allow(device, "assignment"):
            return
        active, settled = self.active, self.settled
        if active is not None and active.has_run(device):
            self._send_run(active, [device])
        elif settled is not None:       # the candidate's canary let it go, or never held it
            self._send_run(settled, [device])
        elif active is not None and device in active.sent:      # let go, with no settled version: its rollback
            self._release_message(active, [device])

    def _count(self, deployment_id: str, name: str) -> None:
        self._counts[(deployment_id, name)] = self._counts.get((deployment_id, name), 0) + 1

    def _count_from(self, device: str, deployment_id: str, name: str) -> None:
        if self._counted.allow(device, (deployment_id, name)):
            self._count(deployment_id, name)

    def _flush_counts(self) -> None:
        """Counters are stored once per tick, not once per message: a device flooding reports
        costs the store one write per tick."""
        if self._counts:
            counts, self._counts = self._counts, {}
            self.table.add_counts(counts)


def _rollback_of(deployment_id: str, reason: str) -> Callable[[str, int], Any]:
    """``message(device, seq)``: the deployment's rollback assignment."""
    return lambda d, seq: D.rollback_message(AGGREGATOR_ID, deployment_id, reason, device=d, seq=seq)


def report_of(stored: dict) -> DeviceReport:
    if stored.get("refused"):
        return DeviceReport(refused=stored["refused"])
    return DeviceReport(stored["n"], stored["correct_candidate"], stored["correct_current"])


def deployment_view(table: DeploymentStore, deployment_id: str, fleet: dict | None = None) -> dict:
    """A deployment as the API shows it: its rule and history, and per device what it was sent and said."""
    row = table.get(deployment_id)
    if row is None:
        raise KeyError(f"no deployment {deployment_id!r}")
    devices = table.devices(deployment_id)
    spec = row["spec"]
    counts = {"sent_run": sum(d["sent"] == D.RUN for d in devices.values()),
              "sent_rollback": sum(d["sent"] == D.ROLLBACK for d in devices.values()),
              "reported": sum(bool(d["report"]) and not d["report"].get("refused") for d in devices.values()),
              "refused": sum(bool(d["report"]) and bool(d["report"].get("refused")) for d in devices.values())}
    counts.update({"late_reports": 0, **table.counters(deployment_id)})     # and refused:<class> as devices said
    if fleet is not None:
        counts["fleet"] = len(fleet)
    return {**{k: row[k] for k in ("deployment_id", "model_id", "state", "created_at", "updated_at")},
            "model_sha256": spec["model_sha256"], "replaces": spec["replaces"], "cohort": spec["cohort"],
            "stages": spec["stages"], "guard": spec["guard"], "bake_s": spec["bake_s"],
            "min_reports": spec["min_reports"], "patience_s": spec["patience_s"], "stage": spec["stage"], "reason": spec["reason"],
            "history": spec["history"], "counts": counts, "devices": devices}
