"""Lower a frozen inference model to an XNNPACK-delegated ExecuTorch program (.pte bytes)."""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging

import torch
from torch import nn

from export.xnnpack_passes import only_applicable_passes

__all__ = ["LoweredProgram", "lower_inference_program", "xnnpack_partitioner"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LoweredProgram:
    buffer: bytes
    # Ops left outside the XNNPACK delegate (run by ExecuTorch's single-threaded portable
    # kernels, with a graph break around each); empty for the backbones fedfleet ships.
    portable_ops: dict[str, int]
    delegate_calls: int


def lower_inference_program(model: nn.Module, example: torch.Tensor, max_batch: int) -> LoweredProgram:
    """Export ``model`` (an ``nn.Module``, or an int8 graph from
    :func:`export.quantization.quantize_int8`) for batches of 1..``max_batch`` images shaped
    like ``example[0]``.

    The trace uses a batch of exactly ``max_batch`` rows: with ExecuTorch 1.5.1, tracing a
    smaller example made memory planning size the input for fewer rows than the declared
    bound (a 64 px MobileNetV2 traced at 2 rows refused 32-row inputs at run time).
    """
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    traced_input = example[:1].expand(max_batch, *example.shape[1:]).contiguous()
    dynamic_shapes = None
    if max_batch > 1:
        dynamic_shapes = ({0: torch.export.Dim("batch", min=1, max=max_batch)},)
    # Not `export(model.eval(), ...)`: a quantized graph's eval() (export.quantization) returns None.
    model.eval()
    exported = torch.export.export(model, (traced_input,), dynamic_shapes=dynamic_shapes)
    # Without the edge-IR verifier, as the training programs (training_program.py): it re-checked the
    # graph after each pass, ~20 % of the lowering (bench/lowering_verifier.py), for the same bytes;
    # every program is checked end to end instead, run on real images against eager (export/parity.py).
    # XNNPACK's passes with nothing to rewrite in this graph are left out: the same bytes, less CPU
    # (export/xnnpack_passes.py)
    with only_applicable_passes():
        edge = to_edge_transform_and_lower(exported, partitioner=[xnnpack_partitioner()],
                                           compile_config=EdgeCompileConfig(_check_ir_validity=False))
    op_counts = collections.Counter(
        _op_name(node.target) for node in edge.exported_program().graph.nodes
        if node.op == "call_function")
    delegate_calls = op_counts.pop("executorch_call_delegate", 0)
    op_counts.pop("getitem", None)
    if op_counts:
        logger.warning("ops left outside the XNNPACK delegate (portable kernels, slower): %s",
                       dict(op_counts))
    return LoweredProgram(buffer=edge.to_executorch().buffer, portable_ops=dict(op_counts),
                          delegate_calls=delegate_calls)


def xnnpack_partitioner():
    """ExecuTorch's ``XnnpackPartitioner``, asking to keep its ops from decomposition only when the
    graph holds one of them.

    Why. ``to_edge_transform_and_lower`` decomposes the graph once more for a partitioner that lists
    ops to keep whole and a check of which of them it takes (XNNPACK's: linear, hardswish,
    max_pool2d, PReLU, bilinear upsampling, torchao's affine quantization): it decomposes with those
    ops kept, swaps the ones the check accepts for placeholders and decomposes again. A graph holding
    none of them (the BatchNorm-folded backbones' feature extractors and their int8 graphs:
    convolutions, clamps, adds, means) has nothing to keep; told so (no ops, no check), it is
    decomposed once. The same .pte bytes (tests/test_xnnpack_passes.py compares them with the stock
    partitioner's, as did a one-off check of MobileNetV2's 32 px inference, trunk and int8 programs and
    EfficientNet-Lite0's 64 px inference and int8 ones), less CPU: ``bench/xnnpack_passes.py
    --partitioner [--int8]`` (MobileNetV2 at 32 px, one run on a loaded 2-core machine: 0.88× the
    stock partitioner's CPU-s for the fp32 program, 7.9 against 9.0; 0.83× for the int8 one, 19.7
    against 23.7). A graph holding one of the ops gets the stock answer."""
    return _keeping_only_ops_present()()


@functools.cache
def _keeping_only_ops_present() -> type:
    """The partitioner class, made on first use (importing ExecuTorch's backend is slow)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    class KeepingOnlyOpsPresent(XnnpackPartitioner):
        def ops_to_not_decompose(self, ep):
            keep, check = super().ops_to_not_decompose(ep)
            present = {node.target for node in ep.graph.nodes if node.op == "call_function"}
            return (keep, check) if present.intersection(keep) else ([], None)

    return KeepingOnlyOpsPresent


def _op_name(target: object) -> str:
    name = getattr(target, "__name__", None) or str(target)
    return name.split("(")[0]
