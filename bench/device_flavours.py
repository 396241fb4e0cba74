"""The torch-free device (``fedfleet[device]``) against the torch device (``fedfleet[device-executorch]``):
install size, memory and per-task time, measured in one run on this machine.

Each flavour is a venv: ``.venv-device`` (``make setup`` builds it: ONNX Runtime, numpy, paho-mqtt,
cryptography, Pillow) and a torch device venv, e.g.

    python3 -m venv /tmp/venv-torch && /tmp/venv-torch/bin/pip install torch==2.13.0 \\
        && /tmp/venv-torch/bin/pip install -e '.[device-executorch]'

(``--torch-venv``, default ``.venv``, the full development venv, whose size is then not a device's).
The driver (run from ``.venv``) exports one MobileNetV2 bundle (ExecuTorch + ONNX inference programs
and the head's training program) and makes real task params with the aggregator's job classes; each
flavour then runs in its own process, started from its venv (this file with ``--worker``), the very
handlers ``fedfleet device`` builds (``edge_client.handlers.device_handlers``) on Fashion-MNIST
images, one thread, with a feature cache as a device has (times are process CPU seconds, which
other jobs on a shared machine do not inflate at one thread; wall seconds are printed too):

* ``fed3r.stats``: extract the training images' features (cache miss) and their statistics;
* ``fedavg.head``: E epochs of head SGD on the cached features (numpy without torch, the
  ExecuTorch training program with ``--training-bundle``, eager torch otherwise);
* ``oll.personalize``: OLL + FP(ψ) with the learning rate chosen by cross-validation
  (extracts the held-out features).

Install size is ``du`` of each venv's site-packages; RSS is read from /proc: after the imports a
device makes, and the peak (VmHWM) over the whole run. Median of ``--repeats`` runs of each task.

Usage: .venv/bin/python bench/device_flavours.py [--torch-venv /tmp/venv-torch] [--image-size 64]
       [--images 200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this file's directory leads sys.path and would shadow the `export` package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]
ROOT = _HERE.parent

TASKS = ("fed3r.stats", "fedavg.head", "oll.personalize")


def rss_mb(field: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


# ---------------------------------------------------------------- the worker (runs in a flavour's venv)
def worker(spec_file: Path) -> None:
    """Run the three tasks through a device's handlers; print one JSON line of timings and memory."""
    t0 = time.perf_counter()
    import numpy as np

    from edge_client.features import FeatureExtractor
    from edge_client.handlers import HandlerConfig, LocalData, device_handlers, torch_free
    from fedfleet.device import set_threads

    spec = json.loads(spec_file.read_text())
    set_threads(spec["runtime"], 1)
    imported_rss = rss_mb()
    with np.load(spec["data"]) as data:
        images, labels = data["images"], data["labels"]
        tensors = {name: data[name] for name in ("weight", "bias")}
    extractor = FeatureExtractor.from_bundle(spec["manifest"], spec["runtime"], spec["cache_dir"])
    started_s = time.perf_counter() - t0
    n = len(labels)
    holdout = np.arange(n - n // 5, n)
    handlers = device_handlers(LocalData(images, labels, np.arange(n - n // 5), holdout), lambda *a, **k: extractor,
                               HandlerConfig(spec["training_manifest"]))
    times = {task: [] for task in TASKS}
    walls = {task: [] for task in TASKS}
    for _ in range(spec["repeats"]):
        for cache in Path(spec["cache_dir"]).glob("*.npy"):
            cache.unlink()                           # every repeat extracts again, as a first task would
        for task in TASKS:
            start, wall = time.process_time(), time.perf_counter()
            handlers[task](spec["params"][task], tensors)
            times[task].append(time.process_time() - start)
            walls[task].append(time.perf_counter() - wall)
    head = handlers["fedavg.head"].last
    print(json.dumps({"torch_free": torch_free(), "torch_imported": "torch" in sys.modules,
                      "head_runtime": head.runtime, "startup_s": started_s, "imported_rss_mb": imported_rss,
                      "peak_rss_mb": rss_mb("VmHWM"), "times": {k: statistics.median(v) for k, v in times.items()},
                      "walls": {k: statistics.median(v) for k, v in walls.items()}}))


# ---------------------------------------------------------------- the driver (runs in .venv)
def site_packages_mb(python: Path) -> tuple[float, list[tuple[str, float]]]:
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    total = int(subprocess.run(["du", "-sk", purelib], capture_output=True, text=True, check=True).stdout.split()[0])
    sizes = []
    for entry in Path(purelib).iterdir():
        if entry.is_dir() and not entry.name.endswith((".dist-info", "__pycache__")):
            kb = int(subprocess.run(["du", "-sk", str(entry)], capture_output=True, text=True).stdout.split()[0])
            sizes.append((entry.name, kb / 1024))
    return total / 1024, sorted(sizes, key=lambda s: -s[1])[:4]


def make_inputs(work: Path, image_size: int, count: int, epochs: int) -> tuple[Path, dict]:
    """The bundle, the device's images and the task params the aggregator's jobs send."""
    import numpy as np

    from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
    from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob
    from aggregator.jobs.personalize import PersonalizeConfig, PersonalizeJob
    from edge_client.data.idx import load_fashion_mnist
    from export import export_bundle

    manifest = export_bundle("mobilenet_v2", work / "bundle", num_classes=10, image_size=image_size,
                             inference_runtimes=("executorch", "onnxruntime"), training=True)
    images, labels = load_fashion_mnist("train")
    common = dict(num_classes=10, image_size=image_size, feature_dim=1280)
    fedavg = FedAvgJob(FedAvgConfig(local_epochs=epochs, batch_size=32, **common))
    params = {"fed3r.stats": Fed3RJob(Fed3RConfig(**common)).task_for("dev")[0],
              "fedavg.head": fedavg.task_for("dev")[0]}
    head = fedavg.model_arrays()
    np.savez(work / "head.npz", **head)
    params["oll.personalize"] = PersonalizeJob(PersonalizeConfig(head_file=str(work / "head.npz"), fp_epochs=epochs,
                                                                 fp_lrs=[1e-3, 1e-2], fp_folds=3, **common)
                                               ).task_for("dev")[0]
    np.savez(work / "data.npz", images=images[:count], labels=labels[:count].astype(np.int64), **head)
    return Path(manifest), params


def run_flavour(python: Path, work: Path, name: str, manifest: Path, params: dict, runtime: str,
                training: bool, repeats: int) -> dict:
    cache = work / f"cache-{name}"
    cache.mkdir()
    spec = {"manifest": str(manifest), "runtime": runtime, "cache_dir": str(cache), "data": str(work / "data.npz"),
            "params": params, "repeats": repeats, "training_manifest": str(manifest) if training else None}
    spec_file = work / f"{name}.json"
    spec_file.write_text(json.dumps(spec))
    out = subprocess.run([str(python), __file__, "--worker", str(spec_file)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    if out.returncode:
        raise SystemExit(f"{name} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--device-venv", type=Path, default=ROOT / ".venv-device")
    p.add_argument("--torch-venv", type=Path, default=ROOT / ".venv")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--images", type=int, default=200, help="the device's images (1/5 held out for OLL)")
    p.add_argument("--epochs", type=int, default=5, help="local epochs of fedavg.head and of FP(ψ)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker)
    flavours = [  # name, venv, feature runtime, head through the ExecuTorch training program
        ("torch-free (ORT + numpy head)", args.device_venv, "onnxruntime", False),
        ("torch (.pte + .pte head)", args.torch_venv, "executorch", True),
        ("torch (ORT + torch head)", args.torch_venv, "onnxruntime", False),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        manifest, params = make_inputs(work, args.image_size, args.images, args.epochs)
        print(f"MobileNetV2 at {args.image_size} px, {args.images} images ({args.images // 5} held out), "
              f"{args.epochs} local epochs, 1 thread, median of {args.repeats}; load average "
              f"{os.getloadavg()[0]:.1f}\n")
        sizes = {venv: site_packages_mb(venv / "bin" / "python") for venv in {args.device_venv, args.torch_venv}}
        rows = []
        for i, (name, venv, runtime, training) in enumerate(flavours):
            r = run_flavour(venv / "bin" / "python", work, f"f{i}", manifest, params, runtime, training, args.repeats)
            rows.append((name, venv, r))
    print("| flavour | venv | site-packages MB | largest packages (MB) | torch imported | head step | start s "
          "| RSS after imports MB | peak RSS MB | " + " | ".join(f"{t} CPU s (wall)" for t in TASKS) + " |")
    print("|" + "---|" * (9 + len(TASKS)))
    for name, venv, r in rows:
        total, largest = sizes[venv]
        print(f"| {name} | {venv.name} | {total:.0f} | {', '.join(f'{n} {mb:.0f}' for n, mb in largest)} "
              f"| {r['torch_imported']} | {r['head_runtime']} | {r['startup_s']:.2f} | {r['imported_rss_mb']:.0f} "
              f"| {r['peak_rss_mb']:.0f} | " + " | ".join(f"{r['times'][t]:.3f} ({r['walls'][t]:.2f})" for t in TASKS) + " |")
    base = rows[0][2]
    for name, venv, r in rows[1:]:
        print(f"\n{name} / torch-free: site-packages {sizes[venv][0] / sizes[args.device_venv][0]:.1f}x, "
              f"peak RSS {r['peak_rss_mb'] / base['peak_rss_mb']:.1f}x, "
              + ", ".join(f"{t} {r['times'][t] / base['times'][t]:.2f}x" for t in TASKS))


if __name__ == "__main__":
    main()
