"""FedNCM jobs: Fed3R's rounds and device task, solved as class means (``aggregator/strategies/fedncm.py``).

Devices run the unchanged ``fed3r.stats`` task (plain) or the Fed3R-Sync one (secure): FedNCM
needs no device code, only Fed3R's upload. The jobs are the Fed3R ones with the FedNCM
strategy; their model.npz holds the normalised class means as ``coef`` (``intercept`` zero),
and ``raw_weights`` the means with the class counts as the last row.
"""

from __future__ import annotations

from dataclasses import dataclass

from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob
from aggregator.strategies.fedncm import FedNCM


def check_fedncm(config: Fed3RConfig) -> None:
    if not config.fit_intercept:
        raise ValueError("fedncm needs fit_intercept (the class counts are the bias row of B)")
    if config.dp:
        # NoisyFed3R's noise and release schedule are the ridge's; FedNCM has no DP variant here
        raise ValueError("fedncm does not run under DP (dp_noise_multiplier must be 0)")


@dataclass
class FedNCMConfig(Fed3RConfig):
    job_id: str = "fedncm"

    def __post_init__(self):
        super().__post_init__()
        check_fedncm(self)


@dataclass
class FedNCMSyncConfig(Fed3RSyncConfig):
    job_id: str = "fedncm-sync"

    def __post_init__(self):
        super().__post_init__()
        check_fedncm(self)


class ClassMeanSolve:
    """Gives a Fed3R job the FedNCM strategy (before Fed3RJob would pick the ridge one)."""

    def __post_init__(self):
        if self.strategy is None:
            self.strategy = FedNCM(self.config.num_classes, self.config.p, self.config.fit_intercept)
        super().__post_init__()


@dataclass
class FedNCMJob(ClassMeanSolve, Fed3RJob):
    config: FedNCMConfig


class FedNCMSyncJob(ClassMeanSolve, Fed3RSyncJob):
    pass
