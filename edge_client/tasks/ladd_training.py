"""LADD on the device: ``ladd.style`` (send the FDA style once) and ``ladd.train`` (self-training).

``ladd.train`` runs LADD's local step (spec §2.4) on the device's unlabelled images:

1. The frozen ImageNet encoder's features of the local images are computed once and cached
   (the encoder never changes); everything below runs on them.
2. Pseudo-labels come from the cluster teacher g_c (sent with the task, or the task's model
   itself when they are equal), hard arg-max labels thresholded by **FDA's class-wise rule**
   (the rule the paper cites; chosen over the authors' per-image variant because a device
   holds its whole local set and the rule needs no per-image tuning): a pixel predicted as
   class c is kept iff its confidence >= τ_c = min(cap, sorted_c[round(q·n_c)]), where
   sorted_c are the confidences of all local pixels predicted c, ascending (q = 0.66,
   cap = 0.9: the top 34 % of each class, plus everything above 0.9). Others get 255.
3. The KD targets come from the frozen pre-trained model f (the job's initial model, sent
   once and cached by digest): q = softmax(α·z_f) (α = 0.5, i.e. temperature 2), masked where
   f's own pseudo-label (same rule) is 255.
4. E epochs of mini-batch SGD with momentum and a fixed learning rate on
   L = L_pseudo + λ_KD·L_KD (``edge_client.models.segmentation.self_training_loss``), over the
   trainable convolution weights the task names; BatchNorm is frozen (eval mode).

Two runtimes compute the loss and gradients of a step, both from
:class:`~edge_client.models.segmentation.SelfTrainingStep`'s loss (``self_training_loss``):

* ``eager`` (default): torch autograd;
* ``executorch``: the step lowered to an ExecuTorch training program (joint forward +
  backward, portable kernels), lowered once per (spec, trainable set, batch, λ, frozen
  tensors) and cached per process. The program has a fixed batch B: a last, smaller batch of
  n images is padded with ignored pixels (pseudo-label 255, KD mask 0), which add nothing
  to the sums, and loss and gradients are rescaled by B/n for the n·H·W denominator.
  Measured on a 2-core CPU (bench/ladd.py) the portable kernels are ~20x slower than eager
  torch, so the emulated fleet uses eager; tests check the two agree.

The momentum SGD update (torch.optim.SGD semantics) is applied here in both cases, written
out (torch.optim.SGD's first step imports torch._dynamo, which costs seconds per process).
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F

from protocols.payloads.ladd import (KIND_STYLE, KIND_TRAIN, LaddTrainParams, SelfTrainingRecipe, StyleParams, encode_style,
                                     encode_update, layout_digest, make_layout, packed_digest, parse_train_task, unpack)

from ..agent import TaskDeclined
from ..work_deadline import each_checked
from ..models.segmentation import IGNORE, SegmentationModel, SegmentationSpec, self_training_loss
from ..style import extract_style
from .extractors import MAX_HELD_EXTRACTORS
from .local_rules import rule_for
from .numpy_head import within_step_budget
from .params import read_params

__all__ = ["LaddStyleTask", "LaddTrainTask", "SelfTrainingRecipe", "TrainedUpdate", "kd_targets", "self_train",
           "threshold_pseudo_labels"]


def threshold_pseudo_labels(probs, quantile: float = 0.66, cap: float = 0.9) -> tuple[np.ndarray, np.ndarray]:
    """FDA's class-wise rule over a whole local set (see the module doc).

    ``probs``: (N, C, H, W) class probabilities (numpy or torch). Returns int64 labels (N, H, W)
    with 255 where dropped, and the thresholds τ (C,) (inf for a class nobody predicted).
    """
    p = probs.detach().cpu().numpy() if isinstance(probs, torch.Tensor) else np.asarray(probs)
    if p.ndim != 4 or p.shape[1] < 1:
        raise ValueError(f"probs must be (N, C, H, W), got {p.shape}")
    if not np.isfinite(p).all():
        raise ValueError("probs contain NaN or Inf")
    if not 0 <= quantile <= 1 or not 0 < cap <= 1:
        raise ValueError("quantile must be in [0, 1] and cap in (0, 1]")
    conf, pred = p.max(axis=1), p.argmax(axis=1)
    C = p.shape[1]
    thresholds = np.full(C, np.inf)
    for c in range(C):
        x = np.sort(conf[pred == c])
        if x.size:
            thresholds[c] = min(cap, float(x[min(int(np.round(x.size * quantile)), x.size - 1)]))
    keep = conf >= thresholds[pred]
    return np.where(keep, pred, IGNORE).astype(np.int64), thresholds


def kd_targets(kd_logits: torch.Tensor, alpha: float, quantile: float, cap: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft targets softmax(α·z) of the pre-trained model and its pseudo-label mask (float 0/1)."""
    labels, _ = threshold_pseudo_labels(F.softmax(kd_logits, dim=1), quantile, cap)
    return F.softmax(alpha * kd_logits, dim=1), torch.from_numpy((labels != IGNORE).astype(np.float32))


@dataclass
class SelfTrainingResult:
    arrays: dict[str, np.ndarray]      # the trainable tensors after training
    steps: int
    gradient_evaluations: int          # forward+backward passes: steps × the rule's (SAM/ASAM: 2)
    loss: float                        # mean loss over the last epoch
    pseudo_loss: float                 # its parts (NaN when the runtime reports only the total)
    kd_loss: float


class _EagerStepper:
    """Loss and gradients by torch autograd on the model's own parameters."""

    runtime = "eager"

    def __init__(self, model: SegmentationModel, trainable: list[str], recipe: SelfTrainingRecipe):
        model.eval()                       # BatchNorm frozen on device
        self.model, self.names, self.kd_lambda = model, trainable, recipe.kd_lambda
        model.set_trainable(trainable)
        named = dict(model.named_parameters())
        self.params = [named[k] for k in trainable]        # in ``names`` order, as the rule's dicts

    def step(self, frozen, pseudo, kd_probs, kd_mask) -> tuple[tuple[float, float, float], list[torch.Tensor]]:
        logits = self.model.logits_from_features(frozen)
        loss, l_pseudo, l_kd = self_training_loss(logits, pseudo, kd_probs, kd_mask, self.kd_lambda)
        grads = torch.autograd.grad(loss, self.params)
        return (loss.item(), l_pseudo.item(), l_kd.item()), list(grads)

    def finish(self) -> dict[str, np.ndarray]:
        self.model.set_trainable(())
        state = self.model.state_dict()
        return {k: state[k].detach().numpy().astype(np.float32, copy=True) for k in self.names}


# Lowered training programs, per process, the most recently used MAX_HELD_PROGRAMS of them: a key
# holds the task's batch size and λ_KD (and the frozen tensors it carries), so a job that changed
# either every round lowered and kept one more program per round for the process's life (a review's
# finding). A stepper keeps its own program's bytes alive while it runs, whatever goes from here.
MAX_HELD_PROGRAMS = 4
_PROGRAMS: collections.OrderedDict[tuple, bytes] = collections.OrderedDict()


def _recently_used(held: collections.OrderedDict, key, make: Callable[[], Any], limit: int):
    """``held[key]``, made by ``make()`` when missing; ``held`` keeps the ``limit`` most recently used
    keys, the least recently used leaving first."""
    value = held.pop(key) if key in held else make()
    held[key] = value                              # the most recent, last
    while len(held) > limit:
        held.popitem(last=False)
    return value


class _ExecuTorchStepper:
    """Loss and gradients from the lowered training program (see the module doc)."""

    runtime = "executorch"

    def __init__(self, model: SegmentationModel, trainable: list[str], recipe: SelfTrainingRecipe):
        import hashlib
        import warnings

        from executorch.extension.training import _load_for_executorch_for_training_from_buffer

        from ..models.segmentation import lower_self_training_program

        state = model.state_dict()
        frozen_digest = hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state)
                                                if k not in set(trainable))).hexdigest()
        key = (model.spec, tuple(trainable), recipe.batch_size, recipe.kd_lambda, frozen_digest)
        self._program = _recently_used(           # the loader does not copy: keep the bytes alive
            _PROGRAMS, key, lambda: lower_self_training_program(model, trainable, recipe.batch_size,
                                                                recipe.kd_lambda), MAX_HELD_PROGRAMS)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._module = _load_for_executorch_for_training_from_buffer(self._program)
        self.names, self.batch, self.spec = trainable, recipe.batch_size, model.spec
        self._first = True
        self._values = {k: state[k].detach().clone() for k in trainable}
        self.params = [self._values[k] for k in trainable]     # updated in place by self_train

    def step(self, frozen, pseudo, kd_probs, kd_mask) -> tuple[tuple[float, float, float], list[torch.Tensor]]:
        n, B = len(frozen), self.batch
        if n < B:
            pad = B - n
            frozen = torch.cat([frozen, frozen.new_zeros((pad, *frozen.shape[1:]))])
            pseudo = torch.cat([pseudo, pseudo.new_full((pad, *pseudo.shape[1:]), IGNORE)])
            kd_probs = torch.cat([kd_probs, kd_probs.new_full((pad, *kd_probs.shape[1:]), 1.0 / kd_probs.shape[1])])
            kd_mask = torch.cat([kd_mask, kd_mask.new_zeros((pad, *kd_mask.shape[1:]))])
        inputs = (frozen.contiguous(), pseudo.contiguous(), kd_probs.contiguous(), kd_mask.contiguous())
        if self._first:              # the module exposes its parameters only after a first call
            self._module.forward_backward("forward", inputs)
            self._program_params = {k: self._module.named_parameters()[f"model.{k}"] for k in self.names}
            self._first = False
        for k in self.names:
            self._program_params[k].copy_(self._values[k])
        out = self._module.forward_backward("forward", inputs)
        grads = self._module.named_gradients()
        scale = B / n
        return (float(out[0]) * scale, float("nan"), float("nan")), \
            [grads[f"model.{k}"].clone() * scale for k in self.names]

    def finish(self) -> dict[str, np.ndarray]:
        return {k: v.numpy().astype(np.float32, copy=True) for k, v in self._values.items()}


STEPPERS = {"eager": _EagerStepper, "executorch": _ExecuTorchStepper}


def _gradient_function(stepper, current: dict[str, np.ndarray], batch: tuple, losses: list):
    """``gradient_at`` of local_rules for one mini-batch: evaluates the stepper at any values of the
    trained tensors (SAM's perturbed point is written into them and the originals put back),
    appending each evaluation's (loss, pseudo, kd) to ``losses``."""
    def gradient_at(values):
        moved = [k for k in current if values[k] is not current[k]]
        saved = {k: current[k].copy() for k in moved}
        for k in moved:
            current[k][...] = values[k]
        try:
            parts, grads = stepper.step(*batch)
        finally:
            for k in moved:
                current[k][...] = saved[k]
        losses.append(parts)
        return parts[0], {k: g.detach().numpy() for k, g in zip(stepper.names, grads)}
    return gradient_at


def self_train(model: SegmentationModel, trainable: list[str], frozen: torch.Tensor, pseudo: np.ndarray,
               kd_probs: torch.Tensor, kd_mask: torch.Tensor, recipe: SelfTrainingRecipe,
               runtime: str = "eager") -> SelfTrainingResult:
    """E epochs of momentum SGD (torch.optim.SGD semantics, fixed lr) on L_pseudo + λ·L_KD, each
    step's direction by the recipe's local rule (``local_rules``: SGD, FedProx, FedSAM, FedASAM)."""
    n = len(frozen)
    if not (len(pseudo) == len(kd_probs) == len(kd_mask) == n) or n == 0:
        raise ValueError("features, pseudo-labels and KD targets must have the same, non-zero length")
    if runtime not in STEPPERS:
        raise ValueError(f"runtime must be one of {sorted(STEPPERS)}, got {runtime!r}")
    within_step_budget(n, recipe.epochs, recipe.batch_size)
    stepper = STEPPERS[runtime](model, list(trainable), recipe)
    rule = rule_for(recipe.rule)
    # the rule works on numpy views of the trained tensors (they share memory), so the SAM/ASAM/
    # FedProx arithmetic is local_rules' one implementation; FedProx pulls towards the received decoder
    current = {k: p.detach().numpy() for k, p in zip(stepper.names, stepper.params)}
    received = {k: v.copy() for k, v in current.items()}
    pseudo_t = torch.from_numpy(np.ascontiguousarray(pseudo, dtype=np.int64))
    velocity: list[torch.Tensor | None] = [None] * len(stepper.params)
    rng = np.random.default_rng(recipe.seed)
    steps, last = 0, []
    for _ in range(recipe.epochs):
        last = []
        order = rng.permutation(n)
        for start in each_checked(range(0, n, recipe.batch_size)):     # stopped once its round is over
            rows = torch.from_numpy(np.sort(order[start:start + recipe.batch_size]))
            batch = (frozen[rows], pseudo_t[rows], kd_probs[rows], kd_mask[rows])
            losses: list[tuple[float, float, float]] = []
            _, direction = rule.direction(current, _gradient_function(stepper, current, batch, losses), received)
            with torch.no_grad():
                for i, (p, name) in enumerate(zip(stepper.params, stepper.names)):
                    g = torch.from_numpy(np.ascontiguousarray(direction[name]))
                    velocity[i] = g.clone() if velocity[i] is None else velocity[i].mul_(recipe.momentum).add_(g)
                    p.add_(velocity[i], alpha=-recipe.lr)
            last.append(losses[0])          # the loss at the step's start (the model's own parameters)
            steps += 1
    arrays = stepper.finish()
    if not all(np.isfinite(a).all() for a in arrays.values()):
        raise FloatingPointError("local self-training diverged (NaN/Inf); lower the learning rate")
    mean = np.mean(last, axis=0)
    return SelfTrainingResult(arrays, steps, steps * rule.evaluations_per_step, float(mean[0]), float(mean[1]),
                              float(mean[2]))


class LaddStyleTask:
    """Handler for ``ladd.style``: the device's FDA style at the job's image size."""

    def __init__(self, images: np.ndarray):
        self.images = images

    def __call__(self, params: dict[str, Any], tensors: dict[str, np.ndarray] | None = None
                 ) -> tuple[dict, dict[str, np.ndarray]]:
        if len(self.images) == 0:
            raise TaskDeclined("no local images")
        task = read_params(StyleParams, params, KIND_STYLE)
        b, size = task.b, task.image_size
        return encode_style(extract_style(self.images, b, (size, size)), len(self.images), b)


ModelFactory = Callable[[SegmentationSpec], SegmentationModel]


@dataclass(frozen=True)
class TrainedUpdate:
    """One ``ladd.train`` answer before encoding: the trained tensors in ``layout`` order."""

    arrays: dict[str, np.ndarray]
    layout: list
    n: int                 # local images: the averaging weight
    cluster: int
    kd_sha256: str
    info: dict


class LaddTrainTask:
    """Handler for ``ladd.train`` (see the module doc). ``model_factory`` may hand out a model
    shared by several devices of one process; ``lock`` then serialises their use of it."""

    def __init__(self, images: np.ndarray, model_factory: ModelFactory | None = None,
                 lock: threading.Lock | None = None, expected_weights_sha256: Callable[[], str] | None = None,
                 runtime: str = "eager"):
        if runtime not in STEPPERS:
            raise ValueError(f"runtime must be one of {sorted(STEPPERS)}, got {runtime!r}")
        self.images = images
        self.runtime = runtime
        self.model_factory = model_factory or (lambda spec: SegmentationModel(spec))
        self.lock = lock or contextlib.nullcontext()
        self.expected_weights_sha256 = expected_weights_sha256
        # (image size, output stride, tail blocks) -> the frozen encoder's features of the local images,
        # for the last MAX_HELD_EXTRACTORS keys tasks asked for: the key is the task's to choose, and
        # kept whole they grew with each new one for the process's life (a review's finding)
        self._frozen: collections.OrderedDict[tuple, torch.Tensor] = collections.OrderedDict()
        self._kd: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.last: SelfTrainingResult | None = None

    def _decode(self, params: dict[str, Any], tensors: dict[str, np.ndarray] | None):
        task = read_params(LaddTrainParams, params, KIND_TRAIN)
        try:
            spec = SegmentationSpec.from_dict(task.model)
            layout, flats = parse_train_task(task, tensors or {})
        except (TypeError, ValueError) as exc:
            raise TaskDeclined(f"bad ladd.train task: {exc}") from exc
        if self.expected_weights_sha256 is not None and task.weights_sha256 \
                and task.weights_sha256 != self.expected_weights_sha256():
            raise TaskDeclined("job wants different encoder weights than this device has")
        if spec.image_size != self.images.shape[1] or spec.image_size != self.images.shape[2]:
            raise TaskDeclined(f"job works on {spec.image_size}px images, local images are {self.images.shape[1:3]}")
        return spec, task, layout, flats

    def __call__(self, params: dict[str, Any], tensors: dict[str, np.ndarray] | None = None
                 ) -> tuple[dict, dict[str, np.ndarray]]:
        trained = self.train(params, tensors)
        return encode_update(trained.arrays, trained.layout, trained.n, trained.cluster, trained.kd_sha256,
                             trained.info)

    def train(self, params: dict[str, Any], tensors: dict[str, np.ndarray] | None = None) -> "TrainedUpdate":
        """The local step itself, before any encoding (``secure_ladd_training`` sums it instead)."""
        if len(self.images) == 0:
            raise TaskDeclined("no local images")
        spec, task, layout, flats = self._decode(params, tensors)
        recipe, cluster, trainable = task.recipe, task.cluster, list(task.trainable)
        t0 = time.perf_counter()
        with self.lock:
            model = self.model_factory(spec)
            local_layout = make_layout(model.exchanged_state())
            if layout != local_layout:
                raise TaskDeclined(f"model layout {layout_digest(layout)[:12]} differs from this device's "
                                   f"{layout_digest(local_layout)[:12]}")
            allowed = set(model.trainable_names("tail+head"))
            if not trainable or not set(trainable) <= allowed:
                raise TaskDeclined(f"cannot train {sorted(set(trainable) - allowed)[:3]} (BatchNorm and the "
                                   "ImageNet encoder are frozen on device)")
            order = {name: i for i, (name, _) in enumerate(layout)}
            trainable = sorted(trainable, key=order.__getitem__)
            frozen = self._frozen_features(model, spec)
            kd_sha = task.kd_sha256
            if recipe.kd_lambda > 0:
                kd_probs, kd_mask = self._kd_targets(model, spec, layout, flats, kd_sha, recipe, frozen)
            else:
                kd_probs = torch.zeros(len(frozen), spec.num_classes, 1, 1).expand(
                    -1, -1, spec.image_size, spec.image_size)
                kd_mask = torch.zeros(len(frozen), spec.image_size, spec.image_size)
            model.load_exchanged(unpack(flats.get("teacher", flats["model"]), layout))
            teacher_probs = F.softmax(model.predict_logits(frozen), dim=1)
            pseudo, _ = threshold_pseudo_labels(teacher_probs, recipe.pseudo_quantile, recipe.pseudo_cap)
            model.load_exchanged(unpack(flats["model"], layout))
            try:
                self.last = self_train(model, trainable, frozen, pseudo, kd_probs, kd_mask, recipe, self.runtime)
            except FloatingPointError as exc:
                raise TaskDeclined(str(exc)) from exc
        info = {"loss": self.last.loss, "pseudo_loss": self.last.pseudo_loss, "kd_loss": self.last.kd_loss,
                "kept_fraction": float((pseudo != IGNORE).mean()), "steps": self.last.steps,
                "gradient_evaluations": self.last.gradient_evaluations,
                "seconds": time.perf_counter() - t0, "runtime": self.runtime}
        info = {k: v for k, v in info.items() if not isinstance(v, float) or math.isfinite(v)}
        return TrainedUpdate(self.last.arrays, make_layout(self.last.arrays, trainable), len(self.images), cluster,
                             kd_sha, info)

    def _frozen_features(self, model: SegmentationModel, spec: SegmentationSpec) -> torch.Tensor:
        key = (spec.image_size, spec.output_stride, spec.tail_blocks)
        return _recently_used(self._frozen, key, lambda: model.frozen_features(self.images), MAX_HELD_EXTRACTORS)

    def _kd_targets(self, model, spec, layout, flats, kd_sha, recipe, frozen):
        key = (kd_sha, recipe.kd_alpha, recipe.pseudo_quantile, recipe.pseudo_cap, spec.image_size)
        if key in self._kd:
            return self._kd[key]
        if "kd_model" not in flats:
            raise TaskDeclined("kd model missing: this device does not hold the KD teacher; resend it")
        if kd_sha and packed_digest(flats["kd_model"]) != kd_sha:
            raise TaskDeclined("kd_model does not match kd_sha256")
        model.load_exchanged(unpack(flats["kd_model"], layout))
        self._kd.clear()        # one KD teacher per job: drop an older one
        self._kd[key] = kd_targets(model.predict_logits(frozen), recipe.kd_alpha, recipe.pseudo_quantile,
                                   recipe.pseudo_cap)
        return self._kd[key]
