"""Payload of ``oll.personalize`` tasks and results: on-device personalization, metrics only.

Task (aggregator -> device), tensors of the ``task`` message:

* ``weight``  float32 (C, d)  the global head to personalise, ``logits = f @ weight.T + bias``
* ``bias``    float32 (C,)

and in ``params``: ``num_classes``, ``feature_dim``, ``backbone``, ``image_size``,
``weights_sha256`` (the backbone the head was trained on), ``fallback`` ("error" | "global",
what OLL does with held-out labels outside the local training labels), and the FP(ψ) recipe:
``fp_epochs`` (0: OLL only), ``batch_size``, ``weight_decay``, ``temperature``, ``seed`` and
``fp_lrs`` (candidate learning rates; with more than one the device picks one by
``fp_folds``-fold cross-validation on its *training* split, ties to the earlier candidate,
then fine-tunes on all of it). ``fp_part`` (absent: "psi") says what FP fine-tunes: "psi" the
pruned head, "phi" the backbone's tail through the device's tail bundle with the OLL head frozen,
"M" the tail and the OLL head (``edge_client/tasks/tail_personalization.py``; a device without a
tail bundle declines); ``correct.oll_fp`` then counts that model.

Result (device -> aggregator): no tensors. The personalised head stays on the device (it is
the device's model; sending it would leak the local label set and more). The body reports
counts on the device's local held-out split:

* ``n_train``, ``n_test``  local training / held-out samples
* ``local_classes``        k = |C_k|, the labels OLL keeps
* ``correct``              {"global": int, "oll": int, "oll_fp": int}: held-out samples that the
                           global head, the OLL-pruned head and the OLL head after FP(ψ)
                           classify correctly ("oll_fp" absent when ``fp_epochs`` is 0); after
                           partial personalization or Ditto (task param ``personal_job``: the
                           ``pp`` or ``ditto`` job whose personal part the device keeps) also
                           "personal": the global weight with the device's own bias v_k (pp),
                           or its own head v_k (ditto), which OLL and FP(ψ) then start from
* ``fallback``             held-out samples whose label is outside C_k (scored by the global
                           head when the task's fallback is "global")
* ``fp_lr``                the FP(ψ) learning rate the device used (null without FP)

The aggregator's personalised accuracy is the sample-weighted mean over devices,
WMA = Σ_k correct_k / Σ_k n_test_k, as in the Fed3R/OLL papers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..envelope import Envelope, EnvelopeError, body_field
from .fedavg import LocalTraining
from .task_params import ModelSpec, TaskParams, check_choices, check_int, check_number, check_str, choice, optional, part

KIND = "oll.personalize"
METHODS = ("global", "oll", "oll_fp")
PERSONAL = "personal"           # with the device's personal part (after a ``pp`` or ``ditto`` job)
FALLBACKS = ("error", "global")
FP_PARTS = ("psi", "phi", "M")    # task param ``fp_part``: FP of the head, of the backbone's tail, of both
MAX_FP_LRS = 16


@dataclass(frozen=True)
class PersonalizeParams(TaskParams):
    """``oll.personalize`` params (module doc); :meth:`recipe` is FP(ψ)'s local recipe, whose
    learning rate the device then picks among ``fp_lrs``."""

    KIND = KIND
    model: ModelSpec = part(ModelSpec)
    feature_dim: int = 1280
    fallback: str = choice("error", FALLBACKS)
    fp_epochs: int = 0
    batch_size: int = 50
    fp_lrs: tuple[float, ...] = ()
    fp_folds: int = 5
    weight_decay: float = 4e-5
    temperature: float = 0.1
    seed: int = 0
    tail_stages: int = 0
    personal_job: str | None = optional()
    fp_part: str = choice("psi", FP_PARTS)      # FP of the head (psi), the backbone's tail (phi) or both (M)

    def __post_init__(self):
        check_int("feature_dim", self.feature_dim, 1, 1_000_000)
        check_choices(self)
        check_int("fp_epochs", self.fp_epochs, 0, 10_000)
        if not isinstance(self.fp_lrs, tuple) or len(self.fp_lrs) > MAX_FP_LRS:
            raise ValueError(f"fp_lrs must be a list of at most {MAX_FP_LRS} learning rates, got {self.fp_lrs!r}")
        for lr in self.fp_lrs:
            check_number("fp_lrs[i]", lr, low_open=True)
        if self.fp_epochs and not self.fp_lrs:
            raise ValueError("FP (fp_epochs > 0) needs at least one learning rate in fp_lrs")
        check_int("fp_folds", self.fp_folds, 2, 20)
        check_int("tail_stages", self.tail_stages, 0, 64)
        if self.personal_job is not None:
            check_str("personal_job", self.personal_job, max_len=128)
        self.recipe()           # refuses a bad batch_size, weight_decay, temperature or seed

    def recipe(self) -> LocalTraining:
        return LocalTraining(epochs=max(self.fp_epochs, 1), batch_size=self.batch_size,
                             weight_decay=self.weight_decay, temperature=self.temperature, seed=self.seed)


@dataclass(frozen=True)
class PersonalizationReport:
    n_train: int
    n_test: int
    local_classes: int
    correct: dict[str, int]
    fallback: int
    fp_lr: float | None


def encode_report(report: PersonalizationReport) -> tuple[dict, dict]:
    """(body, tensors) of an ``oll.personalize`` result."""
    return {"n_train": int(report.n_train), "n_test": int(report.n_test),
            "local_classes": int(report.local_classes),
            "correct": {m: int(c) for m, c in report.correct.items()},
            "fallback": int(report.fallback),
            "fp_lr": None if report.fp_lr is None else float(report.fp_lr)}, {}


def parse_report(msg: Envelope, num_classes: int, with_fp: bool, max_samples: int = 10**9,
                 with_personal: bool = False, fp_lrs: tuple[float, ...] | None = None) -> PersonalizationReport:
    """Validate an ``oll.personalize`` result; raise EnvelopeError if anything is off (``fp_lrs``:
    the task's candidates, one of which the device's ``fp_lr`` must be)."""
    if msg.tensors:
        raise EnvelopeError(f"{KIND}: a personalization result carries no tensors, got {sorted(msg.tensors)}")
    n_train = body_field(msg, "n_train", int)
    n_test = body_field(msg, "n_test", int)
    if not (0 < n_train <= max_samples and 0 < n_test <= max_samples):
        raise EnvelopeError(f"{KIND}: sample counts n_train={n_train}, n_test={n_test} out of range "
                            f"(1..{max_samples})")
    k = body_field(msg, "local_classes", int)
    if not 1 <= k <= num_classes:
        raise EnvelopeError(f"{KIND}: local_classes={k} outside 1..{num_classes}")
    correct = body_field(msg, "correct", dict)
    expected = (set(METHODS) if with_fp else set(METHODS) - {"oll_fp"}) | ({PERSONAL} if with_personal else set())
    if set(correct) != expected:
        raise EnvelopeError(f"{KIND}: correct counts for {sorted(correct)}, expected {sorted(expected)}")
    for method, count in correct.items():
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= n_test:
            raise EnvelopeError(f"{KIND}: correct[{method!r}]={count!r} must be an integer in 0..n_test={n_test}")
    fallback = body_field(msg, "fallback", int)
    if not 0 <= fallback <= n_test:
        raise EnvelopeError(f"{KIND}: fallback={fallback} outside 0..n_test={n_test}")
    fp_lr = msg.body.get("fp_lr")
    if with_fp:
        value = _finite_float(fp_lr)
        if value is None or value <= 0:
            raise EnvelopeError(f"{KIND}: fp_lr={str(fp_lr)[:40]} must be a finite positive number")
        if fp_lrs is not None and value not in fp_lrs:
            raise EnvelopeError(f"{KIND}: fp_lr={value!r} is none of the task's fp_lrs {list(fp_lrs)}")
        fp_lr = value
    elif fp_lr is not None:
        raise EnvelopeError(f"{KIND}: fp_lr={fp_lr!r} reported for a task without FP")
    return PersonalizationReport(n_train, n_test, k, dict(correct), fallback, fp_lr)


def _finite_float(value) -> float | None:
    """``value`` as a finite float, or None: not a number (a bool is not), or no finite float (a
    JSON integer of 400 digits raised OverflowError out of ``math.isfinite``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None
