"""FedAvg(ψ) without rounds: FedBuff's asynchronous buffered aggregation of head updates.

Pure logic, driven by :class:`aggregator.service.async_runner.AsyncJobRunner`. There are no rounds to
wait for: every idle online device (up to ``clients_per_round`` at once: FedBuff's concurrency)
is given a *dispatch*, the head of the current model version to train (``fedavg.head`` task,
``model_version`` in its params); a device that finishes is given a new dispatch with the then
current model at its next tick. Each dispatch is a round of one device to the round machinery,
so the store, the acks, retries, deadlines and the restart replay are the synchronous jobs' own.

The device echoes ``model_version`` in its result; ``parse_result`` refuses a result whose
version is not the one this job dispatched for that round (the server's record decides the
base model, never the device's claim). ``apply`` hands the trained head to
:class:`~aggregator.strategies.fedbuff.FedBuff`, which steps every ``buffer_size`` arrivals
with weight 1/√(1+staleness) and drops (counts) updates older than ``max_staleness``; each step
bounds its updates' influence with FedAvg(ψ)'s layers and defaults (norm and contribution
bounds, direction screen, rule, history momentum; ``PLAIN_MEAN`` turns them off).

Durability: the job's whole state (kept model versions, the open buffer, outstanding
dispatches, and the applied dispatches a replay could meet again) is checkpointed at every
dispatch's close, so a restart resumes the very buffer it had. Dispatches close out of order, so
the checkpoint names a floor (every round up to it closed and in the state), not the round that
closed: the restart replays the rounds above the floor, and ``apply`` of a dispatch already in the
checkpoint is a no-op, which makes that replay idempotent. The job is done after ``rounds``
server steps.
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from dataclasses import dataclass

import numpy as np

from protocols.envelope import Envelope, EnvelopeError, body_field
from protocols.payloads.fedavg import HeadTrainingParams
from protocols.rounds import RoundClosed

from aggregator.strategies.fedbuff import FedBuff
from aggregator.jobs.base import AsynchronousJob
from aggregator.jobs.config_limits import Range, limited
from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob, RoundUpdate
from aggregator.jobs.participant_draw import draw_state, restored_draw

log = logging.getLogger("fedfleet.aggregator")


@dataclass
class AsyncFedAvgConfig(FedAvgConfig):
    """FedAvg's fields, where ``rounds`` counts server steps (model versions), ``clients_per_round``
    is the concurrency (devices training at any moment) and ``round_timeout_s`` applies per
    dispatch (a device silent this long is given up)."""

    job_id: str = "fedavg-async"
    buffer_size: int = limited(4, Range(1, 100_000))        # K: updates per server step
    max_staleness: int = limited(8, Range(0, 10_000))       # older updates are acknowledged, counted, not applied
    staleness_exponent: float = limited(0.5, Range(0, 10))  # s(τ) = (1+τ)^-a; 0.5: FedBuff's 1/√(1+τ)

    def __post_init__(self):
        super().__post_init__()
        if self.dp:     # its steps take the raw buffered updates: DP-FedAvg's clip and noise never run
            raise ValueError("fedavg-async has no DP mechanism (FedBuff steps on the raw buffered updates): "
                             "no dp with fedavg-async")
        if self.server_momentum:
            raise ValueError("fedavg-async has no server momentum (FedBuff steps with server_lr only)")
        if self.server_optimizer != "sgd" or self.served_model != "last":
            raise ValueError("fedavg-async steps with FedBuff's server_lr only and serves its last model "
                             "(server_optimizer must be 'sgd', served_model 'last')")
        if self.buffer_size < 1 or self.max_staleness < 0:
            raise ValueError("buffer_size must be >= 1 and max_staleness >= 0")
        rule = self.robust_aggregation().rule          # a step combines buffer_size updates, not κ
        if self.buffer_size < rule.min_updates():
            raise ValueError(f"aggregator {self.aggregator!r} needs buffer_size >= {rule.min_updates()}, "
                             f"got {self.buffer_size}")


@dataclass(frozen=True)
class VersionedUpdate:
    round: int          # the dispatch
    version: int        # the model version it was dispatched with (checked against the job's record)
    update: object      # HeadUpdate


class AsyncFedAvgJob(AsynchronousJob, FedAvgJob):
    """Served by AsyncJobRunner: many one-device rounds open at once (``evaluate_at_round_close``,
    FedAvg's: the runner evaluates when the version moved)."""

    def __post_init__(self):
        super().__post_init__()
        c = self.config
        # FedAvg(ψ)'s bounded influence, composed: a step's K buffered updates go through the layers a
        # synchronous round's go through, with the same defaults (AsyncFedAvgConfig inherits them)
        self.buffer = FedBuff(self.params, c.buffer_size, c.server_lr, c.max_staleness, c.staleness_exponent,
                              aggregation=c.robust_aggregation(), history=c.round_history(),
                              small_rounds=self.small_rounds)
        self.dispatches: dict[int, tuple[str, int]] = {}   # dispatch round not yet closed -> (device, version)
        # devices whose update waits in the open buffer: none is asked again before the buffer steps,
        # so one device (answering at once, every time) cannot fill the buffer and set its medians
        self.in_buffer: set[str] = set()
        self._applied: set[int] = set()       # applied dispatch rounds a checkpoint replay could meet again
        self.replay_floor = 0

    @property
    def version(self) -> int:
        return self.buffer.version

    # ------------------------------------------------------------------ scheduling
    def next_dispatches(self, idle: set[str]) -> list[str]:
        """Devices to give a task now: seeded draw from the idle ones, up to the free concurrency."""
        free = self.config.clients_per_round - len(self.dispatches)
        pool = sorted(idle - {device for device, _ in self.dispatches.values()} - self.in_buffer)
        if free <= 0 or not pool or self.finished(set(), set()):
            return []
        return sorted(self._rng.sample(pool, min(free, len(pool))))

    def open_dispatch(self, device: str) -> int:
        """A new one-device round for ``device`` with the current version; its round number."""
        self.round += 1
        self.dispatches[self.round] = (device, self.version)
        return self.round

    def keep_dispatches(self, open_rounds: dict[int, str]) -> None:
        """After a restart: exactly the dispatches whose rounds are still open (round -> device)."""
        versions = {r: v for r, (_, v) in self.dispatches.items()}
        self.dispatches = {r: (device, versions[r]) for r, device in open_rounds.items() if r in versions}

    def hopeless(self, round_: int) -> bool:
        """The dispatch's model is too old to be applied: no use waiting for it."""
        return round_ in self.dispatches and self.version - self.dispatches[round_][1] > self.config.max_staleness

    def finished(self, online: set[str], known: set[str]) -> bool:
        return self.version >= self.config.rounds

    def task_params(self, device: str) -> HeadTrainingParams:
        round_, version = next((r, v) for r, (d, v) in self.dispatches.items() if d == device)
        seed = zlib.crc32(f"{self.config.seed}:{round_}:{device}".encode())
        return dataclasses.replace(self.config.device_params(seed), model_version=version)

    def task_for(self, device: str) -> tuple[dict, dict[str, np.ndarray]]:
        params = self.task_params(device)
        return params.to_params(), {k: np.array(v) for k, v in self.buffer.model_for(params.model_version).items()}

    # ------------------------------------------------------------------ results
    def parse_result(self, env: Envelope) -> VersionedUpdate:
        plain: RoundUpdate = super().parse_result(env)
        version = body_field(env, "model_version", int)
        dispatched = self.dispatches.get(plain.round)
        if dispatched is not None and dispatched[1] != version:
            raise EnvelopeError(f"result names model version {version}, round {plain.round} "
                                f"was dispatched with version {dispatched[1]}")
        return VersionedUpdate(plain.round, version, plain.update)

    def apply(self, device: str, payload: VersionedUpdate) -> None:
        if payload.round in self._applied:
            return                      # already in the checkpointed state (restart replay)
        # the dispatch stays until its round closes (close_round): an answered round still open, as
        # a replayed one is until the next tick, must hold the replay floor below it
        dispatched = self.dispatches.get(payload.round)
        if dispatched is None or dispatched[0] != device:
            self.late_discarded += 1    # the round machine answers these before they get here
            return
        outcome = self.buffer.add(payload.update.tensors(), dispatched[1], device)
        if outcome == "stepped":
            self.in_buffer = set()          # a new buffer: every device may be asked again
        elif outcome == "buffered":
            self.in_buffer.add(device)
        self._applied.add(payload.round)
        if outcome != "stale":
            self.contributed[device] = self.contributed.get(device, 0) + 1
            self.samples += payload.update.n
        self.params = dict(self.buffer.params)

    def close_round(self, closed: RoundClosed) -> None:
        # This close's checkpoint (and every later one) is taken at a round >= floor: applied
        # dispatches above it must stay marked, those below can never be replayed again.
        # Every round up to the floor is closed and, if answered, in the state: a restart replays the
        # rounds above it (the checkpoint says so), skipping the applied ones marked here. The
        # floor never falls below an unmarked round because self.dispatches holds every round not
        # yet closed, answered ones included (were an answered round left out, a later close could
        # set the floor below it after its mark was dropped: the next restart applied it twice).
        self.replay_floor = min([*self.dispatches, closed.round]) - 1
        self.dispatches.pop(closed.round, None)          # answered or not: the device is free again
        self._applied = {r for r in self._applied if r > self.replay_floor}

    # ------------------------------------------------------------------ model and state
    def evaluate(self, features: np.ndarray | None, labels: np.ndarray | None) -> dict:
        out = super().evaluate(features, labels)
        out.update(version=self.version, server_steps=self.version, stale_dropped=self.buffer.stale_dropped,
                   buffered=self.buffer.buffered, in_flight=len(self.dispatches))
        return out

    def state_dict(self) -> dict[str, np.ndarray]:
        rounds = sorted(self.dispatches)
        return {**self.buffer.state_dict(), "round": np.array([self.round], dtype=np.int64),
                "samples": np.array([self.samples], dtype=np.int64),
                "dispatch.rounds": np.array(rounds, dtype=np.int64),
                "dispatch.versions": np.array([self.dispatches[r][1] for r in rounds], dtype=np.int64),
                "applied": np.array(sorted(self._applied), dtype=np.int64)}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        self.buffer.load_state_dict(state)
        self.params = dict(self.buffer.params)
        # the open buffer's devices, as ``apply`` marked them: a replay skips the dispatches already
        # in the checkpoint, so without this a restart let a device with an update in the buffer be
        # asked again and fill a second slot of it (a review's finding)
        self.in_buffer = self.buffer.buffered_devices()
        self.round, self.samples = int(state["round"][0]), int(state["samples"][0])
        # devices are filled in by keep_dispatches (the open rounds' participants)
        self.dispatches = {int(r): ("", int(v)) for r, v in zip(state["dispatch.rounds"], state["dispatch.versions"])}
        self._applied = {int(r) for r in state["applied"]}

    def bookkeeping(self) -> dict:
        """Stored with each dispatch: which device got which version, and the sampler."""
        device, model_version = self.dispatches[self.round]
        return {"round": self.round, "device": device, "version": model_version,
                "rng": draw_state(self._rng)}

    def restore_bookkeeping(self, state: dict) -> None:
        self._rng = restored_draw(state["rng"])
        r = int(state["round"])
        self.round = max(self.round, r)
        if r not in self._applied:      # (a checkpoint's dispatches come without their device: named here)
            self.dispatches[r] = (state["device"], int(state["version"]))
