"""Secure FedAvg(ψ)/FedAvgM(ψ): each round's head updates reach the aggregator only as one sum.

Each round is one SecAgg (or SecAgg+) group of the κ sampled devices (``SecureGroupRounds``).
A device trains the head as in plain FedAvg and contributes ``[n_k·W_k | n_k·b_k | n_k]``; the
unmasked group sum gives Σ n_k θ_k and Σ n_k, hence exactly the FedAvg mean over the survivors
(up to the fixed-point resolution 2^-f), and the server step is the plain job's. Devices that
drop out mid-round are recovered when at least t survive; a failed round (too few survivors,
or the deadline) leaves the head and the server momentum untouched, as an empty plain round does.

Bound: every entry of a device's vector is at most ``max_samples × max(max_abs_param, 1)`` in
magnitude; devices whose trained head exceeds ``max_abs_param`` decline (the fixed-point range
is part of the signed round configuration, so nothing can overflow silently).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protocols.envelope import Envelope, EnvelopeError
from protocols.identity import DeviceIdentity, IdentityRegistry
from protocols.payloads.secagg import SECURE_FEDAVG_KIND, unpack_weighted_head_sum, weighted_head_length
from protocols.rounds import RoundClosed

from .fedavg import FedAvgConfig, FedAvgJob
from .secure_rounds import MIN_GROUP, SecureGroupRounds, load_identities


@dataclass
class SecureFedAvgConfig(FedAvgConfig):
    graph: str = "complete"                 # "complete" (SecAgg) or "regular" (SecAgg+)
    max_samples: int = 10_000               # per device
    max_abs_param: float = 100.0            # per head entry, after local training
    phase_timeout_s: float = 30.0
    identity_file: str = ""                 # aggregator's Ed25519 private key (PEM)
    device_keys_file: str = ""              # JSON {device id: Ed25519 public key, hex}


class SecureFedAvgJob(SecureGroupRounds, FedAvgJob):
    def __init__(self, config: SecureFedAvgConfig, initial_head: dict[str, np.ndarray] | None = None,
                 identity: DeviceIdentity | None = None, registry: IdentityRegistry | None = None):
        FedAvgJob.__init__(self, config, initial_head=initial_head)
        self.kind = SECURE_FEDAVG_KIND
        if identity is None or registry is None:
            loaded_identity, loaded_registry = load_identities(config.identity_file, config.device_keys_file)
            identity, registry = identity or loaded_identity, registry or loaded_registry
        self._init_secure(identity, registry)
        self.vector_length = weighted_head_length(config.num_classes, config.feature_dim)
        self.bound = float(config.max_samples) * max(float(config.max_abs_param), 1.0)
        self._sum: tuple[dict[str, np.ndarray], int, int] | None = None     # (mean, updates, Σ n) of the round

    def next_participants(self, online: set[str]) -> list[str]:
        pool = {d for d in online if d in self.registry}     # no key, no secure round
        if len(pool) < MIN_GROUP:
            return []        # too few to hide anyone's update in a sum
        chosen = super().next_participants(pool)
        if chosen:
            self._sum = None
            self.open_secure_round(self.round, chosen, self.vector_length, self.bound)
        return chosen

    def task_for(self, device: str) -> tuple[dict, dict[str, np.ndarray]]:
        params, head = super().task_for(device)
        c = self.config
        return {**params, "group": f"g{self.round}", "max_samples": c.max_samples,
                "max_abs_param": c.max_abs_param}, head

    def parse_result(self, env: Envelope):
        raise EnvelopeError("fedavg.secure devices send secagg messages, never plain results")

    def apply(self, device: str, payload) -> None:
        """Nothing to do: the round's sum and its members were recorded when it was unmasked."""

    def on_secure_sum(self, total: np.ndarray, survivors: tuple[str, ...]) -> None:
        c = self.config
        weighted_w, weighted_b, n = unpack_weighted_head_sum(total, c.num_classes, c.feature_dim)
        if n < 1:
            return
        self._sum = ({"weight": weighted_w / n, "bias": weighted_b / n}, len(survivors), n)
        self.samples += n
        for d in survivors:
            self.contributed[d] = self.contributed.get(d, 0) + 1

    def round_mean(self) -> tuple[dict[str, np.ndarray] | None, int, int]:
        return self._sum if self._sum is not None else (None, 0, 0)

    def close_round(self, closed: RoundClosed) -> None:
        self.abort_secure_round(closed.round, "deadline")
        super().close_round(closed)
        self._sum = None
