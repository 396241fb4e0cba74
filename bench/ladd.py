"""LADD costs: per-round device compute, bytes per device, aggregator time, style upload size.

Two parts, both measured in this run:

1. In-process, on the real code paths: the encoded size of a ``ladd.style`` result (the
   one-off style upload), of ``ladd.train`` tasks by what they carry (model; + teacher when
   it differs from the model; + the KD teacher until the device confirms it) and of a
   result; the device time of a training task cold (encoder features and KD targets
   computed and cached) and warm (the same task again); the aggregator's time to close a
   round of κ updates (cluster-specific averaging + teacher updates) and to pre-train.
2. Over a real mosquitto: one seed of the ``ladd`` simulate pipeline (``--quick`` for its
   seconds-long size), from which the workers' per-device bytes and task times and the
   service's per-round aggregation time are read.

Ratios printed: style upload / model update upload, cold / warm device compute, model
tensor / full exchanged state.
Usage: .venv/bin/python bench/ladd.py [--quick] [--seed 0]. Writes runs/bench/ladd.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aggregator.jobs.ladd import LaddConfig, LaddJob  # noqa: E402
from edge_client.models.segmentation import SegmentationModel  # noqa: E402
from edge_client.tasks.ladd_training import LaddStyleTask, LaddTrainTask  # noqa: E402
from fedfleet.emulation.synthetic_scenes import make_benchmark  # noqa: E402
from fedfleet.ladd.aggregator_process import make_pretrainer, segmentation_spec  # noqa: E402
from fedfleet.ladd.config import QUICK, LaddSimConfig  # noqa: E402
from fedfleet.ladd.run import job_configs, run_ladd  # noqa: E402
from protocols import messages as M  # noqa: E402
from protocols.envelope import decode, encode  # noqa: E402
from protocols.payloads.ladd import make_layout, pack  # noqa: E402
from protocols.rounds import RoundClosed  # noqa: E402

OUT_DIR = ROOT / "runs" / "bench"


def task_bytes(job: LaddJob, device: str) -> tuple[int, dict, dict]:
    params, tensors = job.task_for(device)
    msg = M.task_message("aggregator", job.config.job_id, job.round, job.kind, params, time.time() + 60)
    msg.tensors.update(tensors)
    data = encode(msg)
    env = decode(data)
    return len(data), M.parse_task(env)[2], env.tensors


def in_process(cfg: LaddSimConfig, seed: int) -> dict:
    torch.set_num_threads(1)
    c = dataclasses.asdict(cfg)
    bench = make_benchmark(seed=seed, image_size=cfg.image_size, n_source=cfg.n_source, target_domains=cfg.domains,
                           devices_per_domain=cfg.devices_per_domain, images_per_device=cfg.images_per_device,
                           test_per_domain=0)
    devices = bench.devices
    seen: set[str] = set()
    log: dict = {}
    t0 = time.perf_counter()
    pretrainer = make_pretrainer(c, seed, bench.source_images, bench.source_labels, log)
    job = LaddJob(LaddConfig(**job_configs(cfg, seed, len(devices))["ladd"]), pretrainer=pretrainer)
    online = {d.device_id for d in devices}
    style_sizes, style_s = [], []
    parts = job.next_participants(online)
    for d in devices:
        params, _ = job.task_for(d.device_id)
        s0 = time.perf_counter()
        body, tensors = LaddStyleTask(d.images)(params)
        style_s.append(time.perf_counter() - s0)
        data = encode(M.result_message(d.device_id, M.TaskRef("j", job.round, "t"), job.kind, body, tensors))
        style_sizes.append(len(data))
        env = decode(data)
        env.sender = d.device_id
        job.apply(d.device_id, job.parse_result(env))
    c0 = time.perf_counter()
    job.close_round(RoundClosed(job.round, tuple(parts), (), (), ()))
    cluster_and_pretrain_s = time.perf_counter() - c0
    # two training rounds; every task's encoded size by what it carried, device time cold
    # (encoder features and KD targets computed) and warm (cached: the same task once more)
    shared = SegmentationModel(segmentation_spec(c), seed=seed)
    handlers = {d.device_id: LaddTrainTask(d.images, lambda spec: shared) for d in devices}
    sizes: dict[str, list[int]] = {}
    cold, warm, up, rounds = [], [], [], []
    for _ in range(2):
        parts = job.next_participants(online)
        for dev in parts:
            nbytes, params, tensors = task_bytes(job, dev)
            sizes.setdefault("+".join(sorted(tensors)), []).append(nbytes)
            s0 = time.perf_counter()
            body, out = handlers[dev](params, tensors)
            (warm if dev in seen else cold).append(time.perf_counter() - s0)
            if dev not in seen:             # the same task again, on warm caches
                s0 = time.perf_counter()
                handlers[dev](params, tensors)
                warm.append(time.perf_counter() - s0)
                seen.add(dev)
            data = encode(M.result_message(dev, M.TaskRef("j", job.round, "t"), job.kind, body, out))
            env = decode(data)
            env.sender = dev
            job.apply(dev, job.parse_result(env))
            up.append(len(data))
        job.close_round(RoundClosed(job.round, tuple(parts), (), (), ()))
        rounds.append({"aggregate_s": job.round_log[-1]["aggregate_s"], "participants": len(parts)})
    state = job.pretrained
    return {"style_result_bytes": int(np.mean(style_sizes)), "style_values": int(job.styles[devices[0].device_id].size),
            "style_extract_s_mean": float(np.mean(style_s)), "cluster_and_pretrain_s": cluster_and_pretrain_s,
            "pretrain_s": log["fda"]["seconds"], "exchanged_values": int(pack(state, make_layout(state)).size),
            "trainable_values": int(sum(state[k].size for k in job.trainable)), "rounds": rounds,
            "task_bytes": {k: float(np.mean(v)) for k, v in sizes.items()}, "result_bytes": float(np.mean(up)),
            "device_cold_s": float(np.mean(cold)), "device_warm_s": float(np.mean(warm)),
            "setup_s": time.perf_counter() - t0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    base = {**QUICK} if args.quick else {}
    cfg = LaddSimConfig(**{**base, "seeds": (args.seed,), "out_dir": str(OUT_DIR / "ladd-run"),
                           "evaluate_rounds": False})
    local = in_process(cfg, args.seed)
    print(f"LADD costs, {cfg.image_size}px, head {cfg.head_channels} ch, trainable scope {cfg.trainable_scope}")
    print(f"  style upload            {local['style_result_bytes']} B per device, once "
          f"({local['style_values']} float32 = {4 * local['style_values']} B of payload); "
          f"extraction {1e3 * local['style_extract_s_mean']:.1f} ms")
    print(f"  exchanged state         {local['exchanged_values']} values; trainable on device "
          f"{local['trainable_values']} ({local['trainable_values'] / local['exchanged_values']:.0%})")
    tb = local["task_bytes"]
    model_bytes = 4 * local["exchanged_values"]
    print("  task download           " + ", ".join(f"{k}: {v / 1e3:.1f} kB"
                                                    for k, v in sorted(tb.items(), key=lambda kv: kv[1]))
          + f"  (each model tensor {model_bytes / 1e3:.1f} kB)")
    print(f"  update upload           {local['result_bytes'] / 1e3:.1f} kB per device per round "
          f"(update / one model tensor = {local['result_bytes'] / model_bytes:.3f}); "
          f"style upload / update = {local['style_result_bytes'] / local['result_bytes']:.4f}")
    print(f"  device compute / task   cold {1e3 * local['device_cold_s']:.0f} ms (encoder features + KD targets), "
          f"warm {1e3 * local['device_warm_s']:.0f} ms (cached)  (ratio {local['device_cold_s'] / local['device_warm_s']:.2f})")
    print(f"  aggregator / round      {1e3 * local['rounds'][-1]['aggregate_s']:.2f} ms aggregation + teachers "
          f"({local['rounds'][-1]['participants']} updates); clustering + pre-training {local['cluster_and_pretrain_s']:.1f} s")
    report = run_ladd(cfg, quiet=True)
    seed = report["seeds"][str(args.seed)]
    costs = seed["costs"]
    print(f"over mosquitto ({cfg.devices_per_domain * len(cfg.domains)} devices, {cfg.rounds} rounds x "
          f"{cfg.clients_per_round}, LADD then FedAvg+ST):")
    print(f"  device train task       mean {costs['device_train_s_mean']:.3f} s"
          f" over {costs['train_tasks']} tasks; style task {costs['device_style_s_mean']:.3f} s")
    print(f"  bytes per device        up {costs['bytes_up_per_device'] / 1e3:.1f} kB, "
          f"down {costs['bytes_down_per_device'] / 1e3:.1f} kB (whole run)")
    print("  aggregator per round    " + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in
                                                    costs["aggregate_s_per_round"].items()))
    print("  pre-training            " + ", ".join(f"{k} {v:.1f} s" for k, v in costs["pretrain_s"].items()))
    print("  mIoU                    " + ", ".join(f"{m} {v['miou']:.4f}" for m, v in seed["methods"].items()))
    (OUT_DIR / "ladd.json").write_text(json.dumps({"in_process": local, "mqtt": {"costs": costs,
                                                   "miou": {m: v["miou"] for m, v in seed["methods"].items()}}},
                                                  indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
