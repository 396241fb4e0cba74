"""``fedfleet simulate``: an emulated fleet against a real broker and the real aggregator.

Processes: this one (orchestration, progress, the independent centralized reference), one
aggregator process (``python -m aggregator serve``), and W worker processes each hosting a share
of the devices (``python -m fedfleet.emulation.worker``), forks of servers that imported their
code once (``emulation/fork_server.py``). All talk only through MQTT.

The centralized reference is computed in this process, independently of the aggregator
(``simulate_report.py``, which also says what the run reports).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_client.data import load_fashion_mnist
from protocols.mqtt_eventloop import raise_open_file_limit
from protocols.mqtt_link import BrokerConfig
from protocols.topics import Topics

from .emulation.broker import BrokerTree, loopback_sources
from .emulation.fork_server import ForkServer
from .emulation.local_hosts import LocalHosts
from .emulation.processes import stop_all
from .emulation.partition import make_split, train_holdout_split
from .emulation.profiles import sample_profiles
from .errors import UserError, load_json_file
from .progress import StatusWatcher
from .simulate_report import format_report, job_report


@dataclass
class SimConfig:
    devices: int = 100
    dataset: str = "fashion-mnist"
    data_root: str | None = None
    train_limit: int | None = None         # use a seeded subset of the training set
    test_limit: int | None = None
    split: str = "dirichlet"                # iid | dirichlet | classes | long-tailed
    alpha: float = 0.1
    classes_per_device: int = 2
    mean_size: float = 5.0                  # long-tailed: images per device on average (images repeat
    max_size: int = 50                      # across devices), at most max_size
    seed: int = 0
    backbone: str = "mobilenet_v2"
    image_size: int = 64
    runtime: str = "executorch"             # feature extraction: fedfleet.bundles.RUNTIMES
    workers: int = 2
    broker: str | None = None               # None: start a private mosquitto
    topic_root: str = "fedfleet"
    clients_per_round: int = 10
    # One-shot phases (Fed3R/Fed3R-Sync statistics, OLL reports: each device answers once) ask
    # every device in one round instead of κ per round: a round waits for its slowest device, so
    # ⌈K/κ⌉ rounds one after another wait ⌈K/κ⌉ times. FedAvg rounds keep κ.
    oneshot_all_devices: bool = False
    round_timeout_s: float = 120.0
    max_attempts: int = 3
    lam: float = 0.01
    rf_dim: int = 0                         # >0: Fed3R-RF with this many random features
    rf_sigma: float = 1000.0
    b_format: str = "sparse"
    dropout_prob: float = 0.05
    slowdown: tuple[float, float] = (1.0, 3.0)
    bandwidth_bps: tuple[float, float] = (20e6, 200e6)
    availability_fraction: float = 1.0
    holdout_fraction: float = 0.2           # of each device's data, kept as its local held-out split
    out_dir: str = "runs/latest"
    cache_dir: str = ".cache/features"
    timeout_s: float = 1800.0
    retry_after_s: float = 10.0
    secure: bool = False                    # Fed3R-Sync: statistics summed under secure aggregation
    classifier: str = "fed3r"               # --pipeline fed3r: "fed3r" (ridge) or "fedncm" (class means, same upload)
    secure_graph: str = "auto"              # auto (by group size) | complete (SecAgg) | regular (SecAgg+)
    phase_timeout_s: float = 60.0
    # DP Fed3R (fedfleet/dp_fleet.py): ε > 0 turns it on; δ 0: 1/devices; F, N; a center of m devices, F_c
    dp_epsilon: float = 0.0
    dp_delta: float = 0.0
    dp_clip: float = 8.0
    dp_max_samples: int = 1
    dp_center_devices: int = 0
    dp_center_clip: float = 4.0
    dp_group_threshold: float = 0.0         # --secure: the share of a SecAgg group that must survive (0: ⌈2κ/3⌉)
    dp_release: str = "end"                 # central DP: "end" (one release when the job ends) or "round" (one per round)
    # --pipeline fed3r-ft-oll: FedAvg(ψ) fine-tuning from the Fed3R head, then OLL on every device
    ft_rounds: int = 30
    ft_mode: str = "psi"                    # psi: FT(ψ) head | phi: FT(φ) backbone tail, head frozen | M: both
    tail_stages: int = 1                    # phi / M: backbone stages trained on device
    tail_bundle: str | None = None          # phi / M: an exported bundle's manifest with those stages' programs
                                            # (fedfleet export --tail-stages N); None: exported into .cache/bundles
    ft_client_lr: float = 0.001             # base local LR; devices get × 0.1 after the Fed3R init (spec §1.8)
    ft_init_scale: float = 1.0              # the Fed3R head × this at the FT init (bench/ft_init_scale.py)
    ft_server_momentum: float = 0.0         # > 0: FedAvgM
    ft_server_optimizer: str = "sgd"        # sgd (FedAvg/FedAvgM) | adam | yogi | adagrad (FedOpt)
    ft_algorithm: str = "fedavg"            # fedavg (the FedAvg family above) | fedgloss (FedGloSS(ψ): server SAM + ADMM)
    #                                         | scaffold (Scaffold on ft_mode's tensors: ψ, φ or M)
    ft_server_lr: float = 1.0               # η of the server step (FedOpt wants ~0.01-0.1)
    ft_local_rule: str = "sgd"              # the devices' step: sgd | sam (FedSAM) | asam (FedASAM)
    ft_sam_rho: float = 0.1                 # SAM/ASAM's ρ
    ft_prox_mu: float = 0.0                 # > 0: FedProx's μ (with any local rule)
    ft_served_model: str = "last"           # last | swa (from 0.75·ft_rounds, every round) | wima (last 10)
    fp_epochs: int = 25                     # FP(ψ) local epochs after OLL (0: OLL only)
    fp_part: str = "psi"                    # what FP fine-tunes: the OLL head (psi), the backbone's tail (phi), both (M)
    # --pipeline fed3r-pp-oll / fed3r-ft-pp-oll: partial personalization (shared head weight, personal bias)
    pp_rounds: int = 20
    pp_algorithm: str = "fedalt"            # fedalt | fedsim
    pp_client_lr: float = 0.1               # base local LR; devices get × 0.1 (the head starts at Fed3R's)
    ditto_lambda: float = 0.1               # --pipeline fed3r-ditto-oll / fed3r-ft-ditto-oll: Ditto's λ (pp_rounds, pp_client_lr)
    # --deploy (fed3r-ft-oll, FT(ψ)): roll the fine-tuned head out through a canary, then a broken one back
    deploy: bool = False
    deploy_canary: str = "20%"
    deploy_stages: str = "50%,100%"
    deploy_guard: str = "wma_drop<=1.0"
    deploy_bake_s: float = 1.0
    fp_lrs: tuple[float, ...] = (1e-4, 1e-3)   # candidates; each device picks one by local cross-validation
    # device hosting (fedfleet.emulation.host): threads that run device steps per worker process;
    # a device's emulated slowdown and upload pacing hold one, so devices answering at once need one each
    host_threads: int = 8
    keepalive_s: int = 30                   # the devices' MQTT keepalive (each pings the broker this often)
    evaluate: str = "contribution"          # aggregator evaluates per contribution, or per round (large fleets)
    ray: str | None = None                  # "auto" or a Ray address: device hosts as Ray actors
    shards: int = 0                         # each job's aggregator with --shards K (on ``ray``'s cluster too)
    # more devices than this: they connect to edge brokers bridged to the aggregator's (BrokerTree),
    # as one process opens at most RLIMIT_NOFILE sockets and one loopback port has ~28k clients
    devices_per_broker: int = 15_000

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
    error for a missing file, bad JSON, an unknown field or a bad broker address."""
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
        cfg = SimConfig(**data)
    cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    if type(cfg.keepalive_s) is not int or not 1 <= cfg.keepalive_s <= 65_535:     # MQTT's two-byte field
        raise UserError(f"keepalive_s must be a whole number of seconds in 1..65535, got {cfg.keepalive_s!r}")
    for name in ("devices", "clients_per_round", "workers"):    # 0 failed late, with a traceback
        value = getattr(cfg, name)
        if type(value) is not int or value < 1:
            raise UserError(f"{name} must be a whole number >= 1, got {value!r}")
    if cfg.broker:
        BrokerConfig.from_url(cfg.broker)        # a bad address fails here, before any file is written
    return cfg


def _load(cfg: SimConfig):
    if cfg.dataset != "fashion-mnist":
        raise ValueError(f"unknown dataset {cfg.dataset!r}")
    root = Path(cfg.data_root) if cfg.data_root else None
    Xtr, ytr = load_fashion_mnist("train", root)
    Xte, yte = load_fashion_mnist("test", root)
    rng = np.random.default_rng(cfg.seed)
    train_idx = np.arange(len(ytr))
    if cfg.train_limit:
        train_idx = np.sort(rng.choice(len(ytr), cfg.train_limit, replace=False))
    test_idx = np.arange(len(yte))
    if cfg.test_limit:
        test_idx = np.sort(rng.choice(len(yte), cfg.test_limit, replace=False))
    return Xtr, ytr, train_idx, Xte[test_idx], yte[test_idx]


class EmulatedFleet:
    """The long-lived part of a simulation: a broker and W worker processes hosting the devices
    (every pipeline's: Fed3R, Fed3R → FT → OLL, LADD; plain and secure).

    Jobs come and go (:meth:`run_job` starts one aggregator process per job and waits for it);
    the devices stay connected across jobs, as a real fleet outlives any one training job. The
    workers write their per-device statistics when the fleet stops (:attr:`worker_stats`).
    """

    def __init__(self, cfg: SimConfig, out: Path, profiles, secure: dict | None, quiet: bool,
                 holdout_file: Path | None = None, training_manifest: Path | None = None,
                 tail_manifest: Path | None = None, ladd_devices_file: Path | None = None):
        self.cfg, self.out, self.profiles, self.secure, self.quiet = cfg, out, profiles, secure, quiet
        self.holdout_file, self.training_manifest, self.tail_manifest = holdout_file, training_manifest, tail_manifest
        self.ladd_devices_file = ladd_devices_file       # LADD devices: their own images, not dataset shards
        self.broker = None
        self.hosts = None
        self.job_processes: ForkServer | None = None      # the jobs' aggregators
        self.host_processes: ForkServer | None = None     # the local device hosts
        self.worker_stats: list[dict] = []
        # glibc malloc: a host's step threads would each keep an arena, and the dynamic mmap
        # threshold would move multi-megabyte uploads onto the heap; both keep freed uploads in RSS
        # without any device holding them. A fixed 1 MiB threshold returns them to the system.
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MALLOC_ARENA_MAX="2",
                        MALLOC_MMAP_THRESHOLD_="1048576")

    def __enter__(self) -> "EmulatedFleet":
        cfg = self.cfg
        # mosquitto and the workers (children) inherit it: one descriptor per device
        self.open_file_limit = raise_open_file_limit()
        self.n_workers = max(1, min(cfg.workers, cfg.devices))
        n_brokers = max(1, BrokerTree.edges_for(cfg.devices, cfg.devices_per_broker))
        check_devices_per_process(cfg, self.n_workers, n_brokers, self.open_file_limit)
        self.broker = None if cfg.broker else BrokerTree.for_devices(cfg.devices, Topics(cfg.topic_root),
                                                                     cfg.devices_per_broker).start()
        self.broker_url = cfg.broker or self.broker.url
        self.device_broker_urls = [cfg.broker] if cfg.broker else self.broker.device_urls
        try:
            # the jobs' aggregators and the local device hosts: forks of servers that imported their
            # code once (fedfleet/emulation/fork_server.py), in the children's environment; two, so
            # that a device host holds the device's code only, as a device does, not the server's
            self.job_processes = ForkServer(["aggregator", "fedfleet.ladd.aggregator_process"], self.env)
            specs = self.worker_specs()
            if cfg.ray:
                from .emulation.ray_hosts import RayHosts

                self.hosts = RayHosts(cfg.ray, self.out)
            else:
                self.host_processes = ForkServer(["fedfleet.emulation.worker"], self.env)
                self.hosts = LocalHosts(self.out, self.host_processes)
            self.hosts.start(specs)
        except BaseException:
            self.__exit__()
            raise
        return self

    def worker_specs(self) -> list[dict]:
        """One spec per device host (worker process or Ray actor); devices dealt round-robin."""
        cfg, out = self.cfg, self.out
        threads = max(1, (os.cpu_count() or 1) // self.n_workers)
        specs = []
        for w in range(self.n_workers):
            mine = [{"index": i, "profile": p.to_dict()} for i, p in enumerate(self.profiles)
                    if i % self.n_workers == w]
            specs.append({
                "dataset": cfg.dataset, "data_root": cfg.data_root, "shards_file": str(out / "shards.npz"),
                "holdout_file": str(self.holdout_file) if self.holdout_file else None,
                "training_manifest": str(self.training_manifest) if self.training_manifest else None,
                "tail_manifest": str(self.tail_manifest) if self.tail_manifest else None,
                "ladd_devices_file": str(self.ladd_devices_file) if self.ladd_devices_file else None,
                "broker": self.broker_url, "device_brokers": self.device_broker_urls,
                # local hosts of a private broker tree connect from their own loopback address
                "source_addresses": None if cfg.broker or cfg.ray else loopback_sources(w, len(mine)),
                "topic_root": cfg.topic_root, "devices": mine, "seed": cfg.seed,
                "cache_dir": cfg.cache_dir, "runtime": cfg.runtime, "threads": threads,
                "state_dir": str(out / "device_state"),       # each device's own store, <state_dir>/<device id>
                "step_threads": cfg.host_threads, "keepalive_s": cfg.keepalive_s,
                "retry_after_s": cfg.retry_after_s, "stats_file": str(out / f"worker{w}.json"),
                "secure": None if self.secure is None else {
                    "aggregator_public_key": self.secure["aggregator_public_key"],
                    "device_keys": {d["profile"]["device_id"]: self.secure["device_keys"][d["profile"]["device_id"]]
                                    for d in mine}}})
        return specs

    def run_job(self, kind: str, job: dict, job_dir: Path, eval_features: Path, progress_total: int) -> dict:
        """Run one job to its end with a fresh aggregator process; its results.json as a dict."""
        cfg = self.cfg
        job_dir.mkdir(parents=True, exist_ok=True)
        (job_dir / "job.json").write_text(json.dumps(job, indent=1))
        watcher = StatusWatcher(self.broker_url, Topics(cfg.topic_root), total=progress_total, quiet=self.quiet,
                                job_id=job["job_id"])
        shards, unsharded = aggregator_shards(cfg, kind, job)
        if unsharded and not self.quiet:
            print(f"  {kind}: one aggregator process, not {cfg.shards} shards ({unsharded})", flush=True)
        try:
            self.run_aggregator(["aggregator", "serve", "--config", str(job_dir / "job.json"), "--kind", kind,
                                 "--broker", self.broker_url, "--topic-root", cfg.topic_root, "--out", str(job_dir),
                                 "--eval-features", str(eval_features), "--enrolled", str(self.out / "enrolled.txt"),
                                 "--timeout", str(cfg.timeout_s), "--evaluate", cfg.evaluate, *shards],
                                job_dir / "aggregator.log", kind, cfg.timeout_s + 60)
        finally:
            watcher.close()
        if not (job_dir / "results.json").exists():
            raise RuntimeError(f"{kind} aggregator wrote no results.json (see {job_dir / 'aggregator.log'})")
        return json.loads((job_dir / "results.json").read_text())

    def run_aggregator(self, module_args: list[str], log_file: Path, what: str, timeout_s: float) -> None:
        """``python -m MODULE_ARGS`` as the aggregator process of a job (a fork of the fleet's
        server), until it exits; an error with its log's tail unless it exits 0."""
        agg = self.job_processes.start(module_args[0], module_args[1:], log_file)
        try:
            rc = agg.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = -1
        finally:
            stop_all([agg], first_is_done=False)
        if rc != 0:
            raise RuntimeError(f"{what} aggregator failed (exit {rc}); log tail:\n{log_file.read_text()[-3000:]}")

    def __exit__(self, *exc) -> None:
        """Stop the hosts, the fork servers, then the broker, each whatever the one before raised
        (a host fork server that died left mosquitto and the other servers running)."""
        self.broker_rss_mb = self.broker.rss_mb() if self.broker else None
        try:
            if self.hosts is not None:
                self.worker_stats = self.hosts.stop()
        finally:
            try:
                for server in (self.host_processes, self.job_processes):
                    if server is not None:
                        server.close()
            finally:
                if self.broker:
                    self.broker.stop()


def aggregator_shards(cfg: SimConfig, kind: str, job: dict) -> tuple[list[str], str]:
    """(``aggregator serve``'s shard options for one job of the run, why it has none): with
    ``cfg.shards`` K, ``--shards K`` (and ``--ray`` on the devices' cluster) for a job shards can sum
    (or, a secure job, whose groups shards can host);
    any other job runs in one aggregator process, and the reason is said."""
    if not cfg.shards:
        return [], ""
    from aggregator.jobs.registry import build_job
    from aggregator.shards.partial_sums import shard_capability
    from aggregator.shards.pool import check_shardable

    try:
        shard_capability(kind)              # the registry's: bucket sums, or secure groups shards host
    except ValueError as exc:
        return [], str(exc)
    try:
        check_shardable(build_job(kind, job), kind)
    except ValueError as exc:
        return [], str(exc)
    return ["--shards", str(cfg.shards)] + (["--ray", cfg.ray] if cfg.ray else []), ""


def check_devices_per_process(cfg: SimConfig, n_workers: int, n_brokers: int, open_file_limit: int) -> None:
    """One clear error, before anything starts, where a worker or a broker would need more
    sockets than a process may open (each device holds one in its host and one in its broker)."""
    per_worker = -(-cfg.devices // n_workers)
    per_broker = 0 if cfg.broker else -(-cfg.devices // n_brokers)     # an external broker's limits are its own
    room = open_file_limit - 1000              # the process's own files, the bridge, the aggregator
    if max(per_worker, per_broker) > room and not cfg.ray:
        raise UserError(f"{cfg.devices} devices need ≤ {room} per process (open file limit {open_file_limit}): "
                        f"{per_worker} per worker (raise --workers), {per_broker} per broker "
                        f"(lower devices_per_broker, now {cfg.devices_per_broker})")


@dataclass
class Prepared:
    """What every simulation starts from: data, the split into device shards, the evaluation features."""

    out: Path
    Xtr: np.ndarray
    ytr: np.ndarray
    Xte: np.ndarray
    yte: np.ndarray
    Zte: np.ndarray
    shards: dict[str, np.ndarray]           # device -> training indices
    holdouts: dict[str, np.ndarray]         # device -> local held-out indices (empty without a holdout)
    profiles: list
    extractor: object
    fed3r_job: dict


def split_params(cfg: SimConfig) -> dict:
    """The parameters ``make_split`` takes for the config's split kind."""
    return {"iid": {}, "dirichlet": {"alpha": cfg.alpha}, "classes": {"k": cfg.classes_per_device},
            "long-tailed": {"alpha": cfg.alpha, "mean_size": cfg.mean_size, "max_size": cfg.max_size},
            }.get(cfg.split, {})


def prepare(cfg: SimConfig, say) -> Prepared:
    from edge_client.models import weights_sha256
    from fedfleet.bundles import make_extractor

    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    Xtr, ytr, train_idx, Xte, yte = _load(cfg)
    parts = make_split(cfg.split, ytr[train_idx], cfg.devices, cfg.seed, **split_params(cfg))
    profiles = sample_profiles(cfg.devices, cfg.seed, slowdown=cfg.slowdown, bandwidth_bps=cfg.bandwidth_bps,
                               dropout_prob=cfg.dropout_prob, availability_fraction=cfg.availability_fraction)
    shards, holdouts = {}, {}
    for k, (p, part) in enumerate(zip(profiles, parts)):
        train, held = train_holdout_split(train_idx[part], cfg.holdout_fraction, cfg.seed * 1000 + k)
        shards[p.device_id], holdouts[p.device_id] = train, held
    np.savez(out / "shards.npz", **shards)
    np.savez(out / "holdout.npz", **holdouts)
    (out / "enrolled.txt").write_text("\n".join(shards) + "\n")
    say(f"fedfleet simulate: {cfg.devices} devices, {len(train_idx)} training images ({cfg.split}"
        f"{f' α={cfg.alpha}' if 'alpha' in split_params(cfg) else ''}"
        f"{f', {cfg.holdout_fraction:.0%} of each device held out for personalization' if cfg.holdout_fraction else ''}"
        f"), {len(yte)} test images, {cfg.backbone}@{cfg.image_size}px")

    # held-out evaluation features (the aggregator evaluates on features, never on raw images)
    # threads=None: the process's own setting (torch's default: every core), never changed here —
    # a caller running simulate in its process (the suite's workers hold 1 thread on shared cores)
    # kept the 2 threads set here for everything it ran afterwards, its OpenMP pool spinning idle
    extractor = make_extractor(cfg.backbone, cfg.image_size, cfg.cache_dir, cfg.runtime, threads=None)
    t0 = time.monotonic()
    Zte = extractor.extract(Xte)
    np.savez(out / "eval_features.npz", Z=Zte, y=yte)
    say(f"  evaluation features: {Zte.shape} in {time.monotonic() - t0:.1f}s")
    job = {"job_id": "fed3r-sim", "num_classes": 10, "backbone": cfg.backbone, "image_size": cfg.image_size,
           "weights_sha256": weights_sha256(cfg.backbone), "feature_dim": int(Zte.shape[1]), "lam": cfg.lam,
           "random_features": ({"seed": cfg.seed + 1, "dim": cfg.rf_dim, "sigma": cfg.rf_sigma}
                               if cfg.rf_dim else None),
           "clients_per_round": cfg.oneshot_clients_per_round,
           "round_timeout_s": cfg.round_timeout_s * cfg.oneshot_timeout_factor,
           "max_attempts": cfg.max_attempts, "b_format": cfg.b_format, "expected_devices": cfg.devices,
           "start_timeout_s": 60.0, "seed": cfg.seed}
    return Prepared(out, Xtr, ytr, Xte, yte, Zte, shards, holdouts, profiles, extractor, job)


def run(cfg: SimConfig, quiet: bool = False) -> dict:
    """One Fed3R (or, with ``cfg.secure``, Fed3R-Sync) job on the emulated fleet, checked against
    the centralized ridge solution on the same devices' data."""
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    t_start = time.monotonic()
    prep = prepare(cfg, say)
    out, job, secure = prep.out, dict(prep.fed3r_job), None
    if cfg.secure:
        job_fields, secure = _secure_setup(cfg, out, [p.device_id for p in prep.profiles],
                                           max(len(s) for s in prep.shards.values()))
        job.update(job_fields)
    kind = f"{cfg.classifier}-sync" if cfg.secure else cfg.classifier
    if cfg.dp_epsilon:
        from .dp_fleet import dp_job_fields

        job.update(dp_job_fields(cfg, kind, job))
    with EmulatedFleet(cfg, out, prep.profiles, secure, quiet) as fleet:
        results = fleet.run_job(kind, job, out, out / "eval_features.npz", cfg.devices)
    report = job_report(cfg, results, fleet.worker_stats, prep)
    report["wall_s"] = time.monotonic() - t_start
    report["broker_rss_mb"] = fleet.broker_rss_mb
    if cfg.ray:
        report["ray_placement"] = fleet.hosts.placement
    (out / "report.json").write_text(json.dumps(report, indent=1))
    say(format_report(report))
    return report


def _secure_setup(cfg: SimConfig, out: Path, device_ids: list[str], max_samples: int) -> tuple[dict, dict]:
    """Identities for a secure run: the aggregator's key file and the enrolled public keys (job
    fields), and what the workers get: each device's private key and the aggregator's public key."""
    from .emulation.identities import make_identities

    key_fields, for_workers = make_identities(out, device_ids)
    job_fields = {"graph": cfg.secure_graph, "max_samples": int(max_samples),
                  "phase_timeout_s": cfg.phase_timeout_s * cfg.oneshot_timeout_factor,
                  "b_format": "dense", **key_fields}
    return job_fields, for_workers
