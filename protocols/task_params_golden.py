"""Golden vectors of task params: what a device of any language must accept, read the same, and
refuse (protocols/golden/task_params/<kind>.json), for the task kinds of
``protocols/payloads/task_kinds.py`` (those the Java device serves and those it only reads: a
device of any language reads every kind's params identically, even a kind it declines).

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

from .payloads.ladd import layout_digest
from .payloads.secagg import ClusterSlotLayout
from .payloads.task_kinds import TASK_PARAMS

GOLDEN_DIR = Path(__file__).resolve().parent / "golden" / "task_params"
_MODEL = {"num_classes": 3, "backbone": "mobilenet_v2", "image_size": 64}
_SHA = "ab" * 32
_WIDE = "\U0001d52a"     # one character, two UTF-16 units: text limits count characters (code points)
_DP = {"stddev": 0.5, "scale_bits": 16}
_SYNC = {**_MODEL, "group": "g1", "max_samples": 100}                         # fed3r.secure, minimal
_SECURE_HEAD = {**_MODEL, "group": "g1", "max_samples": 100, "max_abs_param": 50.0}      # fedavg.secure, minimal
_RECIPE = {"feature_dim": 16, "epochs": 2, "batch_size": 8, "lr": 0.05, "weight_decay": 1e-05, "temperature": 0.2,
           "seed": 7, "local_rule": "sgd", "sam_rho": 0.1, "asam_eta": 0.2, "prox_mu": 0.0}
_STATE = {"run": "0123abcd", "round": 1}
_STATEFUL = {**_MODEL, "job_id": "job-1", "state": _STATE}                 # scaffold.head, minimal
_FULL_STATE = {"run": "0123abcd" * 2, "round": 4, "max_staleness": 3, "ttl_s": 3600}
_DITTO = {**_STATEFUL, "ditto_lambda": 0.1, "personal_epochs": 1, "personal_lr": 0.01}
_TAIL = {**_MODEL, "tail_stages": 1, "train": "tail"}
_STATEFUL_TAIL = {**_TAIL, "job_id": "job-1", "state": _STATE}              # scaffold.tail, minimal
_SECURE = {"group": "g1", "max_samples": 100, "max_abs_param": 50.0}
_LAYOUT = [["enc.w", [4]], ["head.w", [2, 3]], ["head.\u00e9", []]]        # a non-ASCII name: the digest's escaping
_LADD = {"model": {"num_classes": 4, "image_size": 32}, "cluster": 1, "layout": _LAYOUT,
         "layout_sha256": layout_digest([(n, tuple(s)) for n, s in _LAYOUT]), "trainable": ["head.w"]}
_SLOTS = ClusterSlotLayout([("enc.w", (4,))], [("head.w", (2, 3))], (True, False))
_SECURE_LADD = {**_LADD, "group": _SLOTS.group_id(), "slots": _SLOTS.to_json(), "max_samples": 10, "max_abs_param": 100.0}


def _stateful_invalid(minimal: dict) -> list[tuple[str, dict]]:
    """What every stateful head kind refuses: the job and the state binding, malformed or missing."""
    without = lambda key: {k: v for k, v in minimal.items() if k != key}       # noqa: E731
    return [("job_id", without("job_id")), ("state", without("state")), ("job_id", {**minimal, "job_id": ""}),
            ("job_id", {**minimal, "job_id": 5}), ("job_id", {**minimal, "job_id": "j" * 129}),
            ("state", {**minimal, "state": None}), ("state", {**minimal, "state": "x"}),
            ("state", {**minimal, "state": {**_STATE, "run": "XYZ"}}), ("state", {**minimal, "state": {"run": "0123abcd"}}),
            ("state", {**minimal, "state": {**_STATE, "extra": 1}}), ("state", {**minimal, "state": {**_STATE, "round": -1}}),
            ("state", {**minimal, "state": {**_STATE, "round": True}}),
            ("state", {**minimal, "state": {**_STATE, "ttl_s": 0}}), ("state", {**minimal, "state": {**_STATE, "ttl_s": 1e9}}),
            ("state", {**minimal, "state": {**_STATE, "max_staleness": 1.5}}), ("lr", {**minimal, "lr": 0}),
            ("params_version", {**minimal, "params_version": 2})]

# kind -> (valid params, [(field refused, params)])
CASES: dict[str, tuple[list[dict], list[tuple[str, dict]]]] = {
    "fed3r.stats": (
        [_MODEL,
         {**_MODEL, "weights_sha256": _SHA, "bundle_sha256": "", "fit_intercept": False, "random_features": None,
          "format": "dense", "dtype": "float32", "factor": True, "feature_clip_norm": 1.5, "max_samples": 20,
          "cap_samples": True, "from_sample": 4, "params_version": 1, "a_field_from_the_future": [1]},
         {**_MODEL, "backbone": _WIDE * 128},
         {**_MODEL, "feature_clip_norm": 8.0, "max_samples": 1, "cap_samples": True, "cap_by_weight": True}],
        [("num_classes", {"backbone": "mobilenet_v2", "image_size": 64}), ("num_classes", {**_MODEL, "num_classes": 0}),
         ("backbone", {**_MODEL, "backbone": 5}), ("backbone", {**_MODEL, "backbone": _WIDE * 129}),
         ("format", {**_MODEL, "format": "csv"}),
         ("dtype", {**_MODEL, "dtype": "float16"}), ("factor", {**_MODEL, "factor": "yes"}),
         ("fit_intercept", {**_MODEL, "fit_intercept": 1}), ("feature_clip_norm", {**_MODEL, "feature_clip_norm": -1.0}),
         ("max_samples", {**_MODEL, "max_samples": 0}), ("cap_samples", {**_MODEL, "cap_samples": True}),
         ("cap_by_weight", {**_MODEL, "max_samples": 3, "cap_by_weight": True}),
         ("cap_by_weight", {**_MODEL, "max_samples": 3, "cap_samples": True, "cap_by_weight": "yes"}),
         ("from_sample", {**_MODEL, "from_sample": -1}), ("weights_sha256", {**_MODEL, "weights_sha256": "xyz"}),
         ("random_features", {**_MODEL, "random_features": "x"}), ("params_version", {**_MODEL, "params_version": 2})]),
    "fedavg.head": (
        [_MODEL,
         {**_MODEL, "feature_dim": 16, "epochs": 2, "batch_size": 8, "lr": 0.05, "weight_decay": 1e-05,
          "temperature": 0.2, "seed": 7, "local_rule": "asam", "sam_rho": 0.5, "asam_eta": 0.3, "prox_mu": 0.01,
          "model_version": 3, "params_version": 1, "a_field_from_the_future": {"x": 1}}],
        [("lr", {**_MODEL, "lr": 0}), ("lr", {**_MODEL, "lr": -1.0}), ("epochs", {**_MODEL, "epochs": 0}),
         ("epochs", {**_MODEL, "epochs": 10_001}), ("batch_size", {**_MODEL, "batch_size": 2 ** 30 + 1}),
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
          "a_field_from_the_future": None},
         {**_MODEL, "personal_job": _WIDE * 128}],
        [("fallback", {**_MODEL, "fallback": "drop"}), ("fp_epochs", {**_MODEL, "fp_epochs": -1}),
         ("fp_lrs", {**_MODEL, "fp_epochs": 2}), ("fp_lrs", {**_MODEL, "fp_lrs": [0]}),
         ("fp_lrs", {**_MODEL, "fp_lrs": "x"}), ("fp_folds", {**_MODEL, "fp_folds": 1}),
         ("fp_folds", {**_MODEL, "fp_folds": 21}), ("tail_stages", {**_MODEL, "tail_stages": -1}),
         ("batch_size", {**_MODEL, "batch_size": 0}), ("personal_job", {**_MODEL, "personal_job": 3}),
         ("personal_job", {**_MODEL, "personal_job": "p" * 129}),
         ("fp_part", {**_MODEL, "fp_part": "tail"}), ("params_version", {**_MODEL, "params_version": 2})]),
    "fed3r.secure": (
        [_SYNC,
         {**_MODEL, "weights_sha256": _SHA, "fit_intercept": False, "random_features": None, "format": "dense",
          "dtype": "float64", "factor": False, "feature_clip_norm": 1.0, "max_samples": 20, "cap_samples": True,
          "from_sample": 0, "group": "g-7", "dp": {**_DP, "threshold": 3, "clip_norm": 1.5}, "params_version": 1,
          "a_field_from_the_future": "x"},
         {**_SYNC, "dp": None, "format": "sparse", "dtype": "float32"}, {**_SYNC, "group": _WIDE * 128},
         {**_SYNC, "dp": _DP, "block_scales": {"a_off_diagonal": 1.4142135623730951, "b": 3.5}},
         {**_SYNC, "dp": _DP, "feature_clip_norm": 8.0, "cap_samples": True, "center_round": True},
         {**_SYNC, "dp": _DP, "feature_clip_norm": 8.0, "cap_samples": True, "cap_by_weight": True},
         {**_SYNC, "dp": _DP, "feature_clip_norm": 4.0, "centered": True, "center_round": False}],
        [("group", {**_MODEL, "max_samples": 20}), ("group", {**_SYNC, "group": ""}), ("group", {**_SYNC, "group": 5}),
         ("group", {**_SYNC, "group": "g" * 129}), ("max_samples", {**_MODEL, "group": "g1"}),
         ("max_samples", {**_SYNC, "max_samples": None}), ("max_samples", {**_SYNC, "max_samples": 0}),
         ("max_samples", {**_SYNC, "max_samples": 1.5}), ("dp", {**_SYNC, "dp": "x"}), ("dp", {**_SYNC, "dp": [_DP]}),
         ("stddev", {**_SYNC, "dp": {"scale_bits": 16}}), ("dp.stddev", {**_SYNC, "dp": {**_DP, "stddev": -1.0}}),
         ("dp.scale_bits", {**_SYNC, "dp": {**_DP, "scale_bits": 63}}),
         ("dp.scale_bits", {**_SYNC, "dp": {**_DP, "scale_bits": 1.5}}),
         ("dp.threshold", {**_SYNC, "dp": {**_DP, "threshold": 0}}),
         ("dp.clip_norm", {**_SYNC, "dp": {**_DP, "clip_norm": 0.0}}), ("format", {**_SYNC, "format": "csv"}),
         ("params_version", {**_SYNC, "params_version": 2}), ("params_version", {**_SYNC, "params_version": "1"}),
         ("block_scales", {**_SYNC, "block_scales": {"a_off_diagonal": 1.5, "b": 2.0}}),
         ("block_scales", {**_SYNC, "dp": _DP, "block_scales": [1.5, 2.0]}),
         ("block_scales.b", {**_SYNC, "dp": _DP, "block_scales": {"a_off_diagonal": 1.5, "b": 0.0}}),
         ("block_scales.a_off_diagonal", {**_SYNC, "dp": _DP, "block_scales": {"a_off_diagonal": 2.0 ** 21, "b": 1.0}}),
         ("block_scales.b", {**_SYNC, "dp": _DP, "block_scales": {"a_off_diagonal": 1.5, "b": "2"}}),
         ("center_round", {**_SYNC, "dp": _DP, "feature_clip_norm": 8.0, "center_round": 1}),
         ("center_round", {**_SYNC, "feature_clip_norm": 8.0, "center_round": True}),
         ("center_round", {**_SYNC, "dp": _DP, "center_round": True}),
         ("center_round", {**_SYNC, "dp": _DP, "feature_clip_norm": 8.0, "fit_intercept": False, "center_round": True}),
         ("center_round", {**_SYNC, "dp": _DP, "feature_clip_norm": 8.0, "centered": True, "center_round": True}),
         ("center_round", {**_SYNC, "dp": _DP, "feature_clip_norm": 8.0, "center_round": True,
                           "block_scales": {"a_off_diagonal": 1.5, "b": 2.0}})]),
    "fedavg.secure": (
        [_SECURE_HEAD,
         {**_MODEL, "feature_dim": 16, "epochs": 2, "batch_size": 8, "lr": 0.05, "weight_decay": 1e-05,
          "temperature": 0.2, "seed": 7, "local_rule": "sam", "sam_rho": 0.5, "asam_eta": 0.3, "prox_mu": 0.0,
          "model_version": 3, "group": "g-2", "max_samples": 64, "max_abs_param": 20, "vector_order": ["bias", "weight"],
          "update_clip_norm": 2.0, "dp": {**_DP, "clip_norm": 1.5}, "params_version": 1,
          "a_field_from_the_future": [None]},
         {**_SECURE_HEAD, "dp": None, "update_clip_norm": None, "vector_order": ["weight"]},
         {**_SECURE_HEAD, "vector_order": ["weight", _WIDE * 256]},
         {**_SECURE_HEAD, "dp": {**_DP, "threshold": 4, "clip_norm": 0.5, "clip_bit_scale": 1.25}}],
        [("group", {**_MODEL, "max_samples": 100, "max_abs_param": 50.0}), ("group", {**_SECURE_HEAD, "group": ""}),
         ("group", {**_SECURE_HEAD, "group": ["g1"]}), ("max_samples", {**_MODEL, "group": "g1", "max_abs_param": 50.0}),
         ("max_samples", {**_SECURE_HEAD, "max_samples": 0}), ("max_samples", {**_SECURE_HEAD, "max_samples": "100"}),
         ("max_samples", {**_SECURE_HEAD, "max_samples": 10**9 + 1}),
         ("max_abs_param", {**_MODEL, "group": "g1", "max_samples": 100}),
         ("max_abs_param", {**_SECURE_HEAD, "max_abs_param": 0.0}), ("max_abs_param", {**_SECURE_HEAD, "max_abs_param": -1}),
         ("max_abs_param", {**_SECURE_HEAD, "max_abs_param": None}), ("vector_order", {**_SECURE_HEAD, "vector_order": []}),
         ("vector_order", {**_SECURE_HEAD, "vector_order": ["weight", "weight"]}),
         ("vector_order", {**_SECURE_HEAD, "vector_order": "weight"}), ("vector_order", {**_SECURE_HEAD, "vector_order": [5]}),
         ("vector_order", {**_SECURE_HEAD, "vector_order": ["weight", _WIDE * 257]}),
         ("update_clip_norm", {**_SECURE_HEAD, "update_clip_norm": -1.0}),
         ("update_clip_norm", {**_SECURE_HEAD, "update_clip_norm": "x"}), ("dp", {**_SECURE_HEAD, "dp": 1}),
         ("clip_norm", {**_SECURE_HEAD, "dp": _DP}), ("dp.stddev", {**_SECURE_HEAD, "dp": {**_DP, "clip_norm": 1.0,
                                                                                            "stddev": "x"}}),
         ("dp.scale_bits", {**_SECURE_HEAD, "dp": {**_DP, "clip_norm": 1.0, "scale_bits": -1}}),
         ("dp.clip_norm", {**_SECURE_HEAD, "dp": {**_DP, "clip_norm": -1.0}}), ("lr", {**_SECURE_HEAD, "lr": 0}),
         ("dp.clip_bit_scale", {**_SECURE_HEAD, "dp": {**_DP, "clip_norm": 1.0, "clip_bit_scale": 0.0}}),
         ("dp.clip_bit_scale", {**_SECURE_HEAD, "dp": {**_DP, "clip_norm": 1.0, "clip_bit_scale": "1"}}),
         ("dp.clip_bit_scale", {**_SECURE_HEAD, "dp": {**_DP, "clip_bit_scale": 1.0}}),
         ("params_version", {**_SECURE_HEAD, "params_version": 2})]),
    "fedavg.tail": (
        [_TAIL, {**_TAIL, **_RECIPE, "tail_stages": 64, "train": "tail+head", "model_version": 2, "params_version": 1,
                 "a_field_from_the_future": 1}],
        [("tail_stages", {**_MODEL, "train": "tail"}), ("train", {**_MODEL, "tail_stages": 1}),
         ("tail_stages", {**_TAIL, "tail_stages": 0}), ("tail_stages", {**_TAIL, "tail_stages": 65}),
         ("tail_stages", {**_TAIL, "tail_stages": "1"}), ("train", {**_TAIL, "train": "head"}),
         ("train", {**_TAIL, "train": 1}), ("epochs", {**_TAIL, "epochs": 0}),
         ("params_version", {**_TAIL, "params_version": 2})]),
    "scaffold.head": (
        [_STATEFUL, {**_STATEFUL, **_RECIPE, "state": _FULL_STATE, "model_version": 1, "params_version": 1,
                     "a_field_from_the_future": {}},
         {**_STATEFUL, "job_id": _WIDE * 128}],
        _stateful_invalid(_STATEFUL)),
    "scaffold.tail": (
        [_STATEFUL_TAIL, {**_STATEFUL_TAIL, **_RECIPE, "train": "tail+head", "tail_stages": 64, "state": _FULL_STATE,
                          "params_version": 1, "a_field_from_the_future": {}}],
        _stateful_invalid(_STATEFUL_TAIL) + [
            ("tail_stages", {k: v for k, v in _STATEFUL_TAIL.items() if k != "tail_stages"}),
            ("train", {k: v for k, v in _STATEFUL_TAIL.items() if k != "train"}),
            ("tail_stages", {**_STATEFUL_TAIL, "tail_stages": 0}), ("train", {**_STATEFUL_TAIL, "train": "head"})]),
    "ditto.head": (
        [_DITTO, {**_DITTO, **_RECIPE, "local_rule": "asam", "sam_rho": 0.5, "state": _FULL_STATE, "ditto_lambda": 2,
                  "personal_epochs": 10000, "personal_lr": 100, "a_field_from_the_future": "x"}],
        _stateful_invalid(_DITTO) + [
            ("ditto_lambda", {k: v for k, v in _DITTO.items() if k != "ditto_lambda"}),
            ("personal_epochs", {k: v for k, v in _DITTO.items() if k != "personal_epochs"}),
            ("personal_lr", {k: v for k, v in _DITTO.items() if k != "personal_lr"}),
            ("ditto_lambda", {**_DITTO, "ditto_lambda": 0}), ("ditto_lambda", {**_DITTO, "ditto_lambda": 1e4 + 1}),
            ("ditto_lambda", {**_DITTO, "ditto_lambda": None}), ("ditto_lambda", {**_DITTO, "ditto_lambda": True}),
            ("personal_epochs", {**_DITTO, "personal_epochs": 0}), ("personal_epochs", {**_DITTO, "personal_epochs": 1.0}),
            ("personal_epochs", {**_DITTO, "personal_epochs": 10001}), ("personal_lr", {**_DITTO, "personal_lr": -0.1}),
            ("personal_lr", {**_DITTO, "personal_lr": 101}), ("personal_lr", {**_DITTO, "personal_lr": "0.1"})]),
    "pp.head": (
        [_STATEFUL, {**_STATEFUL, **_RECIPE, "state": _FULL_STATE, "algorithm": "fedsim", "personal_epochs": 0,
                     "a_field_from_the_future": None},
         {**_STATEFUL, "algorithm": "fedalt", "personal_epochs": 10000, "epochs": 10000, "batch_size": 10000}],
        _stateful_invalid(_STATEFUL) + [
            ("algorithm", {**_STATEFUL, "algorithm": "ditto"}), ("algorithm", {**_STATEFUL, "algorithm": 1}),
            ("personal_epochs", {**_STATEFUL, "personal_epochs": -1}),
            ("personal_epochs", {**_STATEFUL, "personal_epochs": 10001}),
            ("personal_epochs", {**_STATEFUL, "personal_epochs": "1"}), ("epochs", {**_STATEFUL, "epochs": 10001}),
            ("batch_size", {**_STATEFUL, "batch_size": 10001})]),
    "fedgloss.head": (
        [{**_STATEFUL, "admm_beta": 10.0}, {**_STATEFUL, **_RECIPE, "state": _FULL_STATE, "admm_beta": 1000000,
                                            "a_field_from_the_future": []}],
        _stateful_invalid({**_STATEFUL, "admm_beta": 10.0}) + [
            ("admm_beta", _STATEFUL), ("admm_beta", {**_STATEFUL, "admm_beta": 0.0}),
            ("admm_beta", {**_STATEFUL, "admm_beta": 1e6 + 1}), ("admm_beta", {**_STATEFUL, "admm_beta": "10"}),
            ("admm_beta", {**_STATEFUL, "admm_beta": None})]),
    "ladd.style": (
        [{"b": 0, "image_size": 16}, {"b": 8, "image_size": 1024, "params_version": 1, "a_field_from_the_future": 1}],
        [("b", {"image_size": 64}), ("image_size", {"b": 1}), ("b", {"b": -1, "image_size": 64}),
         ("b", {"b": 9, "image_size": 64}), ("b", {"b": 1.0, "image_size": 64}), ("image_size", {"b": 1, "image_size": 15}),
         ("image_size", {"b": 1, "image_size": 1025}), ("image_size", {"b": 1, "image_size": "64"}),
         ("params_version", {"b": 1, "image_size": 64, "params_version": 2})]),
    "fedavg.tail.secure": (
        [{**_TAIL, **_SECURE}, {**_TAIL, **_RECIPE, **_SECURE, "train": "tail+head", "vector_order": ["tail.a", "weight"],
                                "update_clip_norm": 1.0, "dp": {**_DP, "clip_norm": 2.0}, "a_field_from_the_future": 0}],
        [("group", _TAIL), ("group", {**_TAIL, **_SECURE, "group": ""}), ("max_samples", {**_TAIL, **_SECURE, "max_samples": 0}),
         ("max_abs_param", {**_TAIL, **_SECURE, "max_abs_param": 0}), ("vector_order", {**_TAIL, **_SECURE, "vector_order": []}),
         ("clip_norm", {**_TAIL, **_SECURE, "dp": _DP}), ("tail_stages", {**_MODEL, **_SECURE, "train": "tail"}),
         ("train", {**_TAIL, **_SECURE, "train": "all"}), ("params_version", {**_TAIL, **_SECURE, "params_version": 2})]),
    "pp.head.secure": (
        [{**_STATEFUL, **_SECURE}, {**_STATEFUL, **_RECIPE, **_SECURE, "state": _FULL_STATE, "algorithm": "fedsim",
                                    "personal_epochs": 3, "vector_order": ["weight"], "dp": {**_DP, "clip_norm": 1.0},
                                    "a_field_from_the_future": 0}],
        [("group", _STATEFUL), ("group", {**_STATEFUL, **_SECURE, "group": 7}),
         ("max_samples", {**_STATEFUL, **_SECURE, "max_samples": -1}),
         ("max_abs_param", {**_STATEFUL, **_SECURE, "max_abs_param": None}),
         ("vector_order", {**_STATEFUL, **_SECURE, "vector_order": ["weight", "weight"]}),
         ("job_id", {**_MODEL, **_SECURE, "state": _STATE}), ("state", {**_STATEFUL, **_SECURE, "state": {"round": 1}}),
         ("algorithm", {**_STATEFUL, **_SECURE, "algorithm": "fedavg"}),
         ("params_version", {**_STATEFUL, **_SECURE, "params_version": 2})]),
    "scaffold.head.secure": (
        [{**_STATEFUL, **_SECURE, "control_clip_norm": 5.0},
         {**_STATEFUL, **_RECIPE, **_SECURE, "state": _FULL_STATE, "control_clip_norm": 2, "vector_order": ["bias", "weight"],
          "update_clip_norm": 1.0, "a_field_from_the_future": 0}],
        [("control_clip_norm", {**_STATEFUL, **_SECURE}), ("control_clip_norm", {**_STATEFUL, **_SECURE, "control_clip_norm": 0}),
         ("control_clip_norm", {**_STATEFUL, **_SECURE, "control_clip_norm": -1.0}),
         ("control_clip_norm", {**_STATEFUL, **_SECURE, "control_clip_norm": "5"}),
         ("dp", {**_STATEFUL, **_SECURE, "control_clip_norm": 5.0, "dp": {**_DP, "clip_norm": 1.0}}),
         ("group", {**_STATEFUL, "control_clip_norm": 5.0}),
         ("max_abs_param", {**_STATEFUL, **_SECURE, "control_clip_norm": 5.0, "max_abs_param": 0}),
         ("vector_order", {**_STATEFUL, **_SECURE, "control_clip_norm": 5.0, "vector_order": []}),
         ("job_id", {**_MODEL, **_SECURE, "control_clip_norm": 5.0, "state": _STATE}),
         ("state", {**_STATEFUL, **_SECURE, "control_clip_norm": 5.0, "state": {"round": 1}}),
         ("params_version", {**_STATEFUL, **_SECURE, "control_clip_norm": 5.0, "params_version": 2})]),
    "ditto.head.secure": (
        [{**_DITTO, **_SECURE}, {**_DITTO, **_RECIPE, **_SECURE, "state": _FULL_STATE, "ditto_lambda": 2,
                                 "dp": {**_DP, "clip_norm": 1.0}, "a_field_from_the_future": 0}],
        [("group", _DITTO), ("group", {**_DITTO, **_SECURE, "group": ""}),
         ("max_samples", {**_DITTO, **_SECURE, "max_samples": 0}),
         ("max_abs_param", {**_DITTO, **_SECURE, "max_abs_param": -1.0}),
         ("vector_order", {**_DITTO, **_SECURE, "vector_order": ["weight", "weight"]}),
         ("clip_norm", {**_DITTO, **_SECURE, "dp": _DP}),
         ("ditto_lambda", {**_STATEFUL, **_SECURE, "personal_epochs": 1, "personal_lr": 0.01}),
         ("personal_lr", {**_DITTO, **_SECURE, "personal_lr": 0}),
         ("job_id", {**_DITTO, **_SECURE, "job_id": ""}),
         ("params_version", {**_DITTO, **_SECURE, "params_version": 2})]),
    "ladd.train": (
        [_LADD, {**_LADD, "teacher": "tensor", "weights_sha256": _SHA, "kd_sha256": "", "epochs": 10000, "batch_size": 1,
                 "lr": 10, "momentum": 0.0, "kd_lambda": 1e4, "kd_alpha": 100, "pseudo_quantile": 1, "pseudo_cap": 1.0,
                 "seed": -3, "local_rule": "sam", "sam_rho": 0.05, "asam_eta": 0.2, "prox_mu": 0.1, "params_version": 1,
                 "a_field_from_the_future": 1},
         {**_LADD, "trainable": [_WIDE * 256]}],
        [*[(key, {k: v for k, v in _LADD.items() if k != key}) for key in _LADD],
         ("model", {**_LADD, "model": [1]}), ("cluster", {**_LADD, "cluster": 1001}), ("cluster", {**_LADD, "cluster": -1}),
         ("layout", {**_LADD, "layout": []}), ("layout", {**_LADD, "layout": [["a", [2]], ["a", [3]]]}),
         ("layout", {**_LADD, "layout": [["a", [-2]]]}), ("layout", {**_LADD, "layout": [["a", [2.0]]]}),
         ("layout", {**_LADD, "layout": [["a", [10**8]]]}), ("layout", {**_LADD, "layout": "x"}),
         ("layout_sha256", {**_LADD, "layout_sha256": "0" * 64}), ("layout_sha256", {**_LADD, "layout": [["enc.w", [5]]]}),
         ("trainable", {**_LADD, "trainable": []}), ("trainable", {**_LADD, "trainable": "head.w"}),
         ("trainable", {**_LADD, "trainable": [3]}), ("trainable", {**_LADD, "trainable": [_WIDE * 257]}),
         ("teacher", {**_LADD, "teacher": "both"}),
         ("weights_sha256", {**_LADD, "weights_sha256": "AB" * 32}), ("kd_sha256", {**_LADD, "kd_sha256": 5}),
         ("epochs", {**_LADD, "epochs": 10001}), ("batch_size", {**_LADD, "batch_size": 0}), ("lr", {**_LADD, "lr": 0}),
         ("lr", {**_LADD, "lr": 10.5}), ("momentum", {**_LADD, "momentum": 1.0}), ("momentum", {**_LADD, "momentum": -0.1}),
         ("kd_lambda", {**_LADD, "kd_lambda": 1e4 + 1}), ("kd_alpha", {**_LADD, "kd_alpha": 0}),
         ("pseudo_quantile", {**_LADD, "pseudo_quantile": 1.5}), ("pseudo_cap", {**_LADD, "pseudo_cap": 0.0}),
         ("seed", {**_LADD, "seed": 1.5}), ("local_rule", {**_LADD, "local_rule": "adam"}),
         ("prox_mu", {**_LADD, "prox_mu": 1e5}), ("params_version", {**_LADD, "params_version": 2})]),
    "ladd.train.secure": (
        [_SECURE_LADD, {**_SECURE_LADD, "dp": {**_DP, "clip_norm": 1.0}, "teacher": "tensor", "a_field_from_the_future": 1}],
        [("group", {k: v for k, v in _SECURE_LADD.items() if k != "group"}),
         ("slots", {k: v for k, v in _SECURE_LADD.items() if k != "slots"}),
         ("max_samples", {k: v for k, v in _SECURE_LADD.items() if k != "max_samples"}),
         ("max_abs_param", {k: v for k, v in _SECURE_LADD.items() if k != "max_abs_param"}),
         ("group", {**_SECURE_LADD, "group": "g1"}), ("group", {**_SECURE_LADD, "group": ""}),
         ("slots", {**_SECURE_LADD, "slots": {**_SLOTS.to_json(), "extra": []}}),
         ("slots", {**_SECURE_LADD, "slots": {**_SLOTS.to_json(), "enabled": [1]}}),
         ("slots", {**_SECURE_LADD, "slots": {**_SLOTS.to_json(), "enabled": []}}),
         ("slots", {**_SECURE_LADD, "slots": {**_SLOTS.to_json(), "slot": [["enc.w", [4]]]}}),
         ("slots", {**_SECURE_LADD, "slots": {"global": [], "slot": [], "enabled": [True]}}),
         ("slots", {**_SECURE_LADD, "slots": {**_SLOTS.to_json(), "global": [["x", ["4"]]]}}),
         ("slots", {**_SECURE_LADD, "slots": {**_SLOTS.to_json(), "slot": [["h", [40_000_000]]], "enabled": [True] * 4}}),
         ("max_samples", {**_SECURE_LADD, "max_samples": 0}), ("max_abs_param", {**_SECURE_LADD, "max_abs_param": 0.0}),
         ("dp.stddev", {**_SECURE_LADD, "dp": {**_DP, "stddev": -1.0}}), ("layout_sha256", {**_SECURE_LADD, "layout_sha256": ""}),
         ("params_version", {**_SECURE_LADD, "params_version": 2})]),
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
