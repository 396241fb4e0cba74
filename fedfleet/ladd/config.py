"""The LADD experiment's settings: fleet, benchmark, pre-training and the jobs' recipe."""

from __future__ import annotations

from dataclasses import dataclass

from fedfleet.emulation.synthetic_scenes import TARGET_DOMAINS

METHODS = ("source_only", "fda_pretrained", "fedavg_st", "ladd")


@dataclass
class LaddSimConfig:
    seeds: tuple[int, ...] = (0, 1, 2)
    domains: tuple[str, ...] = TARGET_DOMAINS
    devices_per_domain: int = 10
    images_per_device: tuple[int, int] = (12, 24)
    n_source: int = 300
    test_per_domain: int = 40
    image_size: int = 64
    output_stride: int = 8
    tail_blocks: int = 2
    head_channels: int = 32
    pretrain_steps: int = 400
    pretrain_lr: float = 0.05
    pretrain_batch: int = 16
    pool_copies: int = 4
    pretrain_style_prob: float = 0.5           # FDA: share of source images restyled (LADD code: 1.0)
    style_b: int = 1
    k_min: int = 2
    k_max: int = 8
    rounds: int = 12
    clients_per_round: int = 8
    local_epochs: int = 1
    batch_size: int = 8
    lr: float = 0.01
    kd_lambda: float = 10.0
    local_rule: str = "sgd"                    # the decoder's local step: sgd | sam (FedSAM) | asam (FedASAM)
    sam_rho: float = 0.1
    asam_eta: float = 0.2
    prox_mu: float = 0.0                       # > 0: FedProx around the received decoder
    teacher_every: int = 2
    swa_start: int = 6
    cluster_scope: str = "head"
    trainable_scope: str = "tail+head"
    baseline_kd: bool = True
    device_runtime: str = "eager"              # or "executorch": the lowered training program (~20x slower)
    evaluate_rounds: bool = True
    workers: int = 2
    broker: str | None = None
    topic_root: str = "fedfleet"
    round_timeout_s: float = 60.0
    dropout_prob: float = 0.0
    secure: bool = False                       # training rounds summed under SecAgg(+) (SecureLaddJob)
    secure_graph: str = "auto"                 # auto (by group size) | complete (SecAgg) | regular (SecAgg+)
    phase_timeout_s: float = 10.0              # per secure-aggregation phase
    min_cluster_contributors: int = 2          # fewer selected devices in a cluster: its θ_c waits
    slowdown: tuple[float, float] = (1.0, 1.0)
    out_dir: str = "runs/ladd"
    timeout_s: float = 900.0

    def __post_init__(self):
        self.seeds = tuple(int(s) for s in self.seeds)
        self.domains = tuple(self.domains)
        if not self.seeds or len(self.domains) < 1 or self.devices_per_domain < 1:
            raise ValueError("need at least one seed, one domain and one device per domain")


QUICK = dict(seeds=(0,), devices_per_domain=2, images_per_device=(6, 8), n_source=48, test_per_domain=6,
             image_size=32, head_channels=16, pretrain_steps=30, pool_copies=2, rounds=2, clients_per_round=4,
             workers=1, k_max=4, round_timeout_s=30.0, timeout_s=240.0, teacher_every=1, swa_start=2,
             evaluate_rounds=False)
