"""Python and Java are one protocol, proven differentially: random task parameters and data
through the three devices (the full install's Python device, the torch-free device run from
``.venv-device``, and the Java device, one JVM for all cases), for each task kind they share:
``fed3r.stats`` (packed and factor forms, float64 and float32, capped and streaming sample windows
on a fresh device's kept ledger: tests/fuzz_windows.py), ``fedavg.head`` (FedAvg(ψ)) and
``oll.personalize`` (OLL + FP(ψ)), the stateful head kinds ``scaffold.head``, ``ditto.head``
and ``pp.head`` as two rounds on one device state store each (tests/fuzz_stateful.py: seeded,
stale, torn and foreign state; both rounds' uploads and the state files compared), and the
secure kinds ``fedavg.secure`` (secure FedAvg(ψ): [n·θ | n] in the task's vector_order, the
update clipped to update_clip_norm, or under distributed DP [clip(θ − θ_t) | 1] on the round's
grid), ``fed3r.secure`` (Fed3R-Sync: [A_upper | b | n], under DP clipped, capped, count 0) and
the secure stateful heads ``scaffold.head.secure`` ([n·y | clip(Δc) | n], Δc clipped to the
task's control_clip_norm) and ``ditto.head.secure`` ([n·ψ_k | n], distributed DP in a quarter),
each on a fresh state store per device.
Every task is signed by the aggregator and verified by each device, every result signed by its
device and verified here; floats in the signed headers are drawn to include powers of two
(2^-24, where codecs' float writers used to differ).

Secure kinds: what is deterministic is compared. Each device takes the task as it would (the
Python devices' ``on_task``, which opens the SecAgg client; the Java device's
``SecureTask.contribute``) and encodes its contribution as its SecAgg client does at the round's
start (``ClientSecAgg._encode`` / ``RoundConfig.encode``) under a random round config (bound
drawn around what the vector may hold, the finest safe scale or the dp round's, some of a wrong
length). The devices must agree on accept/decline (bad params or vector_order, more samples than
max_samples, a head past max_abs_param, dp without its clip norm or with a noise it cannot
draw), on the encoder's refusal (out of the bound, wrong length) and, where both accept, on the
float64 contribution and the uint64 words SecAgg masks: byte for byte where the arithmetic is
exact (Fed3R on dyadic features without clipping), else within the statistics' or the head's
tolerance carried through the clip (a projection: √L·tol), the weighting by n and the rounding to
the grid (the words: that at the round's scale, plus one for rint); the count entry exactly.
Distributed DP's Skellam noise is drawn as zero on every device (``fuzz_device.ZeroSkellam``,
TaskRunner's zeroNoise; numpy's refusal of a Poisson mean it cannot draw kept), so its vector is
the device's rounding to the grid; the draws are compared in distribution in test_java_secure_vectors.py.
The masked words are out of scope: each device draws its round's X25519 keys and self-mask seed
from OS entropy (neither runtime has a seam for fixed ones, and adding one would be a product
change that weakens it), so masked outputs differ by design; the masks cancel in the sum, which
test_java_secagg.py proves exact (a Java client in Python-run rounds, complete graph and SecAgg+,
with dropouts: the plain modulo-2^64 sum of the encoded inputs), so identical words here mean
identical contributions to every group sum.

Per case the devices must agree on accepting or declining (a diverged training is declined by
all, and the aggregator's parser refuses what no device sends), on the body, and on the
payload: integer tensors byte for byte, float tensors within the tolerance their arithmetic
allows and, where two values are equal, in their bytes too (a -0.0 against a +0.0 is a different
payload hash). Statistics of dyadic features are exact in float64: there the payloads must be
byte-identical.

Head tolerance, derived (``head_tolerance``): the devices differ in how they round, not in what
they compute (the Java step runs in double, rounded into the float32 head; numpy and torch in
float32, their sums in different orders). One step's gradient differs by at most the float32
rounding of the logits, κ_z = (d+2)·ε·F·Θ/T (ε = 2^-24, F = max|f|, Θ a bound on |θ| along the
way), carried through the softmax (Lipschitz 1) into the gradient (×F/T), plus the rounding of
the gradient's own sum, (B+C+2)·ε·F/T; the update adds one float32 rounding of θ, ε·Θ. Over S
steps at rate lr: tol = S·(lr·(κ_z·F/T + (B+C+2)·ε·F/T) + ε·Θ), first order, Θ the largest |θ| at
the start and the ends plus one step's reach lr·2F/T (the worst measured difference over the
fuzzed cases is about a quarter of it, printed by the test). It replaces the 1e-5 once asserted:
at lr 0.3, T 0.1 and 24 steps the OLL fine-tune legitimately drifts 2.6e-5.

Extended to the stateful kinds (tests/fuzz_stateful.py) it found two more: a state file whose
header fields had the wrong JSON types (round 3.0 or "3", run 12345678, expires_at "2e9" or NaN)
was coerced and continued by the Python store but dropped by the Java one, and a state file cut
short after its last entry (its central directory torn off) was read as whole by the Java store
(ZipInputStream never looks there) but dropped by the Python one (tests/test_java_state.py).

On the secure kinds it found one: a dp round whose Poisson mean (σ·2^f)²/2 is past what numpy
draws (~9.2e18, e.g. σ = 32 at scale_bits 29) was declined by the Python devices but taken by the
Java one, whose PTRS candidate saturated at Long.MAX_VALUE in both draws: zero noise, an
un-noised release (SkellamNoise now declines it; test_java_secure_vectors.py).

On the code before this fuzzer (c2bf56a) it fails three ways: the Java device refuses 25 + 25
tasks signed by the aggregator (a 2^-k rate written with 17 digits by Java, 16 by Python: the
signature was checked over a re-encoding), Python and the torch-free device decline 12 + 1 trainings
the Java device uploads (float32 logits overflow, double ones do not), and 45 factor results hold
-0.0 on the Python devices where Java's hold +0.0.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

import fuzz_device
import fuzz_windows
import java_build
from test_java_device import write_features

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))

ROOT = Path(__file__).resolve().parents[1]
DEVICE_PYTHON = ROOT / ".venv-device" / "bin" / "python"
# Cases per kind and the draw's seed: the suite's 200 on a fixed seed (reproducible, ~half a CPU-minute);
# `make test-fuzz` draws 5,000 a kind on a fresh seed it prints (FEDFLEET_FUZZ_CASES / _SEED)
CASES = int(os.environ.get("FEDFLEET_FUZZ_CASES", "200"))
SEED = int(os.environ.get("FEDFLEET_FUZZ_SEED", "20261201"))
EPS32 = 2.0 ** -24
DEVICES = ("python", "numpy", "java")


@pytest.fixture(scope="module")
def keys():
    from protocols.identity import DeviceIdentity

    seeds = {d: bytes([i + 1]) * 32 for i, d in enumerate(DEVICES)}
    return {"aggregator": DeviceIdentity.from_private_bytes("aggregator", bytes(range(32))),
            **{d: DeviceIdentity.from_private_bytes({"python": "py0", "numpy": "numpy0", "java": "java0"}[d], s)
               for d, s in seeds.items()}}


def rate(rng) -> float:
    """A learning rate: often a power of two (2^-24 among them), else log-uniform."""
    return float(2.0 ** -rng.integers(1, 25)) if rng.random() < 0.4 else float(10 ** rng.uniform(-3, -0.5))


def features(rng, n: int, d: int, C: int) -> tuple[np.ndarray, np.ndarray]:
    y = rng.integers(0, C, n)
    if rng.random() < 0.4:                           # dyadic: Fed3R's sums are exact in float64
        Z = rng.integers(-8, 9, (n, d)) / 4.0
    else:
        Z = rng.normal(size=(n, d)) + 1.5 * np.eye(C, d)[y]
    if rng.random() < 0.5:                           # ReLU features: dead channels, exact zeros
        Z = np.maximum(Z, 0)
        Z[:, rng.integers(0, d)] = 0.0
    return Z.astype(np.float32), y


def head(rng, C: int, d: int) -> dict[str, np.ndarray]:
    return {"weight": (rng.normal(size=(C, d)) * 0.3).astype(np.float32),
            "bias": (rng.normal(size=C) * 0.1).astype(np.float32)}


BASE = {"backbone": "b", "image_size": 8, "weights_sha256": ""}


def fed3r_case(rng):
    C, d = int(rng.integers(2, 5)), int(rng.integers(2, 9))
    n = int(rng.integers(2, 2 * d + 4))
    params = {**BASE, "num_classes": C, "fit_intercept": bool(rng.random() < 0.7), "random_features": None,
              "format": "dense" if rng.random() < 0.2 else "sparse",
              "dtype": "float32" if rng.random() < 0.3 else "float64", "factor": bool(rng.random() < 0.6)}
    tensors = {}
    if rng.random() < 0.3:                            # DP: rows clipped, often centred on a released mean first
        params["feature_clip_norm"] = float(rng.uniform(0.5, 4.0))
        if rng.random() < 0.6:
            params["centered"] = True
            center = rng.normal(size=d + (1 if rng.random() < 0.05 else 0))   # some of the wrong length: declined
            tensors = {"feature_center": center} if rng.random() < 0.95 else {}   # some without it: declined
    return params, tensors, features(rng, n, d, C), None


def fedavg_case(rng):
    C, d = int(rng.integers(2, 5)), int(rng.integers(2, 9))
    n = int(rng.integers(C, 24))
    # some diverge: to a head past 2^20, to NaN, or (lr ≳ 1e33) to float32 heads whose float32
    # logits overflow while double ones do not (where a Java device once uploaded ±5e18)
    lr = float(10 ** rng.uniform(3, 38)) if rng.random() < 0.06 else rate(rng)
    params = {**BASE, "num_classes": C, "feature_dim": d, "epochs": int(rng.integers(1, 3)),
              "batch_size": int(rng.integers(4, 17)), "lr": lr,
              "weight_decay": float(rng.choice([0.0, 4e-5, 1e-3])),
              "temperature": float(rng.choice([0.1, 0.25, 0.5, 1.0])), "seed": int(rng.integers(0, 2**40))}
    start = head(rng, C, d)
    if rng.random() < 0.04:     # a global head whose float32 logits overflow (double ones do not)
        start = {k: (v * 10 ** rng.uniform(36.5, 38.5)).astype(np.float32) for k, v in start.items()}
    return params, start, features(rng, n, d, C), None


def personalize_case(rng):
    C, d = int(rng.integers(2, 5)), int(rng.integers(2, 7))
    present = sorted(rng.choice(C, int(rng.integers(1, C + 1)), replace=False).tolist())
    train = features(rng, int(rng.integers(4, 24)), d, C)
    train = (train[0], np.array(present)[rng.integers(0, len(present), len(train[1]))])
    held = features(rng, int(rng.integers(3, 20)), d, C)
    params = {**BASE, "num_classes": C, "feature_dim": d, "fallback": "global",
              "fp_epochs": int(rng.integers(0, 3)), "batch_size": int(rng.integers(4, 17)),
              "fp_lrs": [float(10 ** rng.uniform(3, 38)) if rng.random() < 0.03 else rate(rng)   # some diverge
                         for _ in range(int(rng.integers(1, 4)))], "fp_folds": int(rng.integers(2, 4)),
              "weight_decay": float(rng.choice([0.0, 4e-5])), "temperature": float(rng.choice([0.1, 0.5, 1.0])),
              "seed": int(rng.integers(0, 2**31))}
    return params, head(rng, C, d), train, held


KINDS = {"fed3r.stats": fuzz_windows.fed3r_stats_case, "fedavg.head": fedavg_case, "oll.personalize": personalize_case}
SECURE_KINDS = ("fedavg.secure", "fed3r.secure", "scaffold.head.secure", "ditto.head.secure")   # tests/fuzz_secure.py
STATEFUL_KINDS = ("scaffold.head", "ditto.head", "pp.head")      # tests/fuzz_stateful.py: two rounds a case
ALL_KINDS = (*KINDS, *SECURE_KINDS, *STATEFUL_KINDS)


def write_cases(folder: Path, keys, seed: int) -> dict[str, list]:
    """CASES random cases of every kind on disk: signed tasks, feature files, state folders, one
    cases file per device (all kinds in one, so each device starts once; a stateful case is two
    lines, its two rounds)."""
    import fuzz_secure
    import fuzz_stateful
    from protocols import messages as M
    from protocols.envelope import Envelope, encode

    def signed(kind: str, params: dict, tensors: dict, round_: int, job: str = "fuzz") -> bytes:
        task = M.task_message("aggregator", job, round_, kind, params, 2e9)
        return encode(Envelope(task.type, task.sender, task.body, tensors), signer=keys["aggregator"].sign)

    rng = np.random.default_rng(seed)
    cases, lines = {kind: [] for kind in ALL_KINDS}, {d: [] for d in DEVICES}
    for kind, make in {**KINDS, **fuzz_secure.CASES}.items():
        for i in range(CASES):
            params, tensors, (Z, y), held = make(rng)
            if kind == "fedavg.head" and i == 0:    # past every device's step budget (MAX_LOCAL_STEPS): declined
                params = {**params, "epochs": 10_000, "batch_size": 1}
                Z, y = features(np.random.default_rng(1), 120, params["feature_dim"], params["num_classes"])
            name = f"{kind}-{i}"
            task_path = folder / f"{name}.task"
            task_path.write_bytes(signed(kind, params, tensors, 1))
            feats = write_features(folder / f"{name}.feat", Z, y)
            stateful = kind in fuzz_secure.STATEFUL          # its last part: (round config, held-out split)
            held, split = held if stateful else (held, None)
            if kind in SECURE_KINDS:             # the round config the contribution is encoded under
                held_path = folder / f"{name}.round"
                held_path.write_text(json.dumps(held))
            else:
                held_path = write_features(folder / f"{name}.held", *held) if held is not None else None
            split_path = write_features(folder / f"{name}.held", *split) if split is not None else "-"
            for d in DEVICES:
                state = [split_path, folder / "state" / f"{name}.{d}"] if stateful else []   # a fresh store each
                if state:
                    state[1].mkdir(parents=True)
                lines[d].append(" ".join(map(str, [task_path, feats, folder / f"{name}.{d}"]
                                              + ([held_path] if held_path else []) + state)))
            cases[kind].append((params, tensors, (Z, y), held))
    for kind in STATEFUL_KINDS:
        for i in range(CASES):
            case = fuzz_stateful.draw(rng, kind, i)
            sign = lambda p, t, r, kind=kind: signed(kind, p, t, r, p["job_id"])     # noqa: E731
            devices = DEVICES if i % fuzz_stateful.FULL_DEVICE_EVERY == 0 else ("numpy", "java")
            for d, two in fuzz_stateful.write_case(case, rng, folder, f"{kind}-{i}", sign, devices).items():
                lines[d] += two
            cases[kind].append(case)
    for d in DEVICES:
        (folder / f"{d}.cases").write_text("\n".join(lines[d]) + "\n")
    return cases


def run_devices(folder: Path, keys) -> dict[str, list[dict]]:
    """Each device over every case: the Java one in one JVM, the torch-free one in one process."""
    agg = keys["aggregator"].public_key_bytes.hex()
    java = subprocess.Popen(java_build.java_command("-cp", java_build.built(), "TaskRunner", "--batch",
                                                    str(folder / "java.cases"), agg, keys["java"].private_bytes().hex()),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    numpy_device = subprocess.Popen([str(DEVICE_PYTHON), str(Path(__file__).with_name("fuzz_device.py")),
                                     str(folder / "numpy.cases"), agg, keys["numpy"].private_bytes().hex(),
                                     str(folder / "numpy")], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                    stderr=subprocess.PIPE, text=True)
    python = fuzz_device.run_cases((folder / "python.cases").read_text().splitlines(),
                                   keys["aggregator"].public_key_bytes, keys["python"].private_bytes(), "py0")
    out, err = java.communicate(timeout=120)
    assert java.returncode == 0, err[-3000:]
    _, err = numpy_device.communicate(timeout=120)
    assert numpy_device.returncode == 0, err[-3000:]
    return {"python": python, "numpy": json.loads((folder / "numpy.json").read_text()), "java": java_statuses(out, folder)}


def java_statuses(out: str, folder: Path) -> list[dict]:
    cases: list[dict] = []
    results = [line.split()[2] for line in (folder / "java.cases").read_text().splitlines()]
    for line in out.splitlines():
        word, _, rest = line.partition(" ")
        if word == "CASE":
            cases.append({"result": results[int(rest)]})
        elif word in ("DONE", "DECLINED", "REFUSED", "OUT_OF_RANGE"):
            cases[-1].update(status=word.lower(), reason=rest)
        elif word == "STEPS":
            cases[-1]["steps"] = int(rest.split()[0])
    return cases


def head_tolerance(params: dict, start: dict, Z: np.ndarray, steps: int, batch: int, *ends: dict,
                   mu: float = 0.0, correction: float = 0.0) -> float:
    """The float32 rounding two correct head steppers may differ by after ``steps`` steps (module
    docstring); Θ: the largest |θ| of the start and the ``ends`` (the heads compared) plus what
    one step can move a parameter, lr·2F/T (plus lr·μ·2Θ and lr·``correction`` below).

    ``mu``: a proximal pull μ(θ − anchor) in each step's direction (FedProx; Ditto's personal pass,
    μ = λ). Its term is computed from θ (float64 on the Python devices, double in Java) and rounded
    once more into the float32 direction on the Python devices: + lr·ε·μ·2Θ per step. It also
    carries an earlier difference δ into the next step as (1 − lr·μ)·δ: a pull with lr·μ > 2 grows
    it by |1 − lr·μ| per step, so the bound is multiplied by max(1, |1 − lr·μ|)^steps (exact for the
    pull, which is linear; the loss's own part stays first order, as above).
    ``correction``: Scaffold's |c − c_k| bound. lr·(c − c_k) is formed in float32 the same way on
    every device (identical bits), but subtracted from θ after the step, one more float32 rounding:
    + ε·Θ per step; and it adds lr·|c − c_k| to one step's reach."""
    C, d = start["weight"].shape
    F, T, lr = max(1.0, float(np.abs(Z).max())), params["temperature"], params["lr"]
    theta = max(float(np.abs(np.asarray(v, np.float64)).max()) for h in (start, *ends) for v in h.values())
    theta += lr * 2 * F / T
    theta += lr * (mu * 2 * theta + correction)
    logits = (d + 2) * EPS32 * F * theta / T
    per_step = lr * (logits * F / T + (batch + C + 2) * EPS32 * F / T + EPS32 * mu * 2 * theta) \
        + EPS32 * theta * (2 if correction else 1)
    growth = math.exp(min(700.0, steps * math.log(max(1.0, abs(1 - lr * mu)))))     # no OverflowError
    return steps * per_step * growth


def stats_tolerance(ref: np.ndarray, dtype: str) -> float:
    scale = max(1.0, float(np.abs(ref).max()))
    return (1e-12 if dtype == "float64" else 4 * np.finfo(np.float32).eps) * scale


def compare_payloads(kind: str, case: tuple, results: dict, report: dict) -> None:
    """The three devices' results of one case, against the Python device's (``results``: device ->
    decoded, verified envelope); appends any disagreement to report["failures"]."""
    params, start, (Z, y), _ = case
    ref = results["python"]
    for device in ("numpy", "java"):
        got = results[device]
        body = {k: got.body[k] for k in ref.body if k not in ("job", "round", "task")}
        want = {k: ref.body[k] for k in body}
        if body != want and not (kind == "oll.personalize" and report["near_boundary"]):
            report["failures"].append((device, "body", body, want))
        if set(got.tensors) != set(ref.tensors):
            report["failures"].append((device, "tensor names", sorted(got.tensors), sorted(ref.tensors)))
            continue
        for name, want_t in ref.tensors.items():
            got_t = got.tensors[name]
            if got_t.dtype != want_t.dtype or got_t.shape != want_t.shape:
                report["failures"].append((device, name, got_t.dtype, got_t.shape, want_t.dtype, want_t.shape))
                continue
            if want_t.dtype.kind != "f" or report.get("exact"):
                if got_t.tobytes() != want_t.tobytes():
                    report["failures"].append((device, name, "bytes differ", got_t.ravel()[:6], want_t.ravel()[:6]))
                continue
            equal = got_t == want_t                  # equal values must be equal bytes (signed zeros)
            if (np.signbit(got_t) != np.signbit(want_t))[equal].any():
                report["failures"].append((device, name, "-0.0 vs +0.0", got_t[equal & (np.signbit(got_t) != np.signbit(want_t))]))
            if kind == "fedavg.head":
                tol = head_tolerance(params, start, Z, report["steps"], params["batch_size"],
                                     dict(ref.tensors), dict(got.tensors))
            else:
                tol = stats_tolerance(want_t, str(want_t.dtype))
            diff = float(np.abs(got_t.astype(np.float64) - want_t).max()) if want_t.size else 0.0
            report["worst"] = max(report["worst"], diff / tol)
            if diff > tol:
                report["failures"].append((device, name, "differs by", diff, "tolerance", tol))


def parse_for_aggregator(kind: str, msg, case):
    """What the aggregator's parser makes of a result (EnvelopeError if it refuses it)."""
    from protocols.payloads.fed3r import parse_stats
    from protocols.payloads.fedavg import parse_head_update
    from protocols.payloads.personalize import parse_report

    params = case[0]
    if kind == "fed3r.stats":
        return parse_stats(msg, case[2][0].shape[1] + int(params["fit_intercept"]), params["num_classes"],
                           fit_intercept=params["fit_intercept"])
    if kind == "fedavg.head":
        return parse_head_update(msg, params["num_classes"], params["feature_dim"])
    return parse_report(msg, params["num_classes"], with_fp=bool(params["fp_epochs"]),
                        fp_lrs=tuple(params["fp_lrs"]) if params["fp_epochs"] else None)


def failure_kinds(failures: list[tuple]) -> dict[str, int]:
    """How many cases failed how: a status disagreement by who did what, a payload one by what."""
    kinds: dict[str, int] = {}
    for f in failures:
        key = (" ".join(f"{d}={s[0]}" for d, s in f[2].items()) if f[1] == "status"
               else f"{f[1]} {f[2]} {f[3] if isinstance(f[3], str) else ''}".strip())
        kinds[key] = kinds.get(key, 0) + 1
    return kinds


@pytest.fixture(scope="module")
def fuzz_folder(tmp_path_factory):
    """Where the fuzzer's files go: in memory where there is a tmpfs (each stateful task writes and
    fsyncs its state, twice a case), removed after the module however it ended."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        yield tmp_path_factory.mktemp("fuzz")
        return
    folder = Path(tempfile.mkdtemp(prefix="fedfleet-fuzz-", dir=shm))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def fuzzed(keys, fuzz_folder):
    """Every kind's CASES cases through the three devices (each device started once): {kind:
    (cases, {device: statuses, a stateful case's as [round 1, round 2] or None where not run}, the
    run's folder and seconds)}."""
    import fuzz_stateful

    if not DEVICE_PYTHON.exists():
        pytest.fail(f"{DEVICE_PYTHON} is missing: `make setup` builds it")
    java_build.built()
    folder = fuzz_folder
    started = time.perf_counter()
    cases = write_cases(folder, keys, seed=SEED)
    statuses = run_devices(folder, keys)
    took = time.perf_counter() - started
    print(f"differential fuzzer: {len(ALL_KINDS)} x {CASES} cases through {len(DEVICES)} devices in {took:.1f} s")
    out, at = {}, dict.fromkeys(DEVICES, 0)
    for kind in ALL_KINDS:
        mine = {d: [] for d in DEVICES}
        for i in range(CASES):
            for d in DEVICES:
                if kind not in STATEFUL_KINDS:
                    mine[d].append(statuses[d][at[d]])
                    at[d] += 1
                elif d != "python" or i % fuzz_stateful.FULL_DEVICE_EVERY == 0:   # two rounds; None: not run there
                    mine[d].append(statuses[d][at[d]:at[d] + 2])
                    at[d] += 2
                else:
                    mine[d].append(None)
        out[kind] = (cases[kind], mine, folder, took)
    assert all(len(statuses[d]) == at[d] for d in DEVICES), (at, {d: len(s) for d, s in statuses.items()})
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_python_torch_free_and_java_devices_agree_on_random_tasks(kind, fuzzed, keys):
    from protocols.envelope import decode
    from protocols.identity import sender_verifier

    cases, statuses, _, _ = fuzzed[kind]
    verifiers = {d: sender_verifier(keys[d].device_id, keys[d].public_key_bytes) for d in DEVICES}
    failures, worst, outcomes = [], 0.0, {"done": 0, "declined": 0}
    windows = {"capped": 0, "streaming": 0}     # fed3r.stats: such windows every device answered
    for i, case in enumerate(cases):
        got = {d: statuses[d][i] for d in DEVICES}
        states = {d: got[d]["status"] for d in DEVICES}
        if len(set(states.values())) != 1 or states["python"] == "refused":
            failures.append((i, "status", {d: (got[d]["status"], got[d].get("reason", "")) for d in DEVICES}, case[0]))
            continue
        outcomes[states["python"]] += 1
        if states["python"] != "done":
            continue
        results = {}
        for d in DEVICES:
            try:
                results[d] = decode(Path(got[d]["result"]).read_bytes(), verifiers[d])
                parsed = parse_for_aggregator(kind, results[d], case)
                if kind == "fed3r.stats":          # the window each device answered: numpy's slice
                    failures += [(i, d, *f) for f in fuzz_windows.check_answer(case, parsed)]
            except Exception as exc:        # a refused signature, or a result the aggregator refuses
                failures.append((i, d, "refused here", repr(exc)))
        if len(results) < len(DEVICES):
            continue
        for tag in fuzz_windows.window_tags(case[0], len(case[2][1])) if kind == "fed3r.stats" else ():
            windows[tag] += 1
        report = {"failures": [], "worst": 0.0, "steps": got["java"].get("steps", 0),
                  "near_boundary": got["python"].get("margin", np.inf) < 1e-3,
                  # clipping's norms sum in another order on each device (numpy's pairwise sum): to tolerance
                  "exact": kind == "fed3r.stats" and results["python"].body.get("a_format") != "factor"
                  and not case[0].get("feature_clip_norm")
                  and float(np.abs(case[2][0] * 4 - np.rint(case[2][0] * 4)).max()) == 0.0}
        compare_payloads(kind, case, results, report)
        worst = max(worst, report["worst"])
        failures += [(i, *f) for f in report["failures"]]
    print(f"{kind}: {CASES} cases, {outcomes}, {f'answered by all {windows}, ' if kind == 'fed3r.stats' else ''}"
          f"worst difference / tolerance {worst:.3g}")
    assert not failures, (failure_kinds(failures), failures[:5])
    assert outcomes["done"] >= CASES // 2
    if kind == "fed3r.stats":      # caps below n and from_sample windows computed and compared, not all declined
        assert min(windows.values()) >= CASES // 40, windows
    if kind == "fedavg.head":       # case 0: 10,000 epochs over 120 rows in batches of 1 (1.2 million steps)
        assert all(statuses[d][0]["status"] == "declined" and "1200000 SGD steps" in statuses[d][0]["reason"]
                   for d in DEVICES), {d: statuses[d][0] for d in DEVICES}


@pytest.mark.parametrize("kind", SECURE_KINDS)
def test_the_three_devices_contribute_the_same_words_to_secure_rounds(kind, fuzzed):
    """fed3r.secure and fedavg.secure: every device accepts or declines alike (bad params, too many
    samples, a head past max_abs_param, a dp noise it cannot draw), its SecAgg encoder refuses
    alike (a vector outside the round's bound or of the wrong length) and, where it accepts, the
    contribution and its fixed-point words agree (tests/fuzz_secure.py ``compare``)."""
    import fuzz_secure

    cases, statuses, _, _ = fuzzed[kind]
    failures, worst, outcomes, edge, exact, identical = [], 0.0, {}, 0, 0, 0
    for i, case in enumerate(cases):
        got = {d: statuses[d][i] for d in DEVICES}
        states = {d: got[d]["status"] for d in DEVICES}
        outcomes[states["python"]] = outcomes.get(states["python"], 0) + 1
        if len(set(states.values())) != 1:
            if set(states.values()) <= {"done", "out_of_range", "declined"} and fuzz_secure.near_range_edge(case, got):
                edge += 1
                continue
            failures.append((i, "status", {d: (states[d], got[d].get("reason", "")[:120]) for d in DEVICES}, case[0]))
            continue
        if states["python"] != "done":
            continue
        report = {"failures": [], "worst": 0.0}
        fuzz_secure.compare(kind, case, got, report)
        worst, exact, identical = max(worst, report["worst"]), exact + report["exact"], identical + report["identical"]
        failures += [(i, *f) for f in report["failures"]]
    print(f"{kind}: {CASES} cases, {outcomes}, {edge} within rounding of the bound, {exact} compared byte for "
          f"byte, {identical} with identical words, worst difference / tolerance {worst:.3g}")
    assert not failures, (failure_kinds(failures), failures[:5])
    assert outcomes.get("done", 0) >= CASES // 4 and edge <= max(1, CASES // 100)
    assert identical >= CASES // 10 and (exact >= CASES // 10 or kind != "fed3r.secure")


@pytest.mark.parametrize("kind", STATEFUL_KINDS)
def test_the_three_devices_agree_on_two_rounds_of_random_stateful_tasks(kind, fuzzed, keys):
    """tests/fuzz_stateful.py: each case two rounds on one state store per device (seeded with
    valid, stale, torn or foreign state), on the torch-free and the Java device (and one in
    FULL_DEVICE_EVERY on the full Python device); both rounds' statuses, bodies and uploads and the
    state files each store leaves agree with the torch-free device's, within the derived tolerances."""
    import fuzz_stateful
    from protocols.identity import sender_verifier

    cases, statuses, folder, took = fuzzed[kind]
    verifiers = {d: sender_verifier(keys[d].device_id, keys[d].public_key_bytes) for d in DEVICES}
    failures, worst, outcomes, full, checked = [], 0.0, {}, 0, 0
    for i, case in enumerate(cases):
        dirs = {d: folder / "state" / f"{kind}-{i}.{d}" for d in DEVICES}
        got = {d: statuses[d][i] for d in DEVICES if statuses[d][i] is not None}
        report = fuzz_stateful.check_case(case, got, verifiers, dirs, took + 1.0)
        full += "python" in got
        key = "/".join(report["outcomes"])
        outcomes[key] = outcomes.get(key, 0) + 1
        checked += key == "done/done" and report["constrained"]
        worst = max(worst, report["worst"])
        failures += [(i, case.seeded, case.round2, *f) for f in report["failures"]]
    print(f"{kind}: {CASES} two-round cases ({full} on the full Python device), {outcomes}, "
          f"{checked} done twice within tolerances under 1 % of their values, "
          f"worst difference / tolerance {worst:.3g}")
    assert not failures, (len(failures), failures[:5])
    assert outcomes.get("done/done", 0) >= CASES // 2
    assert checked >= CASES // 2           # most cases check the values, not only statuses and shapes


def test_signed_zero_golden_vector_is_what_the_python_device_sends():
    """result_fed3r_factor_signed_zero: on Z = [[0, 1], [0.5, 1]] the Householder steps leave a
    -0.0 in QtY (checked: the vector tests something); the device sends +0.0, the golden payload
    byte for byte (the Java device's bytes are checked in test_java_device.py); the aggregator
    refuses a factor R holding -0.0."""
    from edge_client.fed3r import canonical_factor
    from edge_client.tasks.fed3r_stats import Fed3RStatsTask
    from protocols import golden
    from protocols.envelope import EnvelopeError, decode
    from protocols.payloads.fed3r import check_canonical_factor

    Z, y = np.array([[0.0, 1.0], [0.5, 1.0]], np.float32), np.array([0, 2])
    _, raw_qty = canonical_factor(np.hstack([Z, np.ones((2, 1))]), np.eye(2))
    assert (np.signbit(raw_qty) & (raw_qty == 0)).any()
    vector = decode(golden.golden_messages()["result_fed3r_factor_signed_zero"])
    params = {**BASE, "num_classes": 3, "fit_intercept": True, "random_features": None, "format": "sparse",
              "dtype": "float64", "factor": True}
    body, tensors = Fed3RStatsTask(Z, y, lambda b, s, w: fuzz_device.PrecomputedFeatures(2))(params, None)
    assert {k: vector.body[k] for k in body} == body
    assert {k: v.tobytes() for k, v in tensors.items()} == {k: v.tobytes() for k, v in vector.tensors.items()}
    assert not np.signbit(vector.tensors["QtY"]).any()
    with pytest.raises(EnvelopeError, match="-0.0"):
        check_canonical_factor(np.array([[1.0, -0.0], [0.0, 2.0]]))


@pytest.mark.parametrize("value", [5e18, -3e6, 2.0 ** 20 * 1.001, np.inf])
def test_the_aggregator_refuses_a_head_no_device_sends(value):
    """A head past the protocol's bound (MAX_ABS_TRAINED = 2^20) or non-finite: every device
    declines such training as diverged, so the aggregator's parser refuses it with one reason;
    the bound itself is accepted, and the Python device's encoder refuses to send past it."""
    from protocols.envelope import Envelope, EnvelopeError, decode, encode
    from protocols.payloads.fedavg import MAX_ABS_TRAINED, encode_head_update, parse_head_update

    def result(weight):
        body, tensors = encode_head_update(weight, np.zeros(2, np.float32), 5)
        return decode(encode(Envelope("result", "d", body, tensors)))

    weight = np.zeros((2, 3), np.float32)
    weight[1, 2] = MAX_ABS_TRAINED
    assert parse_head_update(result(weight), 2, 3).weight[1, 2] == MAX_ABS_TRAINED
    weight[1, 2] = value
    with pytest.raises(ValueError, match="diverged"):
        result(weight)
    forged = Envelope("result", "d", {"n": 5, "num_classes": 2, "feature_dim": 3},
                      {"weight": weight, "bias": np.zeros(2, np.float32)})
    with pytest.raises(EnvelopeError, match="no device sends: tensor 'weight'"):
        parse_head_update(decode(encode(forged)), 2, 3)


def test_every_device_declines_training_that_ends_past_the_bound():
    """A finite head past 2^20 after training (lr 1e6: no NaN anywhere) is declined as diverged by
    the Python device, as by the Java device (fuzzed above)."""
    from edge_client.tasks.head_training import LocalTraining, train_head

    rng = np.random.default_rng(0)
    Z, y = features(rng, 12, 3, 2)
    recipe = LocalTraining(epochs=1, batch_size=4, lr=1e6, temperature=0.5)
    with pytest.raises(FloatingPointError, match=r"diverged .*> 1\.04858e\+06"):
        train_head(np.zeros((2, 3), np.float32), np.zeros(2, np.float32), Z, y, recipe)
