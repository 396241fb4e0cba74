"""What the exporter's two changes to ExecuTorch's XNNPACK lowering save
``export.executorch_export.lower_inference_program``, each against the stock lowering, alternated in
one run: CPU seconds of each lowering and whether the .pte bytes are identical.

- default: leaving the inapplicable passes out (export/xnnpack_passes.py): ExecuTorch's full
  XNNPACK pass list against the applicable ones only;
- ``--partitioner``: the partitioner that keeps ops from decomposition only when the graph holds one
  (``executorch_export.xnnpack_partitioner``) against ExecuTorch's ``XnnpackPartitioner`` (both
  lowerings with the applicable passes only, as the exporter runs them).

``--int8`` lowers the int8 graph of ``export.quantization.quantize_int8`` (random calibration images)
instead of the BatchNorm-folded fp32 model.

    .venv/bin/python bench/xnnpack_passes.py [--partitioner] [--backbone mobilenet_v2] [--image-size 32] [--max-batch 8] [--int8] [--repeats 2]
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


OURS = executorch_export.xnnpack_partitioner


def stock_partitioner():
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return XnnpackPartitioner()


def lower(model, example, max_batch: int, applicable_only: bool, partitioner=OURS) -> tuple[float, bytes]:
    executorch_export.only_applicable_passes = only_applicable_passes if applicable_only else contextlib.nullcontext
    executorch_export.xnnpack_partitioner = partitioner
    start = time.process_time()
    buffer = executorch_export.lower_inference_program(model, example, max_batch).buffer
    return time.process_time() - start, buffer


def main() -> None:
    ap = lowering_arguments(__doc__.splitlines()[0])
    ap.add_argument("--int8", action="store_true")
    ap.add_argument("--partitioner", action="store_true", help="compare the partitioners instead of the pass lists")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    backbone = build_backbone(args.backbone).eval()
    example = torch.randn(args.max_batch, 3, args.image_size, args.image_size)
    model = (quantize_int8(backbone, example, torch.randn(16, 3, args.image_size, args.image_size), args.max_batch)
             if args.int8 else fold_batch_norms(backbone, example))
    lower(model, example, args.max_batch, False)        # the first lowering builds ExecuTorch's pattern graphs
    what = f"{args.backbone} {'int8' if args.int8 else 'fp32 (BatchNorm folded)'} at {args.image_size} px, " \
           f"batches 1..{args.max_batch}"
    if args.partitioner:
        compare_lowerings(what, ("stock partitioner", lambda: lower(model, example, args.max_batch, True, stock_partitioner)),
                          ("ops kept only when present", lambda: lower(model, example, args.max_batch, True)),
                          args.repeats)
    else:
        compare_lowerings(what, ("every XNNPACK pass", lambda: lower(model, example, args.max_batch, False)),
                          ("applicable ones only", lambda: lower(model, example, args.max_batch, True)), args.repeats)


if __name__ == "__main__":
    main()
