"""The LADD comparison end to end: per seed the benchmark, the emulated fleet, the aggregator
process, then an evaluation of every saved model that is independent of the aggregator."""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from fedfleet.emulation.identities import make_identities
from fedfleet.emulation.synthetic_scenes import CLASSES, make_benchmark
from fedfleet.ladd.aggregator_process import segmentation_spec
from fedfleet.ladd.config import METHODS, LaddSimConfig
from fedfleet.ladd.metrics import TestSets, split_cluster_models
from fedfleet.ladd.report import format_report, plots
from fedfleet.sim_config import SimConfig


from fedfleet.simulate import EmulatedFleet


def job_configs(cfg: LaddSimConfig, seed: int, n_devices: int) -> dict:
    """The LADD and FedAvg+ST job configs: every recipe field the experiment shares with
    :class:`aggregator.jobs.ladd.LaddConfig` is taken by name (the experiment's values, not restated
    here), the rest is what this comparison fixes."""
    from aggregator.jobs.ladd import LaddConfig
    from edge_client.models import weights_sha256

    shared = {f.name for f in dataclasses.fields(LaddConfig)} & {f.name for f in dataclasses.fields(cfg)}
    common = {name: getattr(cfg, name) for name in sorted(shared - {"cluster_scope"})}
    common.update(model=segmentation_spec(dataclasses.asdict(cfg)).to_dict(),
                  weights_sha256=weights_sha256("mobilenet_v2"), expected_devices=n_devices, start_timeout_s=120.0,
                  seed=seed)
    common.update(cfg.secure_job_fields())
    ladd = dict(common, job_id=f"ladd-s{seed}", clustering="styles", cluster_scope=cfg.cluster_scope)
    base = dict(common, job_id=f"fedavg-st-s{seed}", clustering="none")
    if not cfg.baseline_kd:
        base.update(kd_lambda=0.0, swa_start=0)
    return {"ladd": ladd, "fedavg_st": base}


def run_seed(cfg: LaddSimConfig, seed: int, broker_url: str, say) -> dict:
    from aggregator.strategies.ladd import clustering_purity, nearest_centroid
    from edge_client.models.segmentation import SegmentationModel

    from fedfleet.emulation.profiles import sample_profiles

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
    jobs = job_configs(cfg, seed, len(ids))
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
        fleet.run_aggregator(["fedfleet.ladd.aggregator_process", str(out / "aggregator.spec.json")],
                             out / "aggregator.log", "LADD", cfg.timeout_s * 2 + 120)
    federated_s = time.monotonic() - t_start

    # ---- evaluation, independent of the aggregator: saved models on the labelled test sets
    model = SegmentationModel(segmentation_spec(dataclasses.asdict(cfg)), seed=seed)
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
    from fedfleet.emulation.broker import MosquittoBroker

    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    n = cfg.devices_per_domain * len(cfg.domains)
    say(f"fedfleet simulate ladd: {n} devices, {len(cfg.domains)} target domains ({', '.join(cfg.domains)}), "
        f"seeds {list(cfg.seeds)}, {cfg.rounds} rounds x {cfg.clients_per_round} devices, {cfg.image_size}px")
    broker = None if cfg.broker else MosquittoBroker().start()
    try:
        seeds = {s: run_seed(cfg, s, cfg.broker or broker.url, say) for s in cfg.seeds}
    finally:
        if broker:
            broker.stop()
    report = {"config": dataclasses.asdict(cfg), "seeds": {str(s): r for s, r in seeds.items()},
              "summary": _summary(seeds), "wall_s": time.monotonic() - t0}
    report["plots"] = plots(report, out)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(format_report(report))
    say(format_report(report))
    return report
