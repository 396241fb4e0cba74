"""Export-time parity: run each artifact in its runtime and compare with eager torch.

Inference artifacts are compared on real images (Fashion-MNIST test images by default,
or any uint8 images the caller gives); an int8 program is compared with
``export.quantization.quantized_parity`` instead, after calibrating on other real images
(:func:`load_calibration_images`). The training program is compared with plain torch
autograd (``F.cross_entropy`` on the un-padded rows, not the exported module) for the
loss and gradients, and with ``torch.optim.SGD`` after a few steps in the runtime.
"""

from __future__ import annotations

import dataclasses
import io
import math
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from protocols.files import read_npy
from protocols.regular_file import read_regular_file

__all__ = [
    "ParityImages",
    "TrainingParity",
    "inference_parity",
    "load_calibration_images",
    "load_parity_images",
    "reference_head_loss",
    "run_for_parity",
    "training_parity",
]


@dataclasses.dataclass(frozen=True)
class ParityImages:
    images: np.ndarray  # uint8 (N, H, W) or (N, H, W, 3)
    labels: np.ndarray | None
    source: str


def load_parity_images(path: str | Path | None = None, count: int = 64) -> ParityImages:
    """``count`` real images: from ``path`` (.npy uint8 array, or an IDX file), else
    the first ``count`` Fashion-MNIST test images."""
    return _load_images(path, count, "test", "parity check", "--parity-images")


def load_calibration_images(path: str | Path | None = None, count: int = 128) -> ParityImages:
    """``count`` real images to calibrate int8 activation ranges (``export.quantization``):
    from ``path`` (as :func:`load_parity_images`), else the first ``count`` Fashion-MNIST
    *train* images, so that the parity check (test images) measures images the calibration
    has not seen."""
    return _load_images(path, count, "train", "int8 calibration", "--calibration-images")


def _load_images(path: str | Path | None, count: int, split: str, use: str,
                 option: str) -> ParityImages:
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be a positive integer, got {count!r}")
    if path is None:
        from edge_client.data.idx import load_fashion_mnist

        try:
            images, labels = load_fashion_mnist(split)
        except FileNotFoundError as error:
            raise FileNotFoundError(
                f"{error}. Export needs real images for its {use}: install the "
                f"dataset or pass images ({option}).") from None
        return ParityImages(images[:count], labels[:count], f"fashion-mnist {split}[0:{count}]")
    from edge_client.data.idx import MAX_IDX_BYTES, read_idx

    path = Path(path)
    if path.suffix == ".npy":   # as an IDX file is read: a regular file (a FIFO blocked np.load), bounded
        data = read_regular_file(path, f"{use} images", MAX_IDX_BYTES)
        images = read_npy(io.BytesIO(data), len(data), f"{use} images {path}")
    else:
        images = read_idx(path)
    if images.dtype != np.uint8 or images.ndim not in (3, 4) or len(images) == 0:
        raise ValueError(
            f"{path}: {use} images must be a non-empty uint8 array (N, H, W[, 3]), "
            f"got {images.dtype} {images.shape}")
    return ParityImages(images[:count], None, f"{path.name}[0:{min(count, len(images))}]")


def run_for_parity(runtime, inputs: np.ndarray, max_batch: int | None) -> tuple[np.ndarray, np.ndarray]:
    """``runtime``'s outputs for ``inputs``, run as a device runs them, then, for a program with a
    batch bound, for one call of ``max_batch`` rows (``inputs`` repeated when fewer); and which row of
    ``inputs`` each output row is of.

    The second run because the first may never reach the largest batch the program was traced and
    memory-planned for: fewer parity images than the bound, or calls sliced smaller
    (``ExecuTorchInference.rows_per_call``: one 224 px row per call on one thread, 16 at 64 px; 40
    rows at a bound of 32 run as 20 + 20). ``run_one_call`` makes that call unsliced.
    """
    outputs, rows = runtime.run(inputs), np.arange(len(inputs))
    if max_batch is None:
        return outputs, rows
    largest = np.arange(max_batch) % len(inputs)
    largest_outputs = runtime.run_one_call(np.ascontiguousarray(inputs[largest]))
    return np.concatenate([outputs, largest_outputs]), np.concatenate([rows, largest])


def inference_parity(runtime, inputs: np.ndarray, reference: np.ndarray, max_batch: int | None = None) -> float:
    """Max abs difference between ``runtime``'s outputs (:func:`run_for_parity`) and the eager
    ``reference``."""
    outputs, rows = run_for_parity(runtime, inputs, max_batch)
    expected = reference[rows]
    if outputs.shape != expected.shape:
        raise ValueError(f"artifact output shape {outputs.shape} != eager {expected.shape}")
    return float(np.max(np.abs(outputs.astype(np.float64) - expected.astype(np.float64))))


def reference_head_loss(features: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor, temperature: float) -> torch.Tensor:
    """Temperature-scaled cross-entropy, mean over the rows: the head's loss, from scratch."""
    return F.cross_entropy(F.linear(features, weight, bias) / temperature, labels)


@dataclasses.dataclass(frozen=True)
class TrainingParity:
    loss_abs_error: float
    gradient_max_abs_error: float
    sgd_max_abs_error: float
    sgd_steps: int
    rows: int

    def to_json(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


def worst_error(errors) -> float:
    """The largest of ``errors``, NaN when any is NaN: Python's ``max`` skips a NaN that is not
    first, and a program with one NaN gradient passed its parity check that way."""
    errors = [float(e) for e in errors]
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)


def training_parity(session, features: np.ndarray, labels: np.ndarray, temperature: float,
                    sgd_steps: int = 3, lr: float = 0.05, seed: int = 0,
                    tail: torch.nn.Module | None = None) -> TrainingParity:
    """Compare a :class:`TrainingSession` with torch autograd / ``torch.optim.SGD``.

    The head starts from small random values (a zero head has symmetric gradients, which
    would hide swapped classes). With ``tail`` (the eager module of a tail_training
    program), ``features`` are the trunk's activations, the reference runs them through the
    tail (its own copy of the parameters, via ``torch.func.functional_call``) and the tail's
    tensors are compared too. ``session`` is left trained; use a throwaway one.
    """
    rng = np.random.default_rng(seed)
    start = {
        "weight": rng.normal(0.0, 0.01, session.parameter_shapes["weight"]).astype(np.float32),
        "bias": rng.normal(0.0, 0.01, session.parameter_shapes["bias"]).astype(np.float32),
    }
    if tail is not None:
        start.update({f"tail.{name}": param.detach().numpy().copy()
                      for name, param in tail.named_parameters()})
    session.set_parameters(start)
    loss, gradients = session.loss_and_gradients(features, labels)

    reference = {name: torch.tensor(value, requires_grad=True) for name, value in start.items()}
    inputs_t = torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))
    labels_t = torch.from_numpy(labels.astype(np.int64))

    def reference_loss() -> torch.Tensor:
        pooled = inputs_t
        if tail is not None:
            pooled = torch.func.functional_call(
                tail, {name[len("tail."):]: value for name, value in reference.items()
                       if name.startswith("tail.")}, (inputs_t,))
        return reference_head_loss(pooled, labels_t, reference["weight"], reference["bias"],
                                   temperature)

    first_loss = reference_loss()
    first_loss.backward()
    gradient_error = worst_error(np.max(np.abs(gradients[name] - value.grad.numpy()))
                                 for name, value in reference.items())

    optimizer = torch.optim.SGD(list(reference.values()), lr=lr)
    for _ in range(sgd_steps):
        session.train_step(features, labels, lr)
        optimizer.zero_grad()
        reference_loss().backward()
        optimizer.step()
    trained = session.get_parameters()
    sgd_error = worst_error(np.max(np.abs(trained[name] - value.detach().numpy()))
                            for name, value in reference.items())
    return TrainingParity(
        loss_abs_error=abs(loss - first_loss.item()),
        gradient_max_abs_error=gradient_error,
        sgd_max_abs_error=sgd_error,
        sgd_steps=sgd_steps,
        rows=len(features),
    )
