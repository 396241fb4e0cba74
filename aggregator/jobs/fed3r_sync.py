"""Fed3R-Sync: Fed3R whose statistics reach the aggregator only as secure group sums.

Each round is one group of κ devices (``clients_per_round``). The devices compute their dense
statistics, pack them into the fixed-shape vector of ``protocols.payloads.secagg`` and run
SecAgg (or SecAgg+) with the aggregator, which learns only the group sum: it adds that sum to
the Fed3R strategy exactly as it would add one device's statistics, so after ⌈K/κ⌉ groups the
classifier is the centralized ridge solution over the surviving devices (up to the fixed-point
resolution 2^-f). Devices that drop out mid-round are recovered from Shamir shares when at least
t survive; otherwise the round fails and *nothing* is applied (the group can be retried).

The job speaks the SecAgg sub-protocol through two hooks the service calls: ``on_protocol``
(a ``secagg`` envelope from a device) and ``on_protocol_tick`` (phase timers); both return
``(device, envelope)`` pairs to publish. When a group's sum is in, ``settled(round)`` tells the
service which devices' data it contains, so the round machine records them as accepted.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from protocols.envelope import Envelope, EnvelopeError
from protocols.identity import DeviceIdentity, IdentityRegistry
from protocols.payloads.secagg import SYNC_KIND, from_envelope, sync_vector_length, to_envelope, unpack_sync_vector
from protocols.rounds import RoundClosed
from protocols.secagg import AggregateReady, Message, RoundConfig, RoundFailed, SecAggError, ServerSecAgg, Timeout
from protocols.secagg.fixedpoint import fed3r_bound
from protocols.topics import AGGREGATOR_ID

from .fed3r import Fed3RConfig, Fed3RJob

log = logging.getLogger("fedfleet.aggregator.secagg")
MIN_GROUP = 3


@dataclass
class Fed3RSyncConfig(Fed3RConfig):
    graph: str = "complete"                 # "complete" (SecAgg) or "regular" (SecAgg+)
    max_samples: int = 10_000               # per device; with the feature bound it fixes B and f
    max_abs_feature: float = 6.0            # ReLU6 features of MobileNetV2 / EfficientNet-Lite
    phase_timeout_s: float = 30.0
    identity_file: str = ""                 # aggregator's Ed25519 private key (PEM)
    device_keys_file: str = ""              # JSON {device id: Ed25519 public key, hex}

    def task_params(self) -> dict:
        return {**super().task_params(), "format": "dense", "dtype": "float64", "max_samples": self.max_samples}


class Fed3RSyncJob(Fed3RJob):
    kind = SYNC_KIND
    order_free = False    # group sums, not per-device statistics, are what the aggregator holds

    def __init__(self, config: Fed3RSyncConfig, identity: DeviceIdentity | None = None,
                 registry: IdentityRegistry | None = None):
        super().__init__(config)
        self.kind = SYNC_KIND       # Fed3RJob's dataclass field would otherwise say fed3r.stats
        self.identity = identity or DeviceIdentity.from_pem(AGGREGATOR_ID, Path(config.identity_file).read_bytes())
        if registry is None:
            keys = json.loads(Path(config.device_keys_file).read_text())
            registry = IdentityRegistry({d: bytes.fromhex(k) for d, k in keys.items()})
        self.registry = registry
        rf = config.random_features
        feature_bound = (np.sqrt(2.0 / rf["dim"]) if rf else config.max_abs_feature)
        self.bound = fed3r_bound(config.max_samples, max(feature_bound, 1.0))   # ≥ 1: the bias feature
        self.vector_length = sync_vector_length(config.p, config.num_classes)
        self.secure: ServerSecAgg | None = None
        self._start_pending = False
        self._phase_at = 0.0
        self._settled: dict[int, tuple[str, ...]] = {}
        self.failed_rounds: list[tuple[int, str]] = []
        self.group_samples: list[int] = []

    @property
    def contributions(self) -> int:
        return len(self.contributed)

    def next_participants(self, online: set[str]) -> list[str]:
        pool = [d for d in self.eligible(online) if d in self.registry]   # no key, no secure round
        if len(pool) < MIN_GROUP:
            return []        # too few left to hide anyone's statistics in a sum
        chosen = super().next_participants(set(pool))
        group = f"g{self.round}"
        config = RoundConfig.create(job_id=self.config.job_id, round_id=self.round, group_id=group,
                                    aggregator_id=AGGREGATOR_ID, members=chosen, vector_length=self.vector_length,
                                    bound=self.bound, graph=self.config.graph)
        self.secure = ServerSecAgg(config, self.identity, self.registry)
        self._start_pending = True
        return chosen

    def finished(self, online: set[str], known: set[str]) -> bool:
        return len(self.eligible(known | online)) < MIN_GROUP

    def task_for(self, device: str) -> tuple[dict, dict[str, np.ndarray]]:
        return {**self.config.task_params(), "group": f"g{self.round}"}, {}

    def parse_result(self, env: Envelope):
        raise EnvelopeError("fed3r.secure devices send secagg messages, never plain results")

    # ---------------------------------------------------------------- the SecAgg sub-protocol
    def on_protocol_tick(self, now: float) -> list[tuple[str, Envelope]]:
        if self.secure is None:
            return []
        if self._start_pending:          # tasks went out when the round opened; now the keys phase
            self._start_pending, self._phase_at = False, now
            return self._route(self.secure.start())
        if now - self._phase_at > self.config.phase_timeout_s and self.secure.phase is not None:
            self._phase_at = now
            return self._route(self.secure.handle(Timeout(self.secure.phase)))
        return []

    def on_protocol(self, device: str, env: Envelope, now: float) -> list[tuple[str, Envelope]]:
        msg = from_envelope(env)
        if msg.sender != device:
            raise EnvelopeError(f"secagg message from {device!r} claims sender {msg.sender!r}")
        if self.secure is None or msg.round_id != self.secure.config.round_id:
            raise EnvelopeError(f"no secure round {msg.round_id} open")
        before = self.secure.phase
        try:
            out = self.secure.handle(msg)
        except SecAggError as exc:
            raise EnvelopeError(f"secagg: {type(exc).__name__}: {exc}") from exc
        if self.secure is not None and self.secure.phase != before:
            self._phase_at = now
        return self._route(out)

    def _route(self, outputs) -> list[tuple[str, Envelope]]:
        sends = []
        for o in outputs:
            if isinstance(o, Message):
                sends.append((o.recipient, to_envelope(o)))
            elif isinstance(o, AggregateReady):
                a_upper, b, n = unpack_sync_vector(o.decode(), self.config.p, self.config.num_classes)
                self.strategy.add_dense(a_upper, b, n)
                self.group_samples.append(n)
                # Who is in the sum is decided here, by the protocol, not by the round machine's view
                # of presence: a device may go offline right after sending its masked input.
                for d in o.survivors:
                    self.contributed[d] = 0
                self._settled[self.secure.config.round_id] = tuple(sorted(o.survivors))
                log.info("secure round %d: sum of %d devices (%d samples)", self.secure.config.round_id,
                         len(o.survivors), n)
                self.secure = None
            elif isinstance(o, RoundFailed):
                round_id = self.secure.config.round_id
                self.failed_rounds.append((round_id, str(o.reason)))
                self._settled[round_id] = ()
                log.warning("secure round %d failed: %s (nothing applied)", round_id, o.reason)
                self.secure = None
        return sends

    def settled(self, round_: int) -> tuple[str, ...] | None:
        """Devices whose data the round's sum holds (empty: failed), once; None while running."""
        return self._settled.pop(round_, None)

    def apply(self, device: str, payload) -> None:
        """Nothing to do: the group sum and its members were recorded when it was unmasked."""

    def close_round(self, closed: RoundClosed) -> None:
        if self.secure is not None and self.secure.config.round_id == closed.round:
            log.warning("secure round %d hit its deadline: aborted, nothing applied", closed.round)
            self.failed_rounds.append((closed.round, "deadline"))
            self.secure = None
