"""Jobs: what to ask which devices, and what to do with their answers.

A job is pure logic (no MQTT, no clock); ``aggregator.service.loop`` drives any job through the
round protocol. One module per kind of job; each wraps a strategy from ``aggregator.strategies``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from protocols.envelope import Envelope
from protocols.rounds import RoundClosed


class JobConfig(Protocol):
    job_id: str
    round_timeout_s: float
    expected_devices: int
    start_timeout_s: float

    def to_dict(self) -> dict: ...


class Job(Protocol):
    config: JobConfig
    kind: str                       # the task/result kind, e.g. "fed3r.stats"
    round: int                      # the last round opened
    contributed: dict[str, Any]     # device -> what it contributed (for reports)

    @property
    def contributions(self) -> int: ...
    def next_participants(self, online: set[str]) -> list[str]: ...      # opens a round (or [] )
    def task_for(self, device: str) -> tuple[dict, dict[str, np.ndarray]]: ...
    def parse_result(self, env: Envelope) -> Any: ...                     # raises EnvelopeError
    def apply(self, device: str, payload: Any) -> None: ...
    def close_round(self, closed: RoundClosed) -> None: ...
    def finished(self, online: set[str], known: set[str]) -> bool: ...
    def evaluate(self, features: np.ndarray | None, labels: np.ndarray | None) -> dict: ...
    def model_arrays(self) -> dict[str, np.ndarray]: ...
    def state_dict(self) -> dict[str, np.ndarray]: ...
    def load_state_dict(self, state: dict[str, np.ndarray]) -> None: ...  # restart from a checkpoint
    def bookkeeping(self) -> dict: ...                                    # JSON-able scheduling state
    def restore_bookkeeping(self, state: dict) -> None: ...
    # optional class attribute ``order_free = True``: the final model depends only on the set of
    # contributions, so the service re-sums them in a canonical order (bit-identical across runs)
    # a job that is also a ``SplitValidation`` gets its large results validated in parallel ingest
    # workers (aggregator/service/ingest.py)
    # optional class attribute ``evaluate_at_round_close = True``: the model changes when a round
    # closes (FedAvg), so it is evaluated then, not only after each contribution
    # optional class attribute ``asynchronous = True``: no rounds; the service drives it with
    # ``aggregator.service.async_runner.AsyncJobRunner`` (next_dispatches / open_dispatch, one-device rounds)


@runtime_checkable
class SplitValidation(Protocol):
    """A job whose validation splits in two: what the message alone decides (run on a copy of the
    job in an ingest worker, or at acceptance) and what needs the job's state (on the service
    thread). Stored bytes passed the first half once and are re-read with ``parse_accepted``."""

    def check_payload(self, env: Envelope) -> Any: ...       # every check on the message alone
    def parse_accepted(self, env: Envelope) -> Any: ...      # parse_result minus check_payload's costly checks
