"""Splitting a backbone for on-device fine-tuning: a frozen trunk and a trainable tail.

FT(φ) and FT(M) of the Fed3R paper fine-tune the feature extractor. A device cannot afford
backpropagation through the whole network (and ExecuTorch's portable backward kernels are
slow), so fedfleet fine-tunes the last ``tail_stages`` stages of the backbone
(``Backbone.stages``), as on-device transfer learning usually does:

* the **trunk** (all earlier stages) is frozen and runs once per image, as an inference
  program; its activations (N, c, h, w) are cached on the device like features are;
* the **tail** (the last stages, then global average pooling) is trained, together with the
  linear head for FT(M) or against the frozen head for FT(φ).

BatchNorm in the tail is frozen (the issue's rule for training programs): every
``BatchNorm2d`` becomes :class:`FrozenBatchNorm2d`, a per-channel affine map ``x·scale +
shift`` whose scale and shift are buffers computed from the pretrained statistics. It is
the eval-mode BatchNorm (up to float rounding), its backward needs only mul/add kernels, and
no running statistic can drift during local training.

Pointwise (1×1, stride 1, ungrouped) convolutions in the tail become :class:`PointwiseConv2d`:
the same weight tensor (same name and shape), computed as a matrix product over the channels.
The training program runs on ExecuTorch's portable kernels (no delegate for training graphs),
whose convolution and convolution-backward are plain loops: a training step of MobileNetV2's
last stage (1×1, 320 → 1280) ran 29× faster as a matrix product in one run of ``bench/export.py``
(its ``conv/matmul`` ratio; eager torch was still 5× faster than either).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

from edge_client.models import Backbone

__all__ = ["FrozenBatchNorm2d", "PointwiseConv2d", "TailModel", "freeze_batchnorm", "split_backbone",
           "tail_parameter_shapes"]


class FrozenBatchNorm2d(nn.Module):
    """Eval-mode BatchNorm as fixed buffers: ``y = x * scale + shift`` per channel."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(1, channels, 1, 1))
        self.register_buffer("shift", torch.zeros(1, channels, 1, 1))

    @classmethod
    def from_batchnorm(cls, bn: nn.BatchNorm2d) -> "FrozenBatchNorm2d":
        frozen = cls(bn.num_features)
        with torch.no_grad():
            scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
            frozen.scale.copy_(scale.reshape(1, -1, 1, 1))
            frozen.shift.copy_((bn.bias - bn.running_mean * scale).reshape(1, -1, 1, 1))
        return frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift


def freeze_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every BatchNorm2d inside ``module`` (in place) by its FrozenBatchNorm2d."""
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            setattr(module, name, FrozenBatchNorm2d.from_batchnorm(child))
        else:
            freeze_batchnorm(child)
    return module


class PointwiseConv2d(nn.Module):
    """A 1×1 convolution as a matrix product over channels; ``weight`` keeps the conv's
    (out, in, 1, 1) shape, so state dicts and wire names do not change."""

    def __init__(self, conv: nn.Conv2d) -> None:
        super().__init__()
        self.weight = nn.Parameter(conv.weight.detach().clone())
        self.bias = None if conv.bias is None else nn.Parameter(conv.bias.detach().clone())

    @staticmethod
    def replaces(module: nn.Module) -> bool:
        return (isinstance(module, nn.Conv2d) and module.kernel_size == (1, 1) and module.stride == (1, 1)
                and module.groups == 1 and module.dilation == (1, 1) and module.padding in ((0, 0), "valid"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_channels, in_channels = self.weight.shape[:2]
        y = F.linear(x.permute(0, 2, 3, 1), self.weight.view(out_channels, in_channels), self.bias)
        return y.permute(0, 3, 1, 2)


def pointwise_as_matmul(module: nn.Module) -> nn.Module:
    """Replace every pointwise Conv2d inside ``module`` (in place) by its PointwiseConv2d."""
    for name, child in module.named_children():
        if PointwiseConv2d.replaces(child):
            setattr(module, name, PointwiseConv2d(child))
        else:
            pointwise_as_matmul(child)
    return module


class TailModel(nn.Module):
    """The last stages of a backbone + global average pooling: activations -> features.

    ``stages`` parameters are the trainable ones (named ``stages.<i>.<...>``); BatchNorm is
    frozen, pointwise convolutions are matrix products (``pointwise_matmul=False`` keeps them
    convolutions, which bench/export.py times against). Pooling is spelled like
    ``Backbone.forward`` so features agree with the backbone.
    """

    def __init__(self, stages: list[nn.Module], pointwise_matmul: bool = True) -> None:
        super().__init__()
        # A copy: the caller's modules (a backbone's own stages) are never rewritten.
        self.stages = freeze_batchnorm(copy.deepcopy(nn.Sequential(*stages)))
        if pointwise_matmul:
            pointwise_as_matmul(self.stages)

    def forward(self, activations: torch.Tensor) -> torch.Tensor:
        feature_map = self.stages(activations)
        pooled = feature_map.mean(dim=(-2, -1), keepdim=True)
        return pooled.view(-1, feature_map.shape[1])


def split_backbone(backbone: Backbone, tail_stages: int) -> tuple[nn.Module, TailModel]:
    """(trunk, tail) with ``tail(trunk(x)) == backbone(x)`` (up to float rounding).

    Both are deep copies: training the tail never touches ``backbone``. The trunk keeps its
    BatchNorm layers (eval mode, frozen like the rest of the trunk).
    """
    stages = backbone.stages()
    if isinstance(tail_stages, bool) or not isinstance(tail_stages, int) \
            or not 1 <= tail_stages < len(stages):
        raise ValueError(f"tail_stages must be an integer in [1, {len(stages) - 1}] for "
                         f"{backbone.name}, got {tail_stages!r}")
    trunk = copy.deepcopy(nn.Sequential(*stages[:-tail_stages])).eval().requires_grad_(False)
    tail = TailModel(stages[-tail_stages:]).eval().requires_grad_(True)
    return trunk, tail


def tail_parameter_shapes(tail: TailModel) -> dict[str, tuple[int, ...]]:
    """Trainable tensor name -> shape, in the tail's own order."""
    return {name: tuple(param.shape) for name, param in tail.named_parameters()}
