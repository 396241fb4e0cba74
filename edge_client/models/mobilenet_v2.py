"""MobileNetV2 (Sandler et al., 2018), width 1.0, laid out like torchvision's implementation.

The module tree mirrors torchvision's parameter names exactly (``features.0`` .. ``features.18``,
``classifier.1``) so that the ImageNet checkpoint ``mobilenet_v2-b0353104.pth`` loads with
strict=True. Padding is symmetric ``(k - 1) // 2``, as in PyTorch-trained weights; BatchNorm
uses PyTorch's default eps of 1e-5. Inputs are normalised with the ImageNet mean/std.
"""

from __future__ import annotations

import torch
from torch import nn

from edge_client.models.backbone import Backbone

# (expansion t, output channels c, repeats n, first stride s), from Table 2 of the paper.
_INVERTED_RESIDUAL_SETTINGS = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)
_STEM_CHANNELS = 32
_HEAD_CHANNELS = 1280


class ConvBNReLU6(nn.Sequential):
    """Conv (no bias) -> BatchNorm -> ReLU6; the children are named 0, 1, 2 like torchvision."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3,
                 stride: int = 1, groups: int = 1) -> None:
        super().__init__(
            nn.Conv2d(in_channels, out_channels, kernel_size, stride,
                      padding=(kernel_size - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU6(inplace=False),
        )


class InvertedResidual(nn.Module):
    """Expand (1x1) -> depthwise 3x3 -> linear project (1x1), with a skip when shapes match."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, expansion: int) -> None:
        super().__init__()
        hidden = in_channels * expansion
        self.use_skip = stride == 1 and in_channels == out_channels
        layers: list[nn.Module] = []
        if expansion != 1:
            layers.append(ConvBNReLU6(in_channels, hidden, kernel_size=1))
        layers += [
            ConvBNReLU6(hidden, hidden, stride=stride, groups=hidden),
            nn.Conv2d(hidden, out_channels, 1, bias=False),
            nn.BatchNorm2d(out_channels),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_skip:  # fixed at construction, so not data-dependent
            return x + self.conv(x)
        return self.conv(x)


class MobileNetV2(Backbone):
    name = "mobilenet_v2"
    feature_dim = _HEAD_CHANNELS
    feature_range = (0.0, 6.0)      # ReLU6, then average pooling
    mean = (0.485, 0.456, 0.406)
    std = (0.229, 0.224, 0.225)

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = [ConvBNReLU6(3, _STEM_CHANNELS, stride=2)]
        in_channels = _STEM_CHANNELS
        for expansion, out_channels, repeats, first_stride in _INVERTED_RESIDUAL_SETTINGS:
            for index in range(repeats):
                stride = first_stride if index == 0 else 1
                layers.append(InvertedResidual(in_channels, out_channels, stride, expansion))
                in_channels = out_channels
        layers.append(ConvBNReLU6(in_channels, _HEAD_CHANNELS, kernel_size=1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(_HEAD_CHANNELS, num_classes))
        self.reset_parameters()

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)

    def stages(self) -> list[nn.Module]:
        return list(self.features)

    def imagenet_head(self, features: torch.Tensor) -> torch.Tensor:
        return self.classifier(features)
