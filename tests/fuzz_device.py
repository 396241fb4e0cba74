"""The Python device's side of the differential fuzzer (tests/test_differential_fuzz.py): the
device's own task handlers (fed3r.stats, fedavg.head, oll.personalize, and the stateful
scaffold.head, ditto.head, pp.head on a state store per case line; the secure fedavg.secure,
fed3r.secure, scaffold.head.secure and ditto.head.secure up to the words SecAgg masks, ``run_secure``) on many cases in one process, each task verified under the aggregator's key and each result signed, as a device does.

Run in-process it is the full install's device (torch's head step); run by ``.venv-device``'s
python (``python fuzz_device.py <cases> <aggregator key hex> <device seed hex> <out prefix>``) it
is the torch-free device (numpy's head step). Imports nothing from ``aggregator`` or the tests.
"""

from __future__ import annotations

import functools
import itertools
import json
import sys
import tempfile

import numpy as np


class PrecomputedFeatures:
    """The 'images' already are features (as the Java harness's PrecomputedFeatures)."""

    def __init__(self, dim: int):
        self.feature_dim = dim

    def extract(self, x):
        return np.asarray(x, dtype=np.float32)


@functools.lru_cache(maxsize=4)     # a stateful case's two rounds read the same files (read-only arrays)
def read_features(path: str) -> tuple[np.ndarray, np.ndarray]:
    """The FeatureFile format: int32 n, int32 d, n·d float32, n int32 labels (little-endian)."""
    raw = open(path, "rb").read()
    n, d = np.frombuffer(raw[:8], "<i4")
    Z = np.frombuffer(raw[8:8 + 4 * n * d], "<f4").reshape(n, d)
    y = np.frombuffer(raw[8 + 4 * n * d:], "<i4").astype(np.int64)
    y.flags.writeable = False
    return Z, y


STATEFUL = {"scaffold.head": "edge_client.tasks.scaffold_training:ScaffoldTrainingTask",
            "ditto.head": "edge_client.tasks.ditto_training:DittoTrainingTask",
            "pp.head": "edge_client.tasks.partial_training:PartialTrainingTask"}


SECURE = ("fedavg.secure", "fed3r.secure", "scaffold.head.secure", "ditto.head.secure")
SECURE_STATEFUL = {"scaffold.head.secure": "scaffold.head", "ditto.head.secure": "ditto.head"}   # secure -> plain


class ZeroSkellam:
    """Distributed DP's noise drawn as zero (as the Java runner's zeroNoise): the vector is then
    the device's rounding to the round's grid alone (the draws are checked by the Skellam tests).
    numpy's own refusal of a μ it cannot draw is kept: such a task is declined."""

    def poisson(self, lam, size):
        np.random.default_rng(0).poisson(lam, 0)
        return np.zeros(size, np.int64)


def run_secure(kind: str, msg, Z: np.ndarray, y: np.ndarray, rest: list[str], result_path: str,
               identity, aggregator_key: bytes) -> dict:
    """A secure task as the device takes it (``on_task``: the vector, then its SecAgg client), and
    the words that client masks at the round's start, its fixed-point encoding under the round
    config ``rest[0]`` (JSON): float64 vector to ``result_path``.vector, uint64 words to
    ``result_path``; status done, declined (the task) or out_of_range (the encoder). The secure
    stateful kinds wrap their plain handler on ``rest[1:]`` (held-out features, state folder)."""
    from edge_client.agent import TaskDeclined
    from edge_client.tasks.fed3r_stats import Fed3RStatsTask
    from edge_client.tasks.head_training import HeadTrainingTask
    from edge_client.tasks.secure_fed3r import SecureFed3R
    from edge_client.tasks.secure_fedavg_training import SecureFedAvgTraining, SecureScaffoldTraining
    from protocols.secagg import ClientSecAgg, RoundConfig, SecAggError

    factory = lambda b, s, w: PrecomputedFeatures(Z.shape[1])      # noqa: E731
    round_path = rest[0]
    if kind in SECURE_STATEFUL:
        make = SecureScaffoldTraining if kind == "scaffold.head.secure" else SecureFedAvgTraining
        plain = handler_for(SECURE_STATEFUL[kind], Z, y, rest[1:])
    elif kind == "fedavg.secure":
        make, plain = SecureFedAvgTraining, HeadTrainingTask(Z, y, factory)
    else:
        make, plain = SecureFed3R, Fed3RStatsTask(Z, y, factory, windows=fresh_windows())
    handler = make(identity, aggregator_key, plain, noise_rng=ZeroSkellam())
    try:
        handler.on_task(msg.body["job"], msg.body["round"], msg.body["params"], dict(msg.tensors))
    except TaskDeclined as exc:
        return {"status": "declined", "reason": str(exc)}
    (client,) = handler.sessions.sessions.values()
    vector = np.asarray(client._raw_input, np.float64)
    with open(result_path + ".vector", "wb") as f:
        f.write(vector.astype("<f8").tobytes())
    try:
        with open(round_path) as f:
            words = ClientSecAgg._encode(vector, RoundConfig.from_dict(json.load(f)))
    except SecAggError as exc:
        return {"status": "out_of_range", "reason": str(exc)}
    with open(result_path, "wb") as f:
        f.write(words.astype("<u8").tobytes())
    return {"status": "done", "result": result_path}


STORES: dict[str, tuple] = {}      # the last case's state folder -> (budget, its store)


_WINDOWS = itertools.count()


@functools.cache
def _windows_folder() -> tempfile.TemporaryDirectory:
    # kept (cached) for the process's life, removed at its end by the object's finalizer
    return tempfile.TemporaryDirectory(prefix="fuzz-sample-windows-")


def fresh_windows():
    """A fresh device's kept sample-window ledger, one per fed3r.stats or fed3r.secure case: a device
    without a state folder answers only all its samples (edge_client/sample_windows.py), and a case's
    cap below its samples or its from_sample would be declined by every device alike, compared
    nowhere (tests/test_fuzz_capped_fed3r.py, tests/fuzz_windows.py)."""
    from edge_client.sample_windows import SampleWindowLedger

    return SampleWindowLedger(f"{_windows_folder().name}/{next(_WINDOWS)}.json")


def handler_for(kind: str, Z: np.ndarray, y: np.ndarray, rest: list[str]):
    """The device's handler of ``kind`` on features (Z, y); ``rest``: the case line's held-out
    features file ("-": none), then for a stateful kind its state folder and (optional) budget."""
    import importlib

    from edge_client.tasks.fed3r_stats import Fed3RStatsTask
    from edge_client.tasks.head_training import HeadTrainingTask
    from edge_client.tasks.personalization import PersonalizeTask

    factory = lambda b, s, w: PrecomputedFeatures(Z.shape[1])      # noqa: E731
    if kind == "fed3r.stats":        # a fresh device with a kept ledger: its caps and from_sample are answered
        return Fed3RStatsTask(Z, y, factory, windows=fresh_windows())
    if kind == "fedavg.head":
        return HeadTrainingTask(Z, y, factory)
    if kind == "oll.personalize":
        return PersonalizeTask(Z, y, *read_features(rest[0]), factory)
    from edge_client.state import DEFAULT_BUDGET_BYTES, DeviceStateStore

    module, name = STATEFUL[kind].split(":")
    budget = int(rest[2]) if len(rest) > 2 else DEFAULT_BUDGET_BYTES
    if STORES.get(rest[1], (None, None))[0] != budget:       # a case's rounds share their store, as a device's do
        STORES.clear()
        STORES[rest[1]] = (budget, DeviceStateStore(rest[1], budget))
    store = STORES[rest[1]][1]
    held = read_features(rest[0]) if rest[0] != "-" else (None, None)
    return getattr(importlib.import_module(module), name)(Z, y, factory, store, *held)


def capture_kept(handler) -> dict[str, np.ndarray]:
    """The state a stateful handler stores this round (filled when it stores it): read off its
    ``keep`` instead of the store's file, which would cost the fuzzer another read per task."""
    kept: dict[str, np.ndarray] = {}
    keep = handler.keep

    def keeping(task, started, now, replaced=None):
        keep(task, started, now, replaced)
        kept.update(now)

    handler.keep = keeping
    return kept


def stateful_facts(handler, kept: dict[str, np.ndarray], tensors: dict) -> dict:
    """What the comparison needs of a stateful round on this device: the largest |value| of the state
    it kept, and the smallest relative logit gap of a held-out sample (personal and global head)."""
    facts = {"state_max": max((float(np.abs(a.astype(np.float64)).max()) for a in kept.values() if a.size),
                              default=0.0)}
    if getattr(handler, "holdout_labels", None) is not None and kept and len(tensors["bias"]) >= 2:
        Zh = np.asarray(handler.holdout_images, np.float32)
        heads = [(kept.get("weight", tensors["weight"]), kept["bias"]), (tensors["weight"], tensors["bias"])]
        facts["margin"] = min(relative_margin(Zh, w, b) for w, b in heads)
    return facts


def relative_margin(Z: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> float:
    with np.errstate(over="ignore", invalid="ignore"):
        logits = np.sort(Z @ weight.T + bias, axis=1)
        gap = (logits[:, -1] - logits[:, -2]) / np.maximum(1.0, np.abs(logits).max(axis=1))
    return float(np.nan_to_num(gap, nan=0.0).min())


def run_cases(lines: list[str], aggregator_key: bytes, device_seed: bytes, device_id: str) -> list[dict]:
    """Per case {"status": done|declined|refused, "reason", "result": path, "margin", "state_max"}."""
    from edge_client.agent import TaskDeclined
    from protocols.envelope import Envelope, EnvelopeError, decode, encode
    from protocols.identity import DeviceIdentity, sender_verifier

    verifier = sender_verifier("aggregator", aggregator_key)
    identity = DeviceIdentity.from_private_bytes(device_id, device_seed)
    out = []
    for line in lines:
        task_path, feats, result_path, *rest = line.split()
        try:
            msg = decode(open(task_path, "rb").read(), verifier)
        except EnvelopeError as exc:
            out.append({"status": "refused", "reason": str(exc)})
            continue
        kind, params = msg.body["kind"], msg.body["params"]
        if kind in SECURE:
            with np.errstate(over="ignore", invalid="ignore"):     # the cases that diverge on purpose
                out.append(run_secure(kind, msg, *read_features(feats), rest, result_path, identity, aggregator_key))
            continue
        handler = handler_for(kind, *read_features(feats), rest)
        kept = capture_kept(handler) if kind in STATEFUL else {}
        try:
            with np.errstate(over="ignore", invalid="ignore"):     # the cases that diverge on purpose
                body, tensors = handler(params, dict(msg.tensors))
        except TaskDeclined as exc:
            out.append({"status": "declined", "reason": str(exc)})
            continue
        body.update({"job": msg.body["job"], "round": msg.body["round"], "task": msg.id, "kind": kind})
        with open(result_path, "wb") as f:
            f.write(encode(Envelope("result", device_id, body, tensors), signer=identity.sign))
        case = {"status": "done", "result": result_path}
        if kind == "oll.personalize":
            case["margin"] = decision_margin(handler, *read_features(rest[0]))
        elif kind in STATEFUL:
            case.update(stateful_facts(handler, kept, msg.tensors))
        out.append(case)
    return out


def decision_margin(task, Z: np.ndarray, y: np.ndarray) -> float:
    """The smallest gap between a held-out sample's two largest logits under the personalised head
    (inf when no head): a count within rounding of a decision boundary may differ between devices."""
    if task.head is None or task.head.weight.shape[0] < 2:
        return float("inf")
    logits = np.sort(Z @ task.head.weight.T + task.head.bias, axis=1)
    return float((logits[:, -1] - logits[:, -2]).min())


if __name__ == "__main__":
    cases, key, seed, prefix = sys.argv[1:5]
    statuses = run_cases(open(cases).read().splitlines(), bytes.fromhex(key), bytes.fromhex(seed), "numpy0")
    with open(prefix + ".json", "w") as f:
        json.dump(statuses, f)
