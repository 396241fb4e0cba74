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
    """TaskDeclined where a local label is not one of the job's ``num_classes`` classes."""
    if labels.min() < 0 or labels.max() >= num_classes:
        raise TaskDeclined(f"local label {labels.max()} outside the job's {num_classes} classes")


def extractor_of_dim(factory: ExtractorFactory, model: ModelSpec, feature_dim: int):
    """The task's extractor (:func:`extractor_for`); TaskDeclined where its features are not
    ``feature_dim`` wide (the head could not take them)."""
    extractor = extractor_for(factory, model)
    if extractor.feature_dim != feature_dim:
        raise TaskDeclined(f"backbone gives {extractor.feature_dim}-d features, task expects {feature_dim}")
    return extractor
