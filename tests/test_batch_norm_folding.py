"""export/batch_norm_folding.py: a folded model computes what the unfolded one does (float32
rounding apart) and holds no BatchNorm, whether fx traces it (MobileNetV2) or not (EfficientNet-Lite:
folded from a forward pass); where folding does not apply the model is exported as is."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn

from export.batch_norm_folding import fold_batch_norms


def with_statistics(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random running statistics and affine parameters: a fresh BatchNorm's are the identity."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g))
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.weight.copy_(torch.randn(m.num_features, generator=g))
                m.bias.copy_(torch.randn(m.num_features, generator=g))
    return model.eval()


def batch_norms(model: nn.Module) -> int:
    return sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


class ShapeDependent(nn.Module):
    """Padding computed from the input's size, as EfficientNet-Lite's TF-"same" convolutions do
    (fx cannot trace it); ``skip``: the convolution's output is read past its BatchNorm too."""

    def __init__(self, skip: bool = False):
        super().__init__()
        self.conv, self.bn, self.skip = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), skip

    def forward(self, x):
        pad = max(3 - x.shape[-1] % 2, 0)
        y = self.conv(nn.functional.pad(x, (pad, pad, pad, pad)))
        return self.bn(y) + y if self.skip else self.bn(y)


def test_a_folded_model_has_no_batch_norm_and_the_same_outputs():
    model = with_statistics(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU6(),
                                          nn.Conv2d(8, 8, 3, groups=8), nn.BatchNorm2d(8), nn.Flatten(),
                                          nn.Linear(8 * 6 * 6, 5), nn.BatchNorm1d(5)))
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    folded = fold_batch_norms(model, x)
    assert batch_norms(folded) == 0 and batch_norms(model) == 3         # a copy: the model is untouched
    with torch.no_grad():
        expected, got = model(x).numpy(), folded(x).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    without = nn.Sequential(*(nn.Identity() if isinstance(m, nn.modules.batchnorm._BatchNorm) else m for m in model))
    with torch.no_grad():
        assert np.abs(without(x).numpy() - expected).max() > 0.1        # the statistics matter: folding did work


@pytest.mark.parametrize("name,batch_norms_in_it", [("mobilenet_v2", 52), ("efficientnet_lite0", 49)])
def test_the_backbones_fold_whole_within_the_export_tolerance(name, batch_norms_in_it):
    from edge_client.models import build_backbone

    backbone = build_backbone(name).eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    folded = fold_batch_norms(backbone, x)
    assert batch_norms(backbone) == batch_norms_in_it and batch_norms(folded) == 0
    other = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(3))    # not the example
    with torch.no_grad():
        assert (folded(other) - backbone(other)).abs().max().item() < 1e-4      # the export's parity tolerance


def test_a_model_fx_cannot_trace_is_folded_from_a_forward_pass():
    model, x = with_statistics(ShapeDependent()), torch.randn(2, 3, 9, 9)
    folded = fold_batch_norms(model, x)
    assert batch_norms(folded) == 0 and batch_norms(model) == 1
    with torch.no_grad():
        np.testing.assert_allclose(folded(x).numpy(), model(x).numpy(), rtol=1e-5, atol=1e-5)


def test_where_folding_does_not_apply_the_model_is_exported_as_it_is(caplog):
    read_twice, x = with_statistics(ShapeDependent(skip=True)), torch.randn(2, 3, 9, 9)
    with caplog.at_level(logging.INFO, logger="export.batch_norm_folding"):
        assert fold_batch_norms(read_twice, x) is read_twice       # folding would change the skip's input
    assert "not folded" in caplog.text
    training = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))     # training mode: batch statistics
    assert fold_batch_norms(training, x) is training
