"""The checks a device makes of a head task's inputs before it extracts or trains anything.

The head handlers (``fedavg.head``, the stateful heads, ``oll.personalize``) and the tail trainer
decline the same bad inputs with the same reasons, which the Java device gives as well
(``tests/test_java_tasks.py`` compares them): a global head that is not finite, a local label
outside the job's classes, a backbone whose features are not the task's size.
"""

from __future__ import annotations

import numpy as np

from protocols.payloads.task_params import ModelSpec

from ..agent import TaskDeclined
from .extractors import ExtractorFactory, extractor_for


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
