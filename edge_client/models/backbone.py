"""The contract every backbone architecture fills in: normalised images -> pooled features."""

from __future__ import annotations

import torch
from torch import nn


class Backbone(nn.Module):
    """A frozen-feature image model: normalised (N, 3, H, W) float32 -> (N, feature_dim).

    Subclasses provide ``feature_map`` (the last convolutional activations, before pooling)
    and ``imagenet_head`` (the ImageNet-1k linear classifier). ``forward`` is the globally
    average-pooled penultimate feature, i.e. what Fed3R and the other heads train on.
    Everything is plain tensor code without data-dependent control flow, so
    ``torch.export`` traces it; spatial sizes only enter through Python integer arithmetic
    on static shapes.
    """

    name: str
    feature_dim: int = 1280
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    native_image_size: int = 224  # the resolution the ImageNet weights were trained at
    # [lo, hi] every output feature lies in, when the architecture bounds it (a final ReLU6, then
    # average pooling: [0, 6]); bundles declare it, and Fed3R bounds a device's statistics with it
    feature_range: tuple[float, float] | None = None

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def imagenet_head(self, features: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def stages(self) -> list[nn.Module]:
        """The feature map as a chain: applying these modules in order equals ``feature_map``.

        The last few stages are what on-device fine-tuning of the backbone trains
        (``edge_client.models.tail``); the modules are this backbone's own (shared weights).
        """
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feature_map = self.feature_map(x)
        # Global average pooling, spelled so the XNNPACK delegate takes all of it: a 4-D mean
        # over (H, W) with keepdim is XNNPACK's global average pooling, and a view whose only
        # free dimension is -1 is its static reshape. ``mean(dim=(2, 3))`` (same numbers)
        # stayed outside the delegate, on ExecuTorch's single-threaded portable kernel.
        pooled = feature_map.mean(dim=(-2, -1), keepdim=True)
        return pooled.view(-1, feature_map.shape[1])

    def imagenet_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Full ImageNet-1k classifier output (N, 1000), for sanity checks of the weights."""
        return self.imagenet_head(self.forward(x))

    def reset_parameters(self) -> None:
        """Random initialisation (torchvision's scheme for MobileNet-style networks)."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out")
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, 0.01)
                nn.init.zeros_(module.bias)
