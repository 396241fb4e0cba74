"""What an int8 feature extractor costs Fed3R in accuracy: fp32 ``.pte`` vs int8 ``.pte``.

Exports two bundles of the same backbone (``export.export_bundle``; ExecuTorch + XNNPACK only,
one fp32, one ``quantize="int8"``), extracts Fashion-MNIST features with each through
``edge_client.runtime`` as a device would, and fits the closed-form ridge classifier that
Fed3R computes (``aggregator.compute.ridge.ClosedFormRidge``, λ = 0.01, normalised class columns).
Fed3R's aggregated statistics equal the centralized ones exactly, so the centralized ridge
accuracy *is* the Fed3R accuracy for any partition of the training images over devices.

Printed, in one run: test accuracy with fp32 features, with int8 features, and with an
fp32-trained head applied to int8 test features (a fleet that switches devices to the int8
program without re-solving); the differences; the int8 features' relative L2 error and
cosine similarity vs fp32 on the test images; and feature extraction time per image of both
programs (one thread by default).

Training images come from Fashion-MNIST train[10000:], away from the 128 images
(train[0:128]) that calibrate the int8 program; test images are the test split.

Usage: .venv/bin/python bench/quantization.py [--backbone mobilenet_v2] [--size 64]
       [--train 3000] [--test 1000] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this file's directory leads sys.path and bench/export.py would shadow the
# `export` package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != _HERE]

import numpy as np  # noqa: E402  (after the sys.path fix, like the imports below)
import torch

from aggregator.compute.ridge import ClosedFormRidge
from edge_client.data.idx import load_fashion_mnist
from edge_client.models.preprocess import to_model_input
from edge_client.runtime import load_inference
from edge_client.runtime.executorch_runtime import set_executorch_threads
from export import export_bundle
from export.parity import load_parity_images
from export.quantization import quantized_parity

TRAIN_OFFSET = 10_000  # past the calibration images (train[0:128] by default)
NUM_CLASSES = 10


def extract(runtime, images: np.ndarray, chunk: int = 256) -> tuple[np.ndarray, float]:
    """Features of ``images`` (uint8) and the seconds per image it took."""
    norm = runtime.manifest.input
    features, seconds = [], 0.0
    for start in range(0, len(images), chunk):
        inputs = to_model_input(images[start:start + chunk], norm.image_size, norm.mean, norm.std)
        began = time.perf_counter()
        features.append(runtime.run(inputs))
        seconds += time.perf_counter() - began
    return np.concatenate(features), seconds / len(images)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backbone", default="mobilenet_v2")
    parser.add_argument("--size", type=int, default=64, help="input side in pixels")
    parser.add_argument("--train", type=int, default=3000, help="ridge training images")
    parser.add_argument("--test", type=int, default=1000, help="test images")
    parser.add_argument("--lam", type=float, default=0.01, help="ridge λ (Fed3R's default)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="32 px, 1000 train / 500 test images")
    args = parser.parse_args()
    if args.quick:
        args.size, args.train, args.test = 32, 1000, 500
    torch.set_num_threads(args.threads)
    set_executorch_threads(args.threads)

    train_images, train_labels = load_fashion_mnist("train")
    test_images, test_labels = load_fashion_mnist("test")
    train_images = train_images[TRAIN_OFFSET:TRAIN_OFFSET + args.train]
    train_labels = train_labels[TRAIN_OFFSET:TRAIN_OFFSET + args.train]
    test_images, test_labels = test_images[:args.test], test_labels[:args.test]

    features: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    ms_per_image: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="fedfleet-bench-quantization-") as tmp:
        for name, quantize in (("fp32", None), ("int8", "int8")):
            manifest_path = export_bundle(
                args.backbone, Path(tmp) / name, num_classes=NUM_CLASSES, image_size=args.size,
                training=False, inference_runtimes=("executorch",), quantize=quantize,
                parity_images=load_parity_images(count=64))
            runtime = load_inference(manifest_path, prefer=("executorch",))
            train_features, train_seconds = extract(runtime, train_images)
            test_features, test_seconds = extract(runtime, test_images)
            features[name] = (train_features, test_features)
            ms_per_image[name] = 1000 * (train_seconds * len(train_images) + test_seconds * len(
                test_images)) / (len(train_images) + len(test_images))

    heads = {name: ClosedFormRidge(args.lam, device="cpu").fit(train, train_labels, NUM_CLASSES)
             for name, (train, _) in features.items()}
    accuracy = {name: heads[name].score(features[name][1], test_labels) for name in features}
    mixed = heads["fp32"].score(features["int8"][1], test_labels)
    distortion = quantized_parity(features["int8"][1], features["fp32"][1])

    print(f"{args.backbone} {args.size} px, Fashion-MNIST: ridge (Fed3R) on {args.train} train "
          f"images, tested on {args.test}; {args.threads} thread(s), torch {torch.__version__}")
    print(f"  test accuracy, fp32 .pte features:                {accuracy['fp32']:.4f}")
    print(f"  test accuracy, int8 .pte features:                {accuracy['int8']:.4f}  "
          f"(int8 - fp32 = {100 * (accuracy['int8'] - accuracy['fp32']):+.2f} points)")
    print(f"  fp32-trained head on int8 test features:          {mixed:.4f}  "
          f"(- fp32 = {100 * (mixed - accuracy['fp32']):+.2f} points)")
    print(f"  int8 vs fp32 test features: relative L2 error {distortion.relative_l2_error:.4f}, "
          f"cosine similarity mean {distortion.mean_cosine_similarity:.4f} / "
          f"min {distortion.min_cosine_similarity:.4f}")
    print(f"  extraction: fp32 {ms_per_image['fp32']:.3f} ms/img, int8 {ms_per_image['int8']:.3f} "
          f"ms/img, fp32/int8 = {ms_per_image['fp32'] / ms_per_image['int8']:.2f}")


if __name__ == "__main__":
    main()
