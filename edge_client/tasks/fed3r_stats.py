"""``fed3r.stats``: extract features of the local training set and return A_k, b_k.

Streaming (a task with ``from_sample``): the device's data only grows (new samples are appended,
:meth:`Fed3RStatsTask.add_samples`); the task names how many of its samples the aggregator
already holds, and the device sends the statistics of the samples after those only, echoing
``from_sample``. The aggregator's count is the ledger: the device keeps none, so a retry or a
lost reply can never make it count a sample twice.

Which samples a task covers (``from_sample``, ``max_samples`` with ``cap_samples``) is the
aggregator's choice; the device answers only windows that no combination of its answers can
difference down to a few samples (``edge_client/sample_windows.py``, the boundary rule).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from protocols.envelope import EnvelopeError
from protocols.payloads.fed3r import (CENTER_TENSOR, KIND, Fed3RStatsParams, check_canonical_factor, dense_values,
                                      encode_factor, encode_stats, factor_values)
from protocols.random_features import RandomFourierFeatures

from ..agent import TaskDeclined
from ..fed3r import Fed3RAccumulator
from ..sample_windows import SampleWindowLedger
from .extractors import ExtractorFactory, extractor_for
from .params import read_params
from .task_inputs import check_local_labels, local_samples


DEFAULT_MEMORY_BUDGET = 256 * 1024 * 1024


class Fed3RStatsTask:
    """``memory_budget``: the bytes this device gives the task's largest arrays (the float64 p x p
    Gram matrix and C x p class sums, and a random-feature map's input_dim x dim weights); a task
    whose p needs more is declined before anything is allocated (random_features.dim is the
    aggregator's to choose, up to 100,000: 80 GB of Gram matrix). ``windows``: the windows of
    samples this device answered (kept in its state folder by :func:`edge_client.handlers.device_handlers`;
    by default none: then only windows of all its samples are answered, ``edge_client/sample_windows.py``)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, extractor_factory: ExtractorFactory,
                 memory_budget: int = DEFAULT_MEMORY_BUDGET, windows: SampleWindowLedger | None = None):
        self.images, self.labels = local_samples(images, labels)
        self.extractor_factory = extractor_factory
        self.memory_budget = memory_budget
        self.windows = SampleWindowLedger() if windows is None else windows

    def add_samples(self, images: np.ndarray, labels: np.ndarray) -> None:
        """New local data (appended: the samples a streaming job already holds keep their indices)."""
        images, labels = local_samples(images, labels)
        self.images = np.concatenate([self.images, images])
        self.labels = np.concatenate([self.labels, labels])

    def __call__(self, params: dict[str, Any], tensors: dict | None = None) -> tuple[dict, dict[str, np.ndarray]]:
        if len(self.images) == 0:
            raise TaskDeclined("no local training data")
        task = read_params(Fed3RStatsParams, params, KIND)
        num_classes, dense, start = task.model.num_classes, task.format == "dense", task.from_sample or 0
        if not 0 <= start <= len(self.images):
            raise TaskDeclined(f"the aggregator holds {start} samples of this device, it has {len(self.images)}")
        if start == len(self.images):
            raise TaskDeclined("no new samples")
        images, labels = self.images[start:], self.labels[start:]
        check_local_labels(labels, num_classes)
        extractor = extractor_for(self.extractor_factory, task.model)
        cap = task.sample_cap
        if cap is not None and not task.weighs_samples:
            # DP caps the samples per device: the first max_samples, a choice blind to the data (or, with
            # cap_by_weight, every sample weighed below: the same bound, none of the data left out)
            images, labels = images[:cap], labels[:cap]
        self._check_memory(task, extractor.feature_dim, rows=len(labels))
        window = (start, start + len(labels), len(self.images))
        if (reason := self.windows.refusal(*window)) is not None:
            raise TaskDeclined(reason)
        spec = task.random_features
        rf = None if spec is None else RandomFourierFeatures(spec.dim, float(spec.sigma), spec.seed)
        acc = Fed3RAccumulator(num_classes, extractor.feature_dim, task.fit_intercept, rf,
                               keep_rows=task.factor and not dense, feature_clip_norm=task.feature_clip_norm or 0.0,
                               feature_center=feature_center(task, tensors, extractor.feature_dim))
        try:
            acc.update(extractor.extract(images), labels)
        except ValueError as exc:          # statistics that are not numbers are declined, never sent
            raise TaskDeclined(str(exc)) from None
        if task.weighs_samples:
            acc.weigh(cap)
        body, out = encode_smallest(acc, num_classes, dense, task.dtype)
        if task.from_sample is not None:
            body["from_sample"] = start
        if (reason := self.windows.record(*window)) is not None:     # written down before it goes out
            raise TaskDeclined(reason)
        return body, out


    def _check_memory(self, task: Fed3RStatsParams, feature_dim: int, rows: int) -> None:
        spec = task.random_features
        p = (feature_dim if spec is None else spec.dim) + task.fit_intercept
        # A, B and the random features' matrix, and per row what the task's own numbers size: the
        # labels' one-hot (C) and the random features with their copy (2p); a review found the rows'
        # share left out (20x the budget at C = 10^5). The backbone's features per row are the
        # device's own data, held however the task is sized.
        per_row = task.model.num_classes + (0 if spec is None else 2 * p)
        needed = 8 * (p * p + task.model.num_classes * p + (0 if spec is None else feature_dim * spec.dim)
                      + rows * per_row)
        if needed > self.memory_budget:
            raise TaskDeclined(f"statistics of {p} features need {needed / 2**20:.0f} MiB, over this device's "
                               f"{self.memory_budget / 2**20:.0f} MiB")


def feature_center(task: Fed3RStatsParams, tensors: dict | None, feature_dim: int) -> np.ndarray | None:
    """The center a ``centered`` task carries: the feature dimension's finite vector, else a decline."""
    if not task.centered:
        return None
    center = (tensors or {}).get(CENTER_TENSOR)
    if center is None:
        raise TaskDeclined(f"a centered {KIND} task without its {CENTER_TENSOR!r} tensor")
    center = np.asarray(center)
    # the Java device's order and words (Fed3RStatsTask.featureCenter): an integer center was taken
    if center.dtype not in (np.float32, np.float64):
        raise TaskDeclined(f"tensor {CENTER_TENSOR!r} must be float32 or float64, got {center.dtype}")
    if center.shape != (feature_dim,):
        raise TaskDeclined(f"{CENTER_TENSOR} must be {feature_dim} finite values, got shape {list(center.shape)}")
    if not np.isfinite(center).all():
        raise TaskDeclined(f"{CENTER_TENSOR} must be {feature_dim} finite values")
    return center.astype(np.float64)


def encode_smallest(acc: Fed3RAccumulator, num_classes: int, dense: bool, dtype: str):
    """The exact factor form when the device kept its rows and it is smaller, else the triangle."""
    factor = acc.factor()       # first: the dense A is built only if it is what goes out
    if factor is not None and factor_values(len(factor.r_factor), acc.p, len(factor.class_ids),
                                            len(factor.zero_columns)) < dense_values(acc.p, len(factor.class_ids)):
        ids = factor.class_ids
        body, tensors = encode_factor(factor.r_factor, factor.qty, ids, acc.n, num_classes, dtype=dtype,
                                      zero_columns=factor.zero_columns)
        try:                 # rounding to the wire dtype may (in theory) flush a tiny entry to zero
            check_canonical_factor(tensors["R"])
            return body, tensors
        except EnvelopeError:
            pass
    A, ids, b = acc.sparse()
    return encode_stats(A, ids, b, acc.n, num_classes, dense=dense, dtype=dtype)
