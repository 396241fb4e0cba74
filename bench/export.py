"""Exported runtimes vs eager torch, measured in one run on this machine.

For each backbone and input size (default MobileNetV2 at 64/128/224 px) the script exports
a bundle (``export.export_bundle``, into a temporary directory), loads its three inference
artifacts through ``edge_client.runtime`` (ExecuTorch + XNNPACK, ONNX Runtime, eager torch)
and times ``run`` on real Fashion-MNIST images at batch 1 and batch 32. It then times one
SGD step of the head's training program (ExecuTorch) against the eager head, and one
forward/backward of the FT(φ) tail program (MobileNetV2's last stage + head, 64 px) as
exported (pointwise convolutions as matrix products) against the same tail exported with
convolutions (``conv/matmul``: what ``edge_client.models.tail.PointwiseConv2d`` gains on
ExecuTorch's portable training kernels) and against eager torch.

All runtimes get the same thread count (``--threads``, default: every core; torch.set_num_threads,
ORT intra-op threads, the ExecuTorch threadpool that XNNPACK runs on), read back from each
runtime and printed. Eager torch runs the model in eval mode under ``torch.inference_mode``,
ONNX Runtime with its default graph optimizations, and the ``.pte`` through
``edge_client.runtime`` as a device would (which slices large batches into cache-sized calls,
see ``edge_client.runtime.executorch_runtime``). The ops left outside the XNNPACK delegate
are printed per program, and the load average before and after, since other processes on a
shared machine slow multi-threaded runs. Timings are interleaved (one timed call of each
runtime per round) so background load hits all of them alike. Each timed call follows
``--settle`` seconds of sleep and one untimed call of the same runtime: ORT's intra-op
workers spin for about 40 ms after a run and eager torch's OpenMP workers for a few ms, and
a call timed right after another runtime's would share the cores with those spinning
threads (in a first version eager took 400 ms per 64 px image right after ORT). The median of
``--repeats`` rounds after ``--warmup`` rounds is reported as ms per image (wall clock, or
with ``--clock cpu`` the process CPU time, which other load on a shared machine does not
inflate when ``--threads 1``). Ratios > 1 mean
the exported program is faster: ``eager/pte`` (target >= 3 for MobileNetV2) and
``ort/pte`` (target >= 1). ``1call/pte`` times the same ``.pte`` handed the whole batch in one
call: > 1 is what the runtime's cache-sized slicing gains. At batch 1 the bundle's program
(dynamic batch 1..32) is timed next to a batch-1 program (``fedfleet export --batch-size 1``:
static shapes, what a latency-bound single-image deployment exports): ``pte1`` and
``ort/pte1``.

A second table times, in the same interleaved rounds, the int8 program of a bundle exported
with ``quantize="int8"`` (``fedfleet export --quantize int8``; skipped with ``--no-int8``):
``eager/int8``, ``pte/int8`` (fp32 .pte over int8 .pte), ``ort/int8``, and how far its
features are from eager fp32 on the benchmark images (relative L2 error, worst-row cosine).
What int8 costs in accuracy is measured by bench/quantization.py.

Usage: .venv/bin/python bench/export.py [--backbones mobilenet_v2,efficientnet_lite0]
       [--sizes 64,128,224] [--threads N] [--repeats 15] [--quick] [--no-int8]
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
from edge_client.runtime.executorch_runtime import executorch_threads, set_executorch_threads
from edge_client.runtime.auto import RuntimeCalibration
from edge_client.runtime.onnx_runtime import OnnxRuntimeInference, set_onnxruntime_threads
from edge_client.runtime.verification import read_verified
from export import export_bundle
from export.parity import load_parity_images
from export.quantization import quantized_parity

RUNTIMES = ("executorch", "onnxruntime", "eager")


def set_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    set_executorch_threads(threads)
    set_onnxruntime_threads(threads)          # sessions made without a count (--runtime auto's)


def threads_in_use(runtimes: dict) -> dict[str, int]:
    """Each runtime's thread count as the runtime itself reports it."""
    return {"executorch": executorch_threads(),
            "onnxruntime": runtimes["onnxruntime"].intra_op_threads,
            "eager": torch.get_num_threads()}


def load_average() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def load_runtimes(manifest_path: Path, threads: int) -> dict:
    runtimes = {name: load_inference(manifest_path, prefer=(name,)) for name in ("executorch", "eager")}
    manifest = read_manifest(manifest_path)
    spec = manifest.find("inference", "onnxruntime")
    runtimes["onnxruntime"] = OnnxRuntimeInference(
        read_verified(manifest, spec), spec, manifest.input.image_size, intra_op_threads=threads)
    return runtimes


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def interleaved_medians(calls: dict, warmup: int, repeats: int, clock: str,
                        settle: float) -> dict[str, float]:
    """Median seconds per call of each callable, timed round-robin.

    Before each timed call: ``settle`` seconds of sleep (the previous runtime's worker
    threads stop spin-waiting) and one untimed call of the same callable (which wakes its
    own workers, as in a stream of calls).
    """
    now = CLOCKS[clock]
    times: dict[str, list[float]] = {name: [] for name in calls}
    for round_index in range(warmup + repeats):
        for name, call in calls.items():
            time.sleep(settle)
            call()
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
    threads = threads_in_use(runtimes)
    if set(threads.values()) != {args.threads}:
        raise RuntimeError(f"runtimes do not all use {args.threads} threads: {threads}")
    pte = manifest.find("inference", "executorch")
    print(f"{backbone} {size} px: .pte has {pte.details['delegate_calls']} XNNPACK delegate "
          f"call(s), ops outside it: {pte.details['portable_ops'] or 'none'}; .pte runs "
          f"<= {runtimes['executorch'].rows_per_call} rows per call; threads {threads}",
          flush=True)
    chosen = RuntimeCalibration(batch=8, repeats=5).choose(manifest)
    print(f"  --runtime auto on this bundle chose {chosen.runtime}: "
          + "; ".join(trial.line() for trial in chosen.calibration), flush=True)
    del chosen
    inputs = to_model_input(images, size, manifest.input.mean, manifest.input.std)
    # the same program fed a whole batch per call: what the cache-sized calls of the runtime gain
    one_call = load_inference(manifest_path, prefer=("executorch",))
    one_call.rows_per_call = pte.batch.max
    single = None
    if 1 in args.batches:
        single = load_inference(export_bundle(
            backbone, workdir / f"{backbone}-{size}-b1", num_classes=10, image_size=size, training=False,
            batch_size=1, inference_runtimes=("executorch",), parity_images=load_parity_images(count=32)),
            prefer=("executorch",))
    int8, distortion = None, None
    if args.int8:
        int8 = load_inference(export_bundle(
            backbone, workdir / f"{backbone}-{size}-int8", num_classes=10, image_size=size,
            training=False, inference_runtimes=("executorch",), quantize="int8",
            parity_images=load_parity_images(count=32)), prefer=("executorch",))
        distortion = quantized_parity(int8.run(inputs), runtimes["eager"].run(inputs))
    rows = []
    for batch in args.batches:
        x = np.ascontiguousarray(inputs[:batch])
        calls = {name: (lambda runtime=runtimes[name]: runtime.run(x)) for name in RUNTIMES}
        calls["executorch_one_call"] = lambda: one_call.run(x)
        if batch == 1:
            calls["executorch_b1"] = lambda: single.run(x)
        if int8 is not None:
            calls["executorch_int8"] = lambda: int8.run(x)
        medians = interleaved_medians(calls, args.warmup, args.repeats, args.clock, args.settle)
        per_image_ms = {name: 1000 * seconds / batch for name, seconds in medians.items()}
        rows.append({"backbone": backbone, "size": size, "batch": batch, **per_image_ms,
                     "parity": max(spec.parity["max_abs_error"] for spec in manifest.artifacts),
                     "export_s": export_seconds, "int8_distortion": distortion})
    return rows


FASTEST_NAMES = {"executorch": "pte", "onnxruntime": "ort", "eager": "eager", "executorch_int8": "int8"}


def fastest(row: dict) -> str:
    """The quickest of the bundle's runtimes (and the int8 program, when timed) in this row."""
    return FASTEST_NAMES[min((name for name in FASTEST_NAMES if name in row), key=lambda name: row[name])]


def print_int8_table(rows: list[dict]) -> None:
    header = (f"{'backbone':18s} {'px':>4s} {'batch':>5s} {'int8 ms/img':>12s} {'eager/int8':>11s} "
              f"{'pte/int8':>9s} {'ort/int8':>9s} {'relL2 vs fp32':>14s} {'min cos':>8s}")
    print("\nint8 .pte (quantize='int8'; ratios > 1: int8 is faster)")
    print(header)
    print("-" * len(header))
    for row in rows:
        int8, distortion = row["executorch_int8"], row["int8_distortion"]
        print(f"{row['backbone']:18s} {row['size']:4d} {row['batch']:5d} {int8:12.3f} "
              f"{row['eager'] / int8:11.2f} {row['executorch'] / int8:9.2f} "
              f"{row['onnxruntime'] / int8:9.2f} {distortion.relative_l2_error:14.3f} "
              f"{distortion.min_cosine_similarity:8.3f}")


def bench_tail_step(args, batch: int = 32) -> dict:
    """Seconds per forward/backward of the 1-stage tail + head training program, ExecuTorch
    (matmul and conv spellings of the pointwise convolution) and eager torch."""
    from executorch.extension.training import _load_for_executorch_for_training_from_buffer

    from edge_client.models import build_backbone
    from edge_client.models.tail import TailModel
    from edge_client.runtime.program_modules import TemperatureScaledHead
    from export.training_program import lower_training_program

    backbone = build_backbone("mobilenet_v2")
    shape = (320, 2, 2)                                   # the last stage's input at 64 px
    rng = np.random.default_rng(0)
    example = (torch.from_numpy(rng.random((batch, *shape), dtype=np.float32)),
               torch.arange(batch, dtype=torch.int64) % 10, torch.ones(batch))
    calls, programs = {}, []     # the loader does not copy a program's bytes: keep them alive
    for name, matmul in (("matmul", True), ("conv", False)):
        head = TemperatureScaledHead(1280, 10, 0.1, TailModel([backbone.features[-1]], pointwise_matmul=matmul))
        with torch.no_grad():
            head.weight.normal_(0, 0.05)
        programs.append(lower_training_program(head, batch, shape))
        module = _load_for_executorch_for_training_from_buffer(programs[-1])
        calls[name] = lambda module=module: module.forward_backward("forward", example)
        if matmul:
            def eager(head=head):
                head.zero_grad(set_to_none=True)
                head(*example)[0].backward()
            calls["eager"] = eager
    return interleaved_medians(calls, args.warmup, args.repeats, args.clock, args.settle)


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
        args.warmup, args.repeats * 10, args.clock, args.settle)
    return {"batch": batch, **{name: 1000 * seconds for name, seconds in medians.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backbones", default="mobilenet_v2")
    parser.add_argument("--sizes", default="64,128,224")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--settle", type=float, default=0.1,
                        help="seconds of sleep before each runtime's calls (see above)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall time, or process CPU time (with --threads 1: robust to "
                             "other load on a shared machine; it counts spin-waiting threads "
                             "otherwise)")
    parser.add_argument("--quick", action="store_true", help="64 px only, 5 repeats")
    parser.add_argument("--no-int8", dest="int8", action="store_false",
                        help="skip the int8 program (one more export per size)")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.repeats = "64", 5
    args.batches = [int(value) for value in args.batches.split(",")]
    set_threads(args.threads)

    images, labels = load_fashion_mnist("test")
    images, labels = images[:max(args.batches)], labels[:max(args.batches)]
    print(f"threads={args.threads} for every runtime ({os.cpu_count()} cores), {args.clock} clock, "
          f"median of {args.repeats} interleaved rounds, Fashion-MNIST test images, "
          f"torch {torch.__version__}; load average (1/5/15 min) {load_average()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="fedfleet-bench-export-") as tmp:
        workdir = Path(tmp)
        rows = []
        for backbone in args.backbones.split(","):
            for size in (int(value) for value in args.sizes.split(",")):
                rows.extend(bench_inference(backbone, size, images, args, workdir))
        header = (f"{'backbone':18s} {'px':>4s} {'batch':>5s} {'pte ms/img':>11s} "
                  f"{'ort ms/img':>11s} {'eager ms/img':>13s} {'eager/pte':>10s} "
                  f"{'ort/pte':>8s} {'1call/pte':>10s} {'pte1 ms/img':>12s} {'ort/pte1':>9s} "
                  f"{'max|err|':>9s} {'fastest':>8s}")
        print(header)
        print("-" * len(header))
        for row in rows:
            print(f"{row['backbone']:18s} {row['size']:4d} {row['batch']:5d} "
                  f"{row['executorch']:11.3f} {row['onnxruntime']:11.3f} {row['eager']:13.3f} "
                  f"{row['eager'] / row['executorch']:10.2f} "
                  f"{row['onnxruntime'] / row['executorch']:8.2f} "
                  f"{row['executorch_one_call'] / row['executorch']:10.2f} "
                  + (f"{row['executorch_b1']:12.3f} {row['onnxruntime'] / row['executorch_b1']:9.2f} "
                     if "executorch_b1" in row else f"{'–':>12s} {'–':>9s} ")
                  + f"{row['parity']:9.1e} {fastest(row):>8s}")

        if args.int8:
            print_int8_table(rows)
        print(f"load average (1/5/15 min) after inference timings: {load_average()}")

        features = np.random.default_rng(0).random((64, 1280), dtype=np.float32) * 6
        training = bench_training(workdir, features, labels.astype(np.int64) % 10, args)
        print(f"\nhead training step (C=10, d=1280, batch {training['batch']}): "
              f"ExecuTorch program {training['executorch']:.3f} ms, eager torch "
              f"{training['eager']:.3f} ms, eager/pte = "
              f"{training['eager'] / training['executorch']:.2f}")
        tail = bench_tail_step(args)
        print(f"tail training step (MobileNetV2 last stage + head, 64 px, batch 32): ExecuTorch "
              f"{tail['matmul'] * 1e3:.1f} ms as exported (pointwise as matmul), {tail['conv'] * 1e3:.1f} ms "
              f"with convolutions, eager torch {tail['eager'] * 1e3:.1f} ms; conv/matmul = "
              f"{tail['conv'] / tail['matmul']:.1f}, eager/matmul = {tail['eager'] / tail['matmul']:.2f}")


if __name__ == "__main__":
    main()
