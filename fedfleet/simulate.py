"""``fedfleet simulate``: an emulated fleet against a real broker and the real aggregator.

Processes: this one (orchestration, progress, the independent centralized reference), one
aggregator process (``python -m aggregator serve``), and W worker processes each hosting a share
of the devices (``python -m fedfleet.emulation.worker``), forks of servers that imported their
code once (``emulation/fork_server.py``). All talk only through MQTT.

The centralized reference is computed in this process, independently of the aggregator
(``simulate_report.py``, which also says what the run reports).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_client.data import load_fashion_mnist
from protocols.mqtt_eventloop import raise_open_file_limit
from protocols.topics import Topics

from .emulation.broker import BrokerTree, loopback_sources
from .emulation.fork_server import ForkServer, shared_server
from .emulation.local_hosts import LocalHosts
from .emulation.processes import stop_all
from .emulation.partition import make_split, train_holdout_split
from .emulation.profiles import sample_profiles
from .errors import UserError
from .sim_config import SimConfig
from .progress import StatusWatcher
from .simulate_report import format_report, job_report

DEVICE_STATE = "device_state"     # <out>/device_state/<device id>: each emulated device's own store


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
            # that a device host holds the device's code only, as a device does, not the server's.
            # The process's kept servers: its later fleets start none (each start ~2 CPU-s of imports)
            self.job_processes = shared_server(["aggregator", "fedfleet.ladd.aggregator_process"], self.env)
            specs = self.worker_specs()
            if cfg.ray:
                from .emulation.ray_hosts import RayHosts

                self.hosts = RayHosts(cfg.ray, self.out)
            else:
                self.host_processes = shared_server(["fedfleet.emulation.worker"], self.env)
                self.hosts = LocalHosts(self.out, self.host_processes, self.env)
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
                # each device's own store, <state_dir>/<device id>: its per-job state and its Fed3R sample
                # windows (without one a device declines DP caps and streaming: edge_client/sample_windows.py)
                "state_dir": str(out / DEVICE_STATE),
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
        agg = self.job_processes.start(module_args[0], module_args[1:], log_file, env=self.env)
        try:
            rc = agg.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = -1
        finally:
            stop_all([agg], first_is_done=False)
        if rc != 0:
            raise RuntimeError(f"{what} aggregator failed (exit {rc}); log tail:\n{log_file.read_text()[-3000:]}")

    def __exit__(self, *exc) -> None:
        """Stop the hosts, then the broker, whatever stopping the hosts raised (a host fork server
        that died left mosquitto running). The fork servers are the process's, kept for its next
        fleet (``shared_server``)."""
        self.broker_rss_mb = self.broker.rss_mb() if self.broker else None
        try:
            if self.hosts is not None:
                self.worker_stats = self.hosts.stop()
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
    # a fresh fleet each run: an earlier run's device stores in the same --out (kept job state, Fed3R
    # sample windows) describe another fleet's data, and this run's devices would decline windows
    # near the old ones or load another job's state
    shutil.rmtree(out / DEVICE_STATE, ignore_errors=True)
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
