"""``fedfleet export``: build a bundle from the command line (see :func:`export.export_bundle`).

Exit status: 0 written; 1 refused (parity beyond tolerance, or the export failed); 2 bad
arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from protocols.command_help import positive_int
from protocols.log_text import log_to_stderr

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedfleet export",
        description="Export a backbone + linear head to ExecuTorch (.pte), ONNX and eager "
                    "artifacts with a verified manifest.")
    parser.add_argument("--backbone", required=True, help="mobilenet_v2 or efficientnet_lite0")
    parser.add_argument("--num-classes", type=int, required=True, help="classes C of the head")
    parser.add_argument("--out", type=Path, required=True, help="bundle directory to create")
    parser.add_argument("--image-size", type=int, default=224, help="input side in pixels")
    parser.add_argument("--weights", type=Path,
                        help="backbone state dict (default: the pretrained ImageNet weights)")
    parser.add_argument("--head-weights", type=Path,
                        help=".npz with weight (C, d) and bias (C,) to initialise the head")
    parser.add_argument("--full-model", action="store_true",
                        help="inference artifacts output logits (needs --head-weights)")
    parser.add_argument("--temperature", type=float, default=0.1,
                        help="softmax temperature of the training loss (default 0.1)")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="ExecuTorch batch bound / training program batch (default 32)")
    parser.add_argument("--runtimes", default="executorch,onnxruntime,eager",
                        help="comma-separated inference runtimes (may be empty)")
    parser.add_argument("--no-training", action="store_true", help="skip the training program")
    parser.add_argument("--tail-stages", type=int, default=0,
                        help="also export FT(phi)/FT(M) programs that train the backbone's last N "
                             "stages with the head: trunk (images -> activations) + tail_training")
    parser.add_argument("--parity-images", type=Path,
                        help="uint8 images (.npy or IDX) for the parity check "
                             "(default: Fashion-MNIST test images)")
    parser.add_argument("--parity-count", type=positive_int, default=64,
                        help="images of the parity check (default 64)")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="max abs error of inference artifacts vs eager (default 1e-4)")
    parser.add_argument("--gradient-tolerance", type=float, default=1e-5,
                        help="max abs error of gradients / SGD vs torch (default 1e-5)")
    parser.add_argument("--quantize", choices=["int8"],
                        help="int8: the ExecuTorch inference program is statically quantized for "
                             "XNNPACK's int8 kernels (other programs stay fp32); see "
                             "docs/deployment.md for when to use it")
    parser.add_argument("--calibration-images", type=Path,
                        help="uint8 images (.npy or IDX) that calibrate the int8 activation ranges, "
                             "ideally from the deployment (default: Fashion-MNIST train images)")
    parser.add_argument("--calibration-count", type=positive_int, default=128,
                        help="images that calibrate the int8 ranges (default 128)")
    parser.add_argument("--quantized-tolerance", type=float, default=None,
                        help="max relative L2 error of the int8 program's outputs vs eager fp32 "
                             "(default: 0.3, export.request.INT8_RELATIVE_ERROR_TOLERANCE)")
    parser.add_argument("--quantized-min-cosine", type=float, default=None,
                        help="least cosine between any parity image's int8 output row and eager fp32's "
                             "(default: 0.3, export.request.INT8_MIN_ROW_COSINE)")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export (a folder holding a manifest.json; any other non-empty folder is refused)")
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits 2 on bad usage, 0 on --help
        return int(exit_.code or 0)
    if args.quantize is None and (args.calibration_images is not None or args.quantized_tolerance is not None
                                  or args.quantized_min_cosine is not None):
        print("fedfleet export: --calibration-images / --quantized-tolerance / --quantized-min-cosine need "
              "--quantize",
              file=sys.stderr)
        return 2
    log_to_stderr("%(levelname)s %(name)s: %(message)s")     # as every process: one line a record
    if args.verbose:
        logging.getLogger("export").setLevel(logging.INFO)

    # Imported here so `--help` works without torch / executorch.
    from export.parity import load_calibration_images, load_parity_images
    from export.pipeline import (
        INT8_MIN_ROW_COSINE,
        INT8_RELATIVE_ERROR_TOLERANCE,
        ExportError,
        ParityError,
        export_bundle,
    )

    runtimes = tuple(name for name in args.runtimes.split(",") if name.strip())
    try:
        parity_images = load_parity_images(args.parity_images, args.parity_count)
        calibration_images = None
        if args.quantize is not None:
            calibration_images = load_calibration_images(args.calibration_images,
                                                         args.calibration_count)
        quantized_tolerance = (INT8_RELATIVE_ERROR_TOLERANCE if args.quantized_tolerance is None
                               else args.quantized_tolerance)
        quantized_min_cosine = (INT8_MIN_ROW_COSINE if args.quantized_min_cosine is None
                                else args.quantized_min_cosine)
        manifest_path = export_bundle(
            args.backbone, args.out, num_classes=args.num_classes, image_size=args.image_size,
            weights=args.weights, head_weights=args.head_weights, full_model=args.full_model,
            temperature=args.temperature, batch_size=args.batch_size,
            inference_runtimes=tuple(name.strip() for name in runtimes),
            training=not args.no_training, parity_images=parity_images,
            tolerance=args.tolerance, gradient_tolerance=args.gradient_tolerance,
            tail_stages=args.tail_stages, overwrite=args.overwrite, quantize=args.quantize,
            calibration_images=calibration_images, quantized_tolerance=quantized_tolerance,
            quantized_min_cosine=quantized_min_cosine)
    except ParityError as error:
        print(f"fedfleet export: {error}", file=sys.stderr)
        print(json.dumps(error.measurements, indent=2, sort_keys=True), file=sys.stderr)
        return 1
    except ExportError as error:  # the request itself is unusable
        print(f"fedfleet export: {error}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as error:  # missing/unreadable inputs, existing output, ...
        print(f"fedfleet export: {error}", file=sys.stderr)
        return 1
    print(_summary(manifest_path))
    return 0


def _summary(manifest_path: Path) -> str:
    from protocols.bundle_manifest import read_manifest

    from protocols.files import file_sha256

    manifest = read_manifest(manifest_path)
    lines = [f"wrote {manifest_path}",
             f"bundle sha256 {file_sha256(manifest_path)}  (a job's bundle_sha256; serve the folder with --artifacts)"]
    for spec in manifest.artifacts:
        parity = spec.parity
        if "relative_l2_error" in parity:
            measured = (f"{spec.details['quantization']['mode']}: relative L2 error vs eager fp32 "
                        f"{parity['relative_l2_error']:.3f}, min cosine "
                        f"{parity['min_cosine_similarity']:.3f}")
        elif "max_abs_error" in parity:     # inference, trunk and tail_eval programs (outputs vs eager)
            measured = f"max abs error vs eager {parity['max_abs_error']:.2e}"
        else:
            measured = (f"gradient error {parity['gradient_max_abs_error']:.2e}, "
                        f"SGD error {parity['sgd_max_abs_error']:.2e}")
        lines.append(f"  {spec.file:26s} {spec.kind:9s} {spec.runtime:11s} "
                     f"{spec.size_bytes / 1e6:7.2f} MB  {measured}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
