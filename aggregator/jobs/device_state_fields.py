"""What a job whose devices keep state between its rounds (``edge_client.state``) tells them.

Partial personalization (``pp.head``), Scaffold (``scaffold.head``) and FedGloSS (``fedgloss.head``)
bind each task's device state to the job's *run*: a random id made when the job is created, kept in its checkpoint and
in each round's bookkeeping, so a restarted aggregator continues the same run (devices continue
their state) while a job created again under the same id starts a new one (devices drop the old
state instead of continuing it). The config says how old a device's state may be before the
device restarts it (``state_max_staleness`` rounds: a device sampled again after many rounds)
and how long a device keeps it after a task (``state_ttl_s``, the job's horizon).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np

from protocols.payloads.stateful import MAX_TTL_S, StateBinding

from aggregator.jobs.base import JobConfig
from aggregator.jobs.config_limits import Range, check_whole_number, limited

RUN_KEY = "device_state_run"


@dataclass
class DeviceStateFields(JobConfig):
    # rounds; older device state is restarted (FedSim: global v; Scaffold: c_k = 0)
    state_max_staleness: int = limited(50, Range(0, 1_000_000))
    # how long a device keeps the job's state after a task
    state_ttl_s: float = limited(7 * 24 * 3600.0, Range(1, 365 * 86400))

    def check_device_state(self) -> None:
        check_whole_number(self, "state_max_staleness", 0)
        if not 0 < self.state_ttl_s <= MAX_TTL_S:
            raise ValueError(f"state_ttl_s must be in (0, {MAX_TTL_S:g}], got {self.state_ttl_s!r}")

    def binding(self, run: str, round_: int) -> StateBinding:
        return StateBinding(run, round_, self.state_max_staleness, float(self.state_ttl_s))


class DeviceStateRun:
    """The job's run id, and how it travels through checkpoints and round bookkeeping."""

    def __init__(self):
        self.run = secrets.token_hex(8)

    def state_dict(self) -> dict[str, np.ndarray]:
        return {RUN_KEY: np.frombuffer(self.run.encode(), dtype=np.uint8).copy()}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        if RUN_KEY in state:
            self.run = bytes(np.asarray(state[RUN_KEY], dtype=np.uint8)).decode()
            StateBinding(self.run, 0)        # a malformed stored run is refused here, not sent to devices

    def bookkeeping(self) -> dict:
        return {RUN_KEY: self.run}

    def restore_bookkeeping(self, state: dict) -> None:
        self.load_state_dict({RUN_KEY: np.frombuffer(str(state.get(RUN_KEY, self.run)).encode(), dtype=np.uint8)})


class StatefulDevicesJob:
    """Mixin, before the job class it extends (``class ScaffoldJob(StatefulDevicesJob, FedAvgJob)``):
    the job's run travels in its checkpoint and its round bookkeeping beside the job's own state.
    The job sets ``self.device_state = DeviceStateRun()`` when it is built."""

    device_state: DeviceStateRun

    def participation(self, count: int) -> float:
        """|S|/K of ``count`` devices in a round's step (Scaffold's c, FedGloSS's σ): K the fleet's size,
        the config's ``total_devices``, or when 0 the devices that contributed so far (a lower bound
        that grows as the job meets its fleet), never below ``count``."""
        return count / max(self.config.total_devices, len(self.contributed), count)

    def state_dict(self) -> dict[str, np.ndarray]:
        return {**super().state_dict(), **self.device_state.state_dict()}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        super().load_state_dict(state)
        self.device_state.load_state_dict(state)

    def bookkeeping(self) -> dict:
        return {**super().bookkeeping(), **self.device_state.bookkeeping()}

    def restore_bookkeeping(self, state: dict) -> None:
        super().restore_bookkeeping(state)
        self.device_state.restore_bookkeeping(state)
