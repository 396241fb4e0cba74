"""The optimizer fields of the FedAvg family's configs: the server's step (FedAvg/FedAvgM or
FedOpt's Adam, Yogi, Adagrad), the devices' local step rule (SGD, FedProx, FedSAM, FedASAM) and
the model the job serves (the last global model, SWA or WiMA).

A mixin, like ``robustness_fields.py`` and ``privacy_fields.py``: every FedAvg-family kind (plain,
tail, secure) inherits the fields, checks them once in ``__post_init__`` and builds its server
step from them, so the API schema, ``fedfleet admin job create`` and ``simulate`` see one set of
names. Each field declares its limit (``config_limits.py``); the algorithms are in docs/algorithms.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocols.payloads.fedavg import LOCAL_RULES, LocalRuleRecipe

from aggregator.jobs.config_limits import OneOf, Range, limited

from aggregator.strategies.fedavg import ServerOptimizer
from aggregator.strategies.fedopt import SERVER_OPTIMIZERS, make_server_optimizer
from aggregator.strategies.model_averaging import (SERVED_MODELS, LastModel, ServedModel, StochasticWeightAveraging,
                                                   WindowAverage)


@dataclass
class ServerOptimizerFields:
    # "sgd": FedAvg/FedAvgM; "adam" | "yogi" | "adagrad": FedOpt
    server_optimizer: str = limited("sgd", OneOf(SERVER_OPTIMIZERS))
    server_lr: float = limited(1.0, Range(0, 100))           # η (FedOpt: Reddi et al. tune it in 10^{-3..0})
    server_momentum: float = limited(0.0, Range(0, 1))       # sgd only: 0 FedAvg, > 0 FedAvgM
    server_beta1: float = limited(0.9, Range(0, 0.9999))     # FedOpt's first moment
    server_beta2: float = limited(0.99, Range(0, 0.9999))    # FedAdam's / FedYogi's second moment
    server_tau: float = limited(1e-3, Range(1e-12, 1e3))     # FedOpt's adaptivity bound τ

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

    # "sgd" | "sam" (FedSAM) | "asam" (FedASAM): 2 gradients per step
    local_rule: str = limited("sgd", OneOf(LOCAL_RULES))
    sam_rho: float = limited(LocalRuleRecipe.sam_rho, Range(0, 100))
    asam_eta: float = limited(LocalRuleRecipe.asam_eta, Range(0, 100))
    prox_mu: float = limited(0.0, Range(0, 1e4))   # > 0: FedProx's proximal term μ/2‖w − w_global‖² (any rule)

    def local_rule_recipe(self) -> LocalRuleRecipe:
        """The recipe devices get (its checks run when the config is created)."""
        return LocalRuleRecipe(self.local_rule, self.sam_rho, self.asam_eta, self.prox_mu)


# the entries WiMA's window may hold in all: 2^28 float32 is 1 GiB (the largest head, 2^25 entries,
# gets a window of 8)
MAX_WINDOW_ENTRIES = 1 << 28


@dataclass
class ServedModelFields:
    """Which model the job evaluates, reports and saves (``aggregator/strategies/model_averaging.py``)."""

    served_model: str = limited("last", OneOf(SERVED_MODELS))  # "last" | "swa" (server SWA) | "wima" (window average)
    swa_start_round: int = limited(1, Range(1, 1_000_000))     # t₀: the first round of SWA's first cycle
    swa_cycle_rounds: int = limited(1, Range(1, 100_000))  # c: a cycle's rounds; the mean takes each cycle's last model
    # γ₂, the cycle's lowest client LR (0: constant, the job's client_lr)
    swa_lr_min: float = limited(0.0, Range(0, 100))
    wima_window: int = limited(10, Range(1, 1000))         # W: WiMA serves the mean of the last W global models

    def check_served_model_memory(self, model_entries: int) -> None:
        """WiMA keeps its window's W models (in memory and in every checkpoint) and averages them
        at each round: at most MAX_WINDOW_ENTRIES entries in all. A review's finding: a job of
        26,000 classes with W = 1,000, each limit met alone, was accepted and asked 124 GiB; eight
        rounds took 5.4 GB and 1.1 GiB checkpoints, until the process died."""
        if self.served_model == "wima" and self.wima_window * model_entries > MAX_WINDOW_ENTRIES:
            raise ValueError(f"wima_window x the model's {model_entries:,} entries = {self.wima_window * model_entries:,} "
                             f"exceed {MAX_WINDOW_ENTRIES:,} (WiMA keeps every model of its window): a window of at "
                             f"most {max(MAX_WINDOW_ENTRIES // max(model_entries, 1), 0)} rounds")

    def served_model_rule(self) -> ServedModel:
        if self.served_model == "swa":
            return StochasticWeightAveraging(self.swa_start_round, self.swa_cycle_rounds, self.swa_lr_min or None)
        if self.served_model == "wima":
            return WindowAverage(self.wima_window)
        if self.served_model != "last":
            raise ValueError(f"served_model must be one of {SERVED_MODELS}, got {self.served_model!r}")
        return LastModel()
