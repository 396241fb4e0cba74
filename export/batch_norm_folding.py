"""Fold inference-mode BatchNorm layers into the convolution (or linear layer) before them,
before a model is exported.

Why. ExecuTorch's XNNPACK lowering and the ONNX exporter both end up with the folded layer (the
XNNPACK delegate fuses BatchNorm into the convolution; ONNX Runtime does at session start), but
each of MobileNetV2's 52 BatchNorms is a node with four lifted buffers that every export,
decomposition and partitioning pass walks first. Folded beforehand, lowering MobileNetV2 takes
0.42x the CPU and its ONNX export 0.50x (``bench/export_folding.py``, one run: 8.2 against 19.4
CPU-s, 2.9 against 5.8); the programs hold the same delegate calls, and their outputs differ
from the unfolded model's by float32 rounding (~6e-6 on its features, far inside the export's
parity tolerance, which is still checked against the unfolded eager model). An int8 program is
not folded here: its quantization folds BatchNorm itself, and folding first saved nothing (1.02x).

How. ``torch.fx``'s ``fuse`` (a symbolic trace, then each conv/linear → BatchNorm pair whose
convolution output has no other user is replaced by one layer with the folded weights), on a
copy. A model that cannot be traced symbolically (tensor-dependent control flow, as in
EfficientNet-Lite's blocks) is exported as it is: only slower.
"""

from __future__ import annotations

import logging

from torch import nn

logger = logging.getLogger(__name__)


def fold_batch_norms(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with its BatchNorms folded, or ``model`` itself where folding does not
    apply (a BatchNorm in training mode, or a model not symbolically traceable)."""
    from torch.fx.experimental.optimization import fuse

    if any(m.training for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)):
        return model            # a training-mode BatchNorm normalises by the batch: nothing to fold
    try:
        return fuse(model)
    except Exception as error:  # noqa: BLE001  any tracing failure means: export it unfolded
        logger.info("BatchNorm not folded before export (%s: %s); exporting the model as it is",
                    type(error).__name__, error)
        return model
