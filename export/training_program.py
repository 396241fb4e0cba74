"""Lower the trainable head to an ExecuTorch training program (joint forward + backward).

The program computes :class:`~edge_client.runtime.program_modules.TemperatureScaledHead`:
inputs ``features`` (B, d) float32 (or the trunk's ``activations`` (B, c, h, w) when the
program includes the backbone's tail, for FT(φ)/FT(M)), ``labels`` (B,) int64, ``sample_weight`` (B,) float32;
outputs ``loss`` (first, as ExecuTorch training requires) and ``logits``, then the
gradients and parameters the training extension slices off. The optimizer is not part of
the program: the runtime applies SGD. Only the head is in it, so BatchNorm (in the frozen
backbone) never runs in training mode, and no backward kernel the portable library lacks
(batch-norm, max-pool, ...) is needed.
"""

from __future__ import annotations

import torch

from edge_client.runtime.program_modules import TemperatureScaledHead

__all__ = ["TRAINING_INPUTS", "TRAINING_OUTPUTS", "lower_training_program"]

TRAINING_INPUTS = ("features", "labels", "sample_weight")
TRAINING_OUTPUTS = ("loss", "logits")


def lower_training_program(head: TemperatureScaledHead, batch_size: int,
                           input_shape: tuple[int, ...] | None = None) -> bytes:
    """The ``.pte`` bytes of ``head``'s training program for batches of exactly ``batch_size``.

    A head with a tail takes the trunk's activations, one row shaped ``input_shape``.
    """
    from executorch.exir import EdgeCompileConfig, to_edge
    from torch.export.experimental import _export_forward_backward

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    num_classes, feature_dim = head.weight.shape
    if (head.tail is None) != (input_shape is None):
        raise ValueError("a tail + head program needs input_shape (the activations' (c, h, w)); "
                         "a head program takes features and no input_shape")
    example = (
        torch.zeros(batch_size, *(input_shape or (feature_dim,))),
        torch.arange(batch_size, dtype=torch.int64) % num_classes,
        torch.ones(batch_size),
    )
    head.train()
    exported = torch.export.export(head, example, strict=True)
    joint = _export_forward_backward(exported)
    # The joint graph holds ops (e.g. the loss backward) outside the core ATen IR checker's
    # list; the portable kernels run them, as in ExecuTorch's own training examples.
    edge = to_edge(joint, compile_config=EdgeCompileConfig(_check_ir_validity=False))
    return edge.to_executorch().buffer

