"""The LADD comparison's aggregator process: the real ``AggregatorService`` runs the LADD job, then
FedAvg + self-training from the same pre-trained model, then the source-only model is trained.
This layer may import both sides: it injects the device SDK's network into the aggregator's
model-agnostic pre-training and evaluation."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from fedfleet.emulation.synthetic_scenes import CLASSES
from protocols.log_text import log_to_stderr
from fedfleet.ladd.metrics import TestSets

def segmentation_spec(cfg: dict):
    from edge_client.models.segmentation import SegmentationSpec

    return SegmentationSpec(num_classes=len(CLASSES), image_size=cfg["image_size"], output_stride=cfg["output_stride"],
                            tail_blocks=cfg["tail_blocks"], head_channels=cfg["head_channels"])


def make_pretrainer(cfg: dict, seed: int, images: np.ndarray, labels: np.ndarray, log: dict):
    """style bank -> (pre-trained exchanged state, trainable names); also used with an empty bank."""
    from fedfleet.ladd.pretrain import PretrainRecipe, pretrain
    from edge_client.models.segmentation import SegmentationModel

    def run(bank: np.ndarray | None) -> tuple[dict[str, np.ndarray], list[str]]:
        model = SegmentationModel(segmentation_spec(cfg), seed=seed)
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


def serve(spec: dict) -> None:
    """Runs the LADD and FedAvg+ST jobs, then trains the source-only model (``SPEC.json`` is what
    :func:`fedfleet.ladd.run.run_seed` wrote)."""
    import torch

    from aggregator.jobs.ladd import LaddConfig, LaddJob
    from aggregator.jobs.secure_ladd import SecureLaddConfig, SecureLaddJob
    from aggregator.service.loop import AggregatorService
    from aggregator.service.settings import ServiceSettings
    from edge_client.models.segmentation import SegmentationModel
    from protocols.mqtt_link import BrokerConfig

    config_cls, job_cls = (SecureLaddConfig, SecureLaddJob) if spec.get("secure") else (LaddConfig, LaddJob)
    # One intra-op thread: the workers share the cores, and on an oversubscribed machine torch's
    # thread pool made a 2 s pre-training take 28 s (spinning threads waiting for each other).
    torch.set_num_threads(1)
    cfg, out = spec["config"], Path(spec["out"])
    server = np.load(spec["server_file"])
    test = {d: (server[f"test_images.{d}"], server[f"test_labels.{d}"]) for d in cfg["domains"]}
    pre_log: dict = {}
    pretrainer = make_pretrainer(cfg, spec["seed"], server["source_images"], server["source_labels"], pre_log)
    eval_model = SegmentationModel(segmentation_spec(cfg), seed=spec["seed"])
    tests = TestSets(eval_model, test, cfg["style_b"]) if cfg["evaluate_rounds"] else None

    def evaluator(job) -> dict:
        models = {c: job.cluster_model(c) for c in job.theta}
        centroids = job.clustering.cluster_centers_ if job.clustering is not None else None
        r = tests.evaluate(eval_model, models, centroids, len(CLASSES))
        return {"miou": r["miou"], "miou_per_domain": r["per_domain"]}

    broker = BrokerConfig.from_url(spec["broker"])
    settings = ServiceSettings(topic_root=spec["topic_root"], evaluate_every_contribution=False)
    enrolled = set(spec["devices"])
    timings = {}
    first = None
    for name in ("ladd", "fedavg_st"):
        job_cfg = config_cls(**spec["jobs"][name])
        initial = None if first is None else (first.pretrained, first.trainable)
        job = job_cls(job_cfg, pretrainer=pretrainer if first is None else None, initial=initial,
                      evaluator=evaluator if tests is not None else None)
        t0 = time.perf_counter()
        service = AggregatorService(job, broker, out / name, settings, enrolled=enrolled)
        service.run(timeout_s=spec["timeout_s"])
        timings[name] = time.perf_counter() - t0
        (out / name / "job_report.json").write_text(json.dumps({**job.report(), "aggregate_s": job.aggregate_s,
                                                                "wall_s": timings[name],
                                                                "bytes_sent": service.link.bytes_sent,
                                                                "failed_rounds": job.failed_rounds if job.secure_rounds else []}))
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m fedfleet.ladd.aggregator_process SPEC.json", file=sys.stderr)
        return 2
    log_to_stderr()
    serve(json.loads(Path(argv[0]).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
