"""What the edge-IR verifier costs ``export.executorch_export.lower_inference_program``: the same
backbone lowered to an XNNPACK-delegated ExecuTorch program with ExecuTorch's default
``EdgeCompileConfig`` (the verifier on) and with ``_check_ir_validity=False`` (what the exporter
uses), alternated, in one run: CPU seconds of the lowering and whether the .pte bytes are identical.

    .venv/bin/python bench/lowering_verifier.py [--backbone mobilenet_v2] [--image-size 32] [--max-batch 8] [--repeats 2]
"""

from __future__ import annotations

import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from edge_client.models import build_backbone  # noqa: E402
from _lowering_ab import compare_lowerings, lowering_arguments  # noqa: E402


def lower(model, example, dynamic_shapes, check: bool) -> tuple[float, bytes]:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    start = time.process_time()
    exported = torch.export.export(model, (example,), dynamic_shapes=dynamic_shapes)
    edge = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()],
                                       compile_config=EdgeCompileConfig(_check_ir_validity=check))
    buffer = edge.to_executorch().buffer
    return time.process_time() - start, buffer


def main() -> None:
    args = lowering_arguments(__doc__.splitlines()[0]).parse_args()
    torch.set_num_threads(1)
    model = build_backbone(args.backbone).eval()
    example = torch.randn(args.max_batch, 3, args.image_size, args.image_size)
    dynamic = ({0: torch.export.Dim("batch", min=1, max=args.max_batch)},) if args.max_batch > 1 else None
    compare_lowerings(f"{args.backbone} at {args.image_size} px, batches 1..{args.max_batch}",
                      ("verifier on", lambda: lower(model, example, dynamic, True)),
                      ("verifier off", lambda: lower(model, example, dynamic, False)), args.repeats)


if __name__ == "__main__":
    main()
