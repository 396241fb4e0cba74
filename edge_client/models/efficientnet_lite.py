"""EfficientNet-Lite0 (Tan & Le, 2019; the "lite" variants from tensorflow/tpu).

Lite differs from EfficientNet-B0 in what makes it friendly to mobile accelerators and
quantisation: ReLU6 instead of Swish, no squeeze-and-excitation (the checkpoint has no
``_se_`` keys), and a stem (32) and head (1280) that are never width-scaled.

Parameter names follow lukemelas/EfficientNet-PyTorch (``_conv_stem``, ``_bn0``,
``_blocks.N._expand_conv`` ..., ``_conv_head``, ``_bn1``, ``_fc``) so that
``efficientnet-lite0-57934424.pth`` (converted from the TensorFlow checkpoint) loads with
strict=True. Because the weights were trained in TensorFlow, two TF conventions are kept:

* convolutions pad like TF's ``padding="SAME"``: for a stride-2 convolution on an even-sized
  input the padding is asymmetric (one pixel more at the bottom/right);
* BatchNorm eps is 1e-3 (TF's value), not PyTorch's 1e-5.

Inputs are normalised as the lite models were trained: (x - 127) / 128 on 0..255 pixels,
i.e. mean 127/255 and std 128/255 on 0..1 pixels.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from edge_client.models.backbone import Backbone

# One row per stage: (repeats, kernel, first stride, expansion, in channels, out channels),
# the lite0 block strings 'r1_k3_s11_e1_i32_o16', ... with width/depth multipliers of 1.0.
_STAGES = (
    (1, 3, 1, 1, 32, 16),
    (2, 3, 2, 6, 16, 24),
    (2, 5, 2, 6, 24, 40),
    (3, 3, 2, 6, 40, 80),
    (3, 5, 1, 6, 80, 112),
    (4, 5, 2, 6, 112, 192),
    (1, 3, 1, 6, 192, 320),
)
_STEM_CHANNELS = 32
_HEAD_CHANNELS = 1280
_BN_EPS = 1e-3  # TensorFlow's BatchNorm epsilon, which the weights were trained with
_BN_MOMENTUM = 0.01  # TF momentum 0.99 in PyTorch's convention; only matters when training


def _batch_norm(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=_BN_EPS, momentum=_BN_MOMENTUM)


def tf_same_padding(size: int, kernel_size: int, stride: int) -> tuple[int, int]:
    """(before, after) zero padding of TF ``SAME`` along one spatial axis.

    The output has ceil(size / stride) positions; any odd padding goes after, not before.
    """
    out_size = -(-size // stride)
    total = max((out_size - 1) * stride + kernel_size - size, 0)
    return total // 2, total - total // 2


class Conv2dSame(nn.Conv2d):
    """``nn.Conv2d`` with TensorFlow ``SAME`` padding computed from the input's shape.

    The padding depends only on the (static) spatial size, through Python integer arithmetic,
    so export specialises it to constants for the exported image size.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int,
                 stride: int = 1, groups: int = 1) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride,
                         padding=0, groups=groups, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel_h, kernel_w = self.kernel_size
        stride_h, stride_w = self.stride
        top, bottom = tf_same_padding(x.shape[-2], kernel_h, stride_h)
        left, right = tf_same_padding(x.shape[-1], kernel_w, stride_w)
        if top or bottom or left or right:
            x = F.pad(x, (left, right, top, bottom))
        # self.bias: None as built (BatchNorm follows), a BatchNorm folded in for export (export/batch_norm_folding.py)
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class MBConvBlock(nn.Module):
    """Mobile inverted bottleneck without squeeze-excite: expand, depthwise, project, skip."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int,
                 expansion: int) -> None:
        super().__init__()
        hidden = in_channels * expansion
        self.has_expansion = expansion != 1
        self.use_skip = stride == 1 and in_channels == out_channels
        if self.has_expansion:
            self._expand_conv = Conv2dSame(in_channels, hidden, 1)
            self._bn0 = _batch_norm(hidden)
        self._depthwise_conv = Conv2dSame(hidden, hidden, kernel_size, stride, groups=hidden)
        self._bn1 = _batch_norm(hidden)
        self._project_conv = Conv2dSame(hidden, out_channels, 1)
        self._bn2 = _batch_norm(out_channels)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = inputs
        if self.has_expansion:
            x = F.relu6(self._bn0(self._expand_conv(x)))
        x = F.relu6(self._bn1(self._depthwise_conv(x)))
        x = self._bn2(self._project_conv(x))
        if self.use_skip:  # stochastic depth is a training-only detail, not needed here
            x = x + inputs
        return x


class _ConvBNReLU6(nn.Module):
    """The stem or the head convolution as one stage (see ``Backbone.stages``); shares weights."""

    def __init__(self, conv: nn.Module, bn: nn.Module) -> None:
        super().__init__()
        self.conv, self.bn = conv, bn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu6(self.bn(self.conv(x)))


class EfficientNetLite0(Backbone):
    name = "efficientnet_lite0"
    feature_dim = _HEAD_CHANNELS
    feature_range = (0.0, 6.0)      # ReLU6, then average pooling
    mean = (127.0 / 255.0, 127.0 / 255.0, 127.0 / 255.0)
    std = (128.0 / 255.0, 128.0 / 255.0, 128.0 / 255.0)

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self._conv_stem = Conv2dSame(3, _STEM_CHANNELS, 3, stride=2)
        self._bn0 = _batch_norm(_STEM_CHANNELS)
        blocks: list[nn.Module] = []
        for repeats, kernel_size, first_stride, expansion, in_channels, out_channels in _STAGES:
            for index in range(repeats):
                blocks.append(MBConvBlock(
                    in_channels if index == 0 else out_channels, out_channels, kernel_size,
                    first_stride if index == 0 else 1, expansion))
        self._blocks = nn.ModuleList(blocks)
        self._conv_head = Conv2dSame(_STAGES[-1][-1], _HEAD_CHANNELS, 1)
        self._bn1 = _batch_norm(_HEAD_CHANNELS)
        self._dropout = nn.Dropout(0.2)
        self._fc = nn.Linear(_HEAD_CHANNELS, num_classes)
        self.reset_parameters()

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu6(self._bn0(self._conv_stem(x)))
        for block in self._blocks:
            x = block(x)
        return F.relu6(self._bn1(self._conv_head(x)))

    def stages(self) -> list[nn.Module]:
        return [_ConvBNReLU6(self._conv_stem, self._bn0), *self._blocks,
                _ConvBNReLU6(self._conv_head, self._bn1)]

    def imagenet_head(self, features: torch.Tensor) -> torch.Tensor:
        return self._fc(self._dropout(features))
