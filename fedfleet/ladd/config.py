"""The LADD experiment's settings: fleet, benchmark, pre-training and the jobs' recipe.

Checked as ``simulate --config`` is (``fedfleet/sim_config.py``), before anything starts: each
field's JSON type and its limit, declared at the field; a field the LADD job has takes that job
field's own limit, one the fleet shares with ``SimConfig`` takes SimConfig's, and then the job's
own cross-field rules (``k_min`` <= ``k_max``, a recipe the devices take) run on the recipe, so a
mistake is one line at the command instead of the aggregator process's log minutes later.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from aggregator.jobs.config_limits import (FLAG, PATH, SEED, SEGMENTATION_SPEC, TIMEOUT_S, Items, OneOf, Range,
                                           field_limit, limited, validate_config)
from aggregator.jobs.ladd import LaddConfig
from aggregator.jobs.secure_ladd import SecureLaddConfig
from fedfleet.emulation.synthetic_scenes import DOMAINS, TARGET_DOMAINS
from fedfleet.sim_config import SimConfig

METHODS = ("source_only", "fda_pretrained", "fedavg_st", "ladd")
# edge_client.models.segmentation's, which imports torch: `fedfleet simulate`'s parser imports this
# module and checks a config before torch is imported (tests/test_ladd_sim_config.py keeps them equal)
TRAINABLE_SCOPES = ("head", "tail+head")
# The benchmark is rendered whole in memory, uint8 images and labels (4 bytes a pixel), before the
# fleet starts: each of its sizes within its limit could still ask for ~400 GB together (10^5
# source images of 1024 px). 2^28 pixels is 1 GiB; the default run renders 6 M.
MAX_BENCHMARK_PIXELS = 1 << 28


def ladd_job(name: str):
    return field_limit(LaddConfig, name)


def spec(name: str):
    return SEGMENTATION_SPEC.spec[name][1]


@dataclass
class LaddSimConfig:
    # each seed is a whole run, into its own seed{N} folder: a seed named twice reran into the same one
    seeds: tuple[int, ...] = limited((0, 1, 2), Items(SEED, 100, int, distinct=True))
    # each named once: a domain named twice got twice the devices and one test set (rendered twice, one kept)
    domains: tuple[str, ...] = limited(TARGET_DOMAINS, Items(OneOf(tuple(DOMAINS)), len(DOMAINS), str, distinct=True))
    devices_per_domain: int = limited(10, Range(1, 10_000))
    images_per_device: tuple[int, int] = limited((12, 24), Items(Range(1, 10_000), 2, int, min_items=2))
    n_source: int = limited(300, Range(1, 1_000_000))
    test_per_domain: int = limited(40, Range(1, 1_000_000))
    image_size: int = limited(64, spec("image_size"))
    output_stride: int = limited(8, spec("output_stride"))
    tail_blocks: int = limited(2, spec("tail_blocks"))
    head_channels: int = limited(32, spec("head_channels"))
    pretrain_steps: int = limited(400, Range(1, 1_000_000))
    pretrain_lr: float = limited(0.05, Range(1e-9, 100))            # fedfleet/ladd/pretrain.py: > 0
    pretrain_batch: int = limited(16, Range(1, 10_000))
    pool_copies: int = limited(4, Range(0, 64))                      # PretrainRecipe's
    pretrain_style_prob: float = limited(0.5, Range(0, 1))           # FDA: share of source images restyled (LADD code: 1.0)
    style_b: int = limited(1, ladd_job("style_b"))
    k_min: int = limited(2, ladd_job("k_min"))
    k_max: int = limited(8, ladd_job("k_max"))
    rounds: int = limited(12, ladd_job("rounds"))
    clients_per_round: int = limited(8, ladd_job("clients_per_round"))
    local_epochs: int = limited(1, ladd_job("local_epochs"))
    batch_size: int = limited(8, ladd_job("batch_size"))
    lr: float = limited(0.01, ladd_job("lr"))
    kd_lambda: float = limited(10.0, ladd_job("kd_lambda"))
    # the decoder's local step: sgd | sam (FedSAM) | asam (FedASAM)
    local_rule: str = limited("sgd", ladd_job("local_rule"))
    sam_rho: float = limited(0.1, ladd_job("sam_rho"))
    asam_eta: float = limited(0.2, ladd_job("asam_eta"))
    prox_mu: float = limited(0.0, ladd_job("prox_mu"))               # > 0: FedProx around the received decoder
    teacher_every: int = limited(2, ladd_job("teacher_every"))
    swa_start: int = limited(6, ladd_job("swa_start"))
    cluster_scope: str = limited("head", ladd_job("cluster_scope"))
    trainable_scope: str = limited("tail+head", OneOf(TRAINABLE_SCOPES))
    baseline_kd: bool = limited(True, FLAG)
    # or "executorch": the lowered training program (~20x slower)
    device_runtime: str = limited("eager", field_limit(SimConfig, "runtime"))
    evaluate_rounds: bool = limited(True, FLAG)
    workers: int = limited(2, field_limit(SimConfig, "workers"))
    broker: str | None = limited(None, field_limit(SimConfig, "broker"))
    topic_root: str = limited("fedfleet", field_limit(SimConfig, "topic_root"))
    round_timeout_s: float = limited(60.0, ladd_job("round_timeout_s"))
    dropout_prob: float = limited(0.0, field_limit(SimConfig, "dropout_prob"))
    secure: bool = limited(False, FLAG)                              # training rounds summed under SecAgg(+) (SecureLaddJob)
    # auto (by group size) | complete (SecAgg) | regular (SecAgg+)
    secure_graph: str = limited("auto", field_limit(SecureLaddConfig, "graph"))
    phase_timeout_s: float = limited(10.0, field_limit(SecureLaddConfig, "phase_timeout_s"))   # per SecAgg phase
    # fewer selected devices in a cluster: its θ_c waits
    min_cluster_contributors: int = limited(2, field_limit(SecureLaddConfig, "min_cluster_contributors"))
    slowdown: tuple[float, float] = limited((1.0, 1.0), field_limit(SimConfig, "slowdown"))
    out_dir: str = limited("runs/ladd", PATH)
    timeout_s: float = limited(900.0, TIMEOUT_S)

    def __post_init__(self):
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        try:
            validate_config("LaddSimConfig", LaddSimConfig, values)
        except ValueError as exc:       # one line, as SimConfig's
            raise ValueError(str(exc).replace("LaddSimConfig config field", "LaddSimConfig field", 1)) from None
        self.seeds, self.domains = tuple(self.seeds), tuple(self.domains)
        self.images_per_device, self.slowdown = tuple(self.images_per_device), tuple(self.slowdown)
        lo, hi = self.images_per_device
        if lo > hi:
            raise ValueError(f"LaddSimConfig field 'images_per_device' must be [lo, hi] with lo <= hi, got {[lo, hi]}")
        images = self.n_source + len(self.domains) * (self.devices_per_domain * hi + self.test_per_domain)
        if images * self.image_size ** 2 > MAX_BENCHMARK_PIXELS:
            raise ValueError(f"LaddSimConfig: a benchmark of up to {images} images of {self.image_size} px is "
                             f"{images * self.image_size ** 2:.3g} pixels, more than {MAX_BENCHMARK_PIXELS} (fewer "
                             "n_source, devices_per_domain, images_per_device, test_per_domain or a smaller image_size)")
        self.check_recipe()

    def check_recipe(self) -> None:
        """The LADD job's own rules on the fields it takes from this config (what the aggregator
        process would refuse once the benchmark is rendered): its network and its recipe, and with
        ``secure`` the secure job's (a group of at most MAX_GROUP_SIZE, ...)."""
        from fedfleet.ladd.aggregator_process import segmentation_spec

        model = segmentation_spec(dataclasses.asdict(self)).to_dict()      # the network's own checks
        shared = {f.name for f in dataclasses.fields(LaddConfig)} & {f.name for f in dataclasses.fields(self)}
        job_config = SecureLaddConfig if self.secure else LaddConfig
        job_config(model=model, **{name: getattr(self, name) for name in shared}, **self.secure_job_fields())

    def secure_job_fields(self) -> dict:
        """What this experiment sets of the secure LADD job's own fields (none unless ``secure``)."""
        if not self.secure:
            return {}
        return dict(graph=self.secure_graph, phase_timeout_s=self.phase_timeout_s,
                    min_cluster_contributors=self.min_cluster_contributors, max_samples=int(self.images_per_device[1]))


QUICK = dict(seeds=(0,), devices_per_domain=2, images_per_device=(6, 8), n_source=48, test_per_domain=6,
             image_size=32, head_channels=16, pretrain_steps=30, pool_copies=2, rounds=2, clients_per_round=4,
             workers=1, k_max=4, round_timeout_s=30.0, timeout_s=240.0, teacher_every=1, swa_start=2,
             evaluate_rounds=False)
