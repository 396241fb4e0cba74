"""A LADD job's configuration: the fields every job has (``aggregator/jobs/base.py``), DP-FedAvg's
clipping, the robust rule within each cluster, the devices' local step rule, and LADD's own
(its model, style clustering, self-training recipe, teachers, pretrained network). The job is
``aggregator/jobs/ladd.py``."""

from __future__ import annotations

from dataclasses import dataclass

from protocols.payloads.ladd import SelfTrainingRecipe

from aggregator.jobs.config_limits import (BATCH_SIZE, COUNT, LOCAL_EPOCHS, PATH, ROUNDS, SEGMENTATION_SPEC,
                                           SHA256_OR_EMPTY, OneOf, Range, check_declared, limited)
from aggregator.jobs.optimizer_fields import LocalRuleFields
from aggregator.jobs.privacy_fields import UpdateClippingFields
from aggregator.jobs.robustness_fields import FedAvgRobustnessFields
from aggregator.strategies.ladd import (CLUSTER_SCOPES, CLUSTERINGS, STYLE_SCREEN_MULTIPLE, check_screen_multiple,
                                       cluster_specific_predicate)


@dataclass
class LaddConfig(LocalRuleFields, FedAvgRobustnessFields, UpdateClippingFields):
    """The fields every job has (``aggregator/jobs/base.py``), DP-FedAvg's clipping, the robust rule within each cluster,
    the devices' local step rule (FedSAM/FedASAM/FedProx on the decoder), and LADD's."""

    job_id: str = "ladd"
    # LADD keeps the norm bound at 3x the median norm and the weight bound (a claimed n_k counts as
    # at most 2 typical devices: without it one device claiming n = 10^7 was its round's mean), and
    # nothing else: FedAvg(ψ)'s other defaults were measured on its linear head, not on a
    # segmentation network's clusters. small_round_reference is the family's (on: a round of fewer
    # than 3 updates is bounded by earlier rounds' limits too, φ's and the θ slots': LaddSmallRounds).
    norm_bound_multiplier: float = 3.0
    contribution_bound_multiplier: float = 0.0
    direction_screen: bool = False
    history_momentum: float = 0.0       # LADD has none: refused (its clusters' θ_c move in rounds of their own)
    model: dict = limited(limit=SEGMENTATION_SPEC, default_factory=dict)   # edge_client SegmentationSpec as a dict
    weights_sha256: str = limited("", SHA256_OR_EMPTY)     # the devices' ImageNet encoder weights
    style_b: int = limited(1, Range(0, 8))                 # style window (2b+1)²
    clustering: str = limited("styles", OneOf(CLUSTERINGS))   # "styles" (LADD) | "none" (FedAvg + self-training)
    k_min: int = limited(2, Range(1, 64))
    k_max: int = limited(8, Range(1, 64))
    n_init: int = limited(10, Range(1, 1000))
    # a style farther from every other style than this x the fleet's typical distance from the median
    # style is left out of the clustering and of pre-training, and its device goes to the nearest
    # centroid (aggregator/strategies/ladd.py screen_styles, which says how 4 was measured); 0: off, else >= 2
    style_screen_multiple: float = limited(STYLE_SCREEN_MULTIPLE, Range(0, 1e6))
    cluster_scope: str = limited("head", OneOf(CLUSTER_SCOPES))   # θ = "head" (LADD cls) | "all"
    rounds: int = limited(12, ROUNDS)
    clients_per_round: int = 8
    # the devices' self-training recipe: defaults are the wire contract's (which checks them again)
    local_epochs: int = limited(SelfTrainingRecipe.epochs, LOCAL_EPOCHS)
    batch_size: int = limited(SelfTrainingRecipe.batch_size, BATCH_SIZE)
    lr: float = limited(SelfTrainingRecipe.lr, Range(0, 100))
    momentum: float = limited(SelfTrainingRecipe.momentum, Range(0, 1))
    kd_lambda: float = limited(SelfTrainingRecipe.kd_lambda, Range(0, 1e6))
    kd_alpha: float = limited(SelfTrainingRecipe.kd_alpha, Range(0, 1e6))
    pseudo_quantile: float = limited(SelfTrainingRecipe.pseudo_quantile, Range(0, 1))
    pseudo_cap: float = limited(SelfTrainingRecipe.pseudo_cap, Range(0, 1))
    teacher_every: int = limited(1, Range(1, 1_000_000))   # ω
    # t_START; 0: no SWA teacher, the job's default, where the paper averages on every dataset
    # (fedfleet simulate --pipeline ladd sets 6): a job created through the API without it runs LADD
    # without the SWA teacher
    swa_start: int = limited(0, Range(0, 1_000_000))
    min_styles: int = limited(0, COUNT)            # styles needed before clustering (0: every device seen)
    style_attempts: int = limited(3, Range(1, 1000))
    # the pretrained network (``save_initial_model``): what a job built from its stored config alone
    # (admin API, restart) starts from, since the server's FDA pre-training needs the device SDK's model
    initial_model_file: str = limited("", PATH)
    initial_model_sha256: str = limited("", SHA256_OR_EMPTY)

    def __post_init__(self):
        super().__post_init__()
        if self.clustering not in CLUSTERINGS:
            raise ValueError(f"clustering must be one of {CLUSTERINGS}, got {self.clustering!r}")
        cluster_specific_predicate(self.cluster_scope)
        check_declared(self, "model", "rounds", "clients_per_round", "teacher_every", "swa_start", "style_b", "k_min",
                       "n_init", "style_screen_multiple")
        check_screen_multiple(self.style_screen_multiple)
        if self.k_min > self.k_max:
            raise ValueError(f"k_min={self.k_min} must not exceed k_max={self.k_max}")
        self.recipe(seed=0)          # refuse a recipe the devices would refuse, before any round
        self.check_update_clipping()
        self.check_robust_aggregation()
        if self.history_momentum:
            raise ValueError("LADD has no round history (history_momentum must be 0)")

    def recipe(self, seed: int) -> SelfTrainingRecipe:
        return SelfTrainingRecipe(epochs=self.local_epochs, batch_size=self.batch_size, lr=self.lr,
                                  momentum=self.momentum, kd_lambda=self.kd_lambda, kd_alpha=self.kd_alpha,
                                  pseudo_quantile=self.pseudo_quantile, pseudo_cap=self.pseudo_cap, seed=seed,
                                  rule=self.local_rule_recipe())

    @property
    def image_size(self) -> int:
        return int(self.model["image_size"])
