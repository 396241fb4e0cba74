"""Eager torch backend (development): the same modules the programs were exported from.

Artifacts are plain state dicts (``torch.save``), read back with ``weights_only=True`` so a
file cannot run code. The architecture comes from ``edge_client.models`` by the manifest's
backbone name; the weights come from the bundle, so a bundle exported from fine-tuned
weights runs eagerly with those weights.
"""

from __future__ import annotations

import io

import numpy as np

from edge_client.runtime.base import BatchedInference
from edge_client.runtime.errors import RuntimeUnavailableError
from protocols.bundle_manifest import ArtifactSpec, Manifest

__all__ = [
    "EagerTrainer",
    "EagerInference",
    "state_dict_from_bytes",
    "state_dict_to_bytes",
    "torch_version",
]

RUNTIME = "eager"


def torch_version() -> str:
    try:
        import torch
    except ImportError as error:
        raise RuntimeUnavailableError(
            f"PyTorch is not installed ({error}); install it with `pip install torch`") from error
    return torch.__version__


def state_dict_to_bytes(state_dict: dict) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save({name: tensor.detach().cpu().contiguous() for name, tensor in state_dict.items()},
               buffer)
    return buffer.getvalue()


def state_dict_from_bytes(data: bytes) -> dict:
    import torch

    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _architecture(manifest: Manifest):
    """The manifest's backbone with random weights (the bundle's state dict overwrites them)."""
    import torch

    from edge_client.models import build_backbone

    with torch.random.fork_rng():  # random init is overwritten; keep the caller's RNG
        return build_backbone(manifest.backbone, pretrained=False)


def _split(manifest: Manifest):
    from edge_client.models.tail import split_backbone

    return split_backbone(_architecture(manifest), manifest.tail.stages)


class EagerInference(BatchedInference):
    """Runs the exported :class:`InferenceModel` eagerly under ``torch.inference_mode``."""

    runtime = RUNTIME

    def __init__(self, state: bytes, spec: ArtifactSpec, manifest: Manifest):
        torch_version()
        from edge_client.runtime.program_modules import InferenceModel, TrunkModel

        if spec.kind == "trunk":
            self._model = TrunkModel(_split(manifest)[0])
        else:
            num_classes = manifest.num_classes if manifest.output == "logits" else None
            self._model = InferenceModel(_architecture(manifest), num_classes, manifest.feature_dim)
        self._model.load_state_dict(state_dict_from_bytes(state), strict=True)
        self._spec = spec
        self._image_size = manifest.input.image_size

    def _run_batch(self, x: np.ndarray) -> np.ndarray:
        import torch

        with torch.inference_mode():
            return self._model(torch.from_numpy(x)).numpy()


class EagerTrainer:
    """The training module (head, or tail + head) with autograd and a plain SGD update ``p -= lr * g``."""

    runtime = RUNTIME

    def __init__(self, state: bytes, spec: ArtifactSpec, manifest: Manifest):
        torch_version()
        from edge_client.runtime.program_modules import TemperatureScaledHead

        tail = _split(manifest)[1] if spec.kind == "tail_training" else None
        self._head = TemperatureScaledHead(manifest.feature_dim, manifest.num_classes,
                                           manifest.temperature, tail)
        self._head.load_state_dict(state_dict_from_bytes(state), strict=True)
        self._parameter_names = list(spec.details["trainable_parameters"])

    def features(self, rows: np.ndarray) -> np.ndarray:
        """The head's input for these rows under the current parameters: tail(rows) for a
        tail_training program (what OLL needs after FT(φ)/FT(M)), the rows themselves otherwise."""
        import torch

        if self._head.tail is None:
            return rows
        with torch.inference_mode():
            return self._head.tail(torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))).numpy()

    def get_parameters(self) -> dict[str, np.ndarray]:
        values = dict(self._head.named_parameters())
        return {name: values[name].detach().numpy().copy() for name in self._parameter_names}

    def set_parameters(self, values: dict[str, np.ndarray]) -> None:
        import torch

        with torch.no_grad():
            for name, param in self._head.named_parameters():
                param.copy_(torch.from_numpy(values[name]))

    def forward_backward(self, features: np.ndarray, labels: np.ndarray,
                         sample_weight: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        import torch

        self._head.zero_grad(set_to_none=True)
        loss, _ = self._head(torch.from_numpy(features), torch.from_numpy(labels),
                             torch.from_numpy(sample_weight))
        loss.backward()
        values = dict(self._head.named_parameters())
        return loss.item(), {name: values[name].grad.numpy().copy()
                             for name in self._parameter_names}

    def sgd_step(self, gradients: dict[str, np.ndarray], lr: float) -> None:
        import torch

        values = dict(self._head.named_parameters())
        with torch.no_grad():
            for name, grad in gradients.items():     # only the tensors being trained
                values[name].add_(torch.from_numpy(grad), alpha=-lr)
