"""How fast are the eager backbones on this machine, and how good are their features per pixel?

Prints, from one run:

1. eager throughput (images/s, best of ``--repeats`` timed passes after a warm-up batch) of
   MobileNetV2 and EfficientNet-Lite0 at several input sizes, batch 64, with
   ``torch.set_num_threads(--threads)``; the time covers preprocessing + forward, i.e.
   ``FeatureExtractor.extract`` on 28 px Fashion-MNIST images;
2. the linear-probe accuracy (closed-form ridge, small lambda, as in Fed3R) of MobileNetV2
   features on Fashion-MNIST (``--train`` train / ``--test`` test images) per input size,
   next to the same probe on raw pixels, and the projected time for all 70k images.

The demo image size is the smallest one whose probe accuracy is close to the best.
Usage: .venv/bin/python bench/backbone_speed.py [--threads 2] [--quick]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from edge_client.data import load_fashion_mnist
from edge_client.features import FeatureExtractor
from edge_client.models import BACKBONES

FASHION_MNIST_SIZE = 70_000


def throughput(extractor: FeatureExtractor, images: np.ndarray, repeats: int) -> float:
    extractor.extract(images[:extractor.batch_size])  # warm-up: allocator, oneDNN kernels
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        extractor.extract(images)
        best = min(best, time.perf_counter() - start)
    return len(images) / best


def ridge_probe_accuracy(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray,
                         test_y: np.ndarray, ridge_lambda: float) -> float:
    """Closed-form one-vs-all ridge regression (Fed3R's classifier) with a bias column."""
    def with_bias(x: np.ndarray) -> np.ndarray:
        return np.hstack([x.astype(np.float64), np.ones((len(x), 1))])

    a = with_bias(train_x)
    targets = np.eye(int(train_y.max()) + 1)[train_y]
    weights = np.linalg.solve(a.T @ a + ridge_lambda * np.eye(a.shape[1]), a.T @ targets)
    predictions = (with_bias(test_x) @ weights).argmax(axis=1)
    return float((predictions == test_y).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--speed-images", type=int, default=512)
    parser.add_argument("--speed-sizes", type=int, nargs="+", default=[32, 64, 96, 128])
    parser.add_argument("--probe-sizes", type=int, nargs="+", default=[32, 64, 96])
    parser.add_argument("--train", type=int, default=10_000)
    parser.add_argument("--test", type=int, default=2_000)
    parser.add_argument("--ridge-lambda", type=float, default=1e-2)
    parser.add_argument("--data", default=None, help="Fashion-MNIST directory (IDX files)")
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.speed_images, args.repeats, args.train, args.test = 128, 1, 1000, 500
    torch.set_num_threads(args.threads)

    train_images, train_labels = load_fashion_mnist("train", root=args.data)
    test_images, test_labels = load_fashion_mnist("test", root=args.data)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, batch 64, "
          f"Fashion-MNIST 28 px -> S px")

    print("\n== eager throughput, images/s (preprocess + forward) ==")
    print("backbone".ljust(20) + "".join(f"S={size:<8}" for size in args.speed_sizes))
    rates: dict[tuple[str, int], float] = {}
    for name in BACKBONES:
        row = name.ljust(20)
        for size in args.speed_sizes:
            extractor = FeatureExtractor.eager(name, image_size=size, batch_size=64)
            rates[name, size] = throughput(
                extractor, train_images[:args.speed_images], args.repeats)
            row += f"{rates[name, size]:<10.0f}"
        print(row, flush=True)

    print(f"\n== ridge linear probe (lambda={args.ridge_lambda}), MobileNetV2 features, "
          f"{args.train} train / {args.test} test ==")
    pixel_accuracy = ridge_probe_accuracy(
        train_images[:args.train].reshape(args.train, -1) / 255.0, train_labels[:args.train],
        test_images[:args.test].reshape(args.test, -1) / 255.0, test_labels[:args.test],
        args.ridge_lambda)
    print(f"raw 784 pixels             accuracy {pixel_accuracy:.4f}")
    for size in args.probe_sizes:
        extractor = FeatureExtractor.eager("mobilenet_v2", image_size=size, batch_size=64)
        start = time.perf_counter()
        train_features = extractor.extract(train_images[:args.train])
        test_features = extractor.extract(test_images[:args.test])
        rate = (args.train + args.test) / (time.perf_counter() - start)
        accuracy = ridge_probe_accuracy(train_features, train_labels[:args.train],
                                        test_features, test_labels[:args.test],
                                        args.ridge_lambda)
        print(f"S={size:<4} mobilenet_v2    accuracy {accuracy:.4f}   "
              f"({rate:.0f} images/s -> all {FASHION_MNIST_SIZE} images in "
              f"{FASHION_MNIST_SIZE / rate / 60:.1f} min)", flush=True)


if __name__ == "__main__":
    main()
