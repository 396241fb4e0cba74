"""Payload of ``fedavg.head`` tasks and results: a linear softmax head, trained locally.

Task (aggregator -> device), tensors of the ``task`` message:

* ``weight``  float32 (C, d)  the current global head, ``logits = f @ weight.T + bias``
* ``bias``    float32 (C,)

and in ``params`` the local-training recipe (see ``aggregator.jobs.fedavg.FedAvgConfig``) and
the local step rule, :class:`LocalRuleRecipe` (plain SGD, FedProx, FedSAM, FedASAM).

Result (device -> aggregator), tensors of the ``result`` message:

* ``weight``  float32 (C, d)  the head after the device's local epochs (the parameters
                              themselves, not a difference: averaging parameters is FedAvg)
* ``bias``    float32 (C,)

and in the body ``n`` (local training samples, the FedAvg weight n_k), ``num_classes`` and
``feature_dim``. Both directions carry exactly C·d + C float32 values, so a round costs
2·(C·d + C)·4 bytes per participant plus headers (the "2dC" of the Fed3R paper's cost model).

``fedavg.tail`` (FT(φ) / FT(M): fine-tuning the backbone's last stages on device) carries
named tensors instead:

* task: every tensor of the global model, the tail's ``tail.<...>`` tensors (names and
  shapes as in the devices' bundle manifest, section ``tail``) plus ``weight`` and
  ``bias``; in ``params`` the recipe, ``tail_stages`` and ``train``: ``"tail"`` (FT(φ):
  the head stays frozen at the task's values) or ``"tail+head"`` (FT(M));
* result: exactly the tensors the device trained (the tail's for FT(φ), all for FT(M)),
  float32, finite, with ``n`` in the body.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..envelope import Envelope, EnvelopeError, body_field, require_tensor
from .task_params import ModelSpec, TaskParams, WireParams, check_choices, check_int, choice, optional, part

KIND = "fedavg.head"
KIND_TAIL = "fedavg.tail"
MAX_EPOCHS = 10_000             # of one local training
MAX_BATCH_SIZE = 2 ** 30
HEAD_TENSORS = ("weight", "bias")
TAIL_PREFIX = "tail."
# what a fedavg.tail device trains -> whether the head is among the trained tensors
TAIL_TRAIN_MODES = {"tail": False, "tail+head": True}


LOCAL_RULES = ("sgd", "sam", "asam")


@dataclass(frozen=True)
class LocalRuleRecipe(WireParams):
    """How a device turns a mini-batch's gradient into its step: task params of every FedAvg-family
    task, validated on both sides (the job's config, the device's parse).

    ``local_rule``: "sgd"; "sam" (FedSAM: descend with the gradient at w + ρ g/‖g‖); "asam"
    (FedASAM: at w + ρ T² g/‖T g‖, T = diag(|w| + η)). ``prox_mu`` μ > 0 adds FedProx's proximal
    term μ/2‖w − w_global‖² to the local objective under any rule. Defaults: ρ = 0.1, the thesis's
    SAM ρ on CIFAR-10 at α = 0 (its ASAM ρ there is 0.7), and its ASAM η = 0.2.
    """

    local_rule: str = choice("sgd", LOCAL_RULES)
    sam_rho: float = 0.1
    asam_eta: float = 0.2
    prox_mu: float = 0.0

    def __post_init__(self):
        check_choices(self)
        for name, hi in (("sam_rho", 100.0), ("asam_eta", 100.0), ("prox_mu", 1e4)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating)) or not math.isfinite(v) \
                    or not 0 <= v <= hi:
                raise ValueError(f"{name} must be a finite number in [0, {hi}], got {v!r}")
        if self.local_rule != "sgd" and self.sam_rho <= 0:
            raise ValueError(f"{self.local_rule} needs sam_rho > 0")


@dataclass(frozen=True)
class LocalTraining(WireParams):
    """The local SGD recipe of every head-training task (FedAvg(ψ), FT(φ)/FT(M), Scaffold, FedGloSS,
    partial personalization, OLL's FP(ψ)). Defaults: the Fed3R paper's FL setting ([P] §IV: E = 1,
    B = 50, lr 0.1, wd 4e-5, T = 0.1)."""

    epochs: int = 1
    batch_size: int = 50
    lr: float = 0.1
    weight_decay: float = 4e-5
    temperature: float = 0.1
    seed: int = 0
    rule: LocalRuleRecipe = part(LocalRuleRecipe)     # the step's direction: SGD, FedProx, FedSAM, FedASAM

    def __post_init__(self):
        # bounded: a device makes the whole schedule before its first step (a task of 10^12 epochs
        # held one for ever); the ranges Java's LocalTraining takes too
        check_int("epochs", self.epochs, 1, MAX_EPOCHS)
        check_int("batch_size", self.batch_size, 1, MAX_BATCH_SIZE)
        for name, low_ok in (("lr", False), ("weight_decay", True), ("temperature", False)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) \
                    or not math.isfinite(value) or value < 0 or (value == 0 and not low_ok):
                raise ValueError(f"{name} must be a finite number {'>=' if low_ok else '>'} 0, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0 (numpy's generators take no other), got {self.seed!r}")
        if not isinstance(self.rule, LocalRuleRecipe):
            raise ValueError(f"rule must be a LocalRuleRecipe, got {type(self.rule).__name__}")


@dataclass(frozen=True)
class HeadTrainingParams(TaskParams):
    """``fedavg.head`` params: the model, the head's feature dimension, the local recipe, and
    (asynchronous FedAvg) the model version the task carries, which the result echoes."""

    KIND = KIND
    model: ModelSpec = part(ModelSpec)
    feature_dim: int = 1280
    training: LocalTraining = part(LocalTraining)
    model_version: int | None = optional()

    def __post_init__(self):
        check_int("feature_dim", self.feature_dim, 1, 1_000_000)
        if self.model_version is not None:
            check_int("model_version", self.model_version)


@dataclass(frozen=True)
class TailTrainingParams(HeadTrainingParams):
    """``fedavg.tail`` params: ``fedavg.head``'s plus the tail's stages and what trains
    (``train``: "tail", FT(φ), or "tail+head", FT(M))."""

    KIND = KIND_TAIL
    REQUIRED_KEYS = ("tail_stages", "train")      # the device never guesses the split or what trains
    tail_stages: int = 1
    train: str = choice("tail", TAIL_TRAIN_MODES)

    def __post_init__(self):
        super().__post_init__()
        check_int("tail_stages", self.tail_stages, 1, 64)
        check_choices(self)


# What a trained parameter may hold on the wire: a finite float32 of magnitude at most 2^20.
# Every device declines local training that ends outside it as diverged (the Python device:
# train_head and encode_model_update; the Java device: HeadTrainer.MAX_ABS_TRAINED), and the
# aggregator refuses a result outside it, so whether a task diverged no longer depends on the
# runtime (float32 logits overflow to NaN on the Python device long after a double-precision
# device still holds a finite ±5e18 head). Why 2^20: float32's spacing there is 2^-3, so an SGD
# step below 1/16 no longer moves such a parameter (a head that got there has left the range
# where float32 training works), and its logits f·θ/T stay finite in float32 for any feature a
# float32 extractor can give, so no device overflows before it crosses the bound.
MAX_ABS_TRAINED = 2.0 ** 20


def trained_out_of_bounds(tensors: dict[str, np.ndarray]) -> str | None:
    """Why trained tensors break the protocol's bound (NaN/Inf, or |x| > MAX_ABS_TRAINED), or None."""
    for name, value in tensors.items():
        value = np.asarray(value)
        if not np.isfinite(value).all():
            return f"tensor {name!r} contains NaN or Inf"
        if value.size and float(np.abs(value).max()) > MAX_ABS_TRAINED:
            return f"tensor {name!r} holds |x| = {float(np.abs(value).max()):g} > {MAX_ABS_TRAINED:g} (2^20)"
    return None


def raise_if_diverged(tensors: dict[str, np.ndarray]) -> None:
    """The device side of that bound: FloatingPointError (the task is declined as diverged)."""
    broken = trained_out_of_bounds(tensors)
    if broken:
        raise FloatingPointError(f"local training diverged ({broken}); lower the learning rate")


@dataclass(frozen=True)
class HeadUpdate:
    n: int                  # local samples the head was trained on
    weight: np.ndarray      # (C, d) float32
    bias: np.ndarray        # (C,) float32

    def tensors(self) -> dict[str, np.ndarray]:
        return {"weight": self.weight, "bias": self.bias}


@dataclass(frozen=True)
class ModelUpdate:
    """A ``fedavg.tail`` result: the tensors the device trained, by name, and n."""

    n: int
    trained: dict[str, np.ndarray]

    def tensors(self) -> dict[str, np.ndarray]:
        return dict(self.trained)


# The most SGD steps one task may ask of a device, epochs × ⌈rows / batch_size⌉: the recipe's
# limits alone (10,000 epochs, batches of 1) let one task hold a device's memory (its schedule: 1.4
# GB at 1,000 rows) and its only task thread for hours (a review's finding). Past it every device,
# in every language, declines the task with the count.
MAX_LOCAL_STEPS = 1_000_000


class TooManySteps(ValueError):
    """A recipe past ``MAX_LOCAL_STEPS`` on this many rows: the device declines the task with this."""


# The most multiply-adds one task's local training of linear heads may ask of a device: every epoch
# visits each row once, and a row costs every trained head's C × (d + 1) parameters (forward and
# backward alike, counted once). The step budget alone let one task within every limit (50,000
# classes, a batch of every row, 10,000 epochs) hold a device's only task thread for 84 minutes
# (a review's finding); an honest recipe (1,000 classes, 10,000 rows, 100 epochs) is 1.3e12. A
# step whose local rule evaluates the gradient twice (FedSAM/FedASAM: at w and at w + ε̂) counts
# twice: counted once, a SAM task could ask twice the budget.
MAX_LOCAL_WORK = 10 ** 13


def check_local_work(rows: int, epochs: int, per_row: int, evaluations: int = 1) -> int:
    """``epochs`` × ``rows`` × ``per_row`` (the heads' parameters a row meets) × ``evaluations``
    (the gradient evaluations of each step: SAM/ASAM's 2); :class:`TooManySteps` past
    ``MAX_LOCAL_WORK`` (every device's head training)."""
    work = epochs * rows * per_row * evaluations
    if work > MAX_LOCAL_WORK:
        each_step = f", {evaluations} gradient evaluations a step," if evaluations != 1 else ""
        raise TooManySteps(f"local training of {epochs} epochs over {rows} samples through {per_row} head parameters"
                           f"{each_step} is {work:.2e} multiply-adds, more than a device takes ({MAX_LOCAL_WORK:.0e})")
    return work


def check_local_steps(rows: int, epochs: int, batch_size: int) -> int:
    """The SGD steps of ``epochs`` epochs over ``rows`` samples in batches of ``batch_size``;
    :class:`TooManySteps` past ``MAX_LOCAL_STEPS`` (every device's local training, LADD's too)."""
    steps = epochs * -(-rows // batch_size) if batch_size > 0 else 0
    if steps > MAX_LOCAL_STEPS:
        raise TooManySteps(f"local training of {epochs} epochs over {rows} samples in batches of {batch_size} is "
                           f"{steps} SGD steps, more than a device takes ({MAX_LOCAL_STEPS})")
    return steps


class BatchSchedule:
    """What a local-training recipe's ``seed`` means: the row positions of each SGD step, for
    ``epochs`` epochs over ``rows`` samples, each epoch one ``np.random.default_rng(seed)``
    permutation (one generator for all epochs) cut into batches of ``batch_size`` (the last one
    may be smaller). Devices in every language take the same mini-batches (golden vector
    ``sample_order.json``: numpy's SeedSequence + PCG64 + Fisher-Yates, reproducible anywhere).

    ``len`` is the step count; iterating draws each epoch's permutation when it is reached, so a
    schedule holds one epoch's positions at a time (a list of every step held epochs × rows of
    them: 400 MB at 10,000 epochs over 5,000 rows, within the step budget).
    :class:`TooManySteps` past ``MAX_LOCAL_STEPS`` steps, when it is made."""

    def __init__(self, rows: int, epochs: int, batch_size: int, seed: int):
        self.steps = check_local_steps(rows, epochs, batch_size)
        self.rows, self.epochs, self.batch_size, self.seed = rows, epochs, batch_size, seed

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[np.ndarray]:
        rng = np.random.default_rng(self.seed)
        for _ in range(self.epochs):
            order = rng.permutation(self.rows)
            for start in range(0, self.rows, self.batch_size):
                yield order[start:start + self.batch_size]


def batch_schedule(rows: int, epochs: int, batch_size: int, seed: int) -> BatchSchedule:
    """The protocol's batch schedule (:class:`BatchSchedule`)."""
    return BatchSchedule(rows, epochs, batch_size, seed)


def head_tensors(weight: np.ndarray, bias: np.ndarray) -> dict[str, np.ndarray]:
    """The two head tensors in wire form (float32, C order), after a shape check."""
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    bias = np.ascontiguousarray(bias, dtype=np.float32)
    if weight.ndim != 2 or bias.shape != (weight.shape[0],):
        raise ValueError(f"head must be weight (C, d) and bias (C,), got {weight.shape} and {bias.shape}")
    return {"weight": weight, "bias": bias}


def encode_model_update(tensors: dict[str, np.ndarray], n: int) -> tuple[dict, dict[str, np.ndarray]]:
    """(body, tensors) of a result carrying trained named tensors (float32, finite) and n."""
    tensors = {name: np.ascontiguousarray(value, dtype=np.float32) for name, value in tensors.items()}
    broken = trained_out_of_bounds(tensors)
    if broken:
        raise ValueError(f"the trained model breaks the protocol's bound: {broken} (diverged local training?)")
    if int(n) < 1:
        raise ValueError(f"sample count must be >= 1, got {n}")
    return {"n": int(n)}, tensors


def encode_head_update(weight: np.ndarray, bias: np.ndarray, n: int) -> tuple[dict, dict[str, np.ndarray]]:
    """(body, tensors) of a ``fedavg.head`` result."""
    body, tensors = encode_model_update(head_tensors(weight, bias), n)
    C, d = tensors["weight"].shape
    return {**body, "num_classes": int(C), "feature_dim": int(d)}, tensors


def parse_model_update(msg: Envelope, shapes: dict[str, tuple[int, ...]],
                       max_samples: int = 10**9) -> ModelUpdate:
    """A result that must carry exactly the float32 tensors ``shapes`` names, all finite, and a
    sample count n in 1..max_samples; EnvelopeError otherwise."""
    n = body_field(msg, "n", int)
    if not (0 < n <= max_samples):
        raise EnvelopeError(f"{msg.type}: sample count n={n} out of range (1..{max_samples})")
    extra, missing = set(msg.tensors) - set(shapes), set(shapes) - set(msg.tensors)
    if extra or missing:
        raise EnvelopeError(f"{msg.type}: tensors must be exactly the trained ones; unexpected "
                            f"{sorted(extra)}, missing {sorted(missing)}")
    tensors = {name: np.asarray(require_tensor(msg, name, "float32", shape))
               for name, shape in shapes.items()}
    broken = trained_out_of_bounds(tensors)
    if broken:       # no device sends it: each declines such training as diverged
        raise EnvelopeError(f"{msg.type}: a trained parameter no device sends: {broken}")
    return ModelUpdate(n, tensors)


def parse_head_update(msg: Envelope, num_classes: int, feature_dim: int,
                      max_samples: int = 10**9) -> HeadUpdate:
    """Validate a ``fedavg.head`` result against the job's (C, d); raise EnvelopeError if anything is off."""
    if body_field(msg, "num_classes", int) != num_classes:
        raise EnvelopeError(f"{KIND}: num_classes {msg.body['num_classes']} != job's {num_classes}")
    if body_field(msg, "feature_dim", int) != feature_dim:
        raise EnvelopeError(f"{KIND}: feature_dim {msg.body['feature_dim']} != job's {feature_dim}")
    update = parse_model_update(msg, {"weight": (num_classes, feature_dim), "bias": (num_classes,)},
                                max_samples)
    return HeadUpdate(n=update.n, weight=update.trained["weight"], bias=update.trained["bias"])
