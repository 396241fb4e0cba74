"""Bounded-influence settings of a job's config (docs/algorithms.md, "Bounded influence").

On by default: no operator setting is needed for a job to refuse a device whose statistics no
honest device could have computed, or that steers the model far more than the fleet's others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from aggregator.jobs.base import JobConfig
from aggregator.jobs.config_limits import FLAG, OneOf, Range, limited
from aggregator.strategies.robust_fed3r import EnergyScreen, FeatureBound
from aggregator.strategies.robust_fedavg import (CenteredClipping, ContributionBound, CoordinateMedian,
                                                 DirectionScreen, Krum, Mean, NormBound, RobustAggregation,
                                                 RoundHistory, TrimmedMean, WeightBound)
from aggregator.strategies.small_round_reference import SmallRoundReference

RULES = ("mean", "median", "trimmed_mean", "krum", "multi_krum", "centered_clipping")
# The settings under which a FedAvg-family job averages as FedAvg does: every bounded-influence
# layer off (what a test comparing a job to the plain weighted mean, or the bench's "none", sets).
PLAIN_MEAN = {"norm_bound_multiplier": 0.0, "weight_bound_multiplier": 0.0, "contribution_bound_multiplier": 0.0,
              "direction_screen": False, "history_momentum": 0.0, "small_round_reference": False}


@dataclass
class Fed3RRobustnessFields(JobConfig):
    """Fed3R: hard bounds from the backbone's output range, and the fleet's energy screen."""

    # F: every feature lies in [-F, F]; 6 is the range the MobileNetV2 / EfficientNet-Lite bundles
    # declare in their manifest (ReLU6, then average pooling); 0: no per-feature bound. With
    # random features the bound is √(2/D), exactly, whatever this says.
    max_abs_feature: float = limited(6.0, Range(0, 1e6))
    # n above this is refused (a device's claim weighs n)
    max_device_samples: int = limited(1_000_000, Range(1, 1_000_000_000))
    # screen e_k > (ratio + sample_slack / √n_k) x the fleet's class-balanced median (EnergyScreen says why); 0: off
    screen_energy_ratio: float = limited(2.5, Range(0, 1e6))
    screen_sample_slack: float = limited(9.5, Range(0, 1e6))
    screen_min_fleet: int = limited(5, Range(1, 1_000_000))   # ...once this many devices are known
    # screen n_k > ratio x the fleet's median n (statistics scaled with n pass the energy screen); 0: off
    screen_samples_ratio: float = limited(100.0, Range(0, 1e9))

    def feature_bound(self) -> FeatureBound:
        rf = self.random_features
        f = math.sqrt(2.0 / rf["dim"]) if rf else self.max_abs_feature
        return FeatureBound(f, self.max_device_samples, self.fit_intercept)

    def energy_screen(self) -> EnergyScreen:
        """The fleet screen; off under DP (a device's statistics are bounded by clipping and
        hidden in noise) and when streaming (a device's increments are not one contribution)."""
        ratio = 0.0 if self.dp or self.streaming else self.screen_energy_ratio
        return EnergyScreen(ratio, self.screen_min_fleet, self.screen_sample_slack, self.screen_samples_ratio)

    def check_robustness(self) -> None:
        """ValueError for settings that cannot run (the admin API answers 422)."""
        self.feature_bound()
        self.energy_screen()


@dataclass
class FedAvgRobustnessFields(JobConfig):
    """FedAvg family, plaintext: the round's norm bound, contribution bound, direction screen and
    aggregation rule, and the round history. A DP job uses none of them (its clipped, noised mean
    is what the accountant assumes; a robust rule is refused there)."""

    aggregator: str = limited("mean", OneOf(RULES))
    # FedAvg(ψ)'s defaults held every attack of bench/robustness.py within 2 points of the honest
    # run with 10 % attackers on the demo fleet, and gained about 1 point honest (docs/algorithms.md,
    # "Bounded influence"). ‖θ_k − x_t‖ ≤ this × the round's median (0: off); 1: every update
    # clipped to the median norm.
    norm_bound_multiplier: float = limited(1.0, Range(0, 1e6))
    # w_k ≤ this × the round's median weight (0: off): a claimed n_k counts as at most this many typical devices
    weight_bound_multiplier: float = limited(2.0, Range(0, 1e6))
    # w_k·‖Δ_k‖ ≤ this × the round's median (0: off)
    contribution_bound_multiplier: float = limited(0.5, Range(0, 1e6))
    direction_screen: bool = limited(True, FLAG)    # leave out Δ_k with ⟨Δ_k, coordinate-wise median⟩ ≤ 0
    # a round of fewer than 3 updates is bounded by the limits of the last round of >= 3 too (or of
    # >= 3 devices' small rounds), and a round of one moves nothing before there are any
    # (SmallRoundReference says why; Scaffold's c likewise); false: such a round is bounded by its
    # own updates alone
    small_round_reference: bool = limited(True, FLAG)
    # β: the server steps along a momentum of the rounds' steps (0: off)
    history_momentum: float = limited(0.7, Range(0, 0.99))
    trim_fraction: float = limited(0.1, Range(0, 0.499))   # trimmed_mean: β dropped at each end, per coordinate
    krum_byzantine: int = limited(1, Range(0, 100_000))    # krum / multi_krum: f, the devices assumed malicious
    krum_select: int = limited(0, Range(0, 100_000))       # multi_krum: updates kept (0: κ − f)
    # centered_clipping: τ = this × the median distance to the start
    clip_radius_multiplier: float = limited(1.0, Range(1e-6, 1e6))
    clip_iterations: int = limited(3, Range(1, 100))       # centered_clipping: clipping iterations

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
                                 ContributionBound(self.contribution_bound_multiplier),
                                 DirectionScreen(self.direction_screen), WeightBound(self.weight_bound_multiplier))

    def small_rounds(self, key: str = "bounds", layers: list | None = None) -> SmallRoundReference:
        """The bound of rounds of fewer than three updates (state across rounds: the job keeps one
        and checkpoints it, under ``key``) on ``layers`` (None: the update's bound layers; Scaffold
        passes its Δc bound); off when no such layer is on, and under DP (no layer acts there)."""
        return SmallRoundReference(self.small_round_reference and not self.dp,
                                   self.robust_aggregation().bound_layers() if layers is None else layers, key)

    def round_history(self) -> RoundHistory:
        """The state across rounds (the job keeps one and checkpoints it)."""
        return RoundHistory(self.history_momentum)

    def needs_every_update(self) -> str:
        """Why a round's combined update needs every update in one place ("" when sums of them do:
        the sample-weighted mean behind the norm and contribution bounds, whose fleet statistics
        are one number per update; aggregator/shards/fedavg_sums.py)."""
        if self.aggregator != "mean":
            return f"aggregator {self.aggregator!r} needs every update of the round in one place"
        if self.direction_screen:
            return ("direction_screen compares every update with the round's coordinate-wise median, "
                    "which needs every update in one place: set direction_screen false")
        return ""

    def check_robust_aggregation(self) -> None:
        """ValueError when the rule cannot hold its guarantee with κ devices a round (admin API: 422)."""
        for name, flag in (("direction_screen", self.direction_screen),
                           ("small_round_reference", self.small_round_reference)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be true or false, got {flag!r}")
        rule = self.robust_aggregation().rule
        self.round_history()
        self.small_rounds()
        if self.clients_per_round < rule.min_updates():
            raise ValueError(f"aggregator {self.aggregator!r} needs clients_per_round >= {rule.min_updates()} "
                             f"(Krum: 2f + 3 with f={self.krum_byzantine}), got {self.clients_per_round}")
        if self.dp and self.aggregator != "mean":
            raise ValueError("a DP job averages its clipped updates: robust rules are for plaintext jobs")


@dataclass
class SecureUpdateBoundFields(FedAvgRobustnessFields):
    """FedAvg family under secure aggregation: devices clip ‖θ_k − x_t‖ to C before masking, and
    the server checks each group's sum against n·C (0: no clipping, no check). Robust rules, the
    contribution bound and the screen need each update: a secure job averages. The round history
    acts on the round's combined step, which a secure job has too: off by default there (on the
    demo fleet it gained 4.4 points honest and 3.5–6 under each attack, but raised the backdoor's
    success from 17 % to 27 %; docs/secure-aggregation.md)."""

    update_clip_norm: float = limited(0.0, Range(0, 1e9))
    contribution_bound_multiplier: float = 0.0
    direction_screen: bool = False
    history_momentum: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        self.check_secure_bounds()

    def check_secure_bounds(self) -> None:
        if self.aggregator != "mean":
            raise ValueError(f"aggregator {self.aggregator!r} needs each device's update; a secure job sees "
                             "only sums: use update_clip_norm to bound them")
        if self.contribution_bound_multiplier or self.direction_screen:
            raise ValueError("contribution_bound_multiplier and direction_screen are plaintext defences (they need "
                             "each update): a secure job uses update_clip_norm")
        self.round_history()
        if not (self.update_clip_norm >= 0 and math.isfinite(self.update_clip_norm)):
            raise ValueError(f"update_clip_norm must be a finite number >= 0, got {self.update_clip_norm}")
