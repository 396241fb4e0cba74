"""The secure kinds of the differential fuzzer (tests/test_differential_fuzz.py, whose module
docstring says what is compared and why the masked words are out of scope): ``fedavg.secure``
and ``fed3r.secure`` cases (plain fedavg.head / fed3r.stats cases plus the secure round's
fields, distributed DP in a quarter, block scales in most of those, a third of them the feature
center's round (``center_round``), a random round config to encode under),
``scaffold.head.secure`` and ``ditto.head.secure`` cases (round 1 of a stateful case on a fresh
store, plus the same fields and Scaffold's control_clip_norm), and the comparison of the three
devices' contributions and fixed-point words (``compare``).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from test_differential_fuzz import DEVICES, EPS32, fed3r_case, fedavg_case, head_tolerance, stats_tolerance

MEMBERS = ("java0", "numpy0", "py0")
STATEFUL = {"scaffold.head.secure": "scaffold.head", "ditto.head.secure": "ditto.head"}     # secure -> plain kind


def secure_round(rng, length: int, largest: float, scale_bits: int | None = None) -> dict:
    """The round config the contribution is encoded under (its to_dict, as the device receives it):
    the bound drawn around ``largest`` (what the vector may hold), so some vectors fall outside it;
    some of a wrong vector length; scale_bits the finest safe one, or the dp round's."""
    from protocols.secagg import RoundConfig
    from protocols.secagg.fixedpoint import max_scale_bits

    bound = float(min(largest * 2.0 ** rng.uniform(-3, 6), 2.0 ** 50)) if rng.random() < 0.9 \
        else float(2.0 ** rng.integers(-4, 20))
    finest = max_scale_bits(len(MEMBERS), bound)
    bits = finest if scale_bits is None or rng.random() < 0.2 else min(scale_bits, finest)
    return RoundConfig.create(job_id="fuzz", round_id=1, group_id="g1", aggregator_id="aggregator", members=MEMBERS,
                              vector_length=length + (1 if rng.random() < 0.03 else 0), bound=bound,
                              scale_bits=bits).to_dict()


def dp_round(rng, clip: bool) -> dict:
    """A distributed-DP round: stddev·2^scale_bits from far below to past what a Poisson can draw."""
    dp = {"stddev": float(2.0 ** rng.integers(-24, 8)) if rng.random() < 0.5 else float(10 ** rng.uniform(-4, 2)),
          "scale_bits": int(rng.integers(0, 63)) if rng.random() < 0.2 else int(rng.integers(8, 30))}
    if clip and rng.random() < 0.95:          # some without the clip norm a secure update round needs: declined
        dp["clip_norm"] = float(2.0 ** rng.integers(-6, 4)) if rng.random() < 0.5 else float(rng.uniform(0.05, 5))
    return dp


def secure_fedavg_case(rng):
    params, start, (Z, y), _ = fedavg_case(rng)
    n = len(y)
    params.update(group="g1", max_samples=int(n if rng.random() < 0.3 else rng.integers(n // 2, 4 * n)),
                  max_abs_param=float(2.0 ** rng.integers(-1, 12)) if rng.random() < 0.5 else float(10 ** rng.uniform(-0.5, 3)))
    order = rng.random()
    if order < 0.15:
        params["vector_order"] = ["bias", "weight"]
    elif order < 0.18:
        params["vector_order"] = [["weight"], ["weight", "bias", "extra"], ["weight", "weight"]][int(rng.integers(0, 3))]
    if rng.random() < 0.4:
        params["update_clip_norm"] = 0.0 if rng.random() < 0.1 else (
            float(2.0 ** rng.integers(-24, 4)) if rng.random() < 0.4 else float(rng.uniform(0.01, 3)))
    dp = dp_round(rng, clip=True) if rng.random() < 0.25 else None
    if dp:
        params["dp"] = dp
    C, d = start["weight"].shape
    largest = (max(dp.get("clip_norm", 1.0), 2.0 ** -dp["scale_bits"]) if dp
               else n * max(1.0, float(np.abs(start["weight"]).max())))
    return params, start, (Z, y), secure_round(rng, C * d + C + 1, largest, dp and dp["scale_bits"])


def secure_stateful_case(kind: str):
    """Cases of ``scaffold.head.secure`` / ``ditto.head.secure``: round 1 of a stateful case
    (tests/fuzz_stateful.py: its params, tensors and data, on a fresh store) plus the secure
    round's fields as ``fedavg.secure``'s, Scaffold's ``control_clip_norm`` (from one that clips
    every Δc to one that clips none; a few refused), Ditto's distributed DP in a quarter. The case's
    last part is (round config, held-out split)."""
    import fuzz_stateful

    plain = STATEFUL[kind]

    def make(rng):
        case = fuzz_stateful.draw(rng, plain, int(rng.integers(0, 2**31)))
        params, tensors = case.rounds[0]
        (Z, y), n = case.data, len(case.data[1])
        params = {**params, "group": "g1", "max_samples": int(n if rng.random() < 0.3 else rng.integers(n // 2, 4 * n)),
                  "max_abs_param": float(2.0 ** rng.integers(-1, 12)) if rng.random() < 0.5 else float(10 ** rng.uniform(-0.5, 3))}
        if rng.random() < 0.15:
            params["vector_order"] = ["bias", "weight"] if rng.random() < 0.8 else ["weight"]
        if rng.random() < 0.3:
            params["update_clip_norm"] = float(2.0 ** rng.integers(-20, 4)) if rng.random() < 0.5 else float(rng.uniform(0.01, 3))
        dp = None
        if plain == "scaffold.head":
            params["control_clip_norm"] = (0.0 if rng.random() < 0.03 else float(2.0 ** rng.integers(-24, 12))
                                           if rng.random() < 0.5 else float(10 ** rng.uniform(-3, 3)))
        elif rng.random() < 0.25:
            dp = params["dp"] = dp_round(rng, clip=True)
        C, d = params["num_classes"], params["feature_dim"]
        size = C * d + C
        largest = (max(dp.get("clip_norm", 1.0), 2.0 ** -dp["scale_bits"]) if dp
                   else n * max(1.0, float(np.abs(tensors["weight"]).max()), params.get("control_clip_norm", 0.0)))
        length = (2 * size if plain == "scaffold.head" else size) + 1
        return params, tensors, (Z, y), (secure_round(rng, length, largest, dp and dp["scale_bits"]), case.held)
    return make


def secure_fed3r_case(rng):
    params, tensors, (Z, y), _ = fed3r_case(rng)
    n, (C, p) = len(y), (params["num_classes"], Z.shape[1] + int(params["fit_intercept"]))
    params.update(group="g1", max_samples=int(n if rng.random() < 0.3 else rng.integers(n // 2, 4 * n)))
    dp = dp_round(rng, clip=False) if rng.random() < 0.25 else None
    if dp:
        params["dp"] = dp
        if rng.random() < 0.8:               # DP's Fed3R clips and caps (some do not: what do the devices say?)
            params.update(feature_clip_norm=params.get("feature_clip_norm") or float(rng.uniform(0.5, 4.0)),
                          cap_samples=True)
    if rng.random() < (0.6 if dp else 0.05):   # the blocks scaled before the noise (ssp); bad ones, or no dp: declined
        scales = {"a_off_diagonal": math.sqrt(2.0), "b": float(2.0 ** rng.uniform(-3, 5))}
        if rng.random() < 0.15:
            scales[("a_off_diagonal", "b")[int(rng.integers(0, 2))]] = (0.0, -1.0, 2.0 ** 21, "x", None)[
                int(rng.integers(0, 5))]
        params["block_scales"] = scales
    length = p * (p + 1) // 2 + C * p + 1
    if rng.random() < (0.35 if dp else 0.03):  # the feature center's round: (Σ z, n); without dp, scales, a clip,
        params["center_round"] = True          # the intercept, or with a center, declined
        length = p
        if rng.random() < 0.8:
            params.pop("block_scales", None)
            params.pop("centered", None)
            tensors = {}
    largest = n * max(1.0, float(np.abs(Z).max()) ** 2)
    return params, tensors, (Z, y), secure_round(rng, length, largest, dp and dp["scale_bits"])


def stateful_tolerance(kind: str, case: tuple, vectors: dict[str, np.ndarray]) -> float:
    """scaffold.head.secure / ditto.head.secure: per entry, the uploaded head's tolerance as
    fedavg.secure's (Ditto's global pass is fedavg.head's; Scaffold's steps carry the control
    correction, ``head_tolerance``'s ``correction``) and, for Scaffold, the Δc's: y's difference
    divided by K·lr plus four float32 roundings of the largest control (tests/fuzz_stateful.py
    ``tolerances``, one round), the clip non-expansive (√L·tol)."""
    from fuzz_stateful import largest

    params, start, (Z, y), _ = case
    ref = vectors["python"]
    C, d = params["num_classes"], params["feature_dim"]
    size, order = C * d + C, params.get("vector_order", ["weight", "bias"])
    n = 1.0 if params.get("dp") else max(float(ref[-1]), 1.0)
    heads = []
    for v in vectors.values():
        flat = v[:size] / n
        first = C * d if order[0] == "weight" else C
        parts = {order[0]: flat[:first], order[1]: flat[first:]}
        heads.append({"weight": parts["weight"].reshape(C, d) + (start["weight"] if params.get("dp") else 0),
                      "bias": parts["bias"] + (start["bias"] if params.get("dp") else 0)})
    K = params["epochs"] * -(-len(y) // params["batch_size"])
    head = {k: start[k] for k in ("weight", "bias")}
    if kind == "ditto.head.secure":
        return n * math.sqrt(ref.size) * head_tolerance(params, head, Z, K, params["batch_size"], *heads)
    controls = [v for k, v in start.items() if k.startswith("control.")] + [v[size:-1] for v in vectors.values()]
    c_max = 3 * largest(controls + [h[k] for h in heads for k in h])
    moved = head_tolerance(params, head, Z, K, params["batch_size"], *heads, correction=2 * c_max)
    delta = moved / (K * float(np.float32(params["lr"]))) + 4 * EPS32 * c_max
    return math.sqrt(ref.size) * max(n * moved, delta)


def tolerance(kind: str, case: tuple, steps: int, vectors: dict[str, np.ndarray]) -> float:
    """How far two devices' contributions of one secure case may lie apart, per entry. fed3r.secure:
    exact (0) on dyadic features without clipping, else the statistics' float64 tolerance.
    fedavg.secure: the head's (``head_tolerance``) through what the device does to its head, each
    step non-expansive: the clip (a projection: ‖Δ‖₂ ≤ √L·tol), the weighting by n."""
    if kind in STATEFUL:
        return stateful_tolerance(kind, case, vectors)
    params, start, (Z, _), _ = case
    ref = vectors["python"]
    if kind == "fed3r.secure":
        dyadic = float(np.abs(Z * 4 - np.rint(Z * 4)).max()) == 0.0
        return 0.0 if dyadic and not params.get("feature_clip_norm") else stats_tolerance(ref, "float64")
    C, d = start["weight"].shape
    order = params.get("vector_order", ["weight", "bias"])
    n = 1.0 if params.get("dp") else float(ref[-1])
    heads = []
    for v in vectors.values():        # each device's head back from its vector (its update where under dp)
        flat = v[:-1] / max(n, 1.0)
        first = C * d if order[0] == "weight" else C
        parts = {order[0]: flat[:first], order[1]: flat[first:]}
        heads.append({"weight": parts["weight"].reshape(C, d) + (start["weight"] if params.get("dp") else 0),
                      "bias": parts["bias"] + (start["bias"] if params.get("dp") else 0)})
    return n * math.sqrt(ref.size) * head_tolerance(params, start, Z, steps, params["batch_size"], *heads)


def compare(kind: str, case: tuple, got: dict[str, dict], report: dict) -> None:
    """The contributions (float64 vectors) and the words SecAgg masks (uint64) of the three devices:
    byte-identical where the arithmetic is exact, else within ``tolerance`` (the words within
    it at the round's scale, plus one for rint; under dp the vectors also one grid step)."""
    config = case[3]
    vectors = {d: np.frombuffer(Path(got[d]["result"] + ".vector").read_bytes(), "<f8") for d in DEVICES}
    words = {d: np.frombuffer(Path(got[d]["result"]).read_bytes(), "<u8").view(np.int64) for d in DEVICES}
    tol = tolerance(kind, case, got["java"].get("steps", 0), vectors)
    grid = 2.0 ** -case[0]["dp"]["scale_bits"] if case[0].get("dp") else 0.0
    report["exact"] = tol == 0.0
    report["identical"] = len({words[d].tobytes() for d in DEVICES}) == 1
    for d in ("numpy", "java"):
        if vectors[d].shape != vectors["python"].shape or words[d].shape != words["python"].shape:
            report["failures"].append((d, "length", vectors[d].shape, vectors["python"].shape))
            continue
        if tol == 0.0:
            if vectors[d].tobytes() != vectors["python"].tobytes() or words[d].tobytes() != words["python"].tobytes():
                report["failures"].append((d, "bytes differ", vectors[d][:4], vectors["python"][:4]))
            continue
        diff = float(np.abs(vectors[d] - vectors["python"]).max())
        steps = float(np.abs(words[d] - words["python"]).max())
        report["worst"] = max(report["worst"], diff / (tol + grid))
        if diff > tol + grid or steps > (tol + grid) * 2.0 ** config["scale_bits"] + 1:
            report["failures"].append((d, "differs by", diff, steps, "tolerance", tol + grid))
        if vectors[d][-1] != vectors["python"][-1]:           # the count (n, 1 or 0) is exact
            report["failures"].append((d, "count", vectors[d][-1], vectors["python"][-1]))


def near_range_edge(case: tuple, got: dict[str, dict]) -> bool:
    """Whether one device's vector, encoded or not, lies within rounding of the round's bound (the
    statuses done and out_of_range may then differ): a head's float32 rounding, scaled by n."""
    for d in DEVICES:
        path = Path(got[d].get("result", "") + ".vector")
        if got[d]["status"] in ("done", "out_of_range") and path.is_file():
            largest = float(np.abs(np.frombuffer(path.read_bytes(), "<f8")).max())
            if abs(largest - case[3]["bound"]) <= 1e-3 * case[3]["bound"]:
                return True
    return False


CASES = {"fedavg.secure": secure_fedavg_case, "fed3r.secure": secure_fed3r_case,
         **{kind: secure_stateful_case(kind) for kind in STATEFUL}}
