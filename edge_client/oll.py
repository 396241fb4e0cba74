"""OLL (Only Local Labels): personalise a global linear head by keeping only the local classes.

Theory (Fed3R spec §2, [P] Algorithm 2): a device whose training labels cover C_k ⊂ C keeps
the rows of the global head (weights *and* bias, [code]) for c ∈ C_k, renumbered 0..k−1, and
predicts with a softmax over those k classes only, mapping the argmax back to the global id.
Classes outside C_k can never be predicted; the device's problem shrinks from C to k classes
(cheaper inference, no confusion with classes it never sees). Optionally the pruned head is
fine-tuned locally, FP(ψ), with the same loop as federated rounds
(:func:`edge_client.tasks.head_training.train_head`), keeping T = 0.1.

The label map is deterministic: local index i is the i-th smallest global label in C_k, so
the server, the device and a re-run all agree without exchanging the map.

Labels outside C_k at evaluation time (closed-set assumption broken) are handled by
``fallback``:

* ``"error"`` (default, as the reference code): :class:`OutOfLocalLabels` names them;
* ``"global"``: those samples are scored with the full global head instead (counted in the
  result). This routes by the *true* label, so it is an evaluation policy, not something a
  deployed device could do at prediction time; ``predict`` always answers among C_k.

Learning rate for FP(ψ): the spec's rule, base × 0.1 when the global head came from a Fed3R
initialisation, × 0.1 again for OLL (:func:`oll_learning_rate`). The spec itself calls the rule
ambiguous (§7.8), and the right step size depends on the feature scale of the backbone and the
image size (at 32 px the MobileNetV2 features are small and the rule's LR overshoots on
two-class devices). :func:`choose_fp_lr` lets a device pick among candidate LRs by
cross-validation on its own training split, which needs no communication and no test labels.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from protocols.payloads.fedavg import raise_if_diverged

from .tasks.head_training import LocalTraining, TrainedHead, train_head
from .tasks.numpy_head import (head_size, heads_per_lockstep, lockstep_batch, train_heads_together,
                               within_cross_validation_budget)

FALLBACKS = ("error", "global")


class OutOfLocalLabels(ValueError):
    """Labels outside the device's local label set, where OLL cannot answer."""

    def __init__(self, labels: np.ndarray, local: np.ndarray):
        self.labels = np.unique(labels)
        super().__init__(f"labels {self.labels.tolist()} are not among the device's local labels "
                         f"{local.tolist()} (OLL predicts only local labels; use fallback='global' "
                         "to score such samples with the global head)")


def oll_learning_rate(base_lr: float = 0.1, fed3r_init: bool = True) -> float:
    """FP(ψ) learning rate after OLL: base × 0.1 (Fed3R init) × 0.1 (OLL), spec §2/§4."""
    return base_lr * (0.1 if fed3r_init else 1.0) * 0.1


class LabelMap:
    """Sorted global label ids ↔ local indices 0..k−1."""

    def __init__(self, local_labels, num_classes: int | None = None):
        labels = np.asarray(local_labels)
        if labels.ndim != 1 or labels.size == 0 or not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"local labels must be a non-empty 1-D integer array, got {labels.dtype} {labels.shape}")
        if labels.min() < 0 or (num_classes is not None and labels.max() >= num_classes):
            raise ValueError(f"local labels must lie in [0, {num_classes}), got [{labels.min()}, {labels.max()}]")
        self.global_ids = np.unique(labels).astype(np.int64)   # sorted: this *is* the map
        self.num_classes = num_classes

    @property
    def k(self) -> int:
        return len(self.global_ids)

    def contains(self, global_labels) -> np.ndarray:
        return np.isin(np.asarray(global_labels), self.global_ids)

    def to_local(self, global_labels) -> np.ndarray:
        global_labels = np.asarray(global_labels, dtype=np.int64)
        inside = self.contains(global_labels)
        if not inside.all():
            raise OutOfLocalLabels(global_labels[~inside], self.global_ids)
        return np.searchsorted(self.global_ids, global_labels).astype(np.int64)

    def to_global(self, local_indices) -> np.ndarray:
        local_indices = np.asarray(local_indices, dtype=np.int64)
        if local_indices.size and (local_indices.min() < 0 or local_indices.max() >= self.k):
            raise ValueError(f"local indices must lie in [0, {self.k})")
        return self.global_ids[local_indices]


def prune(weight: np.ndarray, bias: np.ndarray, local_labels) -> tuple[np.ndarray, np.ndarray, LabelMap]:
    """OLL (Algorithm 2): the rows of (weight (C, d), bias (C,)) for the local labels, renumbered."""
    weight, bias = np.asarray(weight), np.asarray(bias)
    if weight.ndim != 2 or bias.shape != (weight.shape[0],):
        raise ValueError(f"head must be weight (C, d) and bias (C,), got {weight.shape} and {bias.shape}")
    label_map = LabelMap(local_labels, num_classes=weight.shape[0])
    return weight[label_map.global_ids].copy(), bias[label_map.global_ids].copy(), label_map


@dataclass
class Scored:
    correct: int
    total: int
    fallback: int = 0       # samples scored by the global head (fallback="global")

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else float("nan")


class PersonalizedHead:
    """A device's OLL head: global head pruned to the local training labels."""

    def __init__(self, global_weight: np.ndarray, global_bias: np.ndarray, local_labels,
                 fallback: str = "error"):
        if fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
        self.global_weight = np.asarray(global_weight, dtype=np.float32)
        self.global_bias = np.asarray(global_bias, dtype=np.float32)
        self.weight, self.bias, self.label_map = prune(self.global_weight, self.global_bias, local_labels)
        self.fallback = fallback
        self.last_training: TrainedHead | None = None

    def _check(self, features: np.ndarray) -> np.ndarray:
        features = np.asarray(features, dtype=np.float32)
        if features.ndim != 2 or features.shape[1] != self.weight.shape[1]:
            raise ValueError(f"features must be (n, {self.weight.shape[1]}), got {features.shape}")
        return features

    def logits(self, features: np.ndarray) -> np.ndarray:
        """(n, k) logits over the local classes, in local-index order."""
        return self._check(features) @ self.weight.T + self.bias

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Global label ids, always among the local labels."""
        return self.label_map.to_global(self.logits(features).argmax(axis=1))

    def score(self, features: np.ndarray, labels) -> Scored:
        """Correct / total on labelled samples, applying the fallback policy to out-of-set labels."""
        features, labels = self._check(features), np.asarray(labels, dtype=np.int64)
        if labels.shape != (len(features),):
            raise ValueError(f"need one label per feature row, got {labels.shape}")
        inside = self.label_map.contains(labels)
        if not inside.all() and self.fallback == "error":
            raise OutOfLocalLabels(labels[~inside], self.label_map.global_ids)
        correct = int((self.predict(features[inside]) == labels[inside]).sum()) if inside.any() else 0
        outside = ~inside
        if outside.any():
            global_pred = (features[outside] @ self.global_weight.T + self.global_bias).argmax(axis=1)
            correct += int((global_pred == labels[outside]).sum())
        return Scored(correct, len(labels), int(outside.sum()))

    def fine_tune(self, features: np.ndarray, labels, recipe: LocalTraining, session=None) -> TrainedHead:
        """FP(ψ): local SGD on the pruned head; labels must be local labels (global ids)."""
        local = self.label_map.to_local(labels)
        self.last_training = train_head(self.weight, self.bias, self._check(features), local, recipe, session)
        self.weight, self.bias = self.last_training.weight, self.last_training.bias
        return self.last_training


def fp_recipe(base: LocalTraining | None = None, *, epochs: int = 25, batch_size: int = 64,
              base_lr: float = 0.1, fed3r_init: bool = True, seed: int = 0) -> LocalTraining:
    """The spec's FP(ψ) recipe: 25 epochs, batch 64 (PFL), LR by :func:`oll_learning_rate`, T kept."""
    return replace(base or LocalTraining(), epochs=epochs, batch_size=batch_size,
                   lr=oll_learning_rate(base_lr, fed3r_init), seed=seed)


def choose_fp_lr(weight: np.ndarray, bias: np.ndarray, features: np.ndarray, labels, recipe: LocalTraining,
                 candidates, folds: int = 5) -> tuple[float, dict[float, float]]:
    """Pick the FP(ψ) learning rate by k-fold cross-validation on the local training split:
    (chosen lr, {lr: cross-validated accuracy}).

    The training rows are cut (seeded by ``recipe.seed``) into ``folds`` parts; for each
    candidate LR the OLL head is fine-tuned on all parts but one and scored on the one left out,
    in turn, and the correct answers are added up. Cross-validation, not one validation split: a
    device holds a few hundred samples at ~95 % accuracy, where one 20 % split decides between
    rates on one or two samples. Accuracy, not the loss: a larger step sharpens confident
    predictions (lower cross-entropy) while flipping borderline ones. Ties go to the earlier
    candidate, so list the preferred one first (the personalization job lists the gentler rate
    first: with equal evidence, stay closer to the federated model). With one candidate, or
    fewer rows than folds, the first candidate is returned untrained.

    The folds × candidates heads are fine-tuned side by side in numpy
    (:func:`~edge_client.tasks.numpy_head.train_heads_together`: the steps of ``train_head``, one
    batched step for all of them), as the per-step overhead, not arithmetic, is what a tiny
    k-class head's training costs.

    Its SGD steps and multiply-adds are counted with the chosen rate's fit on all rows that follows
    (the caller's ``PersonalizedHead.fine_tune``): past the step or work budget together, declined
    before any is trained.
    """
    candidates = check_candidates(candidates, folds)
    labels = np.asarray(labels, dtype=np.int64)
    if len(candidates) == 1 or len(labels) < folds:
        return candidates[0], {}
    parts, fits = cv_folds(len(labels), folds, recipe.seed)
    head = PersonalizedHead(weight, bias, labels, fallback="global")
    features, local = head._check(features), head.label_map.to_local(labels)
    start_weight, start_bias = head.weight, head.bias
    within_cross_validation_budget(fits, len(labels), recipe, len(candidates),   # steps, then work: as Java
                                   head_size(start_weight, start_bias))
    # a group of rates at a time, its heads scored and let go: all folds x rates held at once were up
    # to 320 heads (numpy_head.MAX_LOCKSTEP_BYTES)
    rates = max(1, heads_per_lockstep(lockstep_batch(recipe.batch_size, fits), *start_weight.shape) // len(fits))
    scores: dict[float, float] = {}
    for first in range(0, len(candidates), rates):
        group = candidates[first:first + rates]
        weights, biases = train_heads_together(start_weight, start_bias, features, local, fits, group, recipe)
        # the protocol's rule, as for any trained head (Java: FpLearningRate via HeadTrainer)
        raise_if_diverged({"weight": weights, "bias": biases})
        for i, lr in enumerate(group):
            correct = 0
            for k, held in enumerate(parts):
                head.weight, head.bias = weights[k, i], biases[k, i]
                correct += head.score(features[held], labels[held]).correct
            scores[lr] = correct / len(labels)
    return best_candidate(candidates, scores), scores


def check_candidates(candidates, folds) -> list[float]:
    """The candidate learning rates as floats; ValueError unless all are finite and > 0 and folds >= 2."""
    candidates = [float(lr) for lr in candidates]
    if not candidates or any(not np.isfinite(lr) or lr <= 0 for lr in candidates):
        raise ValueError(f"candidate learning rates must be finite and > 0, got {candidates}")
    if isinstance(folds, bool) or not isinstance(folds, (int, np.integer)) or folds < 2:
        raise ValueError(f"folds must be an integer >= 2, got {folds!r}")
    return candidates


def cv_folds(rows: int, folds: int, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(held-out parts, the rows each fold trains on): ``rows`` cut into ``folds`` seeded parts."""
    parts = np.array_split(np.random.default_rng(seed).permutation(rows), folds)
    return parts, [np.concatenate([p for j, p in enumerate(parts) if j != k]) for k in range(folds)]


def best_candidate(candidates: list[float], scores: dict[float, float]) -> float:
    """The best-scoring candidate; ties go to the earlier one (the gentler rate, listed first)."""
    return max(candidates, key=lambda lr: (scores[lr], -candidates.index(lr)))
