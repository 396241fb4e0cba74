"""``fedfleet features``: the evaluation-features file ``aggregator serve --eval-features`` takes.

The aggregator never runs the backbone: it evaluates a model on features (an ``.npz`` with
``Z`` (n, d) float32 and ``y`` (n,) int64). This command makes that file from labelled images
(an image folder or IDX files) with the same feature extractor the devices run: an exported
bundle (``--bundle``, what ``fedfleet export`` wrote and the job's ``bundle_sha256`` names) or
the backbone at an image size (``--backbone``/``--image-size``: the bundle ``fedfleet
simulate`` exports into ``.cache/bundles``, or eager torch). It prints the file's sha256 and the
feature dimension the job config's ``feature_dim`` must match.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

RUNTIMES = ("onnxruntime", "executorch", "eager")


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--image-folder", type=Path, help="root/<class>/*.png layout (any subset of --classes)")
    src.add_argument("--idx", nargs=2, type=Path, metavar=("IMAGES", "LABELS"), help="IDX image and label files")
    p.add_argument("--classes", default=None,
                   help="--image-folder: comma-separated class names in the job's order (label i = i-th name)")
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--bundle", type=Path,
                       help="an exported bundle: its directory or its manifest.json (fedfleet export)")
    model.add_argument("--backbone", help="a backbone name (mobilenet_v2, ...): its bundle under .cache/bundles, "
                                          "exported on first use, or eager torch with --runtime eager")
    p.add_argument("--image-size", type=int, default=64, help="--backbone: input size in pixels")
    p.add_argument("--runtime", choices=RUNTIMES, default="onnxruntime",
                   help="program of the bundle to run; eager: the torch model (--backbone)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N images (default: all)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for the extractor (default: all)")
    p.add_argument("-o", "--out", type=Path, required=True, help="the .npz to write (Z, y)")


def build_features(args) -> int:
    import numpy as np

    from .errors import UserError

    images, labels = _load_images(args)
    if args.limit is not None:
        if args.limit < 1:
            raise UserError("--limit must be >= 1")
        images, labels = images[:args.limit], labels[:args.limit]
    if not len(labels):
        raise UserError("no images to extract features from")
    extractor, source = _extractor(args)
    Z = np.ascontiguousarray(extractor.extract(images), dtype=np.float32)
    y = np.asarray(labels, dtype=np.int64)
    if not np.isfinite(Z).all():
        raise UserError(f"the extractor ({source}) produced non-finite features; check the bundle")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "wb") as f:               # the exact name given (np.savez would append .npz)
        np.savez(f, Z=Z, y=y)
    digest = hashlib.sha256(args.out.read_bytes()).hexdigest()
    print(f"wrote {args.out}: {Z.shape[0]} samples, feature_dim {Z.shape[1]}, classes {sorted(set(y.tolist()))}, "
          f"from {source}; sha256 {digest}")
    print(f"use it with: fedfleet aggregator serve --eval-features {args.out} (job config feature_dim {Z.shape[1]})")
    return 0


def _load_images(args):
    from edge_client.data import load_idx_dataset
    from edge_client.data.image_folder import load_image_folder

    from .errors import UserError

    if args.idx:
        return load_idx_dataset(*args.idx)
    if not args.classes:
        raise UserError("--image-folder needs --classes (the job's class names, in order), so that labels are the "
                        "job's class ids even when the folder holds only some classes")
    images, labels, _ = load_image_folder(args.image_folder, classes=args.classes.split(","))
    return images, labels


def _extractor(args):
    from .bundles import extractor_from_manifest, make_extractor
    from .errors import UserError

    if args.threads is not None:
        if args.threads < 1:
            raise UserError("--threads must be >= 1")
        import torch

        torch.set_num_threads(args.threads)
    if args.bundle is not None:
        if args.runtime == "eager":
            raise UserError("--runtime eager runs the torch model: use it with --backbone, not --bundle")
        manifest = args.bundle / "manifest.json" if args.bundle.is_dir() else args.bundle
        if not manifest.is_file():
            raise UserError(f"--bundle {args.bundle}: no manifest.json there (a directory fedfleet export wrote)")
        return extractor_from_manifest(manifest, args.runtime, cache_dir=None), f"bundle {manifest.parent} ({args.runtime})"
    from edge_client.models import BACKBONES

    if args.backbone not in BACKBONES:
        raise UserError(f"--backbone {args.backbone!r}: not one of {', '.join(sorted(BACKBONES))}")
    from edge_client.tasks.extractors import MAX_DEVICE_IMAGE_SIZE

    if not 1 <= args.image_size <= MAX_DEVICE_IMAGE_SIZE:    # 100,000 px asked for 37 GiB before anything said no
        raise UserError(f"--image-size {args.image_size}: must be 1 to {MAX_DEVICE_IMAGE_SIZE} pixels a side")
    extractor = make_extractor(args.backbone, args.image_size, None, args.runtime, threads=args.threads)
    return extractor, f"{args.backbone}@{args.image_size}px ({args.runtime})"
