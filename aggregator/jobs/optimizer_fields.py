"""The optimizer fields of the FedAvg family's configs: the server's step (FedAvg/FedAvgM or
FedOpt's Adam, Yogi, Adagrad), the devices' local step rule (SGD, FedProx, FedSAM, FedASAM) and
the model the job serves (the last global model, SWA or WiMA).

A mixin, like ``robustness_fields.py`` and ``privacy_fields.py``: every FedAvg-family kind (plain,
tail, secure) inherits the fields, checks them once in ``__post_init__`` and builds its server
step from them, so the API schema, ``fedfleet admin job create`` and ``simulate`` see one set of
names. The limits are in ``config_limits.py``; the algorithms in docs/algorithms.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocols.payloads.fedavg import LocalRuleRecipe

from aggregator.strategies.fedavg import ServerOptimizer
from aggregator.strategies.fedopt import SERVER_OPTIMIZERS, make_server_optimizer
from aggregator.strategies.model_averaging import LastModel, ServedModel, StochasticWeightAveraging, WindowAverage


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


@dataclass
class LocalRuleFields:
    """The devices' local step rule, sent in every task as ``LocalRuleRecipe`` params
    (``edge_client/tasks/local_rules.py`` runs it in every trainer)."""

    local_rule: str = "sgd"              # "sgd" | "sam" (FedSAM) | "asam" (FedASAM): 2 gradients per step
    sam_rho: float = LocalRuleRecipe.sam_rho
    asam_eta: float = LocalRuleRecipe.asam_eta
    prox_mu: float = 0.0                 # > 0: FedProx's proximal term μ/2‖w − w_global‖² (any rule)

    def local_rule_recipe(self) -> LocalRuleRecipe:
        """The recipe devices get (its checks run when the config is created)."""
        return LocalRuleRecipe(self.local_rule, self.sam_rho, self.asam_eta, self.prox_mu)


@dataclass
class ServedModelFields:
    """Which model the job evaluates, reports and saves (``aggregator/strategies/model_averaging.py``)."""

    served_model: str = "last"           # "last" | "swa" (server SWA) | "wima" (window average)
    swa_start_round: int = 1             # t₀: the first round of SWA's first cycle
    swa_cycle_rounds: int = 1            # c: a cycle's rounds; the mean takes each cycle's last model
    swa_lr_min: float = 0.0              # γ₂, the cycle's lowest client LR (0: constant, the job's client_lr)
    wima_window: int = 10                # W: WiMA serves the mean of the last W global models

    def served_model_rule(self) -> ServedModel:
        if self.served_model == "swa":
            return StochasticWeightAveraging(self.swa_start_round, self.swa_cycle_rounds, self.swa_lr_min or None)
        if self.served_model == "wima":
            return WindowAverage(self.wima_window)
        if self.served_model != "last":
            raise ValueError(f"served_model must be 'last', 'swa' or 'wima', got {self.served_model!r}")
        return LastModel()
