"""Fold inference-mode BatchNorm layers into the convolution (or linear layer) before them,
before a model is exported.

Why. ExecuTorch's XNNPACK lowering and the ONNX exporter both end up with the folded layer (the
XNNPACK delegate fuses BatchNorm into the convolution; ONNX Runtime does at session start), but
each of MobileNetV2's 52 BatchNorms is a node with four lifted buffers that every export,
decomposition and partitioning pass walks first. Folded beforehand (``bench/export_folding.py``,
one run), lowering MobileNetV2 takes 0.37x the CPU (7.8 against 21.0 CPU-s) and its ONNX export
0.41x; EfficientNet-Lite0 0.64x and 0.59x. The programs hold the same delegate calls, and their
outputs differ from the unfolded model's by float32 rounding (~6e-6 on the features, far inside
the export's parity tolerance, which is still checked against the unfolded eager model). An int8
program is not folded here: its quantization folds BatchNorm itself, and folding first saved
nothing (1.00-1.02x).

How. ``torch.fx``'s ``fuse`` (a symbolic trace, then each conv/linear → BatchNorm pair whose
convolution output has no other user is replaced by one layer with the folded weights), on a
copy. A model fx cannot trace (its forward branches on the input's shape, as EfficientNet-Lite's
TensorFlow-"same" convolutions do) is folded from one forward pass on the export's example
instead: a BatchNorm whose input is the very tensor a convolution just returned is folded into
that convolution (``torch.nn.utils.fusion``'s arithmetic), and the copy is kept only if it
computes what the model does on that example (a convolution output read elsewhere too, as by a
skip connection, would not). Otherwise the model is exported as it is: only slower.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_weights

logger = logging.getLogger(__name__)

_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def fold_batch_norms(model: nn.Module, example: torch.Tensor) -> nn.Module:
    """A copy of ``model`` with its BatchNorms folded, or ``model`` itself where folding does not
    apply (a BatchNorm in training mode, or no fold that keeps the outputs on ``example``)."""
    from torch.fx.experimental.optimization import fuse

    if any(m.training for m in model.modules() if isinstance(m, _BATCH_NORMS)):
        return model            # a training-mode BatchNorm normalises by the batch: nothing to fold
    try:
        return fuse(model)
    except Exception as error:  # noqa: BLE001  any tracing failure: fold from a forward pass instead
        logger.info("fx cannot trace the model (%s: %s); folding BatchNorm from a forward pass",
                    type(error).__name__, error)
    folded = _fold_called_pairs(model, example)
    with torch.no_grad():
        kept = folded is not None and torch.allclose(folded(example), model(example), rtol=1e-5, atol=1e-5)
    if not kept:
        logger.info("BatchNorm not folded before export; exporting the model as it is")
        return model
    return folded


def _fold_called_pairs(model: nn.Module, example: torch.Tensor) -> nn.Module | None:
    """A copy with every (convolution, BatchNorm) pair that ran back to back on ``example``
    folded into the convolution (the BatchNorm becomes an identity); None when there is none."""
    folded = copy.deepcopy(model)
    just_returned: dict[int, tuple[nn.Module, torch.Tensor]] = {}    # kept alive: ids stay unique
    pairs: list[tuple[nn.Conv2d, nn.Module]] = []

    def after_conv(conv, _inputs, output):
        just_returned[id(output)] = (conv, output)

    def before_batch_norm(batch_norm, inputs):
        conv, output = just_returned.get(id(inputs[0]), (None, None))
        if output is inputs[0] and batch_norm.affine and batch_norm.track_running_stats:
            pairs.append((conv, batch_norm))

    handles = [m.register_forward_hook(after_conv) for m in folded.modules() if isinstance(m, nn.Conv2d)]
    handles += [m.register_forward_pre_hook(before_batch_norm) for m in folded.modules()
                if isinstance(m, nn.BatchNorm2d)]
    try:
        with torch.no_grad():
            folded(example)
    finally:
        for handle in handles:
            handle.remove()
    if not pairs or len({id(bn) for _, bn in pairs}) != len(pairs) or len({id(c) for c, _ in pairs}) != len(pairs):
        return None             # none, or a layer called twice: its fold would not be one
    parents = {id(child): (parent, name) for parent in folded.modules() for name, child in parent.named_children()}
    for conv, batch_norm in pairs:
        conv.weight, conv.bias = fuse_conv_bn_weights(conv.weight, conv.bias, batch_norm.running_mean,
                                                      batch_norm.running_var, batch_norm.eps, batch_norm.weight,
                                                      batch_norm.bias)
        parent, name = parents[id(batch_norm)]
        setattr(parent, name, nn.Identity())
    return folded
