"""What ``fedfleet simulate`` runs: its config (``SimConfig``), the presets, and the one check of both.

A run's config comes from a preset or a JSON file, with the command line's options over it, and
every field is checked before anything starts (no data split, no file written, no process):
its JSON type from the annotation and its limit, declared at the field as a job config's are
(``aggregator/jobs/config_limits.py``: ``limited(default, Range(...))``). A field that becomes a
job's field (``lam``, ``ft_client_lr``, ...) takes that job field's own declared limit, not a
copy, so a value the aggregator would refuse is refused here, before the fleet has started,
instead of minutes later as the aggregator's log. The fleet's own fields (how many devices,
processes, brokers; the emulated profiles) have limits that keep the run's processes within
what one machine can hold; each says why where it is not plain.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from pathlib import Path

from aggregator.jobs.config_limits import (FLAG, PATH, SEED, TIMEOUT_S, Items, OneOf, Pattern, Range, field_limit,
                                           limited, validate_config)
from aggregator.jobs.fed3r import RANDOM_FEATURES, Fed3RConfig
from aggregator.jobs.fed3r_sync import Fed3RSyncConfig
from aggregator.jobs.fedavg import FedAvgConfig
from aggregator.jobs.ditto import DittoConfig
from aggregator.jobs.partial import PartialConfig
from aggregator.jobs.personalize import PersonalizeConfig
from edge_client.tasks.extractors import MAX_DEVICE_IMAGE_SIZE
from protocols.mqtt_link import BrokerConfig
from protocols.topics import TOPIC_ROOT_PATTERN

from .bundles import RUNTIMES
from .emulation.partition import SPLIT_KINDS
from .errors import UserError, load_json_file
from .pipeline_report import FP_LABELS, FT_MODES

FT_ALGORITHMS = ("fedavg", "fedgloss", "scaffold")   # the fine-tuning job's kind (ft_algorithm): its registry name
CLASSIFIERS = ("fed3r", "fedncm")                    # --pipeline fed3r's job kinds (the same upload)
EVALUATE = ("contribution", "round")                 # aggregator serve --evaluate
TEXT = Pattern(r"^[^\x00-\x1f]{1,2048}$")            # a broker URL, a Ray address, a rollout's stage list


def job(config_cls: type, name: str):
    """The limit a job kind declares for its field ``name``: a SimConfig field that becomes it keeps it."""
    return field_limit(config_cls, name)


@dataclass
class SimConfig:
    devices: int = limited(100, Range(1, 1_000_000))
    dataset: str = limited("fashion-mnist", OneOf(("fashion-mnist",)))
    data_root: str | None = limited(None, PATH)
    train_limit: int | None = limited(None, Range(1, 60_000))    # use a seeded subset of the training set
    test_limit: int | None = limited(None, Range(1, 10_000))
    split: str = limited("dirichlet", OneOf(SPLIT_KINDS))
    alpha: float = limited(0.1, Range(1e-6, 1e6))
    classes_per_device: int = limited(2, Range(1, 10))
    mean_size: float = limited(5.0, Range(1, 60_000))  # long-tailed: images per device on average (images repeat
    max_size: int = limited(50, Range(1, 60_000))      # across devices), at most max_size
    seed: int = limited(0, SEED)
    backbone: str = limited("mobilenet_v2", job(Fed3RConfig, "backbone"))
    # a device of this SDK runs at most MAX_DEVICE_IMAGE_SIZE; the job's own limit is the wire's
    image_size: int = limited(64, Range(1, MAX_DEVICE_IMAGE_SIZE))
    runtime: str = limited("executorch", OneOf(RUNTIMES))   # feature extraction: fedfleet.bundles.RUNTIMES
    workers: int = limited(2, Range(1, 1024))
    broker: str | None = limited(None, TEXT)                # None: start a private mosquitto
    topic_root: str = limited("fedfleet", Pattern(TOPIC_ROOT_PATTERN))
    clients_per_round: int = limited(10, job(Fed3RConfig, "clients_per_round"))
    # One-shot phases (Fed3R/Fed3R-Sync statistics, OLL reports: each device answers once) ask
    # every device in one round instead of κ per round: a round waits for its slowest device, so
    # ⌈K/κ⌉ rounds one after another wait ⌈K/κ⌉ times. FedAvg rounds keep κ.
    oneshot_all_devices: bool = limited(False, FLAG)
    round_timeout_s: float = limited(120.0, TIMEOUT_S)
    max_attempts: int = limited(3, job(Fed3RConfig, "max_attempts"))
    lam: float = limited(0.01, job(Fed3RConfig, "lam"))
    rf_dim: int = limited(0, Range(0, RANDOM_FEATURES.spec["dim"][1].hi))   # >0: Fed3R-RF with this many random features
    rf_sigma: float = limited(1000.0, RANDOM_FEATURES.spec["sigma"][1])
    b_format: str = limited("sparse", job(Fed3RConfig, "b_format"))
    # below 1: a device that drops out every time would be asked for ever
    dropout_prob: float = limited(0.05, Range(0, 0.99))
    slowdown: tuple[float, float] = limited((1.0, 3.0), Items(Range(1, 1000), 2, min_items=2))
    bandwidth_bps: tuple[float, float] = limited((20e6, 200e6), Items(Range(1e3, 1e12), 2, min_items=2))
    availability_fraction: float = limited(1.0, Range(1e-3, 1))
    holdout_fraction: float = limited(0.2, Range(0, 0.9))   # of each device's data, kept as its local held-out split
    out_dir: str = limited("runs/latest", PATH)
    cache_dir: str | None = limited(".cache/features", PATH)   # None: no feature cache
    timeout_s: float = limited(1800.0, TIMEOUT_S)
    retry_after_s: float = limited(10.0, TIMEOUT_S)
    secure: bool = limited(False, FLAG)                     # Fed3R-Sync: statistics summed under secure aggregation
    classifier: str = limited("fed3r", OneOf(CLASSIFIERS))  # --pipeline fed3r: "fed3r" (ridge) or "fedncm" (class means)
    secure_graph: str = limited("auto", job(Fed3RSyncConfig, "graph"))   # auto | complete (SecAgg) | regular (SecAgg+)
    phase_timeout_s: float = limited(60.0, job(Fed3RSyncConfig, "phase_timeout_s"))
    # DP Fed3R (fedfleet/dp_fleet.py): ε > 0 turns it on; δ 0: 1/devices; F, N; a center of m devices, F_c
    dp_epsilon: float = limited(0.0, job(Fed3RConfig, "dp_target_epsilon"))
    dp_delta: float = limited(0.0, Range(0, job(Fed3RConfig, "dp_delta").hi))
    dp_clip: float = limited(8.0, job(Fed3RConfig, "feature_clip_norm"))
    dp_max_samples: int = limited(1, job(Fed3RConfig, "max_samples"))
    dp_center_devices: int = limited(0, job(Fed3RConfig, "dp_center_devices"))
    dp_center_clip: float = limited(4.0, job(Fed3RConfig, "dp_center_clip_norm"))
    # --secure: the share of a SecAgg group that must survive (0: ⌈2κ/3⌉)
    dp_group_threshold: float = limited(0.0, job(Fed3RSyncConfig, "dp_group_threshold"))
    # central DP: "end" (one release when the job ends) or "round" (one per round)
    dp_release: str = limited("end", job(Fed3RConfig, "dp_release"))
    # --pipeline fed3r-ft-oll: FedAvg(ψ) fine-tuning from the Fed3R head, then OLL on every device
    ft_rounds: int = limited(30, job(FedAvgConfig, "rounds"))
    # psi: FT(ψ) head | phi: FT(φ) backbone tail, head frozen | M: both
    ft_mode: str = limited("psi", OneOf(tuple(FT_MODES)))
    tail_stages: int = limited(1, job(PersonalizeConfig, "tail_stages"))   # phi / M: backbone stages trained on device
    # phi / M: an exported bundle's manifest with those stages' programs (fedfleet export --tail-stages N);
    # None: exported into .cache/bundles
    tail_bundle: str | None = limited(None, PATH)
    # base local LR; devices get × 0.1 after the Fed3R init (spec §1.8)
    ft_client_lr: float = limited(0.001, job(FedAvgConfig, "client_lr"))
    ft_init_scale: float = limited(1.0, job(FedAvgConfig, "init_scale"))   # the Fed3R head × this (bench/ft_init_scale.py)
    ft_server_momentum: float = limited(0.0, job(FedAvgConfig, "server_momentum"))   # > 0: FedAvgM
    # sgd (FedAvg/FedAvgM) | adam | yogi | adagrad (FedOpt)
    ft_server_optimizer: str = limited("sgd", job(FedAvgConfig, "server_optimizer"))
    # fedavg (the FedAvg family above) | fedgloss (FedGloSS(ψ): server SAM + ADMM) | scaffold (on ft_mode's tensors)
    ft_algorithm: str = limited("fedavg", OneOf(FT_ALGORITHMS))
    ft_server_lr: float = limited(1.0, job(FedAvgConfig, "server_lr"))   # η of the server step (FedOpt wants ~0.01-0.1)
    ft_local_rule: str = limited("sgd", job(FedAvgConfig, "local_rule"))  # sgd | sam (FedSAM) | asam (FedASAM)
    ft_sam_rho: float = limited(0.1, job(FedAvgConfig, "sam_rho"))        # SAM/ASAM's ρ
    ft_prox_mu: float = limited(0.0, job(FedAvgConfig, "prox_mu"))        # > 0: FedProx's μ (with any local rule)
    # last | swa (from 0.75·ft_rounds, every round) | wima (last 10)
    ft_served_model: str = limited("last", job(FedAvgConfig, "served_model"))
    fp_epochs: int = limited(25, job(PersonalizeConfig, "fp_epochs"))   # FP(ψ) local epochs after OLL (0: OLL only)
    # what FP fine-tunes: the OLL head (psi), the backbone's tail (phi), both (M)
    fp_part: str = limited("psi", OneOf(tuple(FP_LABELS)))
    # --pipeline fed3r-pp-oll / fed3r-ft-pp-oll: partial personalization (shared head weight, personal bias)
    pp_rounds: int = limited(20, job(PartialConfig, "rounds"))
    pp_algorithm: str = limited("fedalt", job(PartialConfig, "pp_algorithm"))   # fedalt | fedsim
    pp_client_lr: float = limited(0.1, job(PartialConfig, "client_lr"))  # base local LR; devices get × 0.1
    # --pipeline fed3r-ditto-oll / fed3r-ft-ditto-oll: Ditto's λ (pp_rounds, pp_client_lr)
    ditto_lambda: float = limited(0.1, job(DittoConfig, "ditto_lambda"))
    # --deploy (fed3r-ft-oll, FT(ψ)): roll the fine-tuned head out through a canary, then a broken one back
    deploy: bool = limited(False, FLAG)
    deploy_canary: str = limited("20%", TEXT)
    deploy_stages: str = limited("50%,100%", TEXT)
    deploy_guard: str = limited("wma_drop<=1.0", TEXT)
    deploy_bake_s: float = limited(1.0, TIMEOUT_S)
    # candidates; each device picks one by local cross-validation
    fp_lrs: tuple[float, ...] = limited((1e-4, 1e-3), job(PersonalizeConfig, "fp_lrs"))
    # device hosting (fedfleet.emulation.host): threads that run device steps per worker process;
    # a device's emulated slowdown and upload pacing hold one, so devices answering at once need one each
    host_threads: int = limited(8, Range(1, 4096))
    # the devices' MQTT keepalive (each pings the broker this often): MQTT's two-byte field
    keepalive_s: int = limited(30, Range(1, 65_535))
    # aggregator evaluates per contribution, or per round (large fleets)
    evaluate: str = limited("contribution", OneOf(EVALUATE))
    ray: str | None = limited(None, TEXT)                   # "auto" or a Ray address: device hosts as Ray actors
    shards: int = limited(0, Range(0, 256))                 # each job's aggregator with --shards K (on ``ray``'s cluster too)
    # more devices than this: they connect to edge brokers bridged to the aggregator's (BrokerTree),
    # as one process opens at most RLIMIT_NOFILE sockets and one loopback port has ~28k clients
    devices_per_broker: int = limited(15_000, Range(1, 1_000_000))

    def __post_init__(self):
        """Every SimConfig is checked as it is made: from a file, a preset with options over it
        (``dataclasses.replace``), or Python."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        try:
            validate_config("SimConfig", SimConfig, values)
        except ValueError as exc:       # a ValueError, as a job config's: the commands say it in one line
            raise ValueError(str(exc).replace("SimConfig config field", "SimConfig field", 1)) from None
        for name, value in values.items():       # a JSON array given for a tuple field: the tuple it holds
            if isinstance(value, list) and typing.get_origin(_type_hints()[name]) is tuple:
                setattr(self, name, tuple(value))

    @property
    def oneshot_clients_per_round(self) -> int:
        """Devices per round of a one-shot phase (see ``oneshot_all_devices``)."""
        return self.devices if self.oneshot_all_devices else self.clients_per_round

    @property
    def oneshot_timeout_factor(self) -> int:
        """A one-shot round of all devices does the work of ⌈K/κ⌉ rounds, so its round (and, under
        secure aggregation, phase) timeouts are that many times κ-rounds' (a device that drops out
        is not waited for: it goes offline, and the round stops counting it)."""
        return -(-self.oneshot_clients_per_round // self.clients_per_round)

PRESETS = {
    # every device of a host may be sleeping out its slowdown or upload at once (one-shot rounds of all)
    "demo": SimConfig(oneshot_all_devices=True, host_threads=64),
    "smoke": SimConfig(devices=20, runtime="eager", train_limit=3000, test_limit=600, image_size=32, clients_per_round=5,
                       round_timeout_s=30, dropout_prob=0.1, slowdown=(1.0, 1.5), out_dir="runs/smoke",
                       retry_after_s=3.0, phase_timeout_s=10.0, ft_rounds=5, fp_epochs=5),
    # A cross-device fleet: 10,000 phones with a few images each (50,000 Fashion-MNIST images,
    # Dirichlet α=0.1, ≥ 1 image per device), 1,000 devices per round. Results are acked within a
    # round of ~1,000 uploads, hence the long retry and round timeouts; the model is evaluated once
    # per round. An upload's bandwidth pacing holds one of the host's step threads (host_threads).
    # Both fleet presets run the exported ExecuTorch program (the default runtime), as phones do:
    # a device's 5 images take 12x less there than through eager torch (bench/service_hot_paths.py),
    # which at 100,000 devices was most of the hosts' CPU.
    "fleet-10k": SimConfig(devices=10_000, train_limit=50_000, test_limit=2000, image_size=32,
                           split="dirichlet", alpha=0.1, clients_per_round=1000, round_timeout_s=900,
                           holdout_fraction=0.0, dropout_prob=0.0, slowdown=(1.0, 1.5), retry_after_s=300.0,
                           timeout_s=5400.0, host_threads=32, evaluate="round", out_dir="runs/fleet-10k"),
    # 100,000 phones: each a long-tailed number of Fashion-MNIST's 60,000 training images (1 to 50,
    # about 5, its own Dir(0.1) class mix), so images repeat across devices; 5 % drop out after
    # computing and are asked again (max_attempts 8: with 3, 0.05³ of 100,000 devices, about 12,
    # would drop out every time and be lost); 10,000 devices per round. Eight workers keep
    # each host, and seven brokers (a core and six bridged edges, devices_per_broker) each broker,
    # under the 20,000 sockets one process may open here. Devices ping every 300 s (a phone's
    # usual MQTT keepalive; at 30 s a host's loop answered 12,500 devices' pings 400 times a second).
    "fleet-100k": SimConfig(devices=100_000, test_limit=2000, image_size=32, split="long-tailed",
                            alpha=0.1, mean_size=5.0, max_size=50, clients_per_round=10_000, round_timeout_s=900,
                            holdout_fraction=0.0, dropout_prob=0.05, max_attempts=8, slowdown=(1.0, 1.5),
                            retry_after_s=300.0, timeout_s=5400.0, workers=8, host_threads=32, keepalive_s=300,
                            evaluate="round",
                            devices_per_broker=17_000, out_dir="runs/fleet-100k"),
}


def load_config(name_or_path: str, overrides: dict) -> SimConfig:
    """A preset or a JSON file of SimConfig fields, with the command line's overrides; one clear
    error for a missing file, bad JSON, an unknown field, a value of the wrong type or outside its
    field's limit, or a bad broker address."""
    if name_or_path in PRESETS:
        cfg = PRESETS[name_or_path]
    else:
        if not name_or_path.endswith(".json") and not Path(name_or_path).exists():
            raise UserError(f"--config {name_or_path!r} is neither a preset ({', '.join(sorted(PRESETS))}) "
                            f"nor an existing JSON file")
        data = load_json_file(name_or_path, "--config")
        fields = {f.name for f in dataclasses.fields(SimConfig)}
        if not isinstance(data, dict) or set(data) - fields:
            unknown = sorted(set(data) - fields) if isinstance(data, dict) else ["<not an object>"]
            raise UserError(f"--config {name_or_path}: unknown field {unknown[0]!r} "
                            f"(SimConfig fields: {', '.join(sorted(fields))})")
        try:
            cfg = SimConfig(**data)
        except ValueError as exc:
            raise UserError(f"--config {name_or_path}: {exc}") from None
    try:
        cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    except ValueError as exc:
        raise UserError(f"the command line's {exc}") from None
    if cfg.broker:
        BrokerConfig.from_url(cfg.broker)        # a bad address fails here, before any file is written
    if Path(cfg.out_dir).exists() and not Path(cfg.out_dir).is_dir():
        raise UserError(f"out_dir {cfg.out_dir} is a file, not a folder (the run writes its files into it)")
    return cfg


@functools.cache
def _type_hints() -> dict:
    return typing.get_type_hints(SimConfig)
