"""The job contract: what every job kind is to the service, and the config fields every kind has.

A job is pure logic (no MQTT, no clock); ``aggregator.service`` drives any :class:`Job` through
the round protocol. Everything the service may call is named here: the required methods as
abstract ones (a kind that misses one cannot be instantiated), and every optional behaviour as a
capability declared with its default, which a kind overrides where it differs. The service asks
a job what it is (``job.order_free``, ``job.secure_rounds``, ...); it never probes for methods.

Capabilities that come with methods of their own are interfaces that set their flag:
:class:`SplitValidation` (``split_validation``), :class:`AsynchronousJob` (``asynchronous``) and
``aggregator.jobs.secure_rounds.SecureGroupRounds`` (``secure_rounds``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from protocols.device_inbox import TensorShape
from protocols.envelope import Envelope
from protocols.rounds import RoundClosed

from aggregator.jobs.config_limits import COUNT, JOB_ID, SEED, TIMEOUT_S, Range, limited


@dataclass
class JobConfig:
    """The fields every job kind's config has; a kind's config adds its own and overrides the
    defaults that differ (JSON field names are the storage and API format of configs:
    each declares its limit, ``aggregator/jobs/config_limits.py``). Field groups (``ModelFields``,
    ``SecureAggregationFields``, ...) are subclasses too. A config derived from another kind's
    lists that config *before* the groups it adds (``SecureFedAvgConfig(FedAvgConfig,
    SecureUpdateFields)``): a dataclass takes each field from the first class in its MRO that has
    it, and a group carries this class's defaults, which would hide the other kind's overrides."""

    job_id: str = limited("job", JOB_ID)
    clients_per_round: int = limited(10, Range(1, 1_000_000))  # κ: devices per round (an asynchronous job: at once)
    round_timeout_s: float = limited(120.0, TIMEOUT_S)         # stragglers past this are dropped from the round
    expected_devices: int = limited(0, COUNT)       # start once this many devices are online (0: the first one)...
    start_timeout_s: float = limited(60.0, Range(0, 7 * 86400))  # ...or after this long with whoever is there
    seed: int = limited(0, SEED)                    # fixes the participation schedule

    def __post_init__(self):
        """Checks of the fields; every config's ``__post_init__`` calls its bases' first."""

    def check_stored(self) -> None:
        """Checks of a config that is all the job will have (created through the API or the admin
        command, kept in the store, built at start with nothing beside it); Python can hand a job
        more (``FedAvgJob.from_fed3r``: its initial head as an object). ``ValueError`` when it lacks it."""

    def device_bundle_sha256(self) -> str:
        """The exported bundle the devices must run (its manifest's sha256), "" when the job names none."""
        return ""

    def task_tensors(self) -> dict[str, TensorShape]:
        """The tensors the largest task this job sends carries, as (wire dtype, shape), from the config
        alone: what ``aggregator/jobs/task_size.py`` holds to the devices' inbox bound before the job
        is stored or built. None by default; a kind whose tasks carry tensors declares them."""
        return {}

    def task_size_remedy(self) -> str:
        """What makes this kind's task smaller, said when it is refused as too large."""
        return ""

    def to_dict(self) -> dict:
        """The config as JSON-able fields (what the store keeps and ``spec.config_cls(**d)`` rebuilds)."""
        return asdict(self)


class Job(ABC):
    # What the service reads of every job (set by the constructor):
    config: JobConfig
    kind: str                       # the kind of the task/result of the round opened last, e.g. "fed3r.stats"
    round: int                      # the last round opened
    contributed: dict[str, Any]     # device -> what it contributed (for reports; checkpointed)

    # Capabilities: class constants, or properties where the config decides (DP Fed3R).
    order_free: bool = False
    """The final model depends only on the set of contributions: the service re-sums them in a
    canonical order, bit-identical across runs (``aggregator/service/canonical.py``)."""
    evaluate_at_round_close: bool = False
    """The model moves only when a round closes (FedAvg): evaluated then, not after each contribution."""
    asynchronous: bool = False
    """No rounds to wait for: served by ``AsyncJobRunner`` (an :class:`AsynchronousJob`)."""
    secure_rounds: bool = False
    """Each round is one SecAgg group (a ``SecureGroupRounds``): the service relays its protocol."""
    split_validation: bool = False
    """Large results are validated in parallel ingest workers (a :class:`SplitValidation`)."""
    canonical_round_sums: bool = False
    """Each round's sum is released (noised) at its close (DP Fed3R): the service sums the round's
    stored contributions up the canonical bucket tree and hands the root to :meth:`take_round_sum`
    first (``aggregator/service/canonical.py``), so the release does not depend on arrival order."""
    model_held: bool = False
    """What the model is made of is held until the job ends (DP Fed3R with ``dp_release`` "end"):
    there is no model to store, deploy or write before :meth:`finalize` releases it."""

    waiting: str | None = None
    """Why :meth:`next_participants` opens no round although devices are online (a DP pool too small
    to sample from), shown in the service's status; None otherwise."""

    def take_round_sum(self, state: dict[str, np.ndarray] | None) -> None:
        """The closing round's contributions summed canonically (``canonical_round_sums`` jobs only)."""
        raise TypeError(f"{type(self).__name__} does not take canonical round sums")

    def expect_round_sums(self) -> None:
        """Every round's sum will be handed to :meth:`take_round_sum` (a service with a store): the
        job need not sum its contributions as they arrive (``canonical_round_sums`` jobs only)."""
        raise TypeError(f"{type(self).__name__} does not take canonical round sums")

    @property
    @abstractmethod
    def contributions(self) -> int:
        """How many contributions the model holds."""

    @abstractmethod
    def next_participants(self, online: set[str]) -> list[str]:
        """Open the next round with some of ``online`` (and return them), or return [] for none now."""

    @abstractmethod
    def task_for(self, device: str) -> tuple[dict, dict[str, np.ndarray]]:
        """(params, tensors) of the open round's task for ``device``."""

    @abstractmethod
    def parse_result(self, env: Envelope) -> Any:
        """The validated payload of a result; raises ``EnvelopeError`` for an invalid one."""

    def parse_accepted(self, env: Envelope) -> Any:
        """A result whose bytes were validated before (stored, or by an ingest worker): by default
        parsed again in full; a :class:`SplitValidation` skips the checks already made."""
        return self.parse_result(env)

    @abstractmethod
    def apply(self, device: str, payload: Any) -> None:
        """Add a validated result of the open round to the model."""

    @abstractmethod
    def close_round(self, closed: RoundClosed) -> None:
        """The round ended (everyone answered, or its deadline passed)."""

    @abstractmethod
    def finished(self, online: set[str], known: set[str]) -> bool:
        """Done: no round will be opened again (``known``: devices that may still come back)."""

    @abstractmethod
    def evaluate(self, features: np.ndarray | None, labels: np.ndarray | None) -> dict:
        """Metrics of the current model (accuracy on the evaluation set when one is given)."""

    @abstractmethod
    def model_arrays(self) -> dict[str, np.ndarray]:
        """The model the job reports (model.npz)."""

    @abstractmethod
    def state_dict(self) -> dict[str, np.ndarray]:
        """Everything a restart needs besides ``contributed`` and the bookkeeping (a checkpoint).
        Entries named ``UNPUBLISHED_PREFIX``... (``aggregator/compute/privacy.py``) are checkpointed,
        never written to the job's files."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Back to a checkpoint of :meth:`state_dict` (a restart)."""

    def finalize(self) -> bool:
        """The job ends with a model to report: its last change to that model, made once, before the
        model is evaluated and committed (DP Fed3R with ``dp_release`` "end" releases its held sums
        here). Returns whether the model changed. Nothing by default."""
        return False

    def screened_devices(self) -> dict[str, str]:
        """Devices the job's fleet screen named at the round close just made (device -> why): the
        service quarantines their contributions and rebuilds the job without them (plaintext Fed3R,
        ``aggregator/strategies/robust_fed3r.py``). None by default."""
        return {}

    @abstractmethod
    def bookkeeping(self) -> dict:
        """JSON-able scheduling state as of the round just opened (stored with the round)."""

    @abstractmethod
    def restore_bookkeeping(self, state: dict) -> None:
        """Back to the scheduling state of :meth:`bookkeeping` (a restart)."""


class SplitValidation(Job):
    """A job whose validation splits in two: what the message alone decides (run on a copy of the
    job in an ingest worker, ``aggregator/service/ingest.py``, or at acceptance) and what needs the
    job's state (on the service thread). Stored bytes passed the first half once and are re-read
    with ``parse_accepted``."""

    split_validation = True

    @abstractmethod
    def check_payload(self, env: Envelope) -> Any:
        """Every check on the message alone, none on the job's state."""

    @abstractmethod
    def parse_accepted(self, env: Envelope) -> Any:
        """``parse_result`` minus ``check_payload``'s costly checks (the checks on the job's state stay)."""


class AsynchronousJob(Job):
    """A job without rounds (FedBuff): ``aggregator.service.async_runner.AsyncJobRunner`` gives each
    idle device a *dispatch*, a round of one device, and many are open at once."""

    asynchronous = True
    replay_floor: int = 0           # rounds <= this are closed and in the checkpointed state

    def next_participants(self, online: set[str]) -> list[str]:
        raise TypeError(f"{type(self).__name__} has no rounds: AsyncJobRunner asks next_dispatches")

    @property
    @abstractmethod
    def version(self) -> int:
        """The model version (server steps taken): evaluated again only when it moved."""

    @abstractmethod
    def next_dispatches(self, idle: set[str]) -> list[str]:
        """Devices to give a task now (of the idle online ones)."""

    @abstractmethod
    def open_dispatch(self, device: str) -> int:
        """A new one-device round for ``device``; its round number."""

    @abstractmethod
    def keep_dispatches(self, open_rounds: dict[int, str]) -> None:
        """After a restart: exactly the dispatches whose rounds are still open (round -> device)."""

    @abstractmethod
    def hopeless(self, round_: int) -> bool:
        """The dispatch can no longer be applied: no use waiting for it."""
