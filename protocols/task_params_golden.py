"""Golden vectors of task params: what a device of any language must accept, read the same, and
refuse (protocols/golden/task_params/<kind>.json), for the kinds the Java device serves (its plain
kinds and the secure kinds it answers under SecAgg: fed3r.secure, fedavg.secure).

Each file holds ``valid`` cases (``params`` as a task may carry them: minimal, full, with an
unknown key; ``canonical``: the declared type's ``to_params()`` of them, every default filled
in) and ``invalid`` cases (``params`` and the ``field`` the type refuses). The Python device's
types and the Java device's typed classes (``clients/java/src/org/fedfleet/device/*Params.java``)
are both checked against them by tests/test_task_params_contract.py. Regenerate (only when a
type changes) with ``python -m protocols.task_params_golden``.
"""

from __future__ import annotations

import json
from pathlib import Path

from .payloads.task_kinds import TASK_PARAMS

GOLDEN_DIR = Path(__file__).resolve().parent / "golden" / "task_params"
_MODEL = {"num_classes": 3, "backbone": "mobilenet_v2", "image_size": 64}
_SHA = "ab" * 32
_DP = {"stddev": 0.5, "scale_bits": 16}
_SYNC = {**_MODEL, "group": "g1", "max_samples": 100}                         # fed3r.secure, minimal
_SECURE_HEAD = {**_MODEL, "group": "g1", "max_samples": 100, "max_abs_param": 50.0}      # fedavg.secure, minimal

# kind -> (valid params, [(field refused, params)])
CASES: dict[str, tuple[list[dict], list[tuple[str, dict]]]] = {
    "fed3r.stats": (
        [_MODEL,
         {**_MODEL, "weights_sha256": _SHA, "bundle_sha256": "", "fit_intercept": False, "random_features": None,
          "format": "dense", "dtype": "float32", "factor": True, "feature_clip_norm": 1.5, "max_samples": 20,
          "cap_samples": True, "from_sample": 4, "params_version": 1, "a_field_from_the_future": [1]}],
        [("num_classes", {"backbone": "mobilenet_v2", "image_size": 64}), ("num_classes", {**_MODEL, "num_classes": 0}),
         ("backbone", {**_MODEL, "backbone": 5}), ("format", {**_MODEL, "format": "csv"}),
         ("dtype", {**_MODEL, "dtype": "float16"}), ("factor", {**_MODEL, "factor": "yes"}),
         ("fit_intercept", {**_MODEL, "fit_intercept": 1}), ("feature_clip_norm", {**_MODEL, "feature_clip_norm": -1.0}),
         ("max_samples", {**_MODEL, "max_samples": 0}), ("cap_samples", {**_MODEL, "cap_samples": True}),
         ("from_sample", {**_MODEL, "from_sample": -1}), ("weights_sha256", {**_MODEL, "weights_sha256": "xyz"}),
         ("random_features", {**_MODEL, "random_features": "x"}), ("params_version", {**_MODEL, "params_version": 2})]),
    "fedavg.head": (
        [_MODEL,
         {**_MODEL, "feature_dim": 16, "epochs": 2, "batch_size": 8, "lr": 0.05, "weight_decay": 1e-05,
          "temperature": 0.2, "seed": 7, "local_rule": "asam", "sam_rho": 0.5, "asam_eta": 0.3, "prox_mu": 0.01,
          "model_version": 3, "params_version": 1, "a_field_from_the_future": {"x": 1}}],
        [("lr", {**_MODEL, "lr": 0}), ("lr", {**_MODEL, "lr": -1.0}), ("epochs", {**_MODEL, "epochs": 0}),
         ("batch_size", {**_MODEL, "batch_size": 0}), ("temperature", {**_MODEL, "temperature": "x"}),
         ("local_rule", {**_MODEL, "local_rule": "adam"}), ("sam_rho", {**_MODEL, "local_rule": "sam", "sam_rho": 0.0}),
         ("sam_rho", {**_MODEL, "sam_rho": -1.0}), ("prox_mu", {**_MODEL, "prox_mu": 1e5}),
         ("seed", {**_MODEL, "seed": -1}), ("seed", {**_MODEL, "seed": 1.5}),
         ("model_version", {**_MODEL, "model_version": -1}), ("feature_dim", {**_MODEL, "feature_dim": 0}),
         ("image_size", {**_MODEL, "image_size": "64"}), ("params_version", {**_MODEL, "params_version": 2})]),
    "oll.personalize": (
        [_MODEL,
         {**_MODEL, "feature_dim": 16, "fallback": "global", "fp_epochs": 3, "batch_size": 32,
          "fp_lrs": [0.0001, 0.001], "fp_folds": 4, "weight_decay": 1e-05, "temperature": 0.2, "seed": 2,
          "tail_stages": 0, "personal_job": "pp-1", "fp_part": "psi", "params_version": 1,
          "a_field_from_the_future": None}],
        [("fallback", {**_MODEL, "fallback": "drop"}), ("fp_epochs", {**_MODEL, "fp_epochs": -1}),
         ("fp_lrs", {**_MODEL, "fp_epochs": 2}), ("fp_lrs", {**_MODEL, "fp_lrs": [0]}),
         ("fp_lrs", {**_MODEL, "fp_lrs": "x"}), ("fp_folds", {**_MODEL, "fp_folds": 1}),
         ("fp_folds", {**_MODEL, "fp_folds": 21}), ("tail_stages", {**_MODEL, "tail_stages": -1}),
         ("batch_size", {**_MODEL, "batch_size": 0}), ("personal_job", {**_MODEL, "personal_job": 3}),
         ("fp_part", {**_MODEL, "fp_part": "tail"}), ("params_version", {**_MODEL, "params_version": 2})]),
    "fed3r.secure": (
        [_SYNC,
         {**_MODEL, "weights_sha256": _SHA, "fit_intercept": False, "random_features": None, "format": "dense",
          "dtype": "float64", "factor": False, "feature_clip_norm": 1.0, "max_samples": 20, "cap_samples": True,
          "from_sample": 0, "group": "g-7", "dp": {**_DP, "threshold": 3, "clip_norm": 1.5}, "params_version": 1,
          "a_field_from_the_future": "x"},
         {**_SYNC, "dp": None, "format": "sparse", "dtype": "float32"}],
        [("group", {**_MODEL, "max_samples": 20}), ("group", {**_SYNC, "group": ""}), ("group", {**_SYNC, "group": 5}),
         ("group", {**_SYNC, "group": "g" * 129}), ("max_samples", {**_MODEL, "group": "g1"}),
         ("max_samples", {**_SYNC, "max_samples": None}), ("max_samples", {**_SYNC, "max_samples": 0}),
         ("max_samples", {**_SYNC, "max_samples": 1.5}), ("dp", {**_SYNC, "dp": "x"}), ("dp", {**_SYNC, "dp": [_DP]}),
         ("stddev", {**_SYNC, "dp": {"scale_bits": 16}}), ("dp.stddev", {**_SYNC, "dp": {**_DP, "stddev": -1.0}}),
         ("dp.scale_bits", {**_SYNC, "dp": {**_DP, "scale_bits": 63}}),
         ("dp.scale_bits", {**_SYNC, "dp": {**_DP, "scale_bits": 1.5}}),
         ("dp.threshold", {**_SYNC, "dp": {**_DP, "threshold": 0}}),
         ("dp.clip_norm", {**_SYNC, "dp": {**_DP, "clip_norm": 0.0}}), ("format", {**_SYNC, "format": "csv"}),
         ("params_version", {**_SYNC, "params_version": 2}), ("params_version", {**_SYNC, "params_version": "1"})]),
    "fedavg.secure": (
        [_SECURE_HEAD,
         {**_MODEL, "feature_dim": 16, "epochs": 2, "batch_size": 8, "lr": 0.05, "weight_decay": 1e-05,
          "temperature": 0.2, "seed": 7, "local_rule": "sam", "sam_rho": 0.5, "asam_eta": 0.3, "prox_mu": 0.0,
          "model_version": 3, "group": "g-2", "max_samples": 64, "max_abs_param": 20, "vector_order": ["bias", "weight"],
          "update_clip_norm": 2.0, "dp": {**_DP, "clip_norm": 1.5}, "params_version": 1,
          "a_field_from_the_future": [None]},
         {**_SECURE_HEAD, "dp": None, "update_clip_norm": None, "vector_order": ["weight"]}],
        [("group", {**_MODEL, "max_samples": 100, "max_abs_param": 50.0}), ("group", {**_SECURE_HEAD, "group": ""}),
         ("group", {**_SECURE_HEAD, "group": ["g1"]}), ("max_samples", {**_MODEL, "group": "g1", "max_abs_param": 50.0}),
         ("max_samples", {**_SECURE_HEAD, "max_samples": 0}), ("max_samples", {**_SECURE_HEAD, "max_samples": "100"}),
         ("max_samples", {**_SECURE_HEAD, "max_samples": 10**9 + 1}),
         ("max_abs_param", {**_MODEL, "group": "g1", "max_samples": 100}),
         ("max_abs_param", {**_SECURE_HEAD, "max_abs_param": 0.0}), ("max_abs_param", {**_SECURE_HEAD, "max_abs_param": -1}),
         ("max_abs_param", {**_SECURE_HEAD, "max_abs_param": None}), ("vector_order", {**_SECURE_HEAD, "vector_order": []}),
         ("vector_order", {**_SECURE_HEAD, "vector_order": ["weight", "weight"]}),
         ("vector_order", {**_SECURE_HEAD, "vector_order": "weight"}), ("vector_order", {**_SECURE_HEAD, "vector_order": [5]}),
         ("update_clip_norm", {**_SECURE_HEAD, "update_clip_norm": -1.0}),
         ("update_clip_norm", {**_SECURE_HEAD, "update_clip_norm": "x"}), ("dp", {**_SECURE_HEAD, "dp": 1}),
         ("clip_norm", {**_SECURE_HEAD, "dp": _DP}), ("dp.stddev", {**_SECURE_HEAD, "dp": {**_DP, "clip_norm": 1.0,
                                                                                            "stddev": "x"}}),
         ("dp.scale_bits", {**_SECURE_HEAD, "dp": {**_DP, "clip_norm": 1.0, "scale_bits": -1}}),
         ("dp.clip_norm", {**_SECURE_HEAD, "dp": {**_DP, "clip_norm": -1.0}}), ("lr", {**_SECURE_HEAD, "lr": 0}),
         ("params_version", {**_SECURE_HEAD, "params_version": 2})]),
}


def golden_vector(kind: str) -> dict:
    valid, invalid = CASES[kind]
    cls = TASK_PARAMS[kind]
    return {"kind": kind, "params_type": f"{cls.__module__}.{cls.__name__}",
            "valid": [{"params": p, "canonical": cls.from_params(p).to_params()} for p in valid],
            "invalid": [{"field": field, "params": p} for field, p in invalid]}


def render(kind: str) -> str:
    return json.dumps(golden_vector(kind), indent=1, sort_keys=True) + "\n"


def write(directory: Path = GOLDEN_DIR) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for kind in CASES:
        (directory / f"{kind}.json").write_text(render(kind))


if __name__ == "__main__":
    write()
