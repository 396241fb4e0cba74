"""The torch modules that exported programs compute, shared by ``export`` and the eager runtime.

Defining them once keeps three things identical: what is exported, what the eager
(development) runtime runs, and what the export-time parity check compares against.

* :class:`InferenceModel`: frozen backbone (BatchNorm in eval mode), optionally followed by
  the linear classifier head, so the program returns features or logits.
* :class:`TemperatureScaledHead`: the trainable part. ``forward(features, labels,
  sample_weight) -> (loss, logits)`` with the loss first, as ExecuTorch training requires.
  With a ``tail`` (``edge_client.models.tail.TailModel``: the backbone's last stages, for
  FT(φ)/FT(M)) the first input is the trunk's activations (B, c, h, w) instead, and the
  tail's parameters (``tail.stages....``) are trainable next to ``weight`` and ``bias``.
* :class:`TrunkModel`: the frozen backbone without its tail: images -> activations.
* :class:`TailClassifier`: activations -> logits through the tail and the head, with the
  tail_training program's parameter names; exported (``torch.export``) for the server,
  which evaluates FT(φ)/FT(M) models with it without importing device code.
  The loss is temperature-scaled cross-entropy, ``CE(logits / T, y)`` (T = 0.1 for a
  Fed3R-initialised head), averaged with per-sample weights: ``sum(w_i * l_i) / sum(w_i)``.
  Programs have a fixed batch; padded rows get ``w_i = 0`` and so change neither the loss
  nor the gradients, and with ``w = 1`` on the real rows the loss is exactly the plain mean.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["InferenceModel", "TailClassifier", "TemperatureScaledHead", "TrunkModel"]


class InferenceModel(nn.Module):
    """Backbone features, or logits of a linear head on them; everything frozen."""

    def __init__(self, backbone: nn.Module, num_classes: int | None = None,
                 feature_dim: int | None = None):
        super().__init__()
        self.backbone = backbone
        if num_classes is None:
            self.head = None
        else:
            if feature_dim is None:
                raise ValueError("feature_dim is needed to build a classifier head")
            self.head = nn.Linear(feature_dim, num_classes)
        self.eval()
        self.requires_grad_(False)

    def train(self, mode: bool = True) -> "InferenceModel":
        # BatchNorm stays frozen: the running statistics are part of the exported model.
        return super().train(False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.backbone(images)
        return features if self.head is None else self.head(features)


class TrunkModel(nn.Module):
    """The frozen stages before a tail (``edge_client.models.tail.split_backbone``)."""

    def __init__(self, trunk: nn.Module):
        super().__init__()
        self.trunk = trunk
        self.eval()
        self.requires_grad_(False)

    def train(self, mode: bool = True) -> "TrunkModel":
        return super().train(False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.trunk(images)


class TemperatureScaledHead(nn.Module):
    """Linear classifier ``logits = f W^T + b`` trained with weighted CE on ``logits / T``;
    ``f`` is the input, or ``tail(input)`` when a tail is given."""

    def __init__(self, feature_dim: int, num_classes: int, temperature: float = 0.1,
                 tail: nn.Module | None = None):
        super().__init__()
        self.tail = tail
        if not temperature > 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        self.temperature = float(temperature)
        # Named `weight` and `bias` directly so program FQNs equal the public names.
        self.weight = nn.Parameter(torch.zeros(num_classes, feature_dim))
        self.bias = nn.Parameter(torch.zeros(num_classes))

    def forward(self, features: torch.Tensor, labels: torch.Tensor,
                sample_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.tail is not None:
            features = self.tail(features)
        logits = F.linear(features, self.weight, self.bias)
        per_sample = F.cross_entropy(logits / self.temperature, labels, reduction="none")
        loss = (per_sample * sample_weight).sum() / sample_weight.sum()
        return loss, logits.detach()


class TailClassifier(nn.Module):
    """``logits = head(tail(activations))``; parameters named like the tail_training program."""

    def __init__(self, tail: nn.Module, feature_dim: int, num_classes: int):
        super().__init__()
        self.tail = tail
        self.weight = nn.Parameter(torch.zeros(num_classes, feature_dim))
        self.bias = nn.Parameter(torch.zeros(num_classes))

    def forward(self, activations: torch.Tensor) -> torch.Tensor:
        return F.linear(self.tail(activations), self.weight, self.bias)
