"""The ``ladd`` simulate pipeline: LADD vs FedAvg + self-training vs source-only over a real broker.

Per seed (the benchmark, the fleet's sampling and the head initialisation all follow it):

1. This process draws the synthetic benchmark (``fedfleet.emulation.synthetic_scenes``): a
   labelled source domain for the server, ``devices_per_domain`` unlabelled devices in each
   target domain, and per-domain test sets whose labels are only used for evaluation.
2. It runs the devices on :class:`fedfleet.simulate.EmulatedFleet`'s device hosts (the same
   emulation stack as every other pipeline; a LADD device's handlers, ``ladd.style`` and
   ``ladd.train`` on its own images, come from ``edge_client.handlers.ladd_handlers``), and one
   aggregator process (``python -m fedfleet.ladd_pipeline aggregator SPEC``) that runs the
   real ``AggregatorService`` three times over: the LADD job (style round -> clustering ->
   FDA pre-training on the source set -> T cluster-aware rounds), then the FedAvg +
   self-training job (same pre-trained model, one cluster), then trains the source-only
   model (no FDA). This is the layer allowed to import both sides: it injects the
   ``edge_client`` network into the aggregator's model-agnostic pre-training and evaluation
   (a LADD job built from its config alone starts from a stored pretrained network instead:
   ``LaddConfig.initial_model_file``, what ``aggregator serve`` and the admin API run).
3. It evaluates every saved model on the target test sets (mIoU per domain, per cluster;
   test images routed to the nearest style centroid for LADD), computes clustering purity
   against the true domains, and collects per-round costs from the workers and the service.

With ``secure`` (``--secure``) both federated jobs run as ``SecureLaddJob``
(``aggregator/jobs/secure_ladd.py``): every training round's updates reach the aggregator only
as one SecAgg(+) sum of cluster-slot vectors; the pipeline makes Ed25519 identities for the
aggregator and every device (key files under the seed's output directory).

``run_ladd(cfg) -> report`` is the entry point; ``add_ladd_arguments`` /
``ladd_config_from_args`` wire it into a CLI. ``--quick`` is a seconds-long variant for tests.

Method definitions (docs/ladd.md): *source-only* = trained on the source set without style
augmentation; *FDA pre-trained* = the common starting point of both federated methods;
*FedAvg + ST* = FedAvg over all tensors with the same local self-training objective
(pseudo-labels + KD, SWA teacher) but one global model, i.e. LADD without clusters
(``baseline_kd=False`` drops KD and SWA, the paper's Table 5 row); *LADD* = clusters of styles,
cluster-specific θ_c.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .emulation.identities import make_identities
from .emulation.synthetic_scenes import CLASSES, TARGET_DOMAINS, make_benchmark
from .simulate import EmulatedFleet, SimConfig

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
    secure_graph: str = "complete"             # complete (SecAgg) | regular (SecAgg+)
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


# ----------------------------------------------------------------------------- evaluation
def confusion(labels: np.ndarray, preds: np.ndarray, num_classes: int) -> np.ndarray:
    """(C, C) counts, rows = true class, columns = predicted; pixels labelled 255 are skipped."""
    labels, preds = np.asarray(labels).ravel().astype(np.int64), np.asarray(preds).ravel().astype(np.int64)
    ok = labels != 255
    return np.bincount(labels[ok] * num_classes + preds[ok], minlength=num_classes ** 2).reshape(num_classes,
                                                                                               num_classes)


def miou(cm: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean IoU over the classes that occur (as truth or prediction), and the per-class IoU."""
    inter = np.diag(cm).astype(np.float64)
    union = cm.sum(0) + cm.sum(1) - inter
    iou = np.where(union > 0, inter / np.maximum(union, 1), np.nan)
    return float(np.nanmean(iou)) if (union > 0).any() else float("nan"), iou


class TestSets:
    """Per-domain test images with cached encoder features and per-image styles."""

    def __init__(self, model, test: dict[str, tuple[np.ndarray, np.ndarray]], style_b: int):
        from edge_client.style import image_styles

        self.domains = sorted(test)
        self.labels = {d: test[d][1] for d in self.domains}
        self.frozen = {d: model.frozen_features(test[d][0]) for d in self.domains}
        self.styles = {d: image_styles(test[d][0], style_b).reshape(len(test[d][0]), -1) for d in self.domains}

    def evaluate(self, model, cluster_arrays: dict[int, dict[str, np.ndarray]], centroids: np.ndarray | None,
                 num_classes: int) -> dict:
        """Segment every test image with the model of its cluster (nearest centroid; cluster 0 without)."""
        from aggregator.strategies.ladd import nearest_centroid

        cms = {d: np.zeros((num_classes, num_classes), np.int64) for d in self.domains}
        cluster_cms: dict[int, np.ndarray] = {}
        routing = {}
        for d in self.domains:
            routed = (nearest_centroid(self.styles[d], centroids) if centroids is not None
                      else np.zeros(len(self.labels[d]), np.int64))
            routing[d] = np.bincount(routed, minlength=len(cluster_arrays)).tolist()
            for c in np.unique(routed):
                rows = np.flatnonzero(routed == c)
                model.load_exchanged(cluster_arrays[int(c)])
                import torch

                pred = model.predict_logits(self.frozen[d][torch.from_numpy(rows)]).argmax(1).numpy()
                cm = confusion(self.labels[d][rows], pred, num_classes)
                cms[d] += cm
                cluster_cms[int(c)] = cluster_cms.get(int(c), 0) + cm
        per_domain = {d: miou(cms[d])[0] for d in self.domains}
        pooled = sum(cms.values())
        return {"miou": float(np.mean(list(per_domain.values()))), "per_domain": per_domain,
                "per_cluster": {str(c): miou(cm)[0] for c, cm in sorted(cluster_cms.items())},
                "per_class": dict(zip(CLASSES, np.round(miou(pooled)[1], 4).tolist())),
                "routing": routing}


def split_cluster_models(arrays: dict[str, np.ndarray]) -> tuple[dict[int, dict[str, np.ndarray]], np.ndarray | None]:
    """model.npz of a LADD job -> ({c: φ ∪ θ_c}, centroids or None)."""
    phi = {k[4:]: v for k, v in arrays.items() if k.startswith("phi.")}
    thetas: dict[int, dict] = collections.defaultdict(dict)
    for k, v in arrays.items():
        if k.startswith("theta."):
            _, c, name = k.split(".", 2)
            thetas[int(c)][name] = v
    models = {c: {**phi, **theta} for c, theta in sorted(thetas.items())} or {0: phi}
    return models, arrays.get("style_centroids")


# ----------------------------------------------------------------------------- the aggregator process
def _segmentation_spec(cfg: dict):
    from edge_client.models.segmentation import SegmentationSpec

    return SegmentationSpec(num_classes=len(CLASSES), image_size=cfg["image_size"], output_stride=cfg["output_stride"],
                            tail_blocks=cfg["tail_blocks"], head_channels=cfg["head_channels"])


def make_pretrainer(cfg: dict, seed: int, images: np.ndarray, labels: np.ndarray, log: dict):
    """style bank -> (pre-trained exchanged state, trainable names); also used with an empty bank."""
    from fedfleet.ladd.pretrain import PretrainRecipe, pretrain
    from edge_client.models.segmentation import SegmentationModel

    def run(bank: np.ndarray | None) -> tuple[dict[str, np.ndarray], list[str]]:
        model = SegmentationModel(_segmentation_spec(cfg), seed=seed)
        names = [n for n, _ in model.named_parameters() if n.startswith(("tail.", "head."))]
        params = model.set_trainable(names)
        recipe = PretrainRecipe(steps=cfg["pretrain_steps"], batch_size=cfg["pretrain_batch"], lr=cfg["pretrain_lr"],
                                style_prob=cfg["pretrain_style_prob"] if bank is not None else 0.0,
                                pool_copies=cfg["pool_copies"], seed=seed)
        report = pretrain(model, params, images, labels, bank, recipe)
        model.set_trainable(())
        log["fda" if bank is not None else "source_only"] = dataclasses.asdict(report)
        return model.exchanged_state(), model.trainable_names(cfg["trainable_scope"])
    return run


def _serve(spec: dict) -> None:
    """Body of ``python -m fedfleet.ladd_pipeline aggregator SPEC.json``."""
    import torch

    from aggregator.jobs.ladd import LaddConfig, LaddJob
    from aggregator.jobs.secure_ladd import SecureLaddConfig, SecureLaddJob
    from aggregator.service.loop import AggregatorService
    from edge_client.models.segmentation import SegmentationModel
    from protocols.mqtt_link import BrokerConfig
    from protocols.topics import Topics

    config_cls, job_cls = (SecureLaddConfig, SecureLaddJob) if spec.get("secure") else (LaddConfig, LaddJob)
    # One intra-op thread: the workers share the cores, and on an oversubscribed machine torch's
    # thread pool made a 2 s pre-training take 28 s (spinning threads waiting for each other).
    torch.set_num_threads(1)
    cfg, out = spec["config"], Path(spec["out"])
    server = np.load(spec["server_file"])
    test = {d: (server[f"test_images.{d}"], server[f"test_labels.{d}"]) for d in cfg["domains"]}
    pre_log: dict = {}
    pretrainer = make_pretrainer(cfg, spec["seed"], server["source_images"], server["source_labels"], pre_log)
    eval_model = SegmentationModel(_segmentation_spec(cfg), seed=spec["seed"])
    tests = TestSets(eval_model, test, cfg["style_b"]) if cfg["evaluate_rounds"] else None

    def evaluator(job) -> dict:
        models = {c: job.cluster_model(c) for c in job.theta}
        centroids = job.clustering.cluster_centers_ if job.clustering is not None else None
        r = tests.evaluate(eval_model, models, centroids, len(CLASSES))
        return {"miou": r["miou"], "miou_per_domain": r["per_domain"]}

    broker = BrokerConfig.from_url(spec["broker"])
    topics = Topics(spec["topic_root"])
    enrolled = set(spec["devices"])
    timings = {}
    first = None
    for name in ("ladd", "fedavg_st"):
        job_cfg = config_cls(**spec["jobs"][name])
        initial = None if first is None else (first.pretrained, first.trainable)
        job = job_cls(job_cfg, pretrainer=pretrainer if first is None else None, initial=initial,
                      evaluator=evaluator if tests is not None else None)
        t0 = time.perf_counter()
        service = AggregatorService(job, broker, out / name, topics, enrolled=enrolled, evaluate_every_contribution=False)
        service.run(timeout_s=spec["timeout_s"])
        timings[name] = time.perf_counter() - t0
        (out / name / "job_report.json").write_text(json.dumps({**job.report(), "aggregate_s": job.aggregate_s,
                                                                "wall_s": timings[name],
                                                                "bytes_sent": service.link.bytes_sent,
                                                                "failed_rounds": getattr(job, "failed_rounds", [])}))
        if not job.finished(set(), set()):
            raise SystemExit(f"{name} job did not finish (round {job.round}, phase {job.phase})")
        if first is None:
            first = job
            np.savez(out / "fda_pretrained.npz", **job.pretrained)
    t0 = time.perf_counter()
    arrays, _ = pretrainer(None)
    timings["source_only"] = time.perf_counter() - t0
    np.savez(out / "source_only.npz", **arrays)
    (out / "aggregator_timings.json").write_text(json.dumps({"wall_s": timings, "pretrain": pre_log}))


# ----------------------------------------------------------------------------- orchestration
def _job_configs(cfg: LaddSimConfig, seed: int, n_devices: int) -> dict:
    from edge_client.models import weights_sha256

    model = _segmentation_spec(dataclasses.asdict(cfg)).to_dict()
    common = dict(model=model, weights_sha256=weights_sha256("mobilenet_v2"), style_b=cfg.style_b, k_min=cfg.k_min,
                  k_max=cfg.k_max, rounds=cfg.rounds, clients_per_round=cfg.clients_per_round,
                  local_epochs=cfg.local_epochs, batch_size=cfg.batch_size, lr=cfg.lr, kd_lambda=cfg.kd_lambda,
                  teacher_every=cfg.teacher_every, swa_start=cfg.swa_start, round_timeout_s=cfg.round_timeout_s,
                  expected_devices=n_devices, start_timeout_s=120.0, seed=seed)
    if cfg.secure:
        common.update(graph=cfg.secure_graph, phase_timeout_s=cfg.phase_timeout_s,
                      min_cluster_contributors=cfg.min_cluster_contributors,
                      max_samples=int(cfg.images_per_device[1]))
    ladd = dict(common, job_id=f"ladd-s{seed}", clustering="styles", cluster_scope=cfg.cluster_scope)
    base = dict(common, job_id=f"fedavg-st-s{seed}", clustering="none")
    if not cfg.baseline_kd:
        base.update(kd_lambda=0.0, swa_start=0)
    return {"ladd": ladd, "fedavg_st": base}


def _run_seed(cfg: LaddSimConfig, seed: int, broker_url: str, say) -> dict:
    from aggregator.strategies.ladd import clustering_purity, nearest_centroid
    from edge_client.models.segmentation import SegmentationModel

    from .emulation.profiles import sample_profiles

    out = Path(cfg.out_dir) / f"seed{seed}"
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    bench = make_benchmark(seed=seed, image_size=cfg.image_size, n_source=cfg.n_source, target_domains=cfg.domains,
                           devices_per_domain=cfg.devices_per_domain, images_per_device=cfg.images_per_device,
                           test_per_domain=cfg.test_per_domain)
    np.savez(out / "devices.npz", **{d.device_id: d.images for d in bench.devices})
    np.savez(out / "server.npz", source_images=bench.source_images, source_labels=bench.source_labels,
             **{f"test_images.{d}": v[0] for d, v in bench.test.items()},
             **{f"test_labels.{d}": v[1] for d, v in bench.test.items()})
    say(f"[seed {seed}] {len(bench.devices)} devices in {len(cfg.domains)} domains, "
        f"{sum(len(d.images) for d in bench.devices)} unlabelled images, {cfg.n_source} source images "
        f"({time.monotonic() - t_start:.1f}s)")
    ids = [d.device_id for d in bench.devices]
    profiles = [dataclasses.replace(p, device_id=i) for p, i in zip(
        sample_profiles(len(ids), seed, slowdown=cfg.slowdown, bandwidth_bps=None, dropout_prob=cfg.dropout_prob), ids)]
    topic_root = f"{cfg.topic_root}-ladd-s{seed}"
    jobs = _job_configs(cfg, seed, len(ids))
    keys = None
    if cfg.secure:
        key_fields, keys = make_identities(out, ids)
        jobs = {name: {**fields, **key_fields} for name, fields in jobs.items()}
    agg_spec = {"config": dataclasses.asdict(cfg), "seed": seed, "out": str(out), "server_file": str(out / "server.npz"),
                "broker": broker_url, "topic_root": topic_root, "devices": ids, "timeout_s": cfg.timeout_s,
                "jobs": jobs, "secure": cfg.secure}
    (out / "aggregator.spec.json").write_text(json.dumps(agg_spec))
    # the devices: EmulatedFleet's hosts (LADD devices on their own images); the aggregator: this
    # pipeline's process, which runs both federated jobs with the pre-training and the evaluator
    sim = SimConfig(devices=len(ids), broker=broker_url, topic_root=topic_root, workers=cfg.workers, seed=seed,
                    runtime=cfg.device_runtime, retry_after_s=5.0, host_threads=4)
    with EmulatedFleet(sim, out, profiles, keys, quiet=True, ladd_devices_file=out / "devices.npz") as fleet:
        fleet.run_aggregator(["fedfleet.ladd_pipeline", "aggregator", str(out / "aggregator.spec.json")],
                             out / "aggregator.log", "LADD", cfg.timeout_s * 2 + 120)
    federated_s = time.monotonic() - t_start

    # ---- evaluation, independent of the aggregator: saved models on the labelled test sets
    model = SegmentationModel(_segmentation_spec(dataclasses.asdict(cfg)), seed=seed)
    tests = TestSets(model, bench.test, cfg.style_b)
    C = len(CLASSES)
    methods = {"source_only": tests.evaluate(model, {0: dict(np.load(out / "source_only.npz"))}, None, C),
               "fda_pretrained": tests.evaluate(model, {0: dict(np.load(out / "fda_pretrained.npz"))}, None, C)}
    histories = {}
    for name in ("fedavg_st", "ladd"):
        models, centroids = split_cluster_models(dict(np.load(out / name / "model.npz")))
        methods[name] = tests.evaluate(model, models, centroids, C)
        results = json.loads((out / name / "results.json").read_text())
        histories[name] = [{"train_round": h["train_round"], "miou": h["miou"]} for h in results["history"]
                           if "miou" in h]
    job_reports = {n: json.loads((out / n / "job_report.json").read_text()) for n in ("ladd", "fedavg_st")}
    ladd_report = job_reports["ladd"]
    domain_of = {d.device_id: d.domain for d in bench.devices}
    assigned = sorted(ladd_report["assignment"])
    centroids = split_cluster_models(dict(np.load(out / "ladd" / "model.npz")))[1]
    routed = {d: nearest_centroid(tests.styles[d], centroids) for d in tests.domains}
    clustering = {
        "k": ladd_report["n_clusters"],
        "silhouette": ladd_report["silhouette_scores"].get(str(ladd_report["n_clusters"])),
        "silhouette_scores": ladd_report["silhouette_scores"],
        "purity": clustering_purity([ladd_report["assignment"][d] for d in assigned], [domain_of[d] for d in assigned]),
        "test_routing_purity": clustering_purity(np.concatenate(list(routed.values())),
                                                 np.concatenate([[d] * len(v) for d, v in routed.items()])),
        "devices_per_cluster": dict(collections.Counter(str(c) for c in ladd_report["assignment"].values())),
    }
    workers = {d: stats for w in fleet.worker_stats for d, stats in w["per_device"].items()}
    timings = json.loads((out / "aggregator_timings.json").read_text())
    report = {"seed": seed, "methods": methods, "clustering": clustering, "histories": histories,
              "costs": _costs(workers, job_reports, timings, cfg), "wall_s": time.monotonic() - t_start,
              "secure_failed_rounds": {n: r.get("failed_rounds", []) for n, r in job_reports.items()},
              "federated_wall_s": federated_s}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    say(f"[seed {seed}] mIoU " + "  ".join(f"{m}={methods[m]['miou']:.4f}" for m in METHODS) +
        f"  | k={clustering['k']} purity={clustering['purity']:.3f} ({report['wall_s']:.0f}s)")
    return report


def _costs(workers: dict, job_reports: dict, timings: dict, cfg: LaddSimConfig) -> dict:
    """Per-device costs from the device hosts' statistics (per device: bytes, and per task kind:
    tasks and compute seconds; a secure training task's compute is its masked update)."""
    def kind_totals(prefix: str) -> tuple[int, float]:
        entries = [e for w in workers.values() for k, e in w["by_kind"].items() if k.startswith(prefix)]
        return sum(e["tasks"] for e in entries), sum(e["compute_s"] for e in entries)

    train_tasks, train_s = kind_totals("ladd.train")
    style_tasks, style_s = kind_totals("ladd.style")
    n_dev = max(1, len(workers))
    return {
        "device_train_s_mean": train_s / train_tasks if train_tasks else None,
        "device_style_s_mean": style_s / style_tasks if style_tasks else None,
        "train_tasks": train_tasks,
        "bytes_up_per_device": sum(w["bytes_up"] for w in workers.values()) / n_dev,
        "bytes_down_per_device": sum(w["bytes_down"] for w in workers.values()) / n_dev,
        "aggregate_s_per_round": {n: (r["aggregate_s"] / max(1, cfg.rounds)) for n, r in job_reports.items()},
        "pretrain_s": {k: v["seconds"] for k, v in timings["pretrain"].items()},
        "job_wall_s": timings["wall_s"],
    }


def _summary(seeds: dict[int, dict]) -> dict:
    out = {"miou": {}}
    for m in METHODS:
        vals = [r["methods"][m]["miou"] for r in seeds.values()]
        per_domain = {d: float(np.mean([r["methods"][m]["per_domain"][d] for r in seeds.values()]))
                      for d in next(iter(seeds.values()))["methods"][m]["per_domain"]}
        out["miou"][m] = {"mean": float(np.mean(vals)), "std": float(np.std(vals)), "per_seed": vals,
                          "per_domain": per_domain}
    mean = {m: out["miou"][m]["mean"] for m in METHODS}
    out["ordering_source_lt_fedavg_lt_ladd"] = bool(mean["source_only"] < mean["fedavg_st"] < mean["ladd"])
    for key in ("purity", "silhouette", "test_routing_purity", "k"):
        out[key] = [r["clustering"][key] for r in seeds.values()]
    return out


def run_ladd(cfg: LaddSimConfig, quiet: bool = False) -> dict:
    """Run the whole comparison; writes report.json, report.md and plots under ``cfg.out_dir``."""
    from .emulation.broker import MosquittoBroker

    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    n = cfg.devices_per_domain * len(cfg.domains)
    say(f"fedfleet simulate ladd: {n} devices, {len(cfg.domains)} target domains ({', '.join(cfg.domains)}), "
        f"seeds {list(cfg.seeds)}, {cfg.rounds} rounds x {cfg.clients_per_round} devices, {cfg.image_size}px")
    broker = None if cfg.broker else MosquittoBroker().start()
    try:
        seeds = {s: _run_seed(cfg, s, cfg.broker or broker.url, say) for s in cfg.seeds}
    finally:
        if broker:
            broker.stop()
    report = {"config": dataclasses.asdict(cfg), "seeds": {str(s): r for s, r in seeds.items()},
              "summary": _summary(seeds), "wall_s": time.monotonic() - t0}
    report["plots"] = _plots(report, out)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(format_report(report))
    say(format_report(report))
    return report


def format_report(r: dict) -> str:
    s = r["summary"]
    lines = ["", "=== fedfleet simulate: LADD (mIoU on the target test sets, mean of per-domain mIoU) ===",
             f"{'method':<16}{'mean':>8}{'std':>8}   per seed"]
    for m in METHODS:
        v = s["miou"][m]
        lines.append(f"{m:<16}{v['mean']:>8.4f}{v['std']:>8.4f}   " + " ".join(f"{x:.4f}" for x in v["per_seed"]))
    domains = list(s["miou"]["ladd"]["per_domain"])
    lines += ["", f"{'per domain':<16}" + "".join(f"{d:>10}" for d in domains)]
    for m in METHODS:
        lines.append(f"{m:<16}" + "".join(f"{s['miou'][m]['per_domain'][d]:>10.4f}" for d in domains))
    for seed, rep in r["seeds"].items():
        ladd = rep["methods"]["ladd"]
        majority = {str(c): max(ladd["routing"], key=lambda d: ladd["routing"][d][int(c)]) for c in ladd["per_cluster"]}
        lines.append(f"LADD seed {seed} per cluster (test images routed by style; majority domain): " +
                     ", ".join(f"c{c}[{majority[c]}] {v:.4f}" for c, v in ladd["per_cluster"].items()))
    lines += ["", f"clusters k per seed {s['k']}, silhouette {[round(x, 3) for x in s['silhouette']]}, "
              f"purity {[round(x, 3) for x in s['purity']]}, test-image routing purity "
              f"{[round(x, 3) for x in s['test_routing_purity']]}",
              f"source-only < FedAvg+ST < LADD: {s['ordering_source_lt_fedavg_lt_ladd']}",
              f"wall time {r['wall_s']:.0f}s"]
    if r["config"].get("secure"):
        failed = {seed: {n: len(v) for n, v in rep.get("secure_failed_rounds", {}).items()}
                  for seed, rep in r["seeds"].items()}
        lines.insert(-1, f"secure aggregation ({r['config']['secure_graph']}): training rounds summed under SecAgg; "
                         f"failed (nothing applied) per seed {failed}")
    return "\n".join(lines)


def _plots(report: dict, out: Path) -> list[str]:
    """Bar chart of mIoU per method (mean ± std over seeds) and mIoU per round (PNG, Pillow)."""
    try:
        from PIL import Image, ImageDraw
    except ImportError:  # pragma: no cover - depends on the install
        return []
    s = report["summary"]["miou"]
    W, H, pad = 640, 360, 50
    img = Image.new("RGB", (W, H), "white")
    g = ImageDraw.Draw(img)
    vals = [s[m]["mean"] for m in METHODS]
    lo = max(0.0, min(vals) - 0.1)
    hi = min(1.0, max(vals) + 0.05)
    y = lambda v: H - pad - (v - lo) / max(hi - lo, 1e-9) * (H - 2 * pad)
    g.line([(pad, pad), (pad, H - pad), (W - pad, H - pad)], fill="black")
    for t in np.linspace(lo, hi, 5):
        g.text((5, y(t) - 6), f"{t:.2f}", fill="black")
    bw = (W - 2 * pad) / len(METHODS)
    colours = ["#999999", "#77aadd", "#ee8866", "#44bb99"]
    for i, m in enumerate(METHODS):
        x0 = pad + i * bw + bw * 0.15
        g.rectangle([x0, y(s[m]["mean"]), x0 + bw * 0.7, H - pad], fill=colours[i])
        xc = x0 + bw * 0.35
        g.line([(xc, y(s[m]["mean"] - s[m]["std"])), (xc, y(s[m]["mean"] + s[m]["std"]))], fill="black", width=2)
        g.text((x0, H - pad + 8), m, fill="black")
        g.text((x0, y(s[m]["mean"]) - 14), f"{s[m]['mean']:.3f}", fill="black")
    g.text((pad, 10), "mIoU on target test sets (mean ± std over seeds)", fill="black")
    paths = [out / "ladd_miou.png"]
    img.save(paths[0])
    curves = {}
    for m in ("fedavg_st", "ladd"):
        runs = [r["histories"][m] for r in report["seeds"].values() if r["histories"].get(m)]
        if runs:
            rounds = sorted({h["train_round"] for run in runs for h in run})
            curves[m] = (rounds, [float(np.mean([h["miou"] for run in runs for h in run if h["train_round"] == t]))
                                  for t in rounds])
    if curves:
        img = Image.new("RGB", (W, H), "white")
        g = ImageDraw.Draw(img)
        allv = [v for _, ys in curves.values() for v in ys] + [s["fda_pretrained"]["mean"], s["source_only"]["mean"]]
        lo, hi = min(allv) - 0.02, max(allv) + 0.02
        tmax = max(max(xs) for xs, _ in curves.values())
        x = lambda t: pad + t / max(tmax, 1) * (W - 2 * pad)
        y = lambda v: H - pad - (v - lo) / max(hi - lo, 1e-9) * (H - 2 * pad)
        g.line([(pad, pad), (pad, H - pad), (W - pad, H - pad)], fill="black")
        for t in np.linspace(lo, hi, 5):
            g.text((5, y(t) - 6), f"{t:.3f}", fill="black")
        for t in range(0, tmax + 1, max(1, tmax // 6)):
            g.text((x(t) - 3, H - pad + 6), str(t), fill="black")
        g.text((W // 2 - 20, H - pad + 22), "round", fill="black")
        start = s["fda_pretrained"]["mean"]
        for (m, (xs, ys)), colour in zip(curves.items(), ("#ee8866", "#44bb99")):
            g.line([(x(0), y(start))] + [(x(a), y(b)) for a, b in zip(xs, ys)], fill=colour, width=2)
            g.text((W - pad - 90, y(ys[-1]) - 12), m, fill=colour)
        g.line([(pad, y(s["source_only"]["mean"])), (W - pad, y(s["source_only"]["mean"]))], fill="#999999")
        g.text((pad + 5, y(s["source_only"]["mean"]) + 2), "source-only", fill="#999999")
        g.text((pad, 10), "mIoU per round (mean over seeds); round 0 = FDA pre-trained", fill="black")
        paths.append(out / "ladd_rounds.png")
        img.save(paths[-1])
    return [str(p) for p in paths]


# ----------------------------------------------------------------------------- CLI
def add_ladd_arguments(parser: argparse.ArgumentParser) -> None:
    """LADD options for ``fedfleet simulate``; options the parser already has (--out, --broker,
    --workers, --image-size, --seed) are left alone and read by :func:`ladd_config_from_args`."""
    have = set(parser._option_string_actions)

    def add(flag, **kw):
        if flag not in have:
            parser.add_argument(flag, **kw)

    add("--quick", action="store_true", help="LADD: seconds-long run (1 seed, 8 devices, 2 rounds)")
    add("--ladd-config", help="LADD: JSON file of LaddSimConfig fields")
    add("--seeds", help="LADD: comma-separated seeds (default 0,1,2)")
    add("--devices-per-domain", type=int, help="LADD: devices per target domain (default 10)")
    add("--domains", help="LADD: comma-separated target domains (default night,fog,sunset,rain)")
    add("--rounds", type=int, help="LADD: federated rounds (default 12)")
    add("--clients-per-round", type=int, help="devices per round, every pipeline (default: the preset's; LADD 8)")
    add("--cluster-scope", choices=["head", "all"], help="LADD: cluster-specific tensors (default head)")
    add("--baseline-no-kd", action="store_true", help="LADD: FedAvg+ST with pseudo-labels only (no KD, no SWA)")
    add("--secure", action="store_true", help="LADD: sum each training round's updates under secure aggregation")
    for flag, kw in (("--out", {}), ("--broker", {}), ("--workers", {"type": int}), ("--image-size", {"type": int})):
        add(flag, **kw)


def ladd_config_from_args(args: argparse.Namespace) -> LaddSimConfig:
    base = json.loads(Path(args.ladd_config).read_text()) if getattr(args, "ladd_config", None) else {}
    if getattr(args, "quick", False):
        base = {**QUICK, "out_dir": "runs/ladd-quick", **base}
    over = {"seeds": [int(s) for s in args.seeds.split(",")] if getattr(args, "seeds", None) else None,
            "devices_per_domain": getattr(args, "devices_per_domain", None),
            "domains": args.domains.split(",") if getattr(args, "domains", None) else None,
            "rounds": getattr(args, "rounds", None), "clients_per_round": getattr(args, "clients_per_round", None),
            "cluster_scope": getattr(args, "cluster_scope", None), "out_dir": getattr(args, "out", None),
            "broker": getattr(args, "broker", None), "workers": getattr(args, "workers", None),
            "image_size": getattr(args, "image_size", None)}
    if getattr(args, "baseline_no_kd", False):
        over["baseline_kd"] = False
    if getattr(args, "secure", False):
        over["secure"] = True
    if getattr(args, "secure_graph", None):
        over["secure_graph"] = args.secure_graph
    return LaddSimConfig(**{**base, **{k: v for k, v in over.items() if v is not None}})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "aggregator":
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        spec = json.loads(Path(argv[1]).read_text())
        _serve(spec)
        return 0
    parser = argparse.ArgumentParser(prog="python -m fedfleet.ladd_pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_ladd_arguments(parser)
    run_ladd(ladd_config_from_args(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
