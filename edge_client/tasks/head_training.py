"""``fedavg.head``: train the global linear head on the device's features for E local epochs.

The handler receives the global head (tensors ``weight`` (C, d), ``bias`` (C,)) and a recipe
in the task params, extracts features of the local training set with the frozen backbone
(same extractor factory as ``fed3r.stats``, so the feature cache is shared), runs
:func:`train_head` and returns the trained head with its sample count n_k (the FedAvg weight).

:func:`train_head` is the one local-training loop of the device: FedAvg(ψ)/Fed3R+FT(ψ) rounds
and OLL's FP(ψ) (``edge_client.oll``) both call it. Per epoch it shuffles the rows with a
seeded generator, cuts them into mini-batches of ``batch_size`` (the last one may be smaller)
and takes one SGD step per batch on the temperature-scaled cross-entropy CE(logits / T, y)
with L2 weight decay (torch.optim.SGD semantics: g ← d + wd·θ; θ ← θ − lr·g), where the direction
d is the loss gradient or what the task's local rule makes of it (``local_rules.py``: FedProx's
pull to the global head, FedSAM/FedASAM's gradient at the perturbed head).

Two backends compute that step:

* a :class:`edge_client.runtime.TrainingSession` (the exported ExecuTorch training program,
  or its eager twin) when the device has a training bundle whose head shape (C, d) and
  temperature match the task. The program computes loss and gradients and applies plain SGD;
  weight decay is added here afterwards (θ ← θ − lr·wd·θ_before), which is the same update.
* eager torch otherwise (development mode, or a task whose head the bundle cannot hold, e.g.
  OLL's pruned k-class head): the very module the training program is exported from
  (``TemperatureScaledHead``), autograd, and torch.optim.SGD's update rule written out.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocols.payloads.fedavg import KIND, HeadTrainingParams, LocalTraining, encode_head_update, raise_if_diverged

from ..agent import TaskDeclined
from .extractors import ExtractorFactory
from .task_inputs import check_local_labels, extractor_of_dim, global_head, local_samples
from .local_rules import rule_for
from .params import read_params
from .numpy_head import batch_schedule, head_size

log = logging.getLogger("fedfleet.device")



@dataclass
class TrainedHead:
    weight: np.ndarray      # (C, d) float32
    bias: np.ndarray        # (C,) float32
    steps: int              # SGD steps taken
    mean_loss: float        # mean mini-batch loss over the last epoch (before each step)
    runtime: str            # "executorch", "eager" (a TrainingSession), "torch" (dev path) or "numpy" (no torch)


class _TorchHeadStepper:
    """Development backend: TemperatureScaledHead, autograd, SGD with weight decay."""

    runtime = "torch"

    def __init__(self, weight: np.ndarray, bias: np.ndarray, recipe: LocalTraining):
        import torch

        from edge_client.runtime.program_modules import TemperatureScaledHead

        self._torch = torch
        C, d = weight.shape
        self.head = TemperatureScaledHead(d, C, recipe.temperature)
        with torch.no_grad():
            self.head.weight.copy_(torch.from_numpy(weight))
            self.head.bias.copy_(torch.from_numpy(bias))
        self.lr, self.weight_decay = recipe.lr, recipe.weight_decay
        self.rule = rule_for(recipe.rule)
        self.start = {"weight": weight.copy(), "bias": bias.copy()}       # the round's global head

    def step(self, features: np.ndarray, labels: np.ndarray) -> float:
        torch = self._torch
        inputs = (torch.from_numpy(features), torch.from_numpy(labels), torch.ones(len(labels)))

        def gradient_at(current):
            # a functional call: the rule may ask for the gradient at perturbed parameters (SAM)
            # without the module's own parameters moving
            tensors = {k: torch.from_numpy(np.asarray(v)).requires_grad_(True) for k, v in current.items()}
            loss, _ = torch.func.functional_call(self.head, tensors, inputs)
            grads = torch.autograd.grad(loss, list(tensors.values()))
            return float(loss.detach()), {k: g.numpy() for k, g in zip(tensors, grads)}

        current = {"weight": self.head.weight.detach().numpy(), "bias": self.head.bias.detach().numpy()}
        loss, direction = self.rule.direction(current, gradient_at, self.start)
        # torch.optim.SGD's update, written out: its first step imports torch._dynamo (seconds).
        with torch.no_grad():
            for name, param in (("weight", self.head.weight), ("bias", self.head.bias)):
                grad = torch.from_numpy(np.asarray(direction[name]))
                grad = grad.add(param, alpha=self.weight_decay) if self.weight_decay else grad
                param.add_(grad, alpha=-self.lr)
        return loss

    def parameters(self) -> dict[str, np.ndarray]:
        return {"weight": self.head.weight.detach().numpy().copy(), "bias": self.head.bias.detach().numpy().copy()}


class SessionStepper:
    """TrainingSession backend: the runtime's loss, gradients and SGD; weight decay added here. The
    local rule's extra gradient evaluations (SAM: at w + ε̂) are more calls of the program.

    ``trained`` names the tensors that move (default: all of the program's); the others keep
    their start values (FT(φ) trains the tail against a frozen head). ``correction``: a constant
    added to each step's direction, by trained tensor (Scaffold's c − c_k: each program step
    is then y ← y − lr (g + c − c_k), option II's corrected step, since the program steps once per call).
    """

    def __init__(self, session, start: dict[str, np.ndarray], recipe: LocalTraining,
                 trained: frozenset[str] | None = None, correction: dict[str, np.ndarray] | None = None):
        self.session = session
        self.correction = correction or {}
        self.runtime = session.runtime
        self.recipe = recipe
        self.trained = frozenset(start) if trained is None else trained
        self.rule = rule_for(recipe.rule)
        session.set_parameters(start)
        self._current = {k: v.copy() for k, v in start.items()}
        self.start = {k: v.copy() for k, v in start.items() if k in self.trained}   # the round's global model

    def step(self, features: np.ndarray, labels: np.ndarray) -> float:
        now = {k: self._current[k] for k in self.trained}
        held = now                           # the parameters the program holds

        def gradient_at(point):
            nonlocal held
            if point is not held:           # e.g. SAM's perturbed point: the program computes there
                self.session.set_parameters({**self._current, **point})
                held = point
            loss, gradients = self.session.loss_and_gradients(features, labels)
            return loss, {k: gradients[k] for k in self.trained}

        loss, direction = self.rule.direction(now, gradient_at, self.start)
        direction = {k: d + self.correction[k] if k in self.correction else d for k, d in direction.items()}
        if held is not now:
            self.session.set_parameters(self._current)
        self.session.sgd_step(direction, self.recipe.lr)
        after = self.session.get_parameters()
        if self.recipe.weight_decay:
            shrink = np.float32(self.recipe.lr * self.recipe.weight_decay)
            after = {k: (v - shrink * self._current[k]) if k in self.trained else v for k, v in after.items()}
            self.session.set_parameters(after)
        self._current = after
        return loss

    def parameters(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self._current.items()}


def local_sgd(stepper, rows: int, inputs: np.ndarray, labels: np.ndarray, recipe: LocalTraining,
              per_row: int = 0) -> tuple[int, float]:
    """``recipe.epochs`` epochs of seeded-shuffled mini-batch steps; (steps, mean loss of the last epoch).
    ``per_row``: a head's parameters, for the work budget (a tail's are the bundle's, not the task's)."""
    batches = batch_schedule(rows, recipe, per_row)
    losses = [stepper.step(inputs[batch], labels[batch]) for batch in batches]
    return len(batches), float(np.mean(losses[-(len(batches) // recipe.epochs):]))


def session_fits(session, num_classes: int, feature_dim: int, temperature: float) -> bool:
    """Whether a TrainingSession's program computes this head's loss (same C, d and T)."""
    return (session is not None and session.num_classes == num_classes
            and session.feature_dim == feature_dim
            and math.isclose(session.manifest.temperature, temperature, rel_tol=1e-6)
            and session.kind == "training")


def _plain_stepper(weight: np.ndarray, bias: np.ndarray, recipe: LocalTraining):
    """Without a fitting training program: eager torch where it is installed, else the same step in
    numpy (a torch-free device, ``fedfleet[device]``)."""
    from edge_client.runtime.base import torch_installed

    if not torch_installed():
        from .numpy_head import NumpyHeadStepper

        return NumpyHeadStepper(weight, bias, recipe)
    return _TorchHeadStepper(weight, bias, recipe)


def train_head(weight: np.ndarray, bias: np.ndarray, features: np.ndarray, labels: np.ndarray,
               recipe: LocalTraining, session=None) -> TrainedHead:
    """Local SGD on a linear softmax head; labels are row indices of ``weight`` (0..C-1)."""
    weight = np.array(weight, dtype=np.float32, order="C")
    bias = np.array(bias, dtype=np.float32, order="C")
    features = np.ascontiguousarray(features, dtype=np.float32)
    labels = np.ascontiguousarray(labels, dtype=np.int64)
    if weight.ndim != 2 or bias.shape != (weight.shape[0],):
        raise ValueError(f"head must be weight (C, d) and bias (C,), got {weight.shape} and {bias.shape}")
    C, d = weight.shape
    if features.ndim != 2 or features.shape[1] != d:
        raise ValueError(f"features must be (n, {d}), got {features.shape}")
    if labels.shape != (len(features),) or len(labels) == 0:
        raise ValueError(f"need one label per feature row and at least one row, got {labels.shape}")
    if labels.min() < 0 or labels.max() >= C:
        raise ValueError(f"labels must lie in [0, {C}), got [{labels.min()}, {labels.max()}]")
    if not (np.isfinite(weight).all() and np.isfinite(bias).all() and np.isfinite(features).all()):
        raise ValueError("head or features contain NaN or Inf")
    if session_fits(session, C, d, recipe.temperature):
        stepper = SessionStepper(session, {"weight": weight, "bias": bias}, recipe)
    else:
        if session is not None:
            log.info("training bundle holds a (%d, %d) head with T=%g; task needs (%d, %d), T=%g: eager torch",
                     session.num_classes, session.feature_dim, session.manifest.temperature, C, d,
                     recipe.temperature)
        stepper = _plain_stepper(weight, bias, recipe)
    steps, mean_loss = local_sgd(stepper, len(labels), features, labels, recipe, head_size(weight, bias))
    trained = stepper.parameters()
    w, b = trained["weight"], trained["bias"]
    raise_if_diverged({"weight": w, "bias": b})     # the protocol's rule, the same on every device (HeadTrainer.java)
    return TrainedHead(w, b, steps, mean_loss, stepper.runtime)


class HeadTrainingTask:
    """Handler for ``fedavg.head``: ``(params, tensors) -> (body, tensors)``.

    ``training_manifest``: path of an exported bundle's manifest.json with a training program;
    loaded once, on first use (or pass an already loaded ``session``, e.g. one shared by
    emulated devices that take turns on one CPU; every task sets all of its tensors). A bundle that fails verification makes the task decline (a
    tampered program must never be replaced silently); a runtime that is not installed falls
    back to eager torch.
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray, extractor_factory: ExtractorFactory,
                 training_manifest: str | None = None, session=None):
        self.images, self.labels = local_samples(images, labels)
        self.extractor_factory = extractor_factory
        self.training_manifest = training_manifest
        self._session = session
        self.last: TrainedHead | None = None

    def _training_session(self):
        if self.training_manifest is None or self._session is not None:
            return self._session
        from edge_client.runtime import RuntimeUnavailableError, TrainingSession
        from edge_client.runtime.errors import ArtifactError

        try:
            self._session = TrainingSession.load(self.training_manifest)
        except RuntimeUnavailableError as exc:
            log.warning("no usable training runtime (%s); training the head in eager torch", exc)
            self.training_manifest = None
        except ArtifactError as exc:
            raise TaskDeclined(f"training bundle rejected: {exc}") from exc
        return self._session

    def __call__(self, params: dict[str, Any], tensors: dict[str, np.ndarray] | None = None
                 ) -> tuple[dict, dict[str, np.ndarray]]:
        if len(self.images) == 0:
            raise TaskDeclined("no local training data")
        task = read_params(HeadTrainingParams, params, KIND)
        num_classes, feature_dim, recipe = task.model.num_classes, task.feature_dim, task.training
        weight, bias = global_head(tensors, num_classes, feature_dim, KIND)
        check_local_labels(self.labels, num_classes)
        features = extractor_of_dim(self.extractor_factory, task.model, feature_dim).extract(self.images)
        try:
            self.last = train_head(weight, bias, features, self.labels, recipe, self._training_session())
        except FloatingPointError as exc:
            raise TaskDeclined(str(exc)) from exc
        body, tensors = encode_head_update(self.last.weight, self.last.bias, len(self.labels))
        if task.model_version is not None:     # an asynchronous job's task: the result echoes the version
            body["model_version"] = task.model_version
        return body, tensors
