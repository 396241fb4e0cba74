"""Limits of job config fields: declared at each field, checked before anything is built.

A config arrives from an operator (a JSON file, the admin API, a stored row after a restart); a
typo must not allocate a 100 GB matrix or start a job that can never finish. Each config field
declares its limit where it is declared, ``num_classes: int = limited(10, Range(1, 100_000))``
(the limit rides in the dataclass field's metadata), and everything reads it from there:
:func:`validate_config` (known fields only, JSON types matching the annotations, every field's
limit), the admin API's OpenAPI models (``aggregator/api/schemas.py``) and the CLIs' choices
(:func:`choices_of`). A subclass that only changes a default (``norm_bound_multiplier: float =
3.0``) keeps the limit its base declared (:func:`field_limit` looks along the MRO).

The same field name means the same thing in every job kind (``num_classes`` of a Fed3R job and of
a FedAvg job): a field several kinds share is declared once in its field-group mixin
(``ModelFields``, ``UpdateClippingFields``, ...), and a name that kinds declare on their own
(``batch_size``) takes one of the named limits below. ``tests/test_job_registry.py`` checks that
every field of every registered kind has a limit and that no two declarations of a name differ.
A choice field names the enumeration that its code dispatches on (``OneOf(RULES)``), never a copy.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass
from typing import Any

from protocols.payloads.partial import MAX_RECIPE_COUNT

LIMIT = "config_limit"            # the dataclass field metadata key


@dataclass(frozen=True)
class Range:
    lo: float
    hi: float


@dataclass(frozen=True)
class OneOf:
    values: tuple


@dataclass(frozen=True)
class Pattern:
    """A string field that must match this regular expression (whole string)."""
    regex: str


@dataclass(frozen=True)
class Fields:
    """A dict-valued field with these keys: name -> (type, limit); all of them unless ``required``
    names the ones that must be there."""
    spec: dict
    required: tuple | None = None


@dataclass(frozen=True)
class Items:
    """A list field (a JSON array; a tuple where Python builds the config): ``min_items`` to
    ``max_items`` items, each of ``item_type`` (float: any finite number; int: an integer, never
    1.5 silently cut to 1; str: a name, with ``item`` a OneOf) and within ``item``; ``distinct``: no
    item twice (a list of names, each naming one thing)."""
    item: Range | OneOf
    max_items: int
    item_type: type = float
    min_items: int = 1
    distinct: bool = False


Limit = Range | OneOf | Pattern | Fields | Items


def limited(default: Any = dataclasses.MISSING, limit: Limit | None = None, *,
            default_factory: Any = dataclasses.MISSING) -> Any:
    """A config field with its limit: ``x: int = limited(10, Range(1, 100))`` (a mutable default:
    ``limited(limit=..., default_factory=list)``)."""
    if limit is None:
        raise TypeError("limited() needs a limit")
    return dataclasses.field(default=default, default_factory=default_factory, metadata={LIMIT: limit})


# Limits several declarations use.
FLAG = OneOf((True, False))
SHA256_OR_EMPTY = Pattern(r"^([0-9a-f]{64})?$")
PATH = Pattern(r"^[^\x00-\x1f]{0,1024}$")          # a server-side file path, no control characters
TIMEOUT_S = Range(1e-3, 7 * 86400)
COUNT = Range(0, 1_000_000)
SEED = Range(0, 2 ** 53 - 1)                         # JSON-safe: exact as a double
# a job's id names its output directory: a device id's characters, but never "." or ".."
# (spelt without a look-ahead, which the API schema's regex engine lacks)
JOB_ID_RE = re.compile(r"^(?:[A-Za-z0-9_.-]{3,64}|[A-Za-z0-9_-][A-Za-z0-9_.-]?|\.[A-Za-z0-9_-])$")
JOB_ID = Pattern(JOB_ID_RE.pattern)
# Names that kinds declare on their own, with defaults of their own (a kind that is not in the
# family of another): one limit each, so the same name keeps one meaning.
ROUNDS = Range(0, 1_000_000)                         # FedAvg family, LADD
LOCAL_EPOCHS = Range(1, 1000)                        # FedAvg family, LADD
# FedAvg family, personalization, LADD: one bound for every kind, the tightest device recipe's
# (pp's PartialRecipe): 10^6 passed create and then every pp task was refused
BATCH_SIZE = Range(1, MAX_RECIPE_COUNT)
WEIGHT_DECAY = Range(0, 10)                          # FedAvg family, personalization
TEMPERATURE = Range(1e-6, 1e6)                       # FedAvg family, personalization
MAX_ATTEMPTS = Range(1, 1000)                        # Fed3R, personalization (each device once)
MAX_SAMPLES = Range(1, 10_000_000)                   # Fed3R (DP's cap), secure kinds (the sum's bound)
TAIL_STAGES = Range(0, 64)                           # FT(φ)/FT(M), personalization of their model
PERSONAL_EPOCHS = Range(0, 1000)                     # pp (FedAlt), Ditto
TOTAL_DEVICES = Range(0, 100_000_000)                # Scaffold, FedGloSS
# LADD's model: edge_client's SegmentationSpec as a dict (the aggregator does not import edge_client),
# whose network is cut at stride 8 or 16 only (32 was accepted here and refused by every device)
SEGMENTATION_SPEC = Fields({"num_classes": (int, Range(1, 254)), "image_size": (int, Range(16, 1024)),
                            "output_stride": (int, OneOf((8, 16))), "tail_blocks": (int, Range(0, 4)),
                            "head_channels": (int, Range(4, 512)), "aspp_rates": (list, Items(Range(1, 64), 8, int))},
                           required=("num_classes", "image_size"))


def field_limit(config_cls: type, name: str) -> Limit | None:
    """The limit of a config class's field: declared where the field is, or, when a subclass only
    changed its default, where a base class declared it (None: declared nowhere)."""
    for klass in config_cls.__mro__:
        declared = vars(klass).get("__dataclass_fields__", {}).get(name)
        if declared is not None and LIMIT in declared.metadata:
            return declared.metadata[LIMIT]
    return None


def declared_limits(config_cls: type) -> dict[str, Limit | None]:
    """name -> limit of every field of a config class."""
    return {f.name: field_limit(config_cls, f.name) for f in dataclasses.fields(config_cls)}


def choices_of(config_cls: type, name: str) -> tuple:
    """The values a choice field takes (what a CLI offers as ``choices``)."""
    limit = field_limit(config_cls, name)
    if not isinstance(limit, OneOf):
        raise TypeError(f"{config_cls.__name__}.{name} is not a choice field")
    return limit.values


def validate_config(kind: str, config_cls: type, config: dict) -> None:
    """Refuse a config before anything is built from it (``ValueError`` naming the field)."""
    if not isinstance(config, dict):
        raise ValueError(f"{kind} config must be a JSON object, not {type(config).__name__}")
    hints = typing.get_type_hints(config_cls)
    limits = declared_limits(config_cls)
    for key, value in config.items():
        if key not in limits:
            raise ValueError(f"{kind} config has no field {key!r}")
        if not matches(value, hints[key]):
            raise ValueError(f"{kind} config field {key!r}: {value!r} is not a {hints[key]}")
        if value is not None:
            check_limit(f"{kind} config field {key!r}", value, limits[key])


def check_declared(config: Any, *names: str) -> None:
    """A config object's fields against their declared limits (``ValueError`` naming the field): what a
    ``__post_init__`` checks of a config built in Python rather than from JSON."""
    fields = vars(config)                 # a config dataclass's fields, read by name
    for name in names:
        value = fields[name]
        if value is not None:
            check_limit(name, value, field_limit(type(config), name))


def check_whole_number(config: Any, name: str, least: int) -> None:
    """A count field of a config built in Python (no JSON type check ran): an int, not a bool or a
    float, and at least ``least``; ``ValueError`` naming the field otherwise."""
    value = vars(config)[name]            # a config dataclass's field, read by name
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def undeclared_fields(config_cls: type) -> list[str]:
    """Fields of a config class with no declared limit (a registry test keeps this empty)."""
    return [name for name, limit in declared_limits(config_cls).items() if limit is None]


def _check_distinct(what: str, items) -> None:
    seen = set()
    for item in items:
        if item in seen:
            raise ValueError(f"{what} names {item!r} more than once")
        seen.add(item)


def check_limit(what: str, value, limit: Limit | None) -> None:
    if limit is None:
        raise TypeError(f"{what} has no declared limit")       # a registry test keeps this from happening
    if isinstance(limit, Range) and not limit.lo <= value <= limit.hi:
        raise ValueError(f"{what}={value} is outside [{limit.lo}, {limit.hi}]")
    if isinstance(limit, Pattern) and not re.fullmatch(limit.regex, value):
        raise ValueError(f"{what}={value!r} does not match {limit.regex}")
    if isinstance(limit, OneOf) and value not in limit.values:
        raise ValueError(f"{what} must be one of {limit.values}, not {value!r}")
    if isinstance(limit, Items):
        if not isinstance(value, (list, tuple)) or not limit.min_items <= len(value) <= limit.max_items:
            count = limit.max_items if limit.min_items == limit.max_items else f"{limit.min_items} to {limit.max_items}"
            raise ValueError(f"{what} must be a list of {count} {'strings' if limit.item_type is str else 'numbers'}")
        for i, item in enumerate(value):
            if not matches(item, limit.item_type):
                kind = {int: "an integer", float: "a number", str: "a string"}.get(limit.item_type, limit.item_type)
                raise ValueError(f"{what}[{i}] must be {kind}")
            check_limit(f"{what}[{i}]", item, limit.item)
        if limit.distinct:      # only then: a long list of numbers is not searched for repeats
            _check_distinct(what, value)
    if isinstance(limit, Fields):
        _check_fields(what, value, limit)


def _check_fields(what: str, value, limit: Fields) -> None:
    required = set(limit.spec if limit.required is None else limit.required)
    if not isinstance(value, dict) or not required <= set(value) <= set(limit.spec):
        raise ValueError(f"{what} must have the keys {sorted(required)} and may have {sorted(limit.spec)}")
    for key, (typ, rng) in limit.spec.items():
        if key not in value:
            continue
        if not matches(value[key], typ):
            raise ValueError(f"{what}[{key!r}] must be a {typ.__name__}")
        check_limit(f"{what}[{key!r}]", value[key], rng)


def matches(value, hint) -> bool:
    """Whether a JSON value fits a type annotation (bools are not ints, floats are finite)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(matches(value, h) for h in typing.get_args(hint))
    hint = typing.get_origin(hint) or hint
    if hint is type(None):
        return value is None
    if hint is float:                   # an int is finite: math.isfinite(10**400) raised OverflowError
        return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and math.isfinite(value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is tuple:                   # a JSON array, or the tuple a Python caller built
        return isinstance(value, (list, tuple))
    return isinstance(value, hint)
