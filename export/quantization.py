"""Static int8 quantization of an inference model for XNNPACK (PT2E), and its parity metrics.

Scheme (:data:`INT8_SCHEME`): weights int8, symmetric, one scale per output channel;
activations int8, one affine scale per tensor, fixed at export from calibration images
(histogram observer); the global average pool, residual adds and the head run quantized
too. The whole graph lands in one XNNPACK delegate, which runs it with int8 kernels.

Why a quantizer of our own (a subclass of ExecuTorch's ``XNNPACKQuantizer``): the stock
one fuses ``conv -> relu`` but not ``conv -> ReLU6`` (``hardtanh(x, 0, 6)`` from ``nn.ReLU6``
in MobileNetV2, ``relu6`` from ``F.relu6`` in EfficientNet-Lite0; after every conv but the
projections). Unfused, the conv's output is quantized over the range of its *pre*-activation
values, negative ones included, and ReLU6 either shares that scale (its [0, 6] output then
gets a fraction of the 256 levels) or is not annotated at all. MobileNetV2 features at 224 px
differed from fp32 by 39 % (relative L2) that way, 26 % with the fusion.
:func:`relu6_fusing_quantizer` annotates ``conv -> ReLU6`` like ``conv -> relu``: no
quantization between the two, the clamp's output observed on its own. XNNPACK fuses the
clamp into the convolution (``FuseActivationPass``; ``relu6`` reaches it as ``hardtanh``),
so the lowered program is what the annotation describes.

Parity of an int8 program is not an fp32 max-abs error (1e-4 is out of reach by design) but
how close its outputs stay to eager fp32 as vectors: :func:`quantized_parity`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

__all__ = [
    "INT8_SCHEME",
    "QUANTIZATION_MODES",
    "QuantizedParity",
    "quantize_int8",
    "quantized_parity",
    "relu6_fusing_quantizer",
]

QUANTIZATION_MODES = ("int8",)
INT8_SCHEME = ("pt2e static int8 (XNNPACKQuantizer): weights symmetric per output channel, "
               "activations affine per tensor from calibration images (histogram observer), "
               "conv+ReLU6 fused")
# Rows per calibration forward: bounded like the exported program's batch, so memory stays small.
CALIBRATION_CHUNK = 32


@contextlib.contextmanager
def _quiet_torchao() -> Iterator[None]:
    # torchao logs a warning per optional CUDA kernel library it cannot load on a CPU build.
    logger = logging.getLogger("torchao")
    previous = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(previous)


@functools.cache
def _relu6_fusing_quantizer_class():
    """The quantizer class, built on first use (importing ExecuTorch's quantizer pulls in torchao)."""
    with _quiet_torchao():
        from executorch.backends.xnnpack.quantizer import xnnpack_quantizer_utils as utils
        from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import XNNPACKQuantizer
        from torchao.quantization.pt2e.quantizer import QuantizationAnnotation
        from torchao.quantization.pt2e.utils import _is_conv_node

    def is_relu6(node: torch.fx.Node) -> bool:
        # nn.ReLU6 traces to hardtanh(x, 0, 6) (MobileNetV2), F.relu6 to relu6 (EfficientNet-Lite0)
        if node.op != "call_function":
            return False
        if node.target in (torch.ops.aten.relu6.default, torch.ops.aten.relu6_.default):
            return True
        return (node.target in (torch.ops.aten.hardtanh.default, torch.ops.aten.hardtanh_.default)
                and tuple(node.args[1:3]) == (0.0, 6.0))

    class _Relu6FusingQuantizer(XNNPACKQuantizer):
        def annotate(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
            config = self.global_config
            if config is not None:
                for clamp in model.graph.nodes:
                    conv = clamp.args[0] if is_relu6(clamp) else None
                    if not (isinstance(conv, torch.fx.Node) and _is_conv_node(conv)
                            and len(conv.users) == 1):
                        continue
                    weight, bias = conv.args[1], conv.args[2] if len(conv.args) > 2 else None
                    partition = [clamp, conv, weight] + ([bias] if isinstance(bias, torch.fx.Node) else [])
                    if utils._is_annotated(partition):
                        continue
                    inputs = {conv.args[0]: utils.get_input_act_qspec(config),
                              weight: utils.get_weight_qspec(config)}
                    if isinstance(bias, torch.fx.Node):
                        inputs[bias] = utils.get_bias_qspec(config)
                    conv.meta[utils.Q_ANNOTATION_KEY] = QuantizationAnnotation(
                        input_qspec_map=inputs, _annotated=True)
                    clamp.meta[utils.Q_ANNOTATION_KEY] = QuantizationAnnotation(
                        output_qspec=utils.get_output_act_qspec(config), _annotated=True)
                    utils._mark_nodes_as_annotated(partition)
            # The stock patterns skip what is annotated above and annotate the rest.
            return super().annotate(model)

    return _Relu6FusingQuantizer


def relu6_fusing_quantizer():
    """A new ``XNNPACKQuantizer`` that also fuses ``conv -> ReLU6`` (see the module docstring)."""
    return _relu6_fusing_quantizer_class()()


def quantize_int8(model: nn.Module, example: torch.Tensor, calibration: torch.Tensor,
                  max_batch: int) -> torch.fx.GraphModule:
    """``model`` with int8 quantize/dequantize pairs, calibrated on ``calibration`` images.

    ``example`` is traced like :func:`export.executorch_export.lower_inference_program`
    does (``max_batch`` rows, dynamic batch), so the result can be lowered the same way.
    """
    with _quiet_torchao():
        from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
            get_symmetric_quantization_config,
        )
        from torchao.quantization.pt2e import allow_exported_model_train_eval
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    if len(calibration) == 0:
        raise ValueError("int8 quantization needs at least one calibration image")
    traced_input = example[:1].expand(max_batch, *example.shape[1:]).contiguous()
    dynamic_shapes = None
    if max_batch > 1:
        dynamic_shapes = ({0: torch.export.Dim("batch", min=1, max=max_batch)},)
    graph = torch.export.export(model.eval(), (traced_input,), dynamic_shapes=dynamic_shapes).module()
    quantizer = relu6_fusing_quantizer()
    quantizer.set_global(get_symmetric_quantization_config(is_per_channel=True))
    prepared = prepare_pt2e(graph, quantizer)
    chunk = min(max_batch, CALIBRATION_CHUNK)
    with torch.no_grad():
        for start in range(0, len(calibration), chunk):
            prepared(calibration[start:start + chunk])
    quantized = convert_pt2e(prepared)
    # The graph was traced in eval mode (BatchNorm folded into the convolutions); this only
    # lets the lowering's model.eval() call through instead of raising.
    allow_exported_model_train_eval(quantized)
    return quantized


@dataclasses.dataclass(frozen=True)
class QuantizedParity:
    """How far an int8 program's outputs are from eager fp32 on the same images.

    ``relative_l2_error``: ||Q - F|| / ||F|| over the whole batch (Frobenius), the feature
    distortion a downstream linear model sees; ``min_cosine_similarity``: the worst row's
    cosine between quantized and fp32 outputs (the direction a ridge / softmax head uses);
    ``max_abs_error`` for comparison with the fp32 artifacts.
    """

    relative_l2_error: float
    min_cosine_similarity: float
    mean_cosine_similarity: float
    max_abs_error: float

    def to_json(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def quantized_parity(outputs: np.ndarray, reference: np.ndarray) -> QuantizedParity:
    """Compare quantized ``outputs`` with the fp32 ``reference`` (both (N, width))."""
    if outputs.shape != reference.shape or outputs.ndim != 2:
        raise ValueError(f"artifact output shape {outputs.shape} != eager {reference.shape}")
    quantized, exact = outputs.astype(np.float64), reference.astype(np.float64)
    exact_norm = np.linalg.norm(exact)
    if not np.all(np.isfinite(quantized)):
        return QuantizedParity(float("inf"), -1.0, -1.0, float("inf"))
    if exact_norm == 0.0:
        raise ValueError("the fp32 reference outputs are all zero; parity images cannot tell")
    row_norms = np.linalg.norm(quantized, axis=1) * np.linalg.norm(exact, axis=1)
    # A zero row on either side has no direction; it counts as orthogonal.
    cosines = np.divide(np.sum(quantized * exact, axis=1), row_norms,
                        out=np.zeros(len(exact)), where=row_norms > 0)
    return QuantizedParity(
        relative_l2_error=float(np.linalg.norm(quantized - exact) / exact_norm),
        min_cosine_similarity=float(cosines.min()),
        mean_cosine_similarity=float(cosines.mean()),
        max_abs_error=float(np.max(np.abs(quantized - exact))))
