"""Exported runtimes vs eager torch, measured in one run on this machine.

For each backbone and input size (default MobileNetV2 at 64/128/224 px) the script exports
a bundle (``export.export_bundle``, into a temporary directory), loads its three inference
artifacts through ``edge_client.runtime`` (ExecuTorch + XNNPACK, ONNX Runtime, eager torch)
and times ``run`` on real Fashion-MNIST images at batch 1 and batch 32. It then times one
SGD step of the head's training program (ExecuTorch) against the eager head.

All runtimes get the same thread count (``--threads``; torch.set_num_threads, ORT
intra-op threads, the ExecuTorch threadpool). Timings are interleaved (one call of each
runtime per round) so background load hits all of them alike, and the median of
``--repeats`` rounds after ``--warmup`` rounds is reported as ms per image (wall clock, or
with ``--clock cpu`` the process CPU time, which other load on a shared machine does not
inflate when ``--threads 1``). Ratios > 1 mean
the exported program is faster: ``eager/pte`` (target >= 3 for MobileNetV2) and
``ort/pte`` (target >= 1).

Usage: .venv/bin/python bench/export.py [--backbones mobilenet_v2,efficientnet_lite0]
       [--sizes 64,128,224] [--threads N] [--repeats 15] [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this file's directory leads sys.path and this file (export.py) would
# shadow the `export` package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]

import numpy as np  # noqa: E402  (after the sys.path fix, like the imports below)
import torch

from edge_client.data.idx import load_fashion_mnist
from edge_client.models.preprocess import to_model_input
from edge_client.runtime import TrainingSession, load_inference, read_manifest
from edge_client.runtime.onnx_runtime import OnnxRuntimeInference
from edge_client.runtime.verification import read_verified
from export import export_bundle
from export.parity import load_parity_images

RUNTIMES = ("executorch", "onnxruntime", "eager")


def set_threads(threads: int) -> None:
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

    torch.set_num_threads(threads)
    _unsafe_reset_threadpool(threads)


def load_runtimes(manifest_path: Path, threads: int) -> dict:
    runtimes = {name: load_inference(manifest_path, prefer=(name,)) for name in ("executorch", "eager")}
    manifest = read_manifest(manifest_path)
    spec = manifest.find("inference", "onnxruntime")
    runtimes["onnxruntime"] = OnnxRuntimeInference(
        read_verified(manifest, spec), spec, manifest.input.image_size, intra_op_threads=threads)
    return runtimes


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def interleaved_medians(calls: dict, warmup: int, repeats: int, clock: str) -> dict[str, float]:
    """Median seconds per call of each callable, timed round-robin."""
    now = CLOCKS[clock]
    times: dict[str, list[float]] = {name: [] for name in calls}
    for round_index in range(warmup + repeats):
        for name, call in calls.items():
            start = now()
            call()
            elapsed = now() - start
            if round_index >= warmup:
                times[name].append(elapsed)
    return {name: statistics.median(values) for name, values in times.items()}


def bench_inference(backbone: str, size: int, images: np.ndarray, args, workdir: Path) -> list[dict]:
    started = time.perf_counter()
    manifest_path = export_bundle(backbone, workdir / f"{backbone}-{size}", num_classes=10,
                                  image_size=size, training=False,
                                  parity_images=load_parity_images(count=32))
    export_seconds = time.perf_counter() - started
    manifest = read_manifest(manifest_path)
    runtimes = load_runtimes(manifest_path, args.threads)
    inputs = to_model_input(images, size, manifest.input.mean, manifest.input.std)
    rows = []
    for batch in args.batches:
        x = np.ascontiguousarray(inputs[:batch])
        medians = interleaved_medians(
            {name: (lambda runtime=runtimes[name]: runtime.run(x)) for name in RUNTIMES},
            args.warmup, args.repeats, args.clock)
        per_image_ms = {name: 1000 * seconds / batch for name, seconds in medians.items()}
        rows.append({"backbone": backbone, "size": size, "batch": batch, **per_image_ms,
                     "parity": max(spec.parity["max_abs_error"] for spec in manifest.artifacts),
                     "export_s": export_seconds})
    return rows


def bench_training(workdir: Path, features: np.ndarray, labels: np.ndarray, args) -> dict:
    manifest_path = export_bundle("mobilenet_v2", workdir / "training", num_classes=10,
                                  image_size=64, inference_runtimes=(),
                                  parity_images=load_parity_images(count=40))
    sessions = {name: TrainingSession.load(manifest_path, prefer=(name,))
                for name in ("executorch", "eager")}
    batch = sessions["executorch"].batch_size
    x, y = features[:batch], labels[:batch]
    medians = interleaved_medians(
        {name: (lambda session=session: session.train_step(x, y, 0.01))
         for name, session in sessions.items()},
        args.warmup, args.repeats * 10, args.clock)
    return {"batch": batch, **{name: 1000 * seconds for name, seconds in medians.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backbones", default="mobilenet_v2")
    parser.add_argument("--sizes", default="64,128,224")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall time, or process CPU time (with --threads 1: robust to "
                             "other load on a shared machine; it counts spin-waiting threads "
                             "otherwise)")
    parser.add_argument("--quick", action="store_true", help="64 px only, 5 repeats")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.repeats = "64", 5
    args.batches = [int(value) for value in args.batches.split(",")]
    set_threads(args.threads)

    images, labels = load_fashion_mnist("test")
    images, labels = images[:max(args.batches)], labels[:max(args.batches)]
    print(f"threads={args.threads}, {args.clock} clock, median of {args.repeats} interleaved rounds, "
          f"Fashion-MNIST test images, torch {torch.__version__}")
    with tempfile.TemporaryDirectory(prefix="fedfleet-bench-export-") as tmp:
        workdir = Path(tmp)
        rows = []
        for backbone in args.backbones.split(","):
            for size in (int(value) for value in args.sizes.split(",")):
                rows.extend(bench_inference(backbone, size, images, args, workdir))
        header = (f"{'backbone':18s} {'px':>4s} {'batch':>5s} {'pte ms/img':>11s} "
                  f"{'ort ms/img':>11s} {'eager ms/img':>13s} {'eager/pte':>10s} "
                  f"{'ort/pte':>8s} {'max|err|':>9s}")
        print(header)
        print("-" * len(header))
        for row in rows:
            print(f"{row['backbone']:18s} {row['size']:4d} {row['batch']:5d} "
                  f"{row['executorch']:11.3f} {row['onnxruntime']:11.3f} {row['eager']:13.3f} "
                  f"{row['eager'] / row['executorch']:10.2f} "
                  f"{row['onnxruntime'] / row['executorch']:8.2f} {row['parity']:9.1e}")

        features = np.random.default_rng(0).random((64, 1280), dtype=np.float32) * 6
        training = bench_training(workdir, features, labels.astype(np.int64) % 10, args)
        print(f"\nhead training step (C=10, d=1280, batch {training['batch']}): "
              f"ExecuTorch program {training['executorch']:.3f} ms, eager torch "
              f"{training['eager']:.3f} ms, eager/pte = "
              f"{training['eager'] / training['executorch']:.2f}")


if __name__ == "__main__":
    main()
