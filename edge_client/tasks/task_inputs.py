"""The checks a device's task handlers make of their local data and of a task's inputs.

Every handler takes its local samples as images with int64 labels of the same length
(:func:`local_samples`). The head handlers (``fedavg.head``, the stateful heads,
``oll.personalize``) and the tail trainer decline the same bad inputs with the same reasons, which
the Java device gives as well (``tests/test_java_fedavg_head.py`` and
``tests/test_java_personalization.py`` compare them): a global head that is not finite, a local
label outside the job's classes, a backbone whose features are not the task's size.
"""

from __future__ import annotations

import numpy as np

from protocols.payloads.task_params import ModelSpec

from ..agent import TaskDeclined
from .extractors import ExtractorFactory, extractor_for


def local_samples(images: np.ndarray, labels) -> tuple[np.ndarray, np.ndarray]:
    """A handler's local samples: the images and their labels as int64; ValueError where their
    lengths differ (the device's own data is wrong: no task could use it)."""
    if len(images) != len(labels):
        raise ValueError("images and labels differ in length")
    return images, np.asarray(labels, dtype=np.int64)


def check_global_head(weight: np.ndarray, bias: np.ndarray) -> None:
    """TaskDeclined where the task's head holds a NaN or an infinity (training would spread it)."""
    if not (np.isfinite(weight).all() and np.isfinite(bias).all()):
        raise TaskDeclined("global head contains NaN or Inf")


def check_local_labels(labels: np.ndarray, num_classes: int) -> None:
    """TaskDeclined where a local label is not one of the job's ``num_classes`` classes, quoting the
    first such label in the data's order (the Java device's LocalFeatures.labels)."""
    outside = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if len(outside):
        raise TaskDeclined(f"local label {labels[outside[0]]} outside the job's {num_classes} classes")


def head_tensor(tensors: dict | None, name: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
    """The task's global head tensor ``name`` as float32 (what the device trains): float32 or float64
    of exactly ``shape``, finite once rounded to float32. TaskDeclined otherwise, with the Java
    device's reasons in its order (FedAvgHeadTask.headTensor): its presence, shape, dtype, values.
    An integer head was cast and trained on where the Java device declined it (a review's finding)."""
    value = (tensors or {}).get(name)
    if value is None:
        raise TaskDeclined(f"{kind} task carries no head tensor {name!r} (weight, bias)")
    value = np.asarray(value)
    if value.shape != shape:
        raise TaskDeclined(f"head tensor {name} has shape {list(value.shape)}, the task's params say {list(shape)}")
    if value.dtype not in (np.float32, np.float64):
        raise TaskDeclined(f"tensor {name!r} must be float32 or float64, got {value.dtype}")
    with np.errstate(over="ignore"):        # a float64 past float32's range is an infinity: declined
        value = value.astype(np.float32)
    if not np.isfinite(value).all():
        raise TaskDeclined("global head contains NaN or Inf")
    return value


def global_head(tensors: dict | None, num_classes: int, feature_dim: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """The task's (weight (C, d), bias (C,)), each read by :func:`head_tensor`, the weight first."""
    return (head_tensor(tensors, "weight", (num_classes, feature_dim), kind),
            head_tensor(tensors, "bias", (num_classes,), kind))


def extractor_of_dim(factory: ExtractorFactory, model: ModelSpec, feature_dim: int):
    """The task's extractor (:func:`extractor_for`); TaskDeclined where its features are not
    ``feature_dim`` wide (the head could not take them)."""
    extractor = extractor_for(factory, model)
    if extractor.feature_dim != feature_dim:
        raise TaskDeclined(f"backbone gives {extractor.feature_dim}-d features, task expects {feature_dim}")
    return extractor
