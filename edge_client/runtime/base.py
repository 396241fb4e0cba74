"""What every runtime backend shares: the inference interface, input checks, batching.

Backends differ only in how they run one batch; the checks (shape, dtype, finiteness) and
the splitting of large inputs into batches the program accepts live here, once.
"""

from __future__ import annotations

import functools
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np

from protocols.bundle_manifest import ArtifactSpec

__all__ = [
    "BatchedInference",
    "InferenceRuntime",
    "PIP_PACKAGES",
    "check_image_batch",
    "check_parameter_dict",
    "torch_installed",
    "run_in_batches",
]

# What to `pip install` for each runtime (the eager one also needs fedfleet's model code).
PIP_PACKAGES = {
    "executorch": "executorch=={version}",
    "onnxruntime": "onnxruntime",
    "eager": "torch",
}


@functools.cache
def torch_installed() -> bool:
    """Whether torch can be imported here (asked once: a failing ``import torch`` searches sys.path
    again on every call, which a torch-free device would pay per training run)."""
    return importlib.util.find_spec("torch") is not None


@runtime_checkable
class InferenceRuntime(Protocol):
    """float32 NCHW images (normalised as the manifest says) -> float32 outputs (N, ...)."""

    runtime: str

    def run(self, x: np.ndarray) -> np.ndarray: ...


class BatchedInference(ABC):
    """A backend that runs one batch (:meth:`_run_batch`); the checks and the slicing into batches
    the program accepts are here. ``rows_per_call`` (None: no cap beyond the program's bound) caps
    the rows of one call where a backend runs smaller calls faster (ExecuTorch)."""

    runtime: str
    rows_per_call: int | None = None
    _spec: ArtifactSpec
    _image_size: int

    def run(self, x: np.ndarray) -> np.ndarray:
        """``x`` as a device runs it: in calls of at most the program's bound (and ``rows_per_call``)."""
        return run_in_batches(self._run_batch, check_image_batch(x, self._image_size), self._spec,
                              self.rows_per_call)

    def run_one_call(self, x: np.ndarray) -> np.ndarray:
        """``x`` in a single call of the program, ``rows_per_call`` not applied: the call a parity
        check makes at the largest batch the program was traced and memory-planned for, which
        :meth:`run`'s slicing may never make. ValueError beyond the program's bound."""
        x = check_image_batch(x, self._image_size)
        if self._spec.batch.max is not None and len(x) > self._spec.batch.max:
            raise ValueError(f"{len(x)} rows exceed the program's batch bound {self._spec.batch.max}")
        return self._run_batch(x)

    @abstractmethod
    def _run_batch(self, x: np.ndarray) -> np.ndarray:
        """One checked, C-contiguous float32 batch within the program's bound through the program."""


def check_image_batch(x: object, image_size: int) -> np.ndarray:
    """Validate a normalised image batch; returns it as C-contiguous float32."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"input must be a numpy array, got {type(x).__name__}")
    expected = (3, image_size, image_size)
    if x.ndim != 4 or x.shape[1:] != expected:
        raise ValueError(
            f"input must have shape (N, {expected[0]}, {expected[1]}, {expected[2]}) (NCHW), "
            f"got {x.shape}")
    if x.shape[0] == 0:
        raise ValueError("input batch is empty")
    if x.dtype != np.float32:
        raise ValueError(f"input must be float32 (normalised pixels), got {x.dtype}")
    if not np.isfinite(x).all():
        raise ValueError("input contains NaN or infinite values")
    return np.ascontiguousarray(x)


def check_parameter_dict(values: object, shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Validate trainable parameters (exact names, shapes, finite); returns float32 copies."""
    if not isinstance(values, dict):
        raise TypeError(f"parameters must be a dict of numpy arrays, got {type(values).__name__}")
    if set(values) != set(shapes):
        raise ValueError(f"parameters must be exactly {sorted(shapes)}, got {sorted(values)}")
    checked = {}
    for name, shape in shapes.items():
        value = np.asarray(values[name])
        if value.shape != shape:
            raise ValueError(f"parameter {name!r} must have shape {shape}, got {value.shape}")
        if not np.issubdtype(value.dtype, np.floating):
            raise ValueError(f"parameter {name!r} must be floating point, got {value.dtype}")
        # finite as the float32 the programs hold: a float64 beyond float32's range (3.4e38) cast to inf,
        # and an exported training program started from an infinite head past its parity check (which
        # sets parameters of its own) - a review's finding
        with np.errstate(over="ignore"):
            as_float32 = np.array(value, dtype=np.float32, order="C")
        if not np.isfinite(as_float32).all():
            raise ValueError(f"parameter {name!r} contains NaN or infinite values (as float32)")
        checked[name] = as_float32
    return checked


def run_in_batches(run_batch: Callable[[np.ndarray], np.ndarray], x: np.ndarray,
                   spec: ArtifactSpec, rows_per_call: int | None = None) -> np.ndarray:
    """Run ``x`` in slices of at most ``spec.batch.max`` (and ``rows_per_call``) rows.

    Slices are as equal as possible (40 rows at a limit of 32 run as 20 + 20, not 32 + 8).
    Every row is computed independently (frozen BatchNorm, no cross-sample ops), so slicing
    does not change results.
    """
    limit = min(spec.batch.max or len(x), rows_per_call or len(x))
    if len(x) <= limit:
        return run_batch(x)
    slices = -(-len(x) // limit)
    return np.concatenate([run_batch(np.ascontiguousarray(part))
                           for part in np.array_split(x, slices)])
