"""What every task kind's parameter type shares: the wire form, the version, the field checks.

A task's ``params`` (a JSON object in the task message) is declared once per task kind as a
frozen dataclass in ``protocols/payloads/<kind>.py``, validated in ``__post_init__`` (ValueError
naming the field). The aggregator's job builds it and sends ``to_params()``; the device parses
``from_params()`` and declines the task with the ValueError's reason. The table of kinds and
their types is ``protocols/payloads/task_kinds.py``.

Wire form: every field travels flat under its own name, except

* a *part* (``part(Type)``): a reusable group of fields (the model, the local recipe) whose own
  fields travel flat beside the others;
* a *nested* value (``nested(Type)``): a JSON object under the field's name, parsed by the
  type's ``from_params`` (e.g. the state binding, the DP round);
* an optional field (``optional()``): left out of the params while it is None (absent = None).

Tuples travel as JSON arrays. ``params_version`` is :data:`PARAMS_VERSION`: a device declines
params of a version it does not speak, and reads params without one (older aggregators, the
golden vectors) as version 1. Unknown keys are ignored, so a newer aggregator may add optional
fields without a version bump (a device that does not know a field runs the task without it;
a change that an old device must not run bumps the version instead).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Iterable

import numpy as np

PARAMS_VERSION = 1
VERSION_KEY = "params_version"
MAX_COUNT = 10**9
PART, NESTED, OPTIONAL, CHOICES = "wire_part", "wire_nested", "wire_optional", "wire_choices"


def part(cls: type) -> Any:
    """A field whose type's own fields travel flat in the params (default: the type's defaults,
    when it has a default for every field; else the field is required)."""
    required = any(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   for f in dataclasses.fields(cls))
    if required:
        return dataclasses.field(metadata={PART: cls})
    return dataclasses.field(default_factory=cls, metadata={PART: cls})


def nested(cls: type, default: Any = None, omit_none: bool = True) -> Any:
    """A field that travels as one JSON object (None: left out of the params, or sent as null)."""
    return dataclasses.field(default=default, metadata={NESTED: cls, OPTIONAL: omit_none})


def optional(default: Any = None) -> Any:
    """A field left out of the params while it is None."""
    return dataclasses.field(default=default, metadata={OPTIONAL: True})


def choice(default: str, choices: Iterable[str]) -> Any:
    """A string field that must be one of ``choices`` (checked by :func:`check_choices`, listed
    as the field's enum in the JSON Schema)."""
    return dataclasses.field(default=default, metadata={CHOICES: tuple(choices)})


# ----------------------------------------------------------------------------- field checks
def check_int(name: str, value: Any, low: int = 0, high: int = MAX_COUNT) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")


def check_number(name: str, value: Any, low: float = 0.0, high: float = math.inf, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value) or not low <= value <= high or (low_open and value == low):
        raise ValueError(f"{name} must be a finite number in {'(' if low_open else '['}{low:g}, {high:g}], "
                         f"got {value!r}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be true or false, got {value!r}")


def check_str(name: str, value: Any, choices: Iterable[str] | None = None, max_len: int = 256) -> None:
    if not isinstance(value, str) or len(value) > max_len:
        raise ValueError(f"{name} must be a string of at most {max_len} characters, got {value!r}")
    if choices is not None and value not in tuple(choices):
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def check_choices(params: Any) -> None:
    """Every :func:`choice` field of ``params`` holds one of its choices."""
    for f in dataclasses.fields(params):
        if CHOICES in f.metadata:
            check_str(f.name, getattr(params, f.name), f.metadata[CHOICES])


def check_sha_or_empty(name: str, value: Any) -> None:
    check_str(name, value, max_len=64)
    if value and (len(value) != 64 or any(c not in "0123456789abcdef" for c in value)):
        raise ValueError(f"{name} must be empty or 64 lowercase hex digits, got {value!r}")


# ----------------------------------------------------------------------------- the wire form
def to_json(value: Any) -> Any:
    if isinstance(value, WireParams):
        return value.to_params()
    if isinstance(value, (tuple, list)):
        return [to_json(v) for v in value]
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_from_json(v) for v in value)
    return value


class WireParams:
    """Base of a frozen dataclass that travels in task params (see the module doc)."""

    # fields with a default (None, "") that a task must still name: the device refuses it without them
    REQUIRED_KEYS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def required_keys(cls) -> list[str]:
        """The keys this type's params must hold (not those of its parts)."""
        declared = {k for c in cls.__mro__ for k in vars(c).get("REQUIRED_KEYS", ())}
        return [f.name for f in dataclasses.fields(cls) if PART not in f.metadata and (
            f.name in declared or (f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING))]

    @classmethod
    def from_params(cls, params: dict[str, Any]):
        """The type from a task's params; ValueError when a field is missing or malformed."""
        if not isinstance(params, dict):
            raise ValueError(f"params must be a JSON object, got {type(params).__name__}")
        missing = [k for k in cls.required_keys() if k not in params]
        if missing:
            raise ValueError(f"missing field {missing[0]!r}")
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if PART in f.metadata:
                values[f.name] = f.metadata[PART].from_params(params)
            elif f.name in params:
                raw = params[f.name]
                if NESTED in f.metadata and raw is not None:
                    raw = f.metadata[NESTED].from_params(raw) if isinstance(raw, dict) else _bad_nested(f.name, raw)
                values[f.name] = _from_json(raw)
        try:
            return cls(**values)
        except TypeError as exc:           # a nested value of the wrong shape
            raise ValueError(str(exc)) from None

    @classmethod
    def extending(cls, base: "WireParams", **extra: Any):
        """This type with every field of ``base`` (an instance of a parent type) plus ``extra``."""
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)}, **extra)

    def to_params(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if PART in f.metadata:
                out.update(value.to_params())
            elif not (value is None and f.metadata.get(OPTIONAL)):
                out[f.name] = to_json(value)
        return out


def _bad_nested(name: str, raw: Any):
    raise ValueError(f"{name} must be a JSON object, got {raw!r}")


class TaskParams(WireParams):
    """A task kind's whole params: the wire form plus the version (module doc)."""

    KIND: ClassVar[str] = ""

    @classmethod
    def from_params(cls, params: dict[str, Any]):
        if isinstance(params, dict):
            version = params.get(VERSION_KEY, 1)
            if type(version) is not int or version != PARAMS_VERSION:       # 1.0 is not 1 on the wire
                raise ValueError(f"{VERSION_KEY} {version!r} is not the one this device speaks ({PARAMS_VERSION})")
        return super().from_params(params)

    def to_params(self) -> dict[str, Any]:
        return {**super().to_params(), VERSION_KEY: PARAMS_VERSION}


@dataclasses.dataclass(frozen=True)
class ModelSpec(WireParams):
    """Which model a classification task runs: the backbone, its input size and weights, the
    exported bundle (sha256 of its manifest; "" lets the device use its own), the classes."""

    num_classes: int
    backbone: str
    image_size: int
    weights_sha256: str = ""
    bundle_sha256: str = ""

    def __post_init__(self):
        check_int("num_classes", self.num_classes, 1, 1_000_000)
        check_str("backbone", self.backbone, max_len=128)
        check_int("image_size", self.image_size, 1, 16_384)
        check_sha_or_empty("weights_sha256", self.weights_sha256)
        check_sha_or_empty("bundle_sha256", self.bundle_sha256)


@dataclasses.dataclass(frozen=True)
class DpRound(WireParams):
    """A secure round under distributed DP (``dp`` of a secure task): each member's Skellam noise
    stddev and the fixed-point scale, the round's threshold, and (update-based kinds) the clip norm.
    ``clip_bit_scale`` s (the FedAvg family, adaptive clipping): the device puts its clipped-indicator
    bit (1[‖θ_k − θ_t‖ ≤ clip_norm] − ½)·s before its vector's count entry, noised as the update
    (``protocols/secagg/distributed_dp.py`` clip_bit)."""

    stddev: float
    scale_bits: int
    threshold: int | None = optional()        # what the noise was sized for (the device does not need it)
    clip_norm: float | None = optional()
    clip_bit_scale: float | None = optional()

    def __post_init__(self):
        check_number("dp.stddev", self.stddev)
        check_int("dp.scale_bits", self.scale_bits, 0, 62)
        if self.threshold is not None:
            check_int("dp.threshold", self.threshold, 1, MAX_COUNT)
        if self.clip_norm is not None:
            check_number("dp.clip_norm", self.clip_norm, low_open=True)
        if self.clip_bit_scale is not None:
            check_number("dp.clip_bit_scale", self.clip_bit_scale, low_open=True)
            if self.clip_norm is None:
                raise ValueError("dp.clip_bit_scale: the clipped-indicator bit needs the round's clip_norm")
