"""What the edge-IR verifier costs ``export.executorch_export.lower_inference_program``: the same
backbone lowered to an XNNPACK-delegated ExecuTorch program with ExecuTorch's default
``EdgeCompileConfig`` (the verifier on) and with ``_check_ir_validity=False`` (what the exporter
uses), alternated, in one run: CPU seconds of the lowering and whether the .pte bytes are identical.

    .venv/bin/python bench/lowering_verifier.py [--backbone mobilenet_v2] [--image-size 32] [--max-batch 8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from edge_client.models import build_backbone  # noqa: E402


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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backbone", default="mobilenet_v2")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build_backbone(args.backbone).eval()
    example = torch.randn(args.max_batch, 3, args.image_size, args.image_size)
    dynamic = ({0: torch.export.Dim("batch", min=1, max=args.max_batch)},) if args.max_batch > 1 else None
    times: dict[bool, list[float]] = {True: [], False: []}
    buffers: dict[bool, bytes] = {}
    for _ in range(args.repeats):
        for check in (True, False):
            seconds, buffers[check] = lower(model, example, dynamic, check)
            times[check].append(seconds)
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"{args.backbone} at {args.image_size} px, batches 1..{args.max_batch}; CPU-s of export + lowering:")
    print(f"  verifier on:  {on:.2f}  (runs {', '.join(f'{t:.2f}' for t in times[True])})")
    print(f"  verifier off: {off:.2f}  (runs {', '.join(f'{t:.2f}' for t in times[False])})")
    print(f"  ratio off / on: {off / on:.2f}; .pte bytes identical: {buffers[True] == buffers[False]}")


if __name__ == "__main__":
    main()
