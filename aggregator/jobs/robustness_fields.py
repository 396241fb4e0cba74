"""Bounded-influence settings of a job's config (docs/algorithms.md, "Bounded influence").

On by default: no operator setting is needed for a job to refuse a device whose statistics no
honest device could have computed, or that steers the model far more than the fleet's others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from aggregator.jobs.base import JobConfig
from aggregator.strategies.robust_fed3r import EnergyScreen, FeatureBound
from aggregator.strategies.robust_fedavg import (CenteredClipping, CoordinateMedian, DirectionScreen,
                                                 InfluenceBound, Krum, Mean, NormBound, RobustAggregation,
                                                 TrimmedMean)

RULES = ("mean", "median", "trimmed_mean", "krum", "multi_krum", "centered_clipping")
# FedAvg's own weighted mean: every bounded-influence stage off (what a secure sum replays, or a
# test that holds devices to the plain mean)
NO_BOUNDS = {"norm_bound_multiplier": 0.0, "influence_bound_multiplier": 0.0, "direction_screen": False}


@dataclass
class Fed3RRobustnessFields(JobConfig):
    """Fed3R: hard bounds from the backbone's output range, and the fleet's energy screen."""

    # F: every feature lies in [-F, F]; 6 is the range the MobileNetV2 / EfficientNet-Lite bundles
    # declare in their manifest (ReLU6, then average pooling); 0: no per-feature bound. With
    # random features the bound is √(2/D), exactly, whatever this says.
    max_abs_feature: float = 6.0
    max_device_samples: int = 1_000_000     # n above this is refused (a device's claim weighs n)
    # screen e_k > (ratio + sample_slack / √n_k) x the fleet's median (EnergyScreen says why); 0: off
    screen_energy_ratio: float = 2.5
    screen_sample_slack: float = 9.5
    screen_min_fleet: int = 5               # ...once this many devices are known

    def feature_bound(self) -> FeatureBound:
        rf = self.random_features
        f = math.sqrt(2.0 / rf["dim"]) if rf else self.max_abs_feature
        return FeatureBound(f, self.max_device_samples, self.fit_intercept)

    def energy_screen(self) -> EnergyScreen:
        """The fleet screen; off under DP (a device's statistics are bounded by clipping and
        hidden in noise) and when streaming (a device's increments are not one contribution)."""
        ratio = 0.0 if self.dp or self.streaming else self.screen_energy_ratio
        return EnergyScreen(ratio, self.screen_min_fleet, self.screen_sample_slack)

    def check_robustness(self) -> None:
        """ValueError for settings that cannot run (the admin API answers 422)."""
        self.feature_bound()
        self.energy_screen()


@dataclass
class FedAvgRobustnessFields(JobConfig):
    """FedAvg family, plaintext: the round's norm bound and its aggregation rule."""

    aggregator: str = "mean"                # one of RULES
    # ‖θ_k − x_t‖ ≤ this × the round's median (0: off). 1: every update clipped to the median norm,
    # the setting that held FedAvg(ψ) within about 2 points under 10 % attackers on the demo fleet
    # where 3x lost 14 to sign flipping (docs/algorithms.md, "Bounded influence").
    norm_bound_multiplier: float = 1.0
    # n_k·‖Δ_k‖ ≤ this × the round's median (0: off), and updates pointing away from the round's
    # coordinate-wise median left out: with the 1x norm bound they hold FedAvg(ψ) within about 2
    # points under 10 % attackers (docs/algorithms.md, "Bounded influence")
    influence_bound_multiplier: float = 1.0
    direction_screen: bool = True
    trim_fraction: float = 0.1              # trimmed_mean: β dropped at each end, per coordinate
    krum_byzantine: int = 1                 # krum / multi_krum: f, the devices assumed malicious
    krum_select: int = 0                    # multi_krum: updates kept (0: κ − f)
    clip_radius_multiplier: float = 1.0     # centered_clipping: τ = this × the median distance to the start
    clip_iterations: int = 3                # centered_clipping: clipping iterations

    def robust_aggregation(self) -> RobustAggregation:
        if self.aggregator not in RULES:
            raise ValueError(f"aggregator must be one of {RULES}, got {self.aggregator!r}")
        f = self.krum_byzantine
        rule = {"mean": Mean, "median": CoordinateMedian,
                "trimmed_mean": lambda: TrimmedMean(self.trim_fraction),
                "krum": lambda: Krum(f, 1),
                "multi_krum": lambda: Krum(f, self.krum_select or max(1, self.clients_per_round - f)),
                "centered_clipping": lambda: CenteredClipping(self.clip_radius_multiplier, self.clip_iterations),
                }[self.aggregator]()
        return RobustAggregation(rule, NormBound(self.norm_bound_multiplier),
                                 InfluenceBound(self.influence_bound_multiplier) if self.influence_bound_multiplier else None,
                                 DirectionScreen() if self.direction_screen else None)

    def check_robust_aggregation(self) -> None:
        """ValueError when the rule cannot hold its guarantee with κ devices a round (admin API: 422)."""
        rule = self.robust_aggregation().rule
        if self.clients_per_round < rule.min_updates():
            raise ValueError(f"aggregator {self.aggregator!r} needs clients_per_round >= {rule.min_updates()} "
                             f"(Krum: 2f + 3 with f={self.krum_byzantine}), got {self.clients_per_round}")
        if self.dp and self.aggregator != "mean":
            raise ValueError("a DP job averages its clipped updates: robust rules are for plaintext jobs")


@dataclass
class SecureUpdateBoundFields(FedAvgRobustnessFields):
    """FedAvg family under secure aggregation: devices clip ‖θ_k − x_t‖ to C before masking, and
    the server checks each group's sum against n·C (0: no clipping, no check). Robust rules need
    each update: a secure job only averages."""

    update_clip_norm: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        self.check_secure_bounds()

    def check_secure_bounds(self) -> None:
        if self.aggregator != "mean":
            raise ValueError(f"aggregator {self.aggregator!r} needs each device's update; a secure job sees "
                             "only sums: use update_clip_norm to bound them")
        if not (self.update_clip_norm >= 0 and math.isfinite(self.update_clip_norm)):
            raise ValueError(f"update_clip_norm must be a finite number >= 0, got {self.update_clip_norm}")
