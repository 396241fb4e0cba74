"""The stateful head kinds of the differential fuzzer (tests/test_differential_fuzz.py):
``scaffold.head`` (control c_k kept), ``ditto.head`` (personal head v_k kept) and ``pp.head``
(FedSim/FedAlt: personal bias v_k kept), through the three devices (all three run them: the
stateful head tasks step with numpy on every device, torch or not, and the state store is numpy).

A case is two rounds of one job on one device state store per device: round 1 creates (or
continues) the state, round 2 reads it. Round 2's task is the next round, a jump of rounds (past
``max_staleness`` or not), the same task again (a redelivery: the same upload, byte for byte), an
earlier round (state written at a later round: not continued) or another run of the job (state
dropped). Before round 1 the store may already hold a file, written by the Python store and copied
into each device's folder (the Java device reads the Python store's format): a valid state to
continue (or one written at a later round, or too stale), or one every device must drop alike (torn,
garbage, another run's, another job's under this job's name, wrong shapes, float64, non-finite,
expired, no header, a header whose fields have the wrong JSON types). A few cases have a state
budget too small for the job (declined alike, nothing kept).

Compared per case, against the torch-free device (``REFERENCE``): both rounds' accept/decline,
bodies (``restarted``, also against what the binding rules predict; the held-out counts unless a
sample lies within rounding of a decision boundary) and uploads (``compare_round``, the tolerance
below), and the state files each store leaves (``compare_states``): the same file names, the same header (job, run,
round; ``expires_at`` within the run's duration), the same arrays (dtype, shape, values within the
tolerance, equal values in equal bytes), every file opened here with numpy (so the Python store
reads what the Java store writes).

Tolerances (``tolerances``), from ``head_tolerance`` (tests/test_differential_fuzz.py, where the
prox and control terms are derived): Scaffold's c_k⁺ = c_k − c + (w − y)/(K lr) carries y's
difference scaled by 1/(K lr) plus four float32 roundings of values ≤ the largest control; round 2
starts from round 1's c_k, which moves each of its K steps by lr times c_k's difference. Ditto's
upload is one round's global pass from the task's head; its v_k both rounds' personal passes at
``personal_lr`` with μ = λ. FedSim/FedAlt: both rounds' steps (round 2's u depends on round 1's v_k).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from test_differential_fuzz import BASE, EPS32, features, head, head_tolerance, rate

KINDS = ("scaffold.head", "ditto.head", "pp.head")
# The reference: every case runs on the torch-free device and the Java device. The full install's
# Python device runs these kinds through the very same code (the numpy step and store; the same
# numpy in both environments), so it takes one case in FULL_DEVICE_EVERY: 200 per kind prove it
# takes that path, at a fifth of its cost (each case is two tasks, each reading and writing its state).
REFERENCE = "numpy"
FULL_DEVICE_EVERY = 5
HEADER = "__state_header__"
# what the store holds before round 1 (None: nothing), with its weight in the draw
SEEDS = {None: 40, "valid": 20, "later round": 3, "stale": 3, "torn": 5, "garbage": 3, "other run": 4,
         "other job": 4, "wrong shape": 3, "float64": 3, "nonfinite": 3, "expired": 3, "no header": 2,
         "loose header": 4}
ROUND2 = {"next": 45, "jump": 20, "redelivery": 15, "earlier": 8, "other run": 12}


@dataclass
class StatefulCase:
    kind: str
    rounds: list[tuple[dict, dict]]                 # (params, tensors) of round 1 and round 2
    data: tuple[np.ndarray, np.ndarray]
    held: tuple[np.ndarray, np.ndarray] | None
    round2: str
    seeded: str | None = None
    seed_arrays: dict[str, np.ndarray] = field(default_factory=dict)
    seed_binding: tuple[str, int] = ("", 0)         # the seeded file's (run, round)
    budget: int | None = None

    @property
    def params(self) -> dict:
        return self.rounds[0][0]


def pick(rng, weights: dict):
    keys = list(weights)
    p = np.array(list(weights.values()), float)
    return keys[rng.choice(len(keys), p=p / p.sum())]


def run_id(rng) -> str:
    return f"{int(rng.integers(2**32, 2**40)):x}"


def state_shapes(kind: str, C: int, d: int) -> dict[str, tuple[int, ...]]:
    return {"bias": (C,)} if kind == "pp.head" else {"weight": (C, d), "bias": (C,)}


def round_tensors(rng, kind: str, start: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A round's task tensors: the global head (moved a little from ``start``) and Scaffold's c."""
    tensors = {k: (v + rng.normal(size=v.shape) * 0.05).astype(np.float32) for k, v in start.items()}
    if kind == "scaffold.head":
        tensors.update({f"control.{k}": (rng.normal(size=v.shape) * 0.3).astype(np.float32) for k, v in start.items()})
    return tensors


def kind_params(rng, kind: str) -> dict:
    if kind == "ditto.head":
        lam = float(10 ** rng.uniform(2, 4)) if rng.random() < 0.04 else rate(rng) if rng.random() < 0.5 \
            else float(10 ** rng.uniform(-3, 1))
        return {"ditto_lambda": lam, "personal_epochs": int(rng.integers(1, 3)),
                "personal_lr": float(10 ** rng.uniform(1, 2)) if rng.random() < 0.03 else rate(rng)}
    if kind == "pp.head":
        return {"algorithm": str(rng.choice(["fedsim", "fedalt"])), "personal_epochs": int(rng.integers(0, 3))}
    return {}


def draw(rng, kind: str, index: int) -> StatefulCase:
    C, d = int(rng.integers(2, 5)), int(rng.integers(2, 7))
    Z, y = features(rng, int(rng.integers(C, 20)), d, C)
    # some diverge: to a head past 2^20, to NaN, or to float32 logits that overflow
    lr = float(10 ** rng.uniform(3, 38)) if rng.random() < 0.05 else rate(rng)
    binding = {"run": run_id(rng), "round": int(rng.integers(1, 6)), "max_staleness": int(rng.integers(0, 4)),
               "ttl_s": float(rng.choice([3600.0, 2.0 ** 20, 365 * 24 * 3600.0]))}
    params = {**BASE, "num_classes": C, "feature_dim": d, "epochs": int(rng.integers(1, 3)),
              "batch_size": int(rng.integers(4, 17)), "lr": lr, "weight_decay": float(rng.choice([0.0, 4e-5, 1e-3])),
              "temperature": float(rng.choice([0.1, 0.25, 0.5, 1.0])), "seed": int(rng.integers(0, 2**40)),
              "job_id": f"fuzz-{kind}-{index}", "state": binding, **kind_params(rng, kind)}
    start = head(rng, C, d)
    if rng.random() < 0.03:     # a global head whose float32 logits overflow (double ones do not)
        start = {k: (v * 10 ** rng.uniform(36.5, 38.5)).astype(np.float32) for k, v in start.items()}
    first = round_tensors(rng, kind, start)
    round2 = pick(rng, ROUND2)
    r1 = binding["round"]
    second = {"next": r1 + 1, "jump": r1 + int(rng.integers(2, 6)), "redelivery": r1, "earlier": r1 - 1,
              "other run": r1 + 1}[round2]
    params2 = {**params, "state": {**binding, "round": second,
                                   **({"run": run_id(rng)} if round2 == "other run" else {})}}
    rounds = [(params, first), (params, first) if round2 == "redelivery" else (params2, round_tensors(rng, kind, start))]
    held = None
    if kind != "scaffold.head" and rng.random() < 0.9:
        Zh, yh = features(rng, int(rng.integers(3, 13)), d, C)
        held = (Zh, yh + C * (rng.random() < 0.1))          # some with labels outside the job's: not scored
    case = StatefulCase(kind, rounds, (Z, y), held, round2, pick(rng, SEEDS))
    if case.seeded is None and rng.random() < 0.05:       # a store too small for the job's state (kept twice)
        need = 2 * 4 * sum(int(np.prod(s)) for s in state_shapes(kind, C, d).values())
        case.budget = int(rng.integers(0, need))
    return case


def state_file_name(job_id: str) -> str:
    return hashlib.sha256(job_id.encode()).hexdigest()[:32] + ".npz"


def seed_state(case: StatefulCase, rng, scratch: Path) -> bytes | None:
    """The bytes of the file the store holds before round 1 (written by the Python store), or None."""
    from edge_client.state import DeviceStateStore

    if case.seeded is None:
        return None
    p = case.params
    C, d, job, binding = p["num_classes"], p["feature_dim"], p["job_id"], p["state"]
    shapes = state_shapes(case.kind, C, d)
    arrays = {pre + k: (rng.normal(size=s) * 0.2).astype(np.float32) for k, s in shapes.items() for pre in ("", "previous.")}
    r0 = binding["round"] - int(rng.integers(0, binding["max_staleness"] + 1))
    run, clock, ttl = binding["run"], time.time, 3600.0
    if case.seeded == "later round":
        r0 = binding["round"] + int(rng.integers(1, 3))
    elif case.seeded == "stale":
        r0 = binding["round"] - binding["max_staleness"] - int(rng.integers(1, 3))
    elif case.seeded == "other run":
        run = run_id(rng)
    elif case.seeded == "wrong shape":
        arrays = {k: np.zeros(v.size + 1, np.float32) for k, v in arrays.items()}
    elif case.seeded == "float64":
        arrays = {k: v.astype(np.float64) for k, v in arrays.items()}
    elif case.seeded == "nonfinite":
        for name in ("bias", "previous.bias"):
            arrays[name][int(rng.integers(0, C))] = rng.choice([np.nan, np.inf, -np.inf])
    elif case.seeded == "expired":
        clock, ttl = (lambda: time.time() - 7200.0), 60.0
    case.seed_arrays, case.seed_binding = arrays, (run, max(r0, 0))
    store = DeviceStateStore(scratch, clock=clock)
    store.save("other-job" if case.seeded == "other job" else job, run, max(r0, 0), arrays, ttl)
    raw = next(scratch.glob("*.npz")).read_bytes()
    if case.seeded == "torn":
        return raw[:int(rng.integers(0, len(raw)))]
    if case.seeded == "garbage":
        return rng.bytes(int(rng.integers(0, 400)))
    if case.seeded in ("no header", "loose header"):
        return npz_bytes(arrays, None if case.seeded == "no header" else loose_header(rng, job, run, max(r0, 0)))
    return raw


def loose_header(rng, job: str, run: str, round_: int) -> dict:
    """A header naming this job's state whose fields have the wrong JSON types (what no store writes)."""
    header = {"job_id": job, "run": run, "round": round_, "expires_at": time.time() + 3600.0}
    field_, value = [("round", float(round_)), ("round", str(round_)), ("round", True),
                     ("expires_at", str(header["expires_at"])), ("expires_at", float("nan")), ("run", [run]),
                     ("job_id", None)][rng.integers(0, 7)]
    return {**header, field_: value}


def npz_bytes(arrays: dict[str, np.ndarray], header: dict | None) -> bytes:
    import io

    extra = {} if header is None else {HEADER: np.frombuffer(json.dumps(header).encode(), np.uint8)}
    buffer = io.BytesIO()
    np.savez(buffer, **arrays, **extra)
    return buffer.getvalue()


def expected_restart(case: StatefulCase, round_: int, first_done: bool) -> bool | None:
    """Whether round ``round_`` must start afresh (None: not predicted here), from the binding rules."""
    b1, b2 = case.rounds[0][0]["state"], case.rounds[1][0]["state"]
    if round_ == 1:
        run, r0 = case.seed_binding
        continued = case.seeded in ("valid", "later round", "stale") and run == b1["run"] \
            and 0 <= b1["round"] - r0 <= b1["max_staleness"]
        return not continued
    if case.seeded is not None or not first_done:
        return None
    if case.round2 == "redelivery":
        return expected_restart(case, 1, first_done)    # starts where round 1 did: previous.*, or fresh again
    gap = b2["round"] - b1["round"]
    return not (b2["run"] == b1["run"] and 0 < gap <= b2["max_staleness"])


def write_case(case: StatefulCase, rng, folder: Path, name: str, task_bytes, devices) -> dict[str, list[str]]:
    """The case's files (two signed tasks, features, each device's state folder with the seeded
    file) and, per device, its two case lines: task, features, result, held-out ("-": none),
    state folder[, budget]."""
    from test_java_device import write_features

    seeded = seed_state(case, rng, folder / f"{name}.seed")
    tasks = []
    for r, (params, tensors) in enumerate(case.rounds):
        path = folder / f"{name}.r{r + 1}.task"
        path.write_bytes(task_bytes(params, tensors, params["state"]["round"]))
        tasks.append(path)
    feats = write_features(folder / f"{name}.feat", *case.data)
    held = write_features(folder / f"{name}.held", *case.held) if case.held is not None else "-"
    lines = {}
    for device in devices:
        state = folder / "state" / f"{name}.{device}"
        state.mkdir(parents=True)
        if seeded is not None:
            (state / state_file_name(case.params["job_id"])).write_bytes(seeded)
        budget = [] if case.budget is None else [case.budget]
        lines[device] = [" ".join(map(str, [task, feats, folder / f"{name}.r{r + 1}.{device}", held, state, *budget]))
                         for r, task in enumerate(tasks)]
    return lines


def steps(case: StatefulCase) -> tuple[int, int]:
    """(K, P): the steps of one round's main pass and of its personal pass (Ditto's, FedAlt's; else 0)."""
    p, n = case.params, len(case.data[1])
    per_epoch = -(-n // p["batch_size"])
    personal = p.get("personal_epochs", 0) if case.kind == "ditto.head" or p.get("algorithm") == "fedalt" else 0
    return p["epochs"] * per_epoch, personal * per_epoch


def largest(arrays) -> float:
    """The largest |value| of finite float arrays (0 for none)."""
    values = [float(np.abs(np.asarray(a, np.float64)).max()) for a in arrays
              if np.asarray(a).size and np.asarray(a).dtype.kind == "f" and np.isfinite(a).all()]
    return max(values, default=0.0)


def tolerances(case: StatefulCase, seen: list[np.ndarray]) -> dict[str, float]:
    """By tensor role ("upload", "state", "delta_control"): the float32 rounding the devices may
    differ by over the case's two rounds (module docstring); ``seen``: every array compared, and
    the reference device's largest state value after each round, for Θ (and Scaffold's largest control)."""
    p, (Z, _) = case.params, case.data
    start = {k: case.rounds[0][1][k] for k in ("weight", "bias")}
    seen = seen + [v for _, t in case.rounds for v in t.values()] + list(case.seed_arrays.values())
    ends = [{"seen": np.array([largest(seen)], np.float32)}]
    K, P = steps(case)
    B = p["batch_size"]
    if case.kind == "pp.head":
        tol = head_tolerance(p, start, Z, 2 * (K + P), B, *ends)
        return {"upload": tol, "state": tol}
    if case.kind == "ditto.head":
        return {"upload": head_tolerance(p, start, Z, K, B, *ends),
                "state": head_tolerance({**p, "lr": p["personal_lr"]}, start, Z, 2 * P, B, *ends, mu=p["ditto_lambda"])}
    c_max = 3 * largest(seen)               # |c|, |c_k|, |(w − y)/(K lr)|: each at most the largest value seen
    lr = float(np.float32(p["lr"]))
    moved = head_tolerance(p, start, Z, 2 * K, B, *ends, correction=2 * largest(seen))
    first_c = moved / (K * lr) + 4 * EPS32 * c_max            # round 1's c_k⁺
    y = moved + K * lr * first_c                               # round 2 also moves by its c_k's difference
    second_c = first_c + y / (K * lr) + 4 * EPS32 * c_max      # round 2's c_k⁺
    return {"upload": y, "state": second_c, "delta_control": second_c + first_c + EPS32 * c_max}


def parse_result(kind: str, msg, params: dict) -> None:
    """What the aggregator's parser says of a result (EnvelopeError if it refuses it)."""
    from protocols.payloads.ditto import parse_ditto_update
    from protocols.payloads.partial import parse_partial_update
    from protocols.payloads.scaffold import parse_scaffold_update

    parse = {"scaffold.head": parse_scaffold_update, "ditto.head": parse_ditto_update,
             "pp.head": parse_partial_update}[kind]
    parse(msg, params["num_classes"], params["feature_dim"])


def read_states(folder: Path) -> dict[str, tuple[dict, dict[str, np.ndarray]]] | str:
    """Every file a device's store left, opened with numpy as the Python store does: {name: (header,
    arrays)}; a string saying why when one cannot be read."""
    out = {}
    for path in sorted(folder.iterdir()):
        try:
            with np.load(path, allow_pickle=False) as data:
                out[path.name] = (json.loads(bytes(data[HEADER]).decode()),
                                  {k: data[k] for k in data.files if k != HEADER})
        except Exception as exc:       # noqa: BLE001 - what cannot be read is the finding
            out[path.name] = ({"unreadable": repr(exc)[:200]}, {})
    return out


def role(name: str) -> str:
    return "delta_control" if name.startswith("delta_control.") else "upload"


def compare_arrays(where: tuple, got: np.ndarray, want: np.ndarray, tol: float, report: dict) -> None:
    """dtype, shape, values within ``tol`` and equal values in equal bytes; into report."""
    if got.dtype != want.dtype or got.shape != want.shape:
        report["failures"].append((*where, "dtype/shape", got.dtype, got.shape, want.dtype, want.shape))
        return
    equal = got == want
    if (np.signbit(got) != np.signbit(want))[equal].any():
        report["failures"].append((*where, "-0.0 vs +0.0"))
    if want.dtype.kind != "f" or not want.size:
        if got.tobytes() != want.tobytes():
            report["failures"].append((*where, "bytes differ"))
        return
    finite = np.isfinite(want)
    if (np.isfinite(got) != finite).any() or not np.array_equal(got[~finite], want[~finite], equal_nan=True):
        report["failures"].append((*where, "non-finite values differ"))
        return
    diff = float(np.abs(got[finite].astype(np.float64) - want[finite]).max()) if finite.any() else 0.0
    report["worst"] = max(report["worst"], diff / tol if tol else (np.inf if diff else 0.0))
    if diff > tol:
        report["failures"].append((*where, "differs by", diff, "tolerance", tol))


def compare_states(case: StatefulCase, states: dict, tol: dict, window: float, report: dict) -> None:
    """The state files each device's store left, against the reference device's."""
    want = states[REFERENCE]
    for device, got in states.items():
        if set(got) != set(want):
            report["failures"].append((device, "state files", sorted(got), sorted(want)))
            continue
        for name, (header, arrays) in got.items():
            ref_header, ref_arrays = want[name]
            if "unreadable" in header or "unreadable" in ref_header:
                if header != ref_header or case.seeded is None:
                    report["failures"].append((device, "state unreadable", name, header, ref_header))
                continue
            same = {k: header.get(k) == ref_header.get(k) for k in ("job_id", "run", "round")}
            if not all(same.values()) or abs(float(header["expires_at"]) - float(ref_header["expires_at"])) > window:
                report["failures"].append((device, "state header", header, ref_header))
            if sorted(arrays) != sorted(ref_arrays):
                report["failures"].append((device, "state arrays", sorted(arrays), sorted(ref_arrays)))
                continue
            for k, v in arrays.items():
                compare_arrays((device, "state", k), v, ref_arrays[k], tol["state"], report)


def compare_round(case: StatefulCase, r: int, results: dict, statuses: dict, tol: dict, report: dict) -> None:
    """One round's bodies and uploads, against the reference device's."""
    ref = results[REFERENCE]
    near = statuses[REFERENCE].get("margin", np.inf) < 1e-3
    for device, got in results.items():
        skip = {"job", "round", "task"} | ({"correct", "correct_global"} if near else set())
        body = {k: got.body.get(k) for k in ref.body if k not in skip}
        if body != {k: ref.body[k] for k in body} or set(got.body) != set(ref.body):
            report["failures"].append((device, r, "body", body, ref.body))
        if sorted(got.tensors) != sorted(ref.tensors):
            report["failures"].append((device, r, "tensor names", sorted(got.tensors), sorted(ref.tensors)))
            continue
        for k, want in ref.tensors.items():
            compare_arrays((device, r, k), got.tensors[k], want, tol[role(k)], report)


def check_case(case: StatefulCase, got: dict[str, list[dict]], verifiers: dict, state_dirs: dict[str, Path],
               window: float) -> dict:
    """Both rounds of one case on every device in ``got`` against the torch-free device's:
    {"failures", "worst", "outcomes": its status per round, "constrained": whether the derived
    tolerances are tight enough to check the values}."""
    from protocols.envelope import decode

    report = {"failures": [], "worst": 0.0, "outcomes": [s["status"] for s in got[REFERENCE]]}
    results: list[dict] = [{}, {}]
    for r in range(2):
        states = {d: got[d][r]["status"] for d in got}
        if len(set(states.values())) != 1 or states[REFERENCE] == "refused":
            report["failures"].append((r, "status", {d: (s[r]["status"], s[r].get("reason", "")) for d, s in got.items()}))
            continue
        if states[REFERENCE] != "done":
            continue
        for d in got:
            try:
                results[r][d] = decode(Path(got[d][r]["result"]).read_bytes(), verifiers[d])
                parse_result(case.kind, results[r][d], case.rounds[r][0])
            except Exception as exc:        # noqa: BLE001 - a refused signature, or a result the aggregator refuses
                report["failures"].append((r, d, "refused here", repr(exc)))
        if len(results[r]) < len(got):
            results[r] = {}
            continue
        want = expected_restart(case, r + 1, report["outcomes"][0] == "done")
        if want is not None and results[r][REFERENCE].body["restarted"] != want:
            report["failures"].append((r, "restarted", results[r][REFERENCE].body["restarted"], "expected", want))
    if case.round2 == "redelivery" and all(results):
        for d in got:
            if any(results[0][d].tensors[k].tobytes() != v.tobytes() for k, v in results[1][d].tensors.items()):
                report["failures"].append((d, "a redelivered task uploads another result"))
    states = {d: read_states(state_dirs[d]) for d in got}
    # Θ from the reference device's values only: a device's own wrong, large value must not widen
    # the tolerance it is judged by
    seen = [v for rs in results for d, m in rs.items() if d == REFERENCE for v in m.tensors.values()]
    if not isinstance(states[REFERENCE], str):
        seen += [v for _, arrays in states[REFERENCE].values() for v in arrays.values()]
    seen += [np.array([s.get("state_max", 0.0)]) for s in got[REFERENCE]]
    tol = tolerances(case, seen)
    # a case whose tolerance reaches a hundredth of the values compared checks little beyond
    # statuses, shapes and signs (tiny rates divided back out in Scaffold's control, Ditto's
    # saturated growth): counted, so the test can require enough cases that check the values
    scale = largest(seen + [v for _, t in case.rounds for v in t.values()] + list(case.seed_arrays.values()))
    report["constrained"] = max(tol.values()) < 1e-2 * max(scale, 1e-30)
    for r in range(2):
        if results[r]:
            compare_round(case, r, results[r], {d: got[d][r] for d in got}, tol, report)
    compare_states(case, states, tol, window, report)
    return report
