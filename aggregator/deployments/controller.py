"""The deployment controller: the I/O around :class:`~aggregator.deployments.machine.Deployment`.

It runs beside the aggregator service on its own thread and MQTT connection (deployment traffic
has its own topics, ``protocols/payloads/deployment.py``), with one active deployment at a time:

* each tick it publishes a signed, retained ``run`` assignment to every device of the current
  stage that was not sent one yet (known, not revoked devices; offline ones get it on reconnect),
  and feeds the machine the reports of that stage's devices;
* it answers head fetches (``artifact.get`` on a device's deploy outbox) with the head's bytes;
* it stores each report, each assignment sent and each state change (``DeploymentStore``) before
  acting on it, so a restarted aggregator resumes the same deployment and re-sends nothing;
* on a rollback it publishes a retained ``rollback`` to every device it had sent ``run``.

Operator actions (deploy, promote, rollback) run on its thread through :meth:`call`.
"""

from __future__ import annotations

import hashlib
import io
import logging
import queue
import re
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

import numpy as np

from protocols.chunking import MessageAssembler
from protocols.envelope import EnvelopeError
from protocols.mqtt_link import BrokerConfig, MqttLink
from protocols.payloads import deployment as D
from protocols.payloads.artifacts import GET as ARTIFACT_GET, artifact_message, parse_get
from protocols.topics import AGGREGATOR_ID, Topics

from aggregator.deployments.cohort import CohortRule, parse_percent
from aggregator.deployments.guard import DeviceReport, Guard
from aggregator.deployments.machine import ACTIVE, Assign, Deployment, RollBack, RolledBack, Start, Tick, Promote
from aggregator.storage.deployments import DeploymentStore
from aggregator.storage.store import Store, StoreError

log = logging.getLogger("fedfleet.aggregator.deployments")
_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class DeploymentController:
    def __init__(self, store: Store, broker: BrokerConfig, topics: Topics = Topics(),
                 signer: Callable[[bytes], bytes] | None = None, verifier=None, tick_s: float = 0.5,
                 client_id: str = AGGREGATOR_ID + ".deployments"):
        self.store, self.table, self.topics, self.signer = store, DeploymentStore(store), topics, signer
        self.tick_s = tick_s
        self.assembler = MessageAssembler(verifier=verifier, max_message_bytes=1024 * 1024)
        self._q: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.active: Deployment | None = None
        self.head: bytes = b""                       # the active deployment's head file
        self.sent: dict[str, dict] = {}              # device -> {sent, report} for the active deployment
        self.link = MqttLink(client_id, broker, on_message=lambda t, p: self._q.put(("mqtt", t, p)),
                             subscriptions=[(topics.all_deploy_outs, 1)])
        self._resume()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "DeploymentController":
        self.link.start()
        self._thread = threading.Thread(target=self._run, name="deployments", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.link.stop()

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run ``fn`` on the controller's thread and return its result or raise its error."""
        fut: Future = Future()
        self._q.put(("call", fn, fut))
        return fut.result(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._q.get(timeout=self.tick_s)
            except queue.Empty:
                item = None
            try:
                if item is not None and item[0] == "mqtt":
                    self._on_payload(item[1], item[2])
                elif item is not None:
                    fut = item[2]
                    if fut.set_running_or_notify_cancel():
                        try:
                            fut.set_result(item[1]())
                        except Exception as exc:        # the caller's error (the API makes it a 4xx)
                            fut.set_exception(exc)
                self._tick(time.time())
            except Exception:           # one bad message or a failed write never stops the rollout thread
                log.exception("deployment controller: an event raised")

    def _resume(self) -> None:
        """After a restart: the active deployment, its head, and who was sent what (nothing is re-sent)."""
        for row in self.table.list():
            if row["state"] in ACTIVE:
                self._load(Deployment.from_dict(row["spec"]))
                log.warning("deployment %s resumed in state %s, stage %d", row["deployment_id"], row["state"],
                            self.active.stage)

    def _load(self, dep: Deployment) -> None:
        self.active, self.head = dep, self._head_bytes(dep.model_id)
        if hashlib.sha256(self.head).hexdigest() != dep.model_sha256:
            raise StoreError(f"model {dep.model_id}'s head no longer hashes to deployment {dep.deployment_id}'s")
        self.sent = self.table.devices(dep.deployment_id)

    def _head_bytes(self, model_id: int) -> bytes:
        raw = self.store.model_bytes(model_id)
        if raw is None:
            raise KeyError(f"no model {model_id}")
        with np.load(io.BytesIO(raw), allow_pickle=False) as z:
            return D.head_npz(*D.head_arrays({k: z[k] for k in z.files}))

    # ------------------------------------------------------------------ operator actions
    def deploy(self, model_id: int, cohort: str = "5%", stages: str = "100%", guard: str = "wma_drop<=1.0",
               bake_s: float = 600.0, min_reports: int = 1, deployment_id: str = "", seed: int = 0) -> dict:
        if self.active is not None:
            raise StoreError(f"deployment {self.active.deployment_id} is {self.active.state}: "
                             "promote it to the end or roll it back first")
        head = self._head_bytes(model_id)
        deployment_id = deployment_id or f"m{model_id}-{int(time.time())}"
        if not _ID.match(deployment_id):
            raise ValueError(f"deployment id {deployment_id!r}: use 1-64 of [A-Za-z0-9_.-]")
        fractions = tuple(parse_percent(s) for s in str(stages).split(",") if s.strip())
        previous = self.table.list()
        replaces = next((r["model_id"] for r in reversed(previous) if r["state"] == "complete"), None)
        dep = Deployment(deployment_id, model_id, hashlib.sha256(head).hexdigest(), CohortRule.parse(cohort, seed),
                         fractions, Guard.parse(guard), float(bake_s), int(min_reports), replaces)
        actions = dep.handle(Start(time.time()))
        self.table.create(deployment_id, model_id, dep.state, dep.to_dict())
        self.active, self.head, self.sent = dep, head, {}
        log.info("deployment %s of model %d started: canary %s", deployment_id, model_id, dep.cohort.text())
        self._apply(actions)
        return self.show(deployment_id)

    def promote(self, deployment_id: str) -> dict:
        self._apply(self._operated(deployment_id).handle(Promote(time.time())))
        return self.show(deployment_id)

    def rollback(self, deployment_id: str, reason: str = "rolled back by the operator") -> dict:
        """Roll back the active deployment, or the last one completed (every device it reached)."""
        self._apply(self._operated(deployment_id, completed_too=True).handle(RollBack(time.time(), reason)))
        return self.show(deployment_id)

    def _operated(self, deployment_id: str, completed_too: bool = False) -> Deployment:
        row = self.table.get(deployment_id)
        if row is None:
            raise KeyError(f"no deployment {deployment_id!r}")
        if self.active is not None and self.active.deployment_id == deployment_id:
            return self.active
        if completed_too and self.active is None and row["state"] == "complete":
            self._load(Deployment.from_dict(row["spec"]))
            return self.active
        raise StoreError(f"deployment {deployment_id} is {row['state']}: nothing to do"
                         + (f" (deployment {self.active.deployment_id} is the active one)" if self.active else ""))

    def show(self, deployment_id: str) -> dict:
        return deployment_view(self.table, deployment_id, self._fleet())

    # ------------------------------------------------------------------ the rollout
    def _tick(self, now: float) -> None:
        dep = self.active
        if dep is None or dep.state not in ACTIVE:
            return
        members = self._members(dep)
        self._send_run(sorted(d for d in members if (self.sent.get(d) or {}).get("sent") != D.RUN))
        reports = {d: report_of(self.sent[d]["report"]) for d in members
                   if d in self.sent and self.sent[d]["report"] is not None}
        self._apply(dep.handle(Tick(now, reports)))

    def _apply(self, actions: list) -> None:
        dep = self.active
        if actions:             # a change of state: durable before anything leaves
            self.table.save(dep.deployment_id, dep.state, dep.to_dict())
        for act in actions:
            if isinstance(act, Assign):
                log.info("deployment %s: stage %d (%s)", dep.deployment_id, act.stage, dep.history[-1]["why"])
            elif isinstance(act, RolledBack):
                log.warning("deployment %s rolled back: %s", dep.deployment_id, act.reason)
                self._send(sorted(d for d, s in self.sent.items() if s["sent"] == D.RUN), D.ROLLBACK,
                           D.rollback_message(AGGREGATOR_ID, dep.deployment_id, act.reason))
        if dep.state not in ACTIVE:
            log.info("deployment %s is %s", dep.deployment_id, dep.state)
            self.active = None

    def _send_run(self, devices: list[str]) -> None:
        dep = self.active
        self._send(devices, D.RUN, D.run_message(AGGREGATOR_ID, dep.deployment_id, dep.model_sha256,
                                                 len(self.head), dep.model_id))

    def _send(self, devices: list[str], what: str, env) -> None:
        if not devices:
            return
        self.table.mark_sent(self.active.deployment_id, devices, what)     # a restart re-sends none of these
        for d in devices:
            self.sent.setdefault(d, {"report": None})["sent"] = what
            self.link.publish_envelope(self.topics.deploy(d), env, signer=self.signer, retain=True)

    def _fleet(self) -> dict[str, tuple[str, ...]]:
        """Known, not revoked devices -> their tags (from the profile they announce)."""
        out = {}
        for row in self.store.devices():
            if row["status"] != "revoked":
                tags = row["profile"].get("tags", ())
                out[row["device_id"]] = tuple(tags.split(",") if isinstance(tags, str) else map(str, tags))
        return out

    def _members(self, dep: Deployment) -> set[str]:
        return dep.cohort.stage(dep.stage_fraction, self._fleet())

    # ------------------------------------------------------------------ inbound
    def _on_payload(self, topic: str, payload: bytes) -> None:
        device = self.topics.deploy_device_of(topic)
        try:
            env = self.assembler.feed(payload) if device is not None else None
        except EnvelopeError as exc:
            return log.warning("deployment message on %s refused: %s", topic[:120], exc)
        if env is None:
            return
        if env.sender != device or device not in self._fleet():
            return log.warning("deployment message from %r on %s refused: not that known device", env.sender, topic)
        try:
            if env.type == ARTIFACT_GET:
                self._on_fetch(device, parse_get(env))
            elif env.type == D.REPORT:
                self._on_report(device, D.parse_report(env))
            else:
                log.warning("deployment message of type %r from %s ignored", env.type[:40], device)
        except EnvelopeError as exc:
            log.warning("deployment message from %s refused: %s", device, exc)

    def _on_fetch(self, device: str, sha: str) -> None:
        dep = self.active
        if dep is None or sha != dep.model_sha256 or (self.sent.get(device) or {}).get("sent") != D.RUN:
            return log.warning("head %s… asked by %s: not the head assigned to it", sha[:16], device)
        self.link.publish_envelope(self.topics.deploy_in(device),
                                   artifact_message(AGGREGATOR_ID, sha, f"{dep.deployment_id}.npz", self.head),
                                   signer=self.signer)

    def _on_report(self, device: str, report: dict) -> None:
        dep = self.active
        if dep is None or report["deployment"] != dep.deployment_id or report["sha256"] != dep.model_sha256 \
                or device not in self.sent:
            return log.info("report from %s on %s ignored: not the active deployment's", device, report["deployment"])
        if report.get("refused"):
            log.warning("deployment %s: %s refused the head: %s", dep.deployment_id, device, report["refused"])
        self.table.record_report(dep.deployment_id, device, report)
        self.sent[device]["report"] = report


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
    if fleet is not None:
        counts["fleet"] = len(fleet)
    return {**{k: row[k] for k in ("deployment_id", "model_id", "state", "created_at", "updated_at")},
            "model_sha256": spec["model_sha256"], "replaces": spec["replaces"], "cohort": spec["cohort"],
            "stages": spec["stages"], "guard": spec["guard"], "bake_s": spec["bake_s"],
            "min_reports": spec["min_reports"], "stage": spec["stage"], "reason": spec["reason"],
            "history": spec["history"], "counts": counts, "devices": devices}
