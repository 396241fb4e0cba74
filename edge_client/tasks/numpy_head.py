"""The linear head's SGD step in numpy: what a torch-free device (``fedfleet[device]``) trains with,
and how a device trains many candidate heads side by side (OLL's cross-validation of FP(ψ) rates).

Same step as the eager ``TemperatureScaledHead`` + SGD of ``head_training._TorchHeadStepper`` and
the exported head training program: ``logits = f W^T + b``, mean cross-entropy on
``logits / T``, then ``param -= lr * (d + weight_decay * param)`` where the step's direction d is
the gradient, or what the job's local rule makes of it (``local_rules.py``: FedProx, FedSAM, FedASAM). The gradient is written out
(softmax minus one-hot, weighted by each row's share of the batch, divided by ``T``) since a linear
head needs no autograd.

:func:`train_heads_together` runs that step for G row subsets × L learning rates in lockstep: one
batched step moves all G·L heads, each on its own mini-batch of its own rows, so a device pays the
per-step overhead (which dominates on a tiny k-class head) once instead of G·L times.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from protocols.payloads.fedavg import (MAX_LOCAL_STEPS, MAX_LOCAL_WORK, BatchSchedule, TooManySteps,
                                      check_local_steps, check_local_work)

from ..agent import TaskDeclined
from ..work_deadline import each_checked

from .local_rules import apply_step, rule_for


def head_loss_and_gradients(weight: np.ndarray, bias: np.ndarray, features: np.ndarray, labels: np.ndarray,
                            row_share: np.ndarray, temperature: np.float32) -> tuple[np.ndarray, tuple]:
    """(batch losses, (∂/∂weight, ∂/∂bias)) of (stacks of) heads ``weight`` (..., C, d), ``bias``
    (..., C) on ``features`` (..., B, d) with ``labels`` (..., B) (leading axes broadcast against the
    heads'). ``row_share`` (..., B): each row's weight in the batch mean (1/n per row; 0 for padding)."""
    scaled = (features @ np.swapaxes(weight, -1, -2) + bias[..., None, :]) / temperature
    scaled -= scaled.max(axis=-1, keepdims=True)                  # log-softmax without overflow
    log_p = scaled - np.log(np.exp(scaled).sum(axis=-1, keepdims=True))
    shape = np.broadcast_shapes(log_p.shape[:-1], labels.shape, row_share.shape)
    picked = np.broadcast_to(labels, shape)[..., None]
    share = np.broadcast_to(row_share, shape)
    loss = -(np.take_along_axis(log_p, picked, axis=-1)[..., 0] * share).sum(axis=-1)
    d_logits = np.exp(log_p)
    np.put_along_axis(d_logits, picked, np.take_along_axis(d_logits, picked, axis=-1) - 1.0, axis=-1)
    d_logits *= (share / temperature)[..., None]                  # d mean-loss / d logits
    return loss, (np.swapaxes(d_logits, -1, -2) @ features, d_logits.sum(axis=-2))


def head_sgd_step(weight: np.ndarray, bias: np.ndarray, features: np.ndarray, labels: np.ndarray,
                  row_share: np.ndarray, lr, temperature: np.float32, weight_decay: np.float32) -> np.ndarray:
    """One SGD step, in place, of (stacks of) heads (see :func:`head_loss_and_gradients`);
    ``lr`` a scalar or an array broadcasting to the heads' leading axes (0: that head stays put).
    Returns the batch losses (the heads' leading axes)."""
    loss, grads = head_loss_and_gradients(weight, bias, features, labels, row_share, temperature)
    lr = np.asarray(lr, dtype=np.float32)
    for param, grad in zip((weight, bias), grads):
        if weight_decay:
            grad = grad + weight_decay * param
        step = grad.astype(np.float32) * (lr.reshape(lr.shape + (1,) * (grad.ndim - lr.ndim)) if lr.ndim else lr)
        param -= step
    return loss


class NumpyHeadStepper:
    """One mini-batch SGD step of a temperature-scaled linear softmax head, in float32 numpy."""

    runtime = "numpy"

    def __init__(self, weight: np.ndarray, bias: np.ndarray, recipe, anchor: dict[str, np.ndarray] | None = None):
        """``anchor``: the round's global head, where a proximal rule pulls (default: the start;
        Ditto's personal pass starts from the device's own head and is pulled to the task's)."""
        self.weight = np.array(weight, dtype=np.float32)
        self.bias = np.array(bias, dtype=np.float32)
        anchor = anchor or {"weight": self.weight, "bias": self.bias}
        self.start = {k: np.array(anchor[k], dtype=np.float32) for k in ("weight", "bias")}
        self.temperature = np.float32(recipe.temperature)
        self.lr, self.weight_decay = np.float32(recipe.lr), np.float32(recipe.weight_decay)
        self.rule = rule_for(recipe.rule)

    def step(self, features: np.ndarray, labels: np.ndarray) -> float:
        features, labels = np.asarray(features, dtype=np.float32), np.asarray(labels)
        share = np.full(len(labels), 1.0 / len(labels), dtype=np.float32)

        def gradient_at(current):
            loss, (d_weight, d_bias) = head_loss_and_gradients(current["weight"], current["bias"], features, labels,
                                                               share, self.temperature)
            return float(loss), {"weight": d_weight, "bias": d_bias}

        current = {"weight": self.weight, "bias": self.bias}
        loss, direction = self.rule.direction(current, gradient_at, self.start)
        for name, param in current.items():
            apply_step(param, direction[name], self.lr, self.weight_decay)
        return loss

    def parameters(self) -> dict[str, np.ndarray]:
        return {"weight": self.weight.copy(), "bias": self.bias.copy()}


def batch_schedule(rows: int, recipe, per_row: int = 0) -> BatchSchedule:
    """The mini-batches (row positions) of ``recipe.epochs`` seeded-shuffled epochs over ``rows``
    rows: ``head_training.local_sgd``'s order, step by step (the protocol's definition,
    ``protocols.payloads.fedavg.batch_schedule``, so other languages' devices take the same).
    ``per_row``: the trained heads' parameters a row meets (:func:`head_size`), for the work budget,
    counted at each of the recipe's gradient evaluations a step (:func:`gradient_evaluations`)."""
    evaluations = gradient_evaluations(recipe) if per_row else 1
    return schedule(rows, recipe.epochs, recipe.batch_size, recipe.seed, per_row, evaluations)


def schedule(rows: int, epochs: int, batch_size: int, seed: int, per_row: int = 0,
             evaluations: int = 1) -> BatchSchedule:
    """The protocol's batch schedule; a task past every device's step or work budget is declined with
    the count. Iterating it stops the task's work once its round is over (``edge_client.work_deadline``)."""
    within_step_budget(rows, epochs, batch_size, per_row, evaluations)
    return _DeadlineCheckedSchedule(rows, epochs, batch_size, seed)


def gradient_evaluations(recipe) -> int:
    """The gradient evaluations each step of ``recipe`` takes (its local rule's: FedSAM/FedASAM's 2,
    at w and at w + ε̂), what a step's work is counted at."""
    return rule_for(recipe.rule).evaluations_per_step


def head_size(weight: np.ndarray, bias: np.ndarray) -> int:
    """The parameters of one linear head, C × (d + 1): what one row's step costs it."""
    return int(np.size(weight) + np.size(bias))


class _DeadlineCheckedSchedule(BatchSchedule):
    """The protocol's schedule, each step checked against the running task's moment."""

    def __iter__(self):
        return each_checked(super().__iter__())


def within_step_budget(rows: int, epochs: int, batch_size: int, per_row: int = 0, evaluations: int = 1) -> None:
    """Decline (with the count) local training past every device's step budget (``MAX_LOCAL_STEPS``):
    every kind's, LADD's self-training too; with ``per_row``, past its work budget (``MAX_LOCAL_WORK``),
    each step counted at its ``evaluations`` gradient evaluations."""
    try:
        check_local_steps(rows, epochs, batch_size)
        if per_row:
            check_local_work(rows, epochs, per_row, evaluations)
    except TooManySteps as exc:
        raise TaskDeclined(str(exc)) from exc


class TrainingPass(NamedTuple):
    """One training pass of a task, as its budgets count it: ``epochs`` epochs over ``rows`` rows in
    batches of ``batch_size`` (its SGD steps), through ``per_row`` head parameters at ``evaluations``
    gradient evaluations a step (its multiply-adds; ``per_row`` 0: no work budget, a tail's)."""
    rows: int
    epochs: int
    batch_size: int
    per_row: int = 0
    evaluations: int = 1


def recipe_pass(rows: int, recipe, per_row: int = 0) -> TrainingPass:
    """The pass of ``recipe`` (a ``LocalTraining``) over ``rows`` rows through ``per_row`` head parameters."""
    return TrainingPass(rows, recipe.epochs, recipe.batch_size, per_row, gradient_evaluations(recipe))


def within_passes_budget(passes: list[TrainingPass], what: str) -> None:
    """Decline, before any training and with the count, a task whose training passes ask more SGD
    steps (``MAX_LOCAL_STEPS``), or then more multiply-adds (``MAX_LOCAL_WORK``), together than a
    device takes. ``passes``: a pass run once per learning rate listed that often; ``what``: the
    passes in words. Every pass was checked alone as it started, so one task of several passes asked
    several budgets (review findings: FP(φ)/FP(M)'s cross-validation, 20 folds x 16 rates, 320 of
    them; Ditto's and FedAlt's two passes, 2; FP(ψ)'s chosen rate's fit after its cross-validation).
    A pass past a budget alone is declined with its own count, as before."""
    try:
        steps = sum(check_local_steps(p.rows, p.epochs, p.batch_size) for p in passes)
        if steps > MAX_LOCAL_STEPS:
            raise TooManySteps(f"{what} is {steps} SGD steps, more than a device takes ({MAX_LOCAL_STEPS})")
        work = sum(check_local_work(p.rows, p.epochs, p.per_row, p.evaluations) for p in passes)
        if work > MAX_LOCAL_WORK:
            raise TooManySteps(f"{what} is {work:.2e} multiply-adds, more than a device takes ({MAX_LOCAL_WORK:.0e})")
    except TooManySteps as exc:
        raise TaskDeclined(str(exc)) from exc


def within_cross_validation_budget(fits: list[np.ndarray], rows: int, recipe, rates: int, per_row: int = 0) -> None:
    """FP's learning-rate choice counted as one task: each fold's fit once per candidate rate, then
    the chosen rate's fit on all ``rows`` (FP(ψ)'s heads, of ``per_row`` parameters, and FP(φ)/FP(M)'s
    tail program alike: a tail's work is its bundle's, not counted)."""
    epochs, batch_size = recipe.epochs, recipe.batch_size
    within_passes_budget(
        [recipe_pass(len(fit), recipe, per_row) for fit in fits] * rates + [recipe_pass(rows, recipe, per_row)],
        f"cross-validation of {rates} learning rates over {len(fits)} folds, then the chosen rate's fit on all "
        f"{rows} samples, {epochs} epochs each in batches of {batch_size},")


# The most bytes one lockstep step of train_heads_together may hold: each head's logits over its batch
# and their temporaries, its parameters, gradient and step, and its row set's batch of features.
# The task chooses the heads (fp_folds up to 20 x fp_lrs up to 16) and the batch (up to every row):
# all 320 of them in one step held G x B x d features and G x L x B x k logits at once, 0.9 GB for
# 1,000 rows of 100 local classes and over 3 GB for 5,000 (a review's finding), where the job's
# usual 5 folds x 2 rates in batches of 64 hold a few MB. Heads past the budget are trained in
# groups, one after another: the same steps, the same heads.
MAX_LOCKSTEP_BYTES = 64 * 2**20


def heads_per_lockstep(batch: int, classes: int, dim: int) -> int:
    """How many heads of ``classes`` x ``dim`` one lockstep step over batches of ``batch`` rows may
    move within MAX_LOCKSTEP_BYTES (at least one)."""
    per_head = 4 * (6 * batch * classes + 4 * classes * (dim + 1) + batch * dim)
    return max(1, MAX_LOCKSTEP_BYTES // per_head)


def lockstep_batch(batch_size: int, row_sets: list[np.ndarray]) -> int:
    """The rows a lockstep batch holds: the recipe's batch size, never past the largest row set (a
    review's finding: 65,536 over 200 rows padded every step to 1.1 GB)."""
    return max(1, min(batch_size, max((len(r) for r in row_sets), default=1)))


def within_lockstep_work(row_sets: list[np.ndarray], recipe, rates: int, weight: np.ndarray, bias: np.ndarray) -> None:
    """Decline past the work budget counting every head: each row set through ``rates`` heads
    (cross-validation's 20 folds x 16 rates was 320 heads, each within the budget alone: a review's finding)."""
    try:
        check_local_work(sum(len(rows) for rows in row_sets), recipe.epochs, rates * head_size(weight, bias))
    except TooManySteps as exc:
        raise TaskDeclined(str(exc)) from exc


def train_heads_together(weight: np.ndarray, bias: np.ndarray, features: np.ndarray, labels: np.ndarray,
                         row_sets: list[np.ndarray], lrs: list[float], recipe) -> tuple[np.ndarray, np.ndarray]:
    """Heads (G, L, C, d) and biases (G, L, C): head (g, l) is ``(weight, bias)`` trained as
    ``train_head(weight, bias, features[row_sets[g]], labels[row_sets[g]], recipe with lr=lrs[l])``
    would train it (same batches, same steps; float32 rounding may differ in the last bits).
    A row set with fewer steps than the longest one stops moving once its schedule ends. The heads
    move in lockstep groups of at most :func:`heads_per_lockstep` (``MAX_LOCKSTEP_BYTES``)."""
    features = np.ascontiguousarray(features, dtype=np.float32)
    labels = np.asarray(labels, dtype=np.int64)
    row_sets = [np.asarray(rows) for rows in row_sets]
    G, L = len(row_sets), len(lrs)
    within_lockstep_work(row_sets, recipe, L, weight, bias)
    heads = heads_per_lockstep(lockstep_batch(recipe.batch_size, row_sets), *np.shape(weight))
    rates = min(L, heads)
    sets = max(1, heads // rates)
    weights = np.empty((G, L, *np.shape(weight)), dtype=np.float32)
    biases = np.empty((G, L, len(bias)), dtype=np.float32)
    for g in range(0, G, sets):
        for l in range(0, L, rates):
            weights[g:g + sets, l:l + rates], biases[g:g + sets, l:l + rates] = _lockstep(
                weight, bias, features, labels, row_sets[g:g + sets], lrs[l:l + rates], recipe)
    return weights, biases


def _lockstep(weight: np.ndarray, bias: np.ndarray, features: np.ndarray, labels: np.ndarray,
              row_sets: list[np.ndarray], lrs: list[float], recipe) -> tuple[np.ndarray, np.ndarray]:
    """:func:`train_heads_together`'s heads of ``row_sets`` x ``lrs``, all moved by each step."""
    G, L, B = len(row_sets), len(lrs), lockstep_batch(recipe.batch_size, row_sets)
    # each row set's steps drawn as they are taken (a schedule holds one epoch at a time)
    schedules = [batch_schedule(len(rows), recipe) for rows in row_sets]
    steps = [iter(schedule) for schedule in schedules]
    heads_w = np.broadcast_to(np.asarray(weight, np.float32), (G, L, *np.shape(weight))).copy()
    heads_b = np.broadcast_to(np.asarray(bias, np.float32), (G, L, len(bias))).copy()
    lr = np.asarray(lrs, dtype=np.float32)
    temperature, weight_decay = np.float32(recipe.temperature), np.float32(recipe.weight_decay)
    for step in range(max(map(len, schedules))):
        idx = np.zeros((G, B), dtype=np.int64)
        share = np.zeros((G, B), dtype=np.float32)
        active = np.zeros(G, dtype=np.float32)
        for g, schedule in enumerate(schedules):
            if step < len(schedule):
                batch = row_sets[g][next(steps[g])]
                idx[g, :len(batch)], share[g, :len(batch)], active[g] = batch, 1.0 / len(batch), 1.0
        head_sgd_step(heads_w, heads_b, features[idx][:, None], labels[idx][:, None], share[:, None],
                      active[:, None] * lr[None, :], temperature, weight_decay)
    return heads_w, heads_b
