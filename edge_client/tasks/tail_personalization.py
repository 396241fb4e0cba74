"""FP(φ) and FP(M) after OLL: the device fine-tunes its backbone's tail (φ, the head frozen) or the
tail and the head (M) on its own training split, with no communication (the Fed3R paper's Phase 4,
Table 6; spec ``learning_after_fed3r.md``).

OLL prunes the head to the device's labels; a tail_training program holds the whole C-class head,
so the pruning goes into it as a mask: every class absent from the local labels gets the bias
:data:`MASKED_BIAS`, whose softmax probability is exactly 0 in float32. The program's softmax and
argmax are then OLL's over the local classes, the masked rows get no gradient, and no program has
to be exported per k. The loop is FT(φ)/FT(M)'s (``SessionStepper`` and ``local_sgd`` on the trunk's
cached activations; the task's recipe, seeded batches, weight decay on the trained tensors),
through the bundle's eager twin, which also gives the fine-tuned features. The learning rate is
picked among the task's ``fp_lrs`` by k-fold cross-validation on the training split, as FP(ψ)
picks its own (``edge_client.oll.choose_fp_lr``; ties to the first, the gentler rate).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from protocols.payloads.fedavg import TAIL_PREFIX, raise_if_diverged

from ..oll import PersonalizedHead, best_candidate, check_candidates, cv_folds
from .head_training import LocalTraining, SessionStepper, local_sgd
from .numpy_head import within_cross_validation_budget

FP_PARTS = {"phi": False, "M": True}        # FP of the tail alone, or of the tail and the head: head trains?
MASKED_BIAS = np.float32(-1e4)              # (f·w − 1e4)/T: e^(−1e5) is 0 in float32 for any feature a head sees


def masked_head(head: PersonalizedHead) -> dict[str, np.ndarray]:
    """OLL's pruned head as a whole C-class head: the global rows, absent classes' biases masked."""
    bias = head.global_bias.copy()
    bias[np.setdiff1d(np.arange(len(bias)), head.label_map.global_ids)] = MASKED_BIAS
    return {"weight": head.global_weight.copy(), "bias": bias}


@dataclass
class TailFineTuning:
    """FP(``part``) of a tail_training ``session`` (its eager twin: it gives features) from ``start``
    (every tensor of the program: the tail and the masked head)."""

    session: object
    start: dict[str, np.ndarray]
    part: str
    recipe: LocalTraining

    def __post_init__(self):
        if self.part not in FP_PARTS:
            raise ValueError(f"FP part must be one of {sorted(FP_PARTS)}, got {self.part!r}")
        self.trained = frozenset(name for name in self.start if name.startswith(TAIL_PREFIX) or FP_PARTS[self.part])

    def fit(self, activations: np.ndarray, labels: np.ndarray, lr: float) -> dict[str, np.ndarray]:
        """The model after the recipe's epochs at ``lr`` on these rows (global label ids, all local)."""
        recipe = replace(self.recipe, lr=lr)
        stepper = SessionStepper(self.session, self.start, recipe, self.trained)
        local_sgd(stepper, len(labels), activations, labels, recipe)
        model = stepper.parameters()
        raise_if_diverged({name: model[name] for name in self.trained})
        return model

    def predict(self, model: dict[str, np.ndarray], activations: np.ndarray) -> np.ndarray:
        """Global label ids under ``model``: its tail's features, its (masked) head's argmax."""
        self.session.set_parameters(model)
        features = self.session.features(activations)
        return (features @ model["weight"].T + model["bias"]).argmax(axis=1)

    def choose_lr(self, activations: np.ndarray, labels: np.ndarray, candidates, folds: int
                  ) -> tuple[float, dict[float, float]]:
        """(chosen lr, {lr: cross-validated accuracy}); one candidate, or fewer rows than folds: the first."""
        candidates = check_candidates(candidates, folds)
        if len(candidates) == 1 or len(labels) < folds:
            return candidates[0], {}
        parts, fits = cv_folds(len(labels), folds, self.recipe.seed)
        within_cross_validation_budget(fits, len(labels), self.recipe, len(candidates))
        scores = {}
        for lr in candidates:
            correct = sum(int((self.predict(self.fit(activations[fit], labels[fit], lr), activations[held])
                               == labels[held]).sum()) for fit, held in zip(fits, parts))
            scores[lr] = correct / len(labels)
        return best_candidate(candidates, scores), scores
