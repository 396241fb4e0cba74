"""The aggregator process: MQTT in, round state machines and a job in the middle, MQTT out.

Threading: paho's network thread only enqueues ``(topic, payload)``; one service thread does
everything else (decode, validate, state machines, strategy math, store writes, publishing), so
job state has a single writer and needs no locks. The admin API (another thread) reads the store
and the ``live`` snapshot, and runs every mutation (enrol, revoke, pause, ...) on the service
thread through :meth:`AggregatorService.call`. Every inbound message is checked before it can
touch state: revoked sender, envelope structure and size, signature (when identities are
required), sender == the device named by the topic, device enrolled, job and round ids, then
the kind-specific payload checks (shapes, dtypes, NaN/Inf). Anything that fails is logged and
counted in ``rejections`` and, for results, acknowledged as ``rejected``.

Durability (with a :class:`aggregator.store.Store`): every state change is committed before
anything that depends on it leaves the process::

    step                                   committed first                      then
    open round                             participants, task ids, bookkeeping  publish tasks
    accept result                          raw envelope bytes + message id      apply, evaluate, ack
    decline / invalid result               round event                          (ack for invalid)
    close round                            outcome, model version, checkpoint   status, next round
    finish job                             final model + summary + state        write files

A restarted service rebuilds the job from the store (``_restore``): the checkpoint of the last
closed round (``job.state_dict()``, exact float64 sums), then the open round's contributions in
commit order through ``parse_result``/``apply`` (the same float64 additions in the same order;
without checkpoints: every contribution, and ``close_round`` of every closed round), the job's
bookkeeping of the last opened round, and coordinators whose ``seen_ids`` make every QoS 1
redelivery or device retry an idempotent ``duplicate``. An open round continues with its stored
deadline; its pending participants get their task again (same task id, so a device that already
answered just re-sends the same result). Tasks are also re-sent when the aggregator reconnects
and when a pending participant announces itself online (a broker restart loses in-flight
messages). For an ``order_free`` job (Fed3R), the final model is re-summed from the stored
contributions in device-id order, so it depends only on *which* devices contributed, never on
arrival order, round grouping, crashes or broker restarts.

Crash-point injection (tests only): ``FEDFLEET_CRASH_AT=point[:n]`` makes the process SIGKILL
itself the n-th time it passes ``point`` (one of ``CRASH_POINTS``).
"""

from __future__ import annotations

import json
import logging
import math
import re
import os
import queue
import signal
import threading
import time
import types
import typing
from collections import Counter
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from protocols import messages as M
from protocols.chunking import DEFAULT_CHUNK_SIZE, MessageAssembler
from protocols.envelope import Envelope, EnvelopeError, decode, encode
from protocols.identity import IdentityRegistry, InvalidSignature, UnknownDevice
from protocols.mqtt_link import BrokerConfig, MqttLink
from protocols.payloads.artifacts import GET as ARTIFACT_GET, artifact_message, parse_get
from protocols.payloads.secagg import SECAGG_TYPE
from protocols.rounds import (ApplyResult, Declined, DeviceLost, ResultArrived, ResultInvalid, RoundClosed,
                              RoundCoordinator, RoundState, SendAck, Tick)
from protocols.topics import AGGREGATOR_ID, DEVICE_ID_RE, Topics

from .artifacts import ArtifactShelf
from .broker_security import BrokerSecurity
from .enrollment import DeviceCredentials, Enrollment
from .jobs import Job
from .jobs.fed3r import Fed3RConfig, Fed3RJob
from .jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob
from .jobs.fedavg import FedAvgConfig, FedAvgJob
from .jobs.fedavg_tail import TailFedAvgConfig, TailFedAvgJob
from .jobs.personalize import PersonalizeConfig, PersonalizeJob
from .jobs.secure_fedavg import SecureFedAvgConfig, SecureFedAvgJob, SecureTailFedAvgConfig, SecureTailFedAvgJob
from .store import FINAL_JOB_STATES, Store, StoreError

log = logging.getLogger("fedfleet.aggregator")

CRASH_ENV = "FEDFLEET_CRASH_AT"
CRASH_POINTS = ("restored", "presence", "round_opened", "task_sent", "result_received", "contribution_stored",
                "evaluation_stored", "ack_sent", "round_closing", "round_closed", "job_finishing", "job_finished")

# Job types the service can build from a stored config: name -> (config class, job class).
JOB_TYPES: dict[str, tuple[type, type]] = {"fed3r": (Fed3RConfig, Fed3RJob),
                                           "fed3r-sync": (Fed3RSyncConfig, Fed3RSyncJob),
                                           "fedavg": (FedAvgConfig, FedAvgJob),
                                           "fedavg-secure": (SecureFedAvgConfig, SecureFedAvgJob),
                                           "fedavg-tail": (TailFedAvgConfig, TailFedAvgJob),
                                           "fedavg-tail-secure": (SecureTailFedAvgConfig, SecureTailFedAvgJob),
                                           "personalize": (PersonalizeConfig, PersonalizeJob)}


DURABLE_JOB_METHODS = ("state_dict", "load_state_dict", "bookkeeping", "restore_bookkeeping")


def job_type_name(job: Job) -> str:
    """The registry name of a job's type (its class name if unregistered: it then cannot be
    rebuilt from a stored config, i.e. started through the API or re-summed canonically)."""
    for name, (_, cls) in JOB_TYPES.items():
        if type(job) is cls:
            return name
    return type(job).__name__


def build_job(kind: str, config: dict) -> Job:
    validate_job_config(kind, config)
    config_cls, job_cls = JOB_TYPES[kind]
    return job_cls(config_cls(**config))


@dataclass(frozen=True)
class Range:
    lo: float
    hi: float


@dataclass(frozen=True)
class OneOf:
    values: tuple


@dataclass(frozen=True)
class Pattern:
    """A string field that must match this regular expression (whole string)."""
    regex: str


@dataclass(frozen=True)
class Fields:
    """A dict-valued field with exactly these keys: name -> (type, Range)."""
    spec: dict


# Limits of each kind's config fields; the admin API publishes them in its OpenAPI schema too.
CONFIG_LIMITS: dict[str, dict[str, Range | OneOf | Fields]] = {"fed3r": {
    "num_classes": Range(1, 100_000), "feature_dim": Range(1, 8192), "image_size": Range(1, 4096),
    "lam": Range(1e-12, 1e12), "clients_per_round": Range(1, 1_000_000), "max_attempts": Range(1, 1000),
    "expected_devices": Range(0, 1_000_000), "round_timeout_s": Range(1e-3, 7 * 86400),
    "start_timeout_s": Range(0, 7 * 86400), "seed": Range(0, 2 ** 53 - 1),   # JSON-safe: exact as a double
    "b_format": OneOf(("sparse", "dense")), "bundle_sha256": Pattern(r"^([0-9a-f]{64})?$"), "stats_dtype": OneOf(("float64", "float32")),
    "random_features": Fields({"seed": (int, Range(0, 2 ** 32 - 1)), "dim": (int, Range(1, 8192)),
                               "sigma": (float, Range(1e-12, 1e12))}),
}}
# FT(φ)/FT(M), plain or secure
CONFIG_LIMITS["fedavg-tail"] = CONFIG_LIMITS["fedavg-tail-secure"] = {
    "train": OneOf(("tail", "tail+head")), "tail_stages": Range(1, 64),
    "tail_program_sha256": Pattern(r"^([0-9a-f]{64})?$"),
}
CONFIG_LIMITS["personalize"] = {"tail_stages": Range(0, 64)}


def validate_job_config(kind: str, config: dict) -> None:
    """Refuse a config before anything is built from it: known fields, JSON types that match the
    config class's annotations, and the kind's limits (a typo must not allocate a 100 GB matrix)."""
    if kind not in JOB_TYPES:
        raise ValueError(f"unknown job kind {kind!r} (known: {sorted(JOB_TYPES)})")
    hints = typing.get_type_hints(JOB_TYPES[kind][0])
    limits = CONFIG_LIMITS.get(kind, {})
    for key, value in config.items():
        if key not in hints:
            raise ValueError(f"{kind} config has no field {key!r}")
        if not _matches(value, hints[key]):
            raise ValueError(f"{kind} config field {key!r}: {value!r} is not a {hints[key]}")
        if value is not None and key in limits:
            _check_limit(f"{kind} config field {key!r}", value, limits[key])
    check_device_id_like(config.get("job_id", "x"), "job_id")


def _check_limit(what: str, value, limit) -> None:
    if isinstance(limit, Range) and not limit.lo <= value <= limit.hi:
        raise ValueError(f"{what}={value} is outside [{limit.lo}, {limit.hi}]")
    if isinstance(limit, Pattern) and not re.fullmatch(limit.regex, value):
        raise ValueError(f"{what}={value!r} does not match {limit.regex}")
    if isinstance(limit, OneOf) and value not in limit.values:
        raise ValueError(f"{what} must be one of {limit.values}, not {value!r}")
    if isinstance(limit, Fields):
        if not isinstance(value, dict) or set(value) != set(limit.spec):
            raise ValueError(f"{what} must have exactly the keys {sorted(limit.spec)}")
        for key, (typ, rng) in limit.spec.items():
            if not _matches(value[key], typ):
                raise ValueError(f"{what}[{key!r}] must be a {typ.__name__}")
            _check_limit(f"{what}[{key!r}]", value[key], rng)


def _matches(value, hint) -> bool:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    hint = typing.get_origin(hint) or hint
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def check_device_id_like(value: str, what: str) -> str:
    if not isinstance(value, str) or not DEVICE_ID_RE.match(value):
        raise ValueError(f"{what} must be 1-64 of [A-Za-z0-9_.-], not {value!r}")
    return value


class CrashPoints:
    """SIGKILL this process the n-th time it passes a named point (crash tests only)."""

    def __init__(self, spec: str | None = None):
        self.point, self.nth, self.passed = None, 1, Counter()
        if spec:
            name, _, nth = spec.partition(":")
            if name not in CRASH_POINTS:
                raise ValueError(f"unknown crash point {name!r} (known: {', '.join(CRASH_POINTS)})")
            self.point, self.nth = name, int(nth or 1)

    @classmethod
    def from_env(cls) -> "CrashPoints":
        return cls(os.environ.get(CRASH_ENV))

    def __call__(self, name: str) -> None:
        self.passed[name] += 1
        if name == self.point and self.passed[name] == self.nth:
            log.warning("crash point %s reached (%d): SIGKILL", name, self.nth)
            os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class ServiceStats:
    bytes_in: int = 0
    results_accepted: int = 0
    rejections: Counter = field(default_factory=Counter)
    late: int = 0
    duplicates: int = 0

    def to_dict(self) -> dict:
        return {**asdict(self), "rejections": dict(self.rejections)}

    @classmethod
    def from_dict(cls, d: dict) -> "ServiceStats":
        return cls(d.get("bytes_in", 0), d.get("results_accepted", 0), Counter(d.get("rejections", {})),
                   d.get("late", 0), d.get("duplicates", 0))


@dataclass(frozen=True)
class _Validated:
    """What the round machine carries for a result: the parsed payload and its raw bytes."""
    payload: Any
    raw: bytes


@dataclass
class ActiveJob:
    """Runtime state of the job being served (everything here is rebuilt from the store)."""
    job: Job
    kind: str
    out_dir: Path
    state: str = "running"                      # running | paused
    rounds: dict[int, RoundCoordinator] = field(default_factory=dict)
    current: RoundCoordinator | None = None
    tasks: dict[int, dict[str, str]] = field(default_factory=dict)     # round -> device -> task id
    deadlines: dict[int, float] = field(default_factory=dict)          # round -> wall-clock deadline
    opened_at: dict[int, float] = field(default_factory=dict)
    round_bytes: Counter = field(default_factory=Counter)
    history: list[dict] = field(default_factory=list)
    round_log: list[dict] = field(default_factory=list)
    stats: ServiceStats = field(default_factory=ServiceStats)
    started_at: float = field(default_factory=time.time)                # the job's start (survives restarts)
    waiting_since: float = field(default_factory=time.time)             # this process took it up
    started: bool = False                       # enough devices seen to open a round after (re)start
    cancelling: bool = False
    final_state: str | None = None              # done | cancelled once the job is over

    @property
    def job_id(self) -> str:
        return self.job.config.job_id


def pending(coord: RoundCoordinator) -> set[str]:
    """Participants the round is still waiting for."""
    return (set(coord.participants) - set(coord.accepted) - set(coord.declined) - set(coord.rejected)
            - coord.lost)


class AggregatorService:
    def __init__(self, job: Job | None, broker: BrokerConfig, out_dir: Path, topics: Topics = Topics(),
                 enrolled: set[str] | None = None, eval_set: tuple[np.ndarray, np.ndarray] | None = None,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, max_message_bytes: int = 256 * 1024 * 1024,
                 tick_s: float = 0.2, evaluate_every_contribution: bool = True,
                 store: Store | None = None, security: BrokerSecurity | None = None,
                 require_signatures: bool = False, keep_serving: bool = False,
                 crash: CrashPoints | None = None, checkpoints: bool = True,
                 artifacts: "ArtifactShelf | None" = None):
        self.topics = topics
        self.artifacts = artifacts              # exported bundles devices may fetch by sha256
        self.eval_set = eval_set
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.chunk_size = chunk_size
        self.tick_s = tick_s
        self.evaluate_every_contribution = evaluate_every_contribution
        self.store = store
        self.checkpoints = checkpoints          # job state at every round close: restarts replay one round
        self.enrollment = Enrollment(store, security) if store is not None else None
        self.require_signatures = require_signatures
        self.keep_serving = keep_serving
        self.crash = crash or CrashPoints.from_env()
        self.assembler = MessageAssembler(verifier=self._verify if require_signatures else None,
                                          max_message_bytes=max_message_bytes)
        self.stats = ServiceStats()             # messages that belong to no job (bad topic, malformed, ...)
        self.online: set[str] = set()
        self.seen_devices: set[str] = set()
        self.last_seen: dict[str, float] = {}
        self.revoked: set[str] = set()
        self._device_bytes: Counter = Counter()  # bytes of a device's message being reassembled
        self._q: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self.live: dict = {}                     # snapshot for the admin API, replaced atomically
        self._live_at = 0.0
        self.enrolled, self.registry = self._load_enrolment(enrolled)
        self.link = MqttLink(AGGREGATOR_ID, broker, on_message=lambda t, p: self._q.put(("mqtt", t, p)),
                             subscriptions=[(topics.all_outboxes, 1), (topics.all_presence, 1)],
                             on_connect=lambda: self._q.put(("connected",)))
        if store is not None:
            store.mark_all_offline()
        self.last_finished: ActiveJob | None = None
        self.active: ActiveJob | None = self._activate(job, self.out_dir) if job is not None else None
        self._update_live(force=True)

    @property
    def job(self) -> Job | None:
        """The job being served, else the last one finished by this service."""
        a = self.active or self.last_finished
        return a.job if a else None

    # ------------------------------------------------------------------ lifecycle
    def run(self, timeout_s: float | None = None) -> dict:
        if self.active is not None and self.active.final_state:     # finished before a restart
            return self._finish_job()
        summary: dict = {}
        self.link.start()
        t0 = time.monotonic()
        try:
            while not self._stop.is_set():
                if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                    log.error("service timed out after %.0fs", timeout_s)
                    break
                if self.active is None and not self._start_next_job() and not self.keep_serving:
                    break
                try:
                    self._dispatch(self._q.get(timeout=self.tick_s))
                except queue.Empty:
                    pass
                self._tick(time.monotonic())
                if self.active is not None and self.active.final_state:
                    summary = self._finish_job()
                    if not self.keep_serving:
                        break
                self._update_live()
        finally:
            if self.active is not None:
                summary = self._finish_job()
            self.link.stop()
        return summary

    def stop(self) -> None:
        self._stop.set()

    def call(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        """Run ``fn`` on the service thread (the only writer) and return its result or raise its error."""
        fut: Future = Future()
        self._q.put(("call", fn, fut))
        return fut.result(timeout)

    def _dispatch(self, item: tuple) -> None:
        if item[0] == "mqtt":
            self._on_payload(item[1], item[2])
        elif item[0] == "connected":
            self._resend_tasks(self.online)
        elif item[0] == "call":
            fn, fut = item[1], item[2]
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except Exception as exc:  # handed to the caller (the API turns it into a 4xx)
                    fut.set_exception(exc)

    # ------------------------------------------------------------------ enrolment and devices
    def _load_enrolment(self, enrolled: set[str] | None) -> tuple[set[str] | None, IdentityRegistry | None]:
        if self.store is None:
            return enrolled, (IdentityRegistry() if self.require_signatures else None)
        keys = self.store.enrolled_keys()
        for device in sorted(set(enrolled or ()) - set(keys)):    # a plain allow-list joins the store
            self.store.enroll_device(device, None, None)
        keys = self.store.enrolled_keys()
        self.revoked = {d["device_id"] for d in self.store.devices() if d["status"] == "revoked"}
        allowed = set(keys) if keys or enrolled is not None else None
        registry = self.enrollment.registry() if self.require_signatures else None
        return allowed, registry

    def _verify(self, sender: str, signed: bytes, signature: bytes) -> None:
        try:
            self.registry.verify(sender, signed, signature)
        except (InvalidSignature, UnknownDevice) as exc:
            raise EnvelopeError(f"signature rejected for {sender!r}: {exc}") from None

    def _allowed(self, device: str) -> bool:
        return device not in self.revoked and (self.enrolled is None or device in self.enrolled)

    def enroll(self, device_id: str, public_key: bytes | None = None) -> DeviceCredentials:
        """Issue credentials (service thread; use ``call`` from elsewhere)."""
        if self.enrollment is None:
            raise StoreError("enrolment needs a store")
        creds = self.enrollment.enroll(device_id, public_key)
        self.revoked.discard(device_id)
        self.enrolled = (self.enrolled or set()) | {device_id}
        if self.registry is not None:
            self.registry.revoke(device_id)
            self.registry.enroll(device_id, bytes.fromhex(creds.public_key))
        return creds

    def revoke(self, device_id: str) -> None:
        """Revoke now: the broker refuses it after the reload, this service ignores it at once."""
        if self.enrollment is None:
            raise StoreError("revocation needs a store")
        self.enrollment.revoke(device_id)
        self.revoked.add(device_id)
        if self.enrolled is not None:
            self.enrolled.discard(device_id)
        if self.registry is not None:
            self.registry.revoke(device_id)
        self.online.discard(device_id)
        a = self.active
        if a is not None and a.current is not None:
            self._execute(a.current.handle(DeviceLost(device_id)), a.current.round)

    # ------------------------------------------------------------------ jobs
    def _activate(self, job: Job, out_dir: Path) -> ActiveJob:
        a = ActiveJob(job, job_type_name(job), Path(out_dir))
        a.out_dir.mkdir(parents=True, exist_ok=True)
        if self.store is None:
            return a
        missing = [m for m in DURABLE_JOB_METHODS if not callable(getattr(job, m, None))]
        if missing:
            raise TypeError(f"{type(job).__name__} cannot run with a store: it lacks {', '.join(missing)}")
        if hasattr(job, "on_protocol") and not self.checkpoints:
            # A secure round's secrets (keys, shares, masked vectors) are never persisted: what
            # survives a restart is the job state checkpointed at each round close, so a secure
            # job needs checkpoints (replaying per-device results is impossible: there are none).
            raise TypeError(f"{type(job).__name__} (secure aggregation) needs checkpoints to run with a store")
        row = self.store.job(a.job_id)
        config = job.config.to_dict()
        if row is None:
            self.store.create_job(a.job_id, a.kind, config, state="running")
            self.store.set_job_state(a.job_id, "running")
            a.started_at = self.store.job(a.job_id)["started_at"]
            return a
        if row["kind"] != a.kind or json.loads(json.dumps(config)) != row["config"]:
            raise StoreError(f"job {a.job_id!r} is stored with a different kind/config; use a new job_id")
        self._restore(a, row)
        self.crash("restored")
        return a

    def _restore(self, a: ActiveJob, row: dict) -> None:
        """Rebuild the job from the store: see the module docstring."""
        t0 = time.perf_counter()
        job, store = a.job, self.store
        a.stats = ServiceStats.from_dict(row.get("counters") or {})
        a.started_at = row["started_at"] or row["created_at"]
        checkpoint = store.checkpoint(a.job_id) if self.checkpoints else None
        done_round = 0
        if checkpoint is not None:                   # the state as of the last closed round
            done_round, state, contributed = checkpoint
            job.load_state_dict(state)
            job.contributed = dict(contributed)
        ids = store.contributions(a.job_id, with_payload=False)                 # every round: message ids
        payloads = store.contributions(a.job_id, after_round=done_round)        # only what the state lacks
        nxt_id, nxt_payload = next(ids, None), next(payloads, None)
        rounds = store.rounds(a.job_id)
        now_wall, now_mono = time.time(), time.monotonic()
        replayed = 0
        for r in rounds:
            coord = RoundCoordinator(r.round, frozenset(r.participants), now_mono + (r.deadline - now_wall))
            while nxt_id is not None and nxt_id.round == r.round:
                coord.restore(nxt_id.device, nxt_id.message_id)
                nxt_id = next(ids, None)
            if r.round > done_round:                 # the job as it was right after this round opened
                job.restore_bookkeeping(r.bookkeeping)
            while nxt_payload is not None and nxt_payload.round == r.round:
                # A secure round's members are stored without a payload (the aggregator only ever
                # held their sum): a sum that was not checkpointed before the crash is lost, its
                # devices stay un-contributed (eligible again), and nothing is applied twice.
                if nxt_payload.payload:
                    job.apply(nxt_payload.device, job.parse_result(decode(nxt_payload.payload)))
                    replayed += 1
                nxt_payload = next(payloads, None)
            a.rounds[r.round], a.tasks[r.round] = coord, r.tasks
            a.deadlines[r.round], a.opened_at[r.round] = r.deadline, r.opened_at
            a.round_bytes[r.round] = r.bytes_in
            if r.state == "closed":
                coord.handle(Tick(math.inf))         # CLOSED: later answers are acknowledged "late"
                closed = RoundClosed(r.round, *(tuple(r.outcome[k]) for k in
                                                ("accepted", "dropped", "declined", "rejected")))
                if r.round > done_round:
                    job.close_round(closed)
                a.round_log.append(self._round_entry(a, closed, r.opened_at, r.closed_at))
            else:
                for ev in store.round_events(a.job_id, r.round):
                    event = (Declined(ev["device"], ev["reason"]) if ev["event"] == "declined"
                             else ResultInvalid(ev["device"], "restored", ev["reason"]))
                    coord.handle(event)              # the acks/closure it implies are redone by _tick
                a.current = coord if coord.state is RoundState.OPEN else None
        if nxt_id is not None or nxt_payload is not None:
            raise StoreError(f"job {a.job_id} has contributions that belong to no stored round")
        if rounds:
            job.restore_bookkeeping(rounds[-1].bookkeeping)
        a.history = store.evaluations(a.job_id)
        if row["state"] in FINAL_JOB_STATES:
            a.final_state = row["state"]
        elif row["state"] == "paused":
            a.state = "paused"
        else:
            store.set_job_state(a.job_id, "running")
        log.warning("job %s restored: %d rounds, checkpoint of round %d, %d contributions replayed in %.3fs",
                    a.job_id, len(rounds), done_round, replayed, time.perf_counter() - t0)

    def _start_next_job(self) -> bool:
        """With a store: resume an interrupted job, else start the oldest queued one."""
        if self.store is None:
            return False
        rows = [j for j in self.store.jobs() if j["state"] in ("running", "paused")] or \
            ([self.store.next_queued_job()] if self.store.next_queued_job() else [])
        if not rows:
            return False
        row = rows[0]
        try:
            job = build_job(row["kind"], row["config"])
            if row["state"] == "queued":
                self.store.set_job_state(row["job_id"], "running")
            self.active = self._activate(job, self.out_dir / row["job_id"])
        except Exception as exc:  # a stored job that cannot be built must not stop the service
            log.error("cannot start job %s: %s", row["job_id"], exc)
            self.store.set_job_state(row["job_id"], "stopped", {"error": str(exc)})
            return False
        return True

    def create_job(self, kind: str, config: dict) -> dict:
        validate_job_config(kind, config)
        # the kind's default id, read off the dataclass (a kind may need fields to be built at all)
        job_id = config.get("job_id") or JOB_TYPES[kind][0].__dataclass_fields__["job_id"].default
        if self.store is None:
            raise StoreError("creating jobs needs a store")
        full = JOB_TYPES[kind][0](**{**config, "job_id": job_id}).to_dict()   # defaults made explicit
        self.store.create_job(job_id, kind, full)
        return self.store.job(job_id)

    def control_job(self, job_id: str, action: str) -> dict:
        """start / pause / resume / cancel (service thread)."""
        row = self.store.job(job_id) if self.store else None
        if row is None:
            raise KeyError(job_id)
        a = self.active if self.active is not None and self.active.job_id == job_id else None
        state = row["state"]
        allowed = {"start": ("created", "stopped"), "pause": ("running",), "resume": ("paused", "stopped"),
                   "cancel": ("created", "queued", "running", "paused", "stopped")}
        if action not in allowed:
            raise ValueError(f"unknown action {action!r}")
        if state not in allowed[action]:
            raise StoreError(f"cannot {action} job {job_id} in state {state!r}")
        if action == "pause":
            if a is not None:
                a.state = "paused"
            self.store.set_job_state(job_id, "paused")
        elif action == "resume" and a is not None:
            a.state = "running"
            self.store.set_job_state(job_id, "running")
        elif action in ("start", "resume"):
            self.store.set_job_state(job_id, "queued")
        elif action == "cancel" and a is not None:
            a.cancelling = True
        else:
            self.store.set_job_state(job_id, "cancelled")
        return self.store.job(job_id)

    # ------------------------------------------------------------------ inbound
    def _on_payload(self, topic: str, payload: bytes) -> None:
        self.stats.bytes_in += len(payload)
        if self.active is not None:
            self.active.stats.bytes_in += len(payload)
        device = self.topics.device_of(topic)
        if device is None:
            self._reject("?", None, "bad topic")
            return
        if device in self.revoked:
            self._reject(device, None, "revoked device")
            return
        if topic.endswith("/out"):
            self._device_bytes[device] += len(payload)
        try:
            got = self.assembler.feed_whole(payload)
        except EnvelopeError as exc:
            kind = "bad signature" if str(exc).startswith(("signature", "unsigned")) else "malformed"
            self._device_bytes.pop(device, None)
            self._reject(device, None, f"{kind}: {exc}")
            return
        if got is None:
            return
        env, raw = got
        nbytes = self._device_bytes.pop(device, 0)
        if env.sender != device:
            self._reject(device, None, f"sender {env.sender!r} does not own topic {topic}")
            return
        if topic.endswith("/out") and self.enrolled is not None and device not in self.enrolled:
            self._reject(device, None, "unknown device (not enrolled)")
            return
        self.last_seen[device] = time.time()
        if env.type == M.PRESENCE:
            self._on_presence(device, env)
        elif env.type in (M.RESULT, M.DECLINE):
            self._on_result(device, env, raw, nbytes)
        elif env.type == ARTIFACT_GET:
            self._on_artifact_get(device, env)
        elif env.type == SECAGG_TYPE and hasattr(getattr(self.active, "job", None), "on_protocol"):
            self._on_protocol(device, env)
        else:
            self._reject(device, env.id, f"unexpected message type {env.type!r}")

    def _on_presence(self, device: str, env: Envelope) -> None:
        if not self._allowed(device):
            return
        try:
            online, info = M.parse_presence(env)
        except EnvelopeError as exc:
            self._reject(device, env.id, f"presence: {exc}")
            return
        if self.store is not None:
            self.store.device_seen(device, online, info if online else None)
        self.crash("presence")
        if online:
            self.online.add(device)
            self.seen_devices.add(device)
            self._resend_tasks({device})
        else:
            self.online.discard(device)
            a = self.active
            if a is not None and a.current is not None:
                self._execute(a.current.handle(DeviceLost(device)), a.current.round)

    def _on_result(self, device: str, env: Envelope, raw: bytes, nbytes: int) -> None:
        a = self.active
        try:
            ref, kind = M.parse_result_ref(env)
        except EnvelopeError as exc:
            self._reject(device, env.id, str(exc))
            return
        if a is None or ref.job != a.job_id:
            self._reject(device, env.id, f"unknown job {ref.job!r}")
            return
        coord = a.rounds.get(ref.round)
        if coord is None:
            self._reject(device, env.id, f"no round {ref.round} in job {ref.job}")
            return
        a.round_bytes[ref.round] += nbytes
        open_and_pending = coord.state is RoundState.OPEN and device in pending(coord)
        if env.type == M.DECLINE:
            log.info("device %s declined round %d: %s", device, ref.round, env.body.get("reason", ""))
            if open_and_pending and self.store is not None:
                self.store.add_round_event(a.job_id, ref.round, device, "declined", str(env.body.get("reason", "")))
            self._execute(coord.handle(Declined(device, str(env.body.get("reason", "")))), ref.round)
            return
        try:
            if kind != a.job.kind:
                raise EnvelopeError(f"result kind {kind!r} does not match the job's {a.job.kind!r}")
            payload = a.job.parse_result(env)
        except EnvelopeError as exc:
            a.stats.rejections["invalid payload"] += 1
            log.warning("rejected result from %s: %s", device, exc)
            if open_and_pending and env.id not in coord.seen_ids and self.store is not None:
                self.store.add_round_event(a.job_id, ref.round, device, "rejected", str(exc))
            self._execute(coord.handle(ResultInvalid(device, env.id, str(exc))), ref.round)
            return
        self.crash("result_received")
        self._execute(coord.handle(ResultArrived(device, env.id, _Validated(payload, raw))), ref.round)

    def _on_artifact_get(self, device: str, env: Envelope) -> None:
        try:
            sha = parse_get(env)
        except EnvelopeError as exc:
            self._reject(device, env.id, f"artifact: {exc}")
            return
        found = self.artifacts.get(sha) if self.artifacts is not None else None
        if found is None:
            self._reject(device, env.id, f"artifact: no artifact {sha[:16]} on this aggregator")
            return
        self._send(device, artifact_message(AGGREGATOR_ID, sha, *found))

    def _on_protocol(self, device: str, env: Envelope) -> None:
        """A message of a job's multi-message sub-protocol (secure aggregation)."""
        try:
            sends = self.active.job.on_protocol(device, env, time.monotonic())
        except EnvelopeError as exc:
            self._reject(device, env.id, f"protocol: {exc}")
            return
        for dev, msg in sends:
            self._send(dev, msg)

    def _protocol_tick(self, a: "ActiveJob", now: float) -> None:
        """Phase timers of a job's sub-protocol; once it settles a round, record who is in the sum."""
        for dev, msg in a.job.on_protocol_tick(now):
            self._send(dev, msg)
        coord = a.current
        survivors = a.job.settled(coord.round)
        if survivors is None:
            if not a.job.secure_round_live(coord.round):
                # restored after a restart: the round's secrets died with the old process, so it
                # can never produce a sum; close it now (nothing applied) instead of at its deadline
                log.warning("secure round %d did not survive the restart: closed, nothing applied", coord.round)
                self._execute(coord.handle(Tick(math.inf)), coord.round)
            return
        # Survivors the round machine already counts as lost (offline after sending their masked
        # input: their data IS in the sum) go first, while the others still keep the round open.
        for dev in sorted(survivors, key=lambda d: (d not in coord.lost, d)):
            self._execute(coord.handle(ResultArrived(dev, f"secagg-{coord.round}-{dev}", _Validated(None, b""))),
                          coord.round)
        if a.current is coord:
            self._execute(coord.handle(Tick(math.inf)), coord.round)

    def _reject(self, device: str, message_id: str | None, reason: str) -> None:
        key = reason.split(":")[0]
        (self.active.stats if self.active is not None else self.stats).rejections[key] += 1
        log.warning("rejected message from %s: %s", device, reason)

    # ------------------------------------------------------------------ actions
    def _execute(self, actions: list, round_: int) -> None:
        a = self.active
        for act in actions:
            if isinstance(act, ApplyResult):
                self._apply(a, round_, act)
            elif isinstance(act, SendAck):
                if act.status == "late":
                    a.stats.late += 1
                elif act.status == "duplicate":
                    a.stats.duplicates += 1
                self._send(act.device, M.ack_message(AGGREGATOR_ID, act.ref, act.status, act.reason))
                if act.status == "accepted":
                    self.crash("ack_sent")
            elif isinstance(act, RoundClosed):
                self._close_round(a, act)

    def _apply(self, a: ActiveJob, round_: int, act: ApplyResult) -> None:
        if self.store is not None:
            try:
                self.store.add_contribution(a.job_id, round_, act.device, act.message_id, act.result.raw)
            except StoreError as exc:       # cannot happen while the round machine works; never apply twice
                log.error("not applied: %s", exc)
                return
        self.crash("contribution_stored")
        a.job.apply(act.device, act.result.payload)
        a.stats.results_accepted += 1
        # A job whose model moves only at round close (FedAvg) would evaluate the same model after
        # every contribution; it is evaluated once per round instead (``_close_round``).
        if self.evaluate_every_contribution and not getattr(a.job, "evaluate_at_round_close", False):
            self._record_eval()
            self.crash("evaluation_stored")

    def _close_round(self, a: ActiveJob, act: RoundClosed) -> None:
        self.crash("round_closing")
        a.job.close_round(act)
        closed_at = time.time()
        a.round_log.append(self._round_entry(a, act, a.opened_at.get(act.round), closed_at))
        log.info("round %d closed: %d accepted, %d dropped, %d declined", act.round,
                 len(act.accepted), len(act.dropped), len(act.declined))
        if not self.evaluate_every_contribution or getattr(a.job, "evaluate_at_round_close", False):
            self._record_eval()     # a job whose model moves at round close (FedAvg) is evaluated after it
            self.crash("evaluation_stored")
        if self.store is not None:
            model = a.job.model_arrays() if act.accepted else None
            checkpoint = (a.job.state_dict(), a.job.contributed) if self.checkpoints else None
            self.store.close_round(a.job_id, act.round, a.round_log[-1], model,
                                   a.history[-1] if a.history else {}, a.round_bytes[act.round], a.stats.to_dict(),
                                   checkpoint)
        self.crash("round_closed")
        if a.current is not None and a.current.round == act.round:
            a.current = None
        self._publish_status()

    @staticmethod
    def _round_entry(a: ActiveJob, closed: RoundClosed, opened_at: float | None, closed_at: float | None) -> dict:
        t = (closed_at - a.started_at) if closed_at else None
        return {"round": closed.round, "accepted": list(closed.accepted), "dropped": list(closed.dropped),
                "declined": list(closed.declined), "rejected": list(closed.rejected), "t": t,
                "opened_at": opened_at, "closed_at": closed_at}

    def _send(self, device: str, env: Envelope) -> None:
        self.link.publish_envelope(self.topics.inbox(device), env, chunk_size=self.chunk_size)

    def _record_eval(self) -> None:
        a = self.active
        Z, y = self.eval_set if self.eval_set is not None else (None, None)
        entry = a.job.evaluate(Z, y)
        entry["t"] = time.time() - a.started_at
        entry["bytes_in"] = a.stats.bytes_in
        entry["bytes_out"] = self.link.bytes_sent
        a.history.append(entry)
        if self.store is not None:
            self.store.add_evaluation(a.job_id, entry)
        self._publish_status()

    # ------------------------------------------------------------------ scheduling
    def _tick(self, now: float) -> None:
        a = self.active
        if a is None or a.final_state:
            return
        if a.current is not None and hasattr(a.job, "on_protocol_tick"):
            self._protocol_tick(a, now)
        if a.current is not None:
            coord = a.current
            if a.cancelling or not pending(coord):   # cancelled, or a restored round that had everyone
                self._execute(coord.handle(Tick(math.inf)), coord.round)
            else:
                self._execute(coord.handle(Tick(now)), coord.round)
            return
        if a.cancelling:
            a.final_state = "cancelled"
            return
        if a.state == "paused":
            return
        if not a.started:
            enough = len(self.online) >= max(1, a.job.config.expected_devices)
            if not enough and not (self.online and time.time() - a.waiting_since > a.job.config.start_timeout_s):
                return
            a.started = True
        participants = a.job.next_participants(self.online - self.revoked)
        if not participants:
            if a.job.finished(self.online, self.seen_devices):
                a.final_state = "done"
            return
        self._open_round(a, participants, now)

    def _open_round(self, a: ActiveJob, participants: list[str], now: float) -> None:
        round_ = a.job.round
        deadline_wall = time.time() + a.job.config.round_timeout_s
        tasks = {dev: os.urandom(16).hex() for dev in participants}
        if self.store is not None:
            self.store.open_round(a.job_id, round_, participants, tasks, a.job.bookkeeping(), deadline_wall)
        self.crash("round_opened")
        coord = RoundCoordinator(round_, frozenset(participants), now + a.job.config.round_timeout_s)
        a.rounds[round_] = a.current = coord
        a.tasks[round_], a.deadlines[round_], a.opened_at[round_] = tasks, deadline_wall, time.time()
        for dev in participants:
            self._send_task(a, round_, dev)
        self._publish_status()

    def _send_task(self, a: ActiveJob, round_: int, device: str) -> None:
        params, tensors = a.job.task_for(device)
        msg = M.task_message(AGGREGATOR_ID, a.job_id, round_, a.job.kind, params, a.deadlines[round_])
        msg.id = a.tasks[round_][device]             # the same id on every re-send: devices dedupe by it
        msg.tensors.update(tensors)
        self._send(device, msg)
        self.crash("task_sent")

    def _resend_tasks(self, devices: set[str]) -> None:
        """Re-send the open round's task to those of ``devices`` it still waits for."""
        a = self.active
        if a is None or a.current is None:
            return
        coord = a.current
        for dev in sorted(devices & pending(coord)):
            self._send_task(a, coord.round, dev)

    # ------------------------------------------------------------------ output
    def _update_live(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._live_at < 0.2:
            return
        self._live_at = time.monotonic()
        a = self.active
        snap: dict = {"time": time.time(), "devices_online": sorted(self.online), "revoked": sorted(self.revoked),
                      "last_seen": dict(self.last_seen), "job": None, "stats": self.stats.to_dict()}
        if a is not None:
            coord = a.current
            snap["job"] = {
                "job_id": a.job_id, "kind": a.kind, "state": a.final_state or a.state,
                "round": a.job.round, "contributions": a.job.contributions,
                "accuracy": a.history[-1].get("accuracy") if a.history else None,
                "stats": a.stats.to_dict(),
                "current_round": None if coord is None else {
                    "round": coord.round, "participants": sorted(coord.participants),
                    "accepted": sorted(coord.accepted), "declined": sorted(coord.declined),
                    "rejected": sorted(coord.rejected), "lost": sorted(coord.lost),
                    "pending": sorted(pending(coord)), "opened_at": a.opened_at.get(coord.round),
                    "deadline": a.deadlines.get(coord.round), "bytes_in": a.round_bytes[coord.round]}}
        self.live = snap

    def _publish_status(self, state: str | None = None) -> None:
        a = self.active
        last = a.history[-1] if a.history else {}
        body = {"state": state or a.final_state or a.state, "job": a.job_id, "round": a.job.round,
                "contributions": a.job.contributions, "devices_online": len(self.online),
                "devices_known": len(self.seen_devices), "accuracy": last.get("accuracy"),
                "bytes_in": a.stats.bytes_in}
        env = Envelope(type=M.STATUS, sender=AGGREGATOR_ID, body=body)
        self.link.publish(self.topics.status, encode(env), retain=True)

    def _canonical_job(self, a: ActiveJob) -> Job:
        """The job rebuilt from its stored contributions in device-id order (order-free jobs only)."""
        fresh = build_job(a.kind, a.job.config.to_dict())
        for c in self.store.contributions(a.job_id, canonical=True):
            fresh.apply(c.device, fresh.parse_result(decode(c.payload)))
        return fresh

    def _finish_job(self) -> dict:
        """Write the job's outputs; with a store, commit its final state first (once)."""
        a = self.active
        state = a.final_state or "stopped"
        self.crash("job_finishing")
        if not a.history or a.history[-1]["contributions"] != a.job.contributions:
            self._record_eval()
        final_job, final_eval = a.job, a.history[-1]
        if state in FINAL_JOB_STATES and self.store is not None and getattr(a.job, "order_free", False) \
                and a.kind in JOB_TYPES:
            final_job = self._canonical_job(a)
            Z, y = self.eval_set if self.eval_set is not None else (None, None)
            final_eval = {**final_eval, **final_job.evaluate(Z, y), "round": a.job.round}
        summary = self._summary(a, state, final_eval)
        if self.store is not None:
            row = self.store.job(a.job_id)
            if state in FINAL_JOB_STATES and row["state"] not in FINAL_JOB_STATES:
                compact = {k: v for k, v in summary.items() if k not in ("history", "rounds")}
                self.store.finish_job(a.job_id, state, compact, a.stats.to_dict(), final_job.model_arrays(),
                                      final_eval, a.job.round)
            # an interrupted job (timeout, SIGTERM) stays "running"/"paused" in the store: the next
            # start of the service resumes it, exactly as after a crash
        self.crash("job_finished")
        np.savez(a.out_dir / "model.npz", **final_job.model_arrays())
        np.savez(a.out_dir / "statistics.npz", **final_job.state_dict())
        (a.out_dir / "results.json").write_text(json.dumps(summary, indent=1))
        self._publish_status(state)
        self.last_finished, self.active = a, None
        self._update_live(force=True)
        return summary

    def _summary(self, a: ActiveJob, state: str, final_eval: dict) -> dict:
        return {
            "state": state,
            "job_id": a.job_id,
            "config": a.job.config.to_dict(),
            "contributed": a.job.contributed,
            "rounds": a.round_log,
            "history": a.history,
            "final": final_eval,
            "bytes_in": a.stats.bytes_in,
            "bytes_out": self.link.bytes_sent,
            "results_accepted": a.job.contributions,
            "rejections": dict(a.stats.rejections),
            "late": a.stats.late,
            "duplicates": a.stats.duplicates,
            "wall_s": time.time() - a.started_at,
        }
