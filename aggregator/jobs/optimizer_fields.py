"""The optimizer fields of the FedAvg family's configs: the server's step (FedAvg/FedAvgM or
FedOpt's Adam, Yogi, Adagrad).

A mixin, like ``robustness_fields.py`` and ``privacy_fields.py``: every FedAvg-family kind (plain,
tail, secure) inherits the fields, checks them once in ``__post_init__`` and builds its server
step from them, so the API schema, ``fedfleet admin job create`` and ``simulate`` see one set of
names. The limits are in ``config_limits.py``; the algorithms in docs/algorithms.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from aggregator.strategies.fedavg import ServerOptimizer
from aggregator.strategies.fedopt import SERVER_OPTIMIZERS, make_server_optimizer


@dataclass
class ServerOptimizerFields:
    server_optimizer: str = "sgd"        # "sgd": FedAvg/FedAvgM; "adam" | "yogi" | "adagrad": FedOpt
    server_lr: float = 1.0               # η (FedOpt: Reddi et al. tune it in 10^{-3..0})
    server_momentum: float = 0.0         # sgd only: 0 FedAvg, > 0 FedAvgM
    server_beta1: float = 0.9            # FedOpt's first moment
    server_beta2: float = 0.99           # FedAdam's / FedYogi's second moment
    server_tau: float = 1e-3             # FedOpt's adaptivity bound τ

    def check_server_optimizer(self) -> None:
        if self.server_optimizer not in SERVER_OPTIMIZERS:
            raise ValueError(f"server_optimizer must be one of {SERVER_OPTIMIZERS}, got {self.server_optimizer!r}")
        self.server_step()         # the optimizer's own checks, raised while the config is created

    def server_step(self) -> ServerOptimizer:
        return make_server_optimizer(self.server_optimizer, self.server_lr, self.server_momentum,
                                     self.server_beta1, self.server_beta2, self.server_tau)

