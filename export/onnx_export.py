"""Export a frozen inference model to ONNX (bytes, weights embedded, dynamic batch)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging

import torch
from torch import nn

__all__ = ["OnnxModel", "export_onnx_model"]


@dataclasses.dataclass(frozen=True)
class OnnxModel:
    buffer: bytes
    opset: int
    ir_version: int


@contextlib.contextmanager
def _quiet_exporter():
    # The exporter logs a warning per missing torchvision op and prints progress lines;
    # neither says anything about this model.
    logger = logging.getLogger("torch.onnx")
    previous = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logger.setLevel(previous)


def export_onnx_model(model: nn.Module, example: torch.Tensor, input_name: str,
                      output_name: str) -> OnnxModel:
    """Dynamo-export ``model``; the batch dimension is symbolic (``batch``)."""
    import onnx

    traced_input = example[:1].expand(2, *example.shape[1:]).contiguous()  # 2: not specialised
    with _quiet_exporter():
        program = torch.onnx.export(
            model.eval(), (traced_input,), dynamo=True, input_names=[input_name],
            output_names=[output_name],
            dynamic_shapes=({0: torch.export.Dim("batch", min=1)},),
            external_data=False, verbose=False)
        buffer = io.BytesIO()
        program.save(buffer)
    data = buffer.getvalue()
    proto = onnx.load_model_from_string(data)
    onnx.checker.check_model(proto)
    opset = next(entry.version for entry in proto.opset_import if entry.domain in ("", "ai.onnx"))
    return OnnxModel(buffer=data, opset=int(opset), ir_version=int(proto.ir_version))
