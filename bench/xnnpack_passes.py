"""What leaving XNNPACK's inapplicable passes out (export/xnnpack_passes.py) saves
``export.executorch_export.lower_inference_program``: the same backbone lowered with ExecuTorch's
full XNNPACK pass list and with the applicable ones only (what the exporter uses), alternated, in
one run: CPU seconds of each lowering and whether the .pte bytes are identical. ``--int8`` lowers
the int8 graph of ``export.quantization.quantize_int8`` (random calibration images) instead of the
BatchNorm-folded fp32 model.

    .venv/bin/python bench/xnnpack_passes.py [--backbone mobilenet_v2] [--image-size 32] [--max-batch 8] [--int8] [--repeats 2]
"""

from __future__ import annotations

import contextlib
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import export.executorch_export as executorch_export  # noqa: E402
from edge_client.models import build_backbone  # noqa: E402
from export.batch_norm_folding import fold_batch_norms  # noqa: E402
from export.quantization import quantize_int8  # noqa: E402
from export.xnnpack_passes import only_applicable_passes  # noqa: E402
from _lowering_ab import compare_lowerings, lowering_arguments  # noqa: E402


def lower(model, example, max_batch: int, applicable_only: bool) -> tuple[float, bytes]:
    executorch_export.only_applicable_passes = only_applicable_passes if applicable_only else contextlib.nullcontext
    start = time.process_time()
    buffer = executorch_export.lower_inference_program(model, example, max_batch).buffer
    return time.process_time() - start, buffer


def main() -> None:
    ap = lowering_arguments(__doc__.splitlines()[0])
    ap.add_argument("--int8", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    backbone = build_backbone(args.backbone).eval()
    example = torch.randn(args.max_batch, 3, args.image_size, args.image_size)
    model = (quantize_int8(backbone, example, torch.randn(16, 3, args.image_size, args.image_size), args.max_batch)
             if args.int8 else fold_batch_norms(backbone, example))
    lower(model, example, args.max_batch, False)        # the first lowering builds ExecuTorch's pattern graphs
    what = "int8" if args.int8 else "fp32 (BatchNorm folded)"
    compare_lowerings(f"{args.backbone} {what} at {args.image_size} px, batches 1..{args.max_batch}",
                      ("every XNNPACK pass", lambda: lower(model, example, args.max_batch, False)),
                      ("applicable ones only", lambda: lower(model, example, args.max_batch, True)), args.repeats)


if __name__ == "__main__":
    main()
