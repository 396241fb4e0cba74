"""Limits of job config fields, declared once per field name and checked before anything is built.

A config arrives from an operator (a JSON file, the admin API, a stored row after a restart); a
typo must not allocate a 100 GB matrix or start a job that can never finish. The same field name
means the same thing in every job kind (``num_classes`` of a Fed3R job and of a FedAvg job), so
each name's limit is declared once in :data:`FIELD_LIMITS`; :func:`validate_config` checks a
config dict against a config class: known fields only, JSON types matching the annotations, and
every field's limit. ``tests/test_job_registry.py`` checks that every field of every registered
kind has a declared limit, so a new field cannot slip in unchecked. The admin API builds its
OpenAPI models from the same table (``aggregator/api/schemas.py``).
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass

from protocols.payloads.fedavg import LOCAL_RULES
from protocols.topics import DEVICE_ID_RE

from aggregator.jobs.fedavg import INITS
from aggregator.strategies.fedopt import SERVER_OPTIMIZERS
from aggregator.strategies.model_averaging import SERVED_MODELS


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
    """A list field: at most ``max_items`` items, each within ``item``."""
    item: Range
    max_items: int


SHA256_OR_EMPTY = Pattern(r"^([0-9a-f]{64})?$")
PATH = Pattern(r"^[^\x00-\x1f]{0,1024}$")          # a server-side file path, no control characters
TIMEOUT_S = Range(1e-3, 7 * 86400)
COUNT = Range(0, 1_000_000)
SEED = Range(0, 2 ** 53 - 1)                         # JSON-safe: exact as a double
SEGMENTATION_SPEC = Fields({"num_classes": (int, Range(1, 254)), "image_size": (int, Range(16, 1024)),
                            "output_stride": (int, Range(8, 32)), "tail_blocks": (int, Range(0, 4)),
                            "head_channels": (int, Range(4, 512)), "aspp_rates": (list, Items(Range(1, 64), 8))},
                           required=("num_classes", "image_size"))

FIELD_LIMITS: dict[str, Range | OneOf | Pattern | Fields | Items] = {
    "job_id": Pattern(DEVICE_ID_RE.pattern),
    # the model every classification job names
    "num_classes": Range(1, 100_000), "feature_dim": Range(1, 8192), "image_size": Range(1, 4096),
    "backbone": Pattern(r"^[a-z0-9_]{1,64}$"), "weights_sha256": SHA256_OR_EMPTY, "bundle_sha256": SHA256_OR_EMPTY,
    # scheduling
    "clients_per_round": Range(1, 1_000_000), "max_attempts": Range(1, 1000), "expected_devices": COUNT,
    "round_timeout_s": TIMEOUT_S, "start_timeout_s": Range(0, 7 * 86400), "phase_timeout_s": TIMEOUT_S,
    "rounds": Range(0, 1_000_000), "seed": SEED,
    # Fed3R
    "lam": Range(1e-12, 1e12), "fit_intercept": OneOf((True, False)), "normalize_columns": OneOf((True, False)),
    "b_format": OneOf(("sparse", "dense")), "factor_uploads": OneOf((True, False)),
    "streaming": OneOf((True, False)), "stats_dtype": OneOf(("float64", "float32")),
    "random_features": Fields({"seed": (int, Range(0, 2 ** 32 - 1)), "dim": (int, Range(1, 8192)),
                               "sigma": (float, Range(1e-12, 1e12))}),
    # secure aggregation
    "graph": OneOf(("auto", "complete", "regular")), "expected_dropout": Range(0, 0.49), "max_samples": Range(1, 10_000_000),
    "max_abs_feature": Range(0, 1e6), "max_abs_param": Range(1e-6, 1e6),
    "identity_file": PATH, "device_keys_file": PATH,
    # differential privacy (aggregator/jobs/privacy_fields.py)
    "dp_noise_multiplier": Range(0, 1e4), "dp_target_epsilon": Range(0, 1e4), "dp_delta": Range(1e-15, 0.1),
    "dp_clip_norm": Range(1e-9, 1e9), "dp_adaptive_clip": OneOf((True, False)), "dp_target_quantile": Range(1e-3, 0.999),
    "dp_clip_lr": Range(1e-6, 10), "dp_count_stddev": Range(0, 1e6), "dp_population": COUNT,
    "feature_clip_norm": Range(0, 1e6), "dp_mechanism": OneOf(("ssp", "gaussian")), "dp_b_share": Range(1e-3, 0.999),
    "dp_center_devices": Range(0, 10_000_000), "dp_center_clip_norm": Range(0, 1e6),
    # bounded influence (aggregator/jobs/robustness_fields.py)
    "aggregator": OneOf(("mean", "median", "trimmed_mean", "krum", "multi_krum", "centered_clipping")),
    "clip_radius_multiplier": Range(1e-6, 1e6), "clip_iterations": Range(1, 100),
    "norm_bound_multiplier": Range(0, 1e6), "trim_fraction": Range(0, 0.499), "krum_byzantine": Range(0, 100_000),
    "contribution_bound_multiplier": Range(0, 1e6), "direction_screen": OneOf((True, False)),
    "history_momentum": Range(0, 0.99),
    "krum_select": Range(0, 100_000), "update_clip_norm": Range(0, 1e9), "max_device_samples": Range(1, 1_000_000_000), "screen_energy_ratio": Range(0, 1e6), "screen_sample_slack": Range(0, 1e6), "screen_min_fleet": Range(1, 1_000_000),
    # FedAvg family
    "local_epochs": Range(1, 1000), "batch_size": Range(1, 1_000_000), "client_lr": Range(0, 100),
    "weight_decay": Range(0, 10), "temperature": Range(1e-6, 1e6), "server_lr": Range(0, 100),
    "server_momentum": Range(0, 1), "server_optimizer": OneOf(SERVER_OPTIMIZERS), "server_beta1": Range(0, 0.9999),
    "server_beta2": Range(0, 0.9999), "server_tau": Range(1e-12, 1e3), "local_rule": OneOf(LOCAL_RULES),
    "sam_rho": Range(0, 100), "asam_eta": Range(0, 100), "prox_mu": Range(0, 1e4), "served_model": OneOf(SERVED_MODELS),
    "swa_start_round": Range(1, 1_000_000), "swa_cycle_rounds": Range(1, 100_000), "swa_lr_min": Range(0, 100),
    "wima_window": Range(1, 1000), "buffer_size": Range(1, 100_000), "max_staleness": Range(0, 10_000),
    "staleness_exponent": Range(0, 10), "init": OneOf(INITS), "initial_head_file": PATH,
    "init_scale": Range(1e-3, 1e3),
    # stateful devices (aggregator/jobs/device_state_fields.py): partial personalization, Scaffold, FedGloSS, Ditto
    "state_max_staleness": Range(0, 1_000_000), "state_ttl_s": Range(1, 365 * 86400),
    "pp_algorithm": OneOf(("fedsim", "fedalt")), "personal_epochs": Range(0, 1000),
    "total_devices": Range(0, 100_000_000), "control_clip_norm": Range(1e-9, 1e9),
    "fedgloss_rho": Range(0, 100), "admm_beta": Range(1e-9, 1e6),
    "ditto_lambda": Range(1e-9, 1e4), "personal_lr": Range(0, 100),
    # FT(φ)/FT(M)
    "train": OneOf(("tail", "tail+head")), "tail_stages": Range(0, 64), "tail_program_file": PATH,
    "tail_program_sha256": SHA256_OR_EMPTY,
    # personalization
    "head_file": PATH, "fallback": OneOf(("error", "global")), "fp_epochs": Range(0, 10_000),
    "fp_lrs": Items(Range(1e-9, 10), 16), "fp_folds": Range(2, 100), "fp_part": OneOf(("psi", "phi", "M")),
    "personal_job": Pattern(r"^(" + DEVICE_ID_RE.pattern.strip("^$") + r")?$"),
    # LADD
    "model": SEGMENTATION_SPEC, "style_b": Range(0, 8), "clustering": OneOf(("styles", "none")),
    "k_min": Range(1, 64), "k_max": Range(1, 64), "n_init": Range(1, 1000), "cluster_scope": OneOf(("head", "all")),
    "lr": Range(0, 100), "momentum": Range(0, 1), "kd_lambda": Range(0, 1e6), "kd_alpha": Range(0, 1e6),
    "pseudo_quantile": Range(0, 1), "pseudo_cap": Range(0, 1), "teacher_every": Range(1, 1_000_000),
    "swa_start": Range(0, 1_000_000), "min_styles": COUNT, "style_attempts": Range(1, 1000),
    "min_cluster_contributors": Range(1, 1_000_000), "initial_model_file": PATH, "initial_model_sha256": SHA256_OR_EMPTY,
}


def validate_config(kind: str, config_cls: type, config: dict) -> None:
    """Refuse a config before anything is built from it (``ValueError`` naming the field)."""
    if not isinstance(config, dict):
        raise ValueError(f"{kind} config must be a JSON object, not {type(config).__name__}")
    hints = typing.get_type_hints(config_cls)
    for key, value in config.items():
        if key not in hints:
            raise ValueError(f"{kind} config has no field {key!r}")
        if not matches(value, hints[key]):
            raise ValueError(f"{kind} config field {key!r}: {value!r} is not a {hints[key]}")
        if value is not None:
            check_limit(f"{kind} config field {key!r}", value, FIELD_LIMITS[key])


def undeclared_fields(config_cls: type) -> list[str]:
    """Fields of a config class with no declared limit (a registry test keeps this empty)."""
    return [f.name for f in dataclasses.fields(config_cls) if f.name not in FIELD_LIMITS]


def check_limit(what: str, value, limit) -> None:
    if isinstance(limit, Range) and not limit.lo <= value <= limit.hi:
        raise ValueError(f"{what}={value} is outside [{limit.lo}, {limit.hi}]")
    if isinstance(limit, Pattern) and not re.fullmatch(limit.regex, value):
        raise ValueError(f"{what}={value!r} does not match {limit.regex}")
    if isinstance(limit, OneOf) and value not in limit.values:
        raise ValueError(f"{what} must be one of {limit.values}, not {value!r}")
    if isinstance(limit, Items):
        if not isinstance(value, list) or not 0 < len(value) <= limit.max_items:
            raise ValueError(f"{what} must be a list of 1 to {limit.max_items} numbers")
        for i, item in enumerate(value):
            if not matches(item, float):
                raise ValueError(f"{what}[{i}] must be a number")
            check_limit(f"{what}[{i}]", item, limit.item)
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
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)
