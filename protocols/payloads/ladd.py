"""Payloads of LADD's two task kinds: ``ladd.style`` (once per device) and ``ladd.train`` (rounds).

Parameter packing
-----------------
A segmentation model has far more tensors than an envelope may carry (64), so models travel
as one flat float32 vector plus a *layout*: the ordered list of ``[name, shape]`` pairs.
Values are concatenated in layout order, each tensor C-order. ``layout_digest`` is the
sha256 of the layout's canonical JSON (sorted keys, no spaces), so both sides can check in
one string that they mean the same tensors in the same order.

``ladd.style``
--------------
Task params: ``b`` (window half-width), ``image_size`` (the fixed resize before the FFT).
Result body: ``n`` (images averaged), ``b``; tensor ``style`` float32 (3, 2b+1, 2b+1): the
mean over the device's images of the centred window of the fftshifted amplitude spectrum
(see ``edge_client.style``). Amplitudes are >= 0 and bounded by 255·S² (the DC term of an
all-white image), which the parser enforces.

``ladd.train``
--------------
Task params (among the recipe, ``SelfTrainingRecipe``, whose step rule travels flat as the
FedAvg family's ``LocalRuleRecipe`` params ``local_rule``, ``sam_rho``, ``asam_eta``,
``prox_mu``): ``model`` (the segmentation spec), ``layout`` and ``layout_sha256`` of the
exchanged state, ``trainable`` (names, a subset of the layout, in
layout order), ``cluster``, ``teacher`` ("model" when the pseudo-label teacher equals the
model, else "tensor"), ``kd_sha256`` (digest of the packed pre-trained model, the KD teacher).
Task tensors: ``model`` float32 (L,) always; ``teacher`` (L,) when params say "tensor";
``kd_model`` (L,) when the server does not know that the device holds the KD teacher.

Result body: ``n`` (local images, the averaging weight), ``cluster``, ``layout_sha256`` of the
*trainable* layout, ``kd_sha256`` (the KD teacher the device used, so the server can stop
sending it), plus diagnostics (``loss``, ``kept_fraction``, ``steps``). Result tensor:
``update`` float32 (L_trainable,): the trained parameters themselves (not a difference).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..envelope import Envelope, EnvelopeError, body_field, require_finite, require_tensor
from .fedavg import LocalRuleRecipe
from .task_params import (TaskParams, WireParams, check_choices, check_int, check_sha_or_empty, check_str, choice, part,
                          to_json)

KIND_STYLE = "ladd.style"
KIND_TRAIN = "ladd.train"
MAX_STYLE_B = 8
MAX_PARAMETERS = 50_000_000

Layout = list[tuple[str, tuple[int, ...]]]


# ----------------------------------------------------------------------------- layouts
def make_layout(arrays: dict[str, np.ndarray], names: list[str] | None = None) -> Layout:
    """Layout of ``arrays`` (all of them, or ``names`` in that order)."""
    names = list(arrays) if names is None else list(names)
    return [(n, tuple(int(s) for s in np.shape(arrays[n]))) for n in names]



@dataclass(frozen=True)
class SelfTrainingRecipe(WireParams):
    """The local self-training recipe of a ``ladd.train`` task (its params besides the model
    fields): what the server asks for and what the device runs, validated on both sides."""

    epochs: int = 1
    batch_size: int = 8
    lr: float = 0.01
    momentum: float = 0.9
    kd_lambda: float = 10.0
    kd_alpha: float = 0.5
    pseudo_quantile: float = 0.66
    pseudo_cap: float = 0.9
    seed: int = 0
    # the step's direction (SGD, FedProx, FedSAM, FedASAM): the FedAvg family's params, flat in the task
    rule: LocalRuleRecipe = part(LocalRuleRecipe)

    def __post_init__(self):
        for name in ("epochs", "batch_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= v <= 10_000:
                raise ValueError(f"{name} must be an integer in [1, 10000], got {v!r}")
        checks = {"lr": (0, 10, False), "momentum": (0, 1, True), "kd_lambda": (0, 1e4, True),
                  "kd_alpha": (0, 100, False), "pseudo_quantile": (0, 1, True), "pseudo_cap": (0, 1, False)}
        for name, (lo, hi, lo_ok) in checks.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating)) or not math.isfinite(v) \
                    or v > hi or v < lo or (v == lo and not lo_ok):
                raise ValueError(f"{name} must be a finite number in {'[' if lo_ok else '('}{lo}, {hi}], got {v!r}")
        if self.momentum >= 1:
            raise ValueError("momentum must be < 1")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.rule, LocalRuleRecipe):
            raise ValueError(f"rule must be a LocalRuleRecipe, got {type(self.rule).__name__}")


@dataclass(frozen=True)
class StyleParams(TaskParams):
    """``ladd.style`` params: the spectrum window's half-width and the resize before the FFT."""

    KIND = KIND_STYLE
    b: int
    image_size: int

    def __post_init__(self):
        check_int("b", self.b, 0, MAX_STYLE_B)
        check_int("image_size", self.image_size, 16, 1024)


TEACHERS = ("model", "tensor")
MAX_TRAINABLE = 100_000


@dataclass(frozen=True)
class LaddTrainParams(TaskParams):
    """``ladd.train`` params (module doc). ``model`` is the segmentation spec, a JSON object the
    device's model code parses (it holds the architecture's own fields)."""

    KIND = KIND_TRAIN
    model: dict
    cluster: int
    layout: tuple
    layout_sha256: str
    trainable: tuple[str, ...]
    teacher: str = choice("model", TEACHERS)
    weights_sha256: str = ""
    kd_sha256: str = ""
    recipe: SelfTrainingRecipe = part(SelfTrainingRecipe)

    def __post_init__(self):
        if not isinstance(self.model, dict) or not all(isinstance(k, str) for k in self.model):
            raise ValueError(f"model must be a JSON object (the segmentation spec), got {self.model!r}")
        check_int("cluster", self.cluster, 0, 1_000)
        if layout_digest(self.parsed_layout()) != self.layout_sha256:
            raise ValueError("layout_sha256 does not match the layout")
        if not isinstance(self.trainable, tuple) or not 1 <= len(self.trainable) <= MAX_TRAINABLE:
            raise ValueError(f"trainable must name 1 to {MAX_TRAINABLE} tensors")
        for name in self.trainable:
            check_str("trainable[i]", name)
        check_choices(self)
        check_sha_or_empty("weights_sha256", self.weights_sha256)
        check_sha_or_empty("kd_sha256", self.kd_sha256)

    def parsed_layout(self) -> Layout:
        """The exchanged state's layout (ValueError if malformed)."""
        return layout_from_json(to_json(self.layout))


def layout_to_json(layout: Layout) -> list:
    return [[name, list(shape)] for name, shape in layout]


def layout_from_json(value: Any) -> Layout:
    """Parse a layout from task params; ValueError if malformed."""
    if not isinstance(value, list) or not value:
        raise ValueError("layout must be a non-empty list of [name, shape]")
    out, seen, total = [], set(), 0
    for item in value:
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str)
                or not isinstance(item[1], list)
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in item[1])):
            raise ValueError(f"bad layout entry {item!r}")
        if item[0] in seen:
            raise ValueError(f"duplicate layout name {item[0]!r}")
        seen.add(item[0])
        total += math.prod(item[1])
        out.append((item[0], tuple(item[1])))
    if total > MAX_PARAMETERS:
        raise ValueError(f"layout holds {total} values, more than {MAX_PARAMETERS}")
    return out


def layout_digest(layout: Layout) -> str:
    text = json.dumps(layout_to_json(layout), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def layout_size(layout: Layout) -> int:
    return int(sum(math.prod(shape) for _, shape in layout))


def pack(arrays: dict[str, np.ndarray], layout: Layout) -> np.ndarray:
    """Flat float32 vector of ``arrays`` in layout order (shapes checked)."""
    parts = []
    for name, shape in layout:
        if name not in arrays:
            raise ValueError(f"missing tensor {name!r}")
        a = np.asarray(arrays[name], dtype=np.float32)
        if a.shape != shape:
            raise ValueError(f"tensor {name!r} has shape {a.shape}, layout says {shape}")
        parts.append(a.ravel())
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def unpack(flat: np.ndarray, layout: Layout) -> dict[str, np.ndarray]:
    """Inverse of :func:`pack` (copies, so the result is writable)."""
    flat = np.asarray(flat)
    if flat.ndim != 1 or len(flat) != layout_size(layout):
        raise ValueError(f"packed vector has shape {flat.shape}, layout needs ({layout_size(layout)},)")
    out, offset = {}, 0
    for name, shape in layout:
        size = math.prod(shape)
        out[name] = np.array(flat[offset:offset + size], dtype=np.float32).reshape(shape)
        offset += size
    return out


def packed_digest(flat: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(flat, dtype="<f4").tobytes()).hexdigest()


# ----------------------------------------------------------------------------- ladd.style
@dataclass(frozen=True)
class StyleResult:
    n: int
    style: np.ndarray        # (3, 2b+1, 2b+1) float32


def encode_style(style: np.ndarray, n: int, b: int) -> tuple[dict, dict[str, np.ndarray]]:
    style = np.ascontiguousarray(style, dtype=np.float32)
    if style.shape != (3, 2 * b + 1, 2 * b + 1):
        raise ValueError(f"style must be (3, {2 * b + 1}, {2 * b + 1}), got {style.shape}")
    if not np.isfinite(style).all() or (style < 0).any():
        raise ValueError("style must be finite and non-negative")
    if int(n) < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return {"n": int(n), "b": int(b)}, {"style": style}


def parse_style(msg: Envelope, b: int, image_size: int, max_samples: int = 10**7) -> StyleResult:
    """Validate a ``ladd.style`` result for window half-width ``b`` at ``image_size``²."""
    n = body_field(msg, "n", int)
    if not 0 < n <= max_samples:
        raise EnvelopeError(f"{KIND_STYLE}: n={n} out of range (1..{max_samples})")
    if body_field(msg, "b", int) != b:
        raise EnvelopeError(f"{KIND_STYLE}: b={msg.body['b']}, the job uses b={b}")
    extra = set(msg.tensors) - {"style"}
    if extra:
        raise EnvelopeError(f"{KIND_STYLE}: unexpected tensors {sorted(extra)}")
    style = require_tensor(msg, "style", "float32", (3, 2 * b + 1, 2 * b + 1))
    require_finite(msg, "style")
    bound = 255.0 * image_size * image_size * 1.0001
    if (style < 0).any() or (style > bound).any():
        raise EnvelopeError(f"{KIND_STYLE}: amplitudes must lie in [0, 255·S²={bound:.0f}]")
    return StyleResult(n, np.array(style, dtype=np.float32))


# ----------------------------------------------------------------------------- ladd.train
@dataclass(frozen=True)
class ModelUpdate:
    n: int
    cluster: int
    tensors: dict[str, np.ndarray]
    kd_sha256: str = ""
    info: dict = field(default_factory=dict)


def encode_update(arrays: dict[str, np.ndarray], trainable_layout: Layout, n: int, cluster: int,
                  kd_sha256: str = "", info: dict | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    flat = pack(arrays, trainable_layout)
    if not np.isfinite(flat).all():
        raise ValueError("the trained model contains NaN or Inf (diverged local training?)")
    if int(n) < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    body = {"n": int(n), "cluster": int(cluster), "layout_sha256": layout_digest(trainable_layout),
            "kd_sha256": kd_sha256, **{k: v for k, v in (info or {}).items() if k not in ("n", "cluster")}}
    return body, {"update": flat}


def parse_update(msg: Envelope, trainable_layout: Layout, expected_cluster: int,
                 max_samples: int = 10**7, max_abs: float = 1e4) -> ModelUpdate:
    """Validate a ``ladd.train`` result: layout digest, cluster, shape, dtype, finite, bounded."""
    n = body_field(msg, "n", int)
    if not 0 < n <= max_samples:
        raise EnvelopeError(f"{KIND_TRAIN}: n={n} out of range (1..{max_samples})")
    cluster = body_field(msg, "cluster", int)
    if cluster != expected_cluster:
        raise EnvelopeError(f"{KIND_TRAIN}: update for cluster {cluster}, the device belongs to {expected_cluster}")
    if body_field(msg, "layout_sha256", str) != layout_digest(trainable_layout):
        raise EnvelopeError(f"{KIND_TRAIN}: layout digest does not match the job's trainable layout")
    extra = set(msg.tensors) - {"update"}
    if extra:
        raise EnvelopeError(f"{KIND_TRAIN}: unexpected tensors {sorted(extra)}")
    flat = require_tensor(msg, "update", "float32", (layout_size(trainable_layout),))
    require_finite(msg, "update")
    if flat.size and float(np.abs(flat).max()) > max_abs:
        raise EnvelopeError(f"{KIND_TRAIN}: parameter magnitude above {max_abs:g} (diverged or hostile)")
    kd = msg.body.get("kd_sha256", "")
    info = {k: msg.body[k] for k in ("loss", "kept_fraction", "steps", "gradient_evaluations", "seconds")
            if isinstance(msg.body.get(k), (int, float)) and not isinstance(msg.body.get(k), bool)}
    return ModelUpdate(n, cluster, unpack(flat, trainable_layout), kd if isinstance(kd, str) else "", info)


def train_task_tensors(model: np.ndarray, teacher: np.ndarray | None, kd_model: np.ndarray | None
                       ) -> dict[str, np.ndarray]:
    out = {"model": model}
    if teacher is not None:
        out["teacher"] = teacher
    if kd_model is not None:
        out["kd_model"] = kd_model
    return out


def parse_train_task(task: "LaddTrainParams | dict", tensors: dict[str, np.ndarray]) -> tuple[Layout, dict[str, np.ndarray]]:
    """Device side: check the task's flat tensors against its layout; returns (layout, {role: flat})."""
    if not isinstance(task, LaddTrainParams):
        task = LaddTrainParams.from_params(task)
    layout = task.parsed_layout()
    size = layout_size(layout)
    roles = {"model"} | ({"teacher"} if task.teacher == "tensor" else set())
    out = {}
    for role in ("model", "teacher", "kd_model"):
        if role not in tensors:
            if role in roles:
                raise ValueError(f"task carries no {role!r} tensor")
            continue
        flat = np.asarray(tensors[role])
        if flat.dtype != np.float32 or flat.shape != (size,):
            raise ValueError(f"{role!r} must be float32 ({size},), got {flat.dtype} {flat.shape}")
        if not np.isfinite(flat).all():
            raise ValueError(f"{role!r} contains NaN or Inf")
        out[role] = flat
    unexpected = set(tensors) - {"model", "teacher", "kd_model"}
    if unexpected:
        raise ValueError(f"unexpected task tensors {sorted(unexpected)}")
    return layout, out
