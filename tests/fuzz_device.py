"""The Python device's side of the differential fuzzer (tests/test_differential_fuzz.py): the
device's own task handlers (fed3r.stats, fedavg.head, oll.personalize) on many cases in one
process, each task verified under the aggregator's key and each result signed, as a device does.

Run in-process it is the full install's device (torch's head step); run by ``.venv-device``'s
python (``python fuzz_device.py <cases> <aggregator key hex> <device seed hex> <out prefix>``) it
is the torch-free device (numpy's head step). Imports nothing from ``aggregator`` or the tests.
"""

from __future__ import annotations

import json
import sys

import numpy as np


class PrecomputedFeatures:
    """The 'images' already are features (as the Java harness's PrecomputedFeatures)."""

    def __init__(self, dim: int):
        self.feature_dim = dim

    def extract(self, x):
        return np.asarray(x, dtype=np.float32)


def read_features(path: str) -> tuple[np.ndarray, np.ndarray]:
    """The FeatureFile format: int32 n, int32 d, n·d float32, n int32 labels (little-endian)."""
    raw = open(path, "rb").read()
    n, d = np.frombuffer(raw[:8], "<i4")
    Z = np.frombuffer(raw[8:8 + 4 * n * d], "<f4").reshape(n, d)
    return Z, np.frombuffer(raw[8 + 4 * n * d:], "<i4").astype(np.int64)


def run_cases(lines: list[str], aggregator_key: bytes, device_seed: bytes, device_id: str) -> list[dict]:
    """Per case {"status": done|declined|refused, "reason", "result": path, "margin"}."""
    from edge_client.agent import TaskDeclined
    from edge_client.tasks.fed3r_stats import Fed3RStatsTask
    from edge_client.tasks.head_training import HeadTrainingTask
    from edge_client.tasks.personalization import PersonalizeTask
    from protocols.envelope import Envelope, EnvelopeError, decode, encode
    from protocols.identity import DeviceIdentity, sender_verifier

    verifier = sender_verifier("aggregator", aggregator_key)
    identity = DeviceIdentity.from_private_bytes(device_id, device_seed)
    out = []
    for line in lines:
        task_path, feats, result_path, *held = line.split()
        try:
            msg = decode(open(task_path, "rb").read(), verifier)
        except EnvelopeError as exc:
            out.append({"status": "refused", "reason": str(exc)})
            continue
        Z, y = read_features(feats)
        factory = lambda b, s, w: PrecomputedFeatures(Z.shape[1])      # noqa: E731
        kind, params = msg.body["kind"], msg.body["params"]
        if kind == "fed3r.stats":
            handler = Fed3RStatsTask(Z, y, factory)
        elif kind == "fedavg.head":
            handler = HeadTrainingTask(Z, y, factory)
        else:
            handler = PersonalizeTask(Z, y, *read_features(held[0]), factory)
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
            case["margin"] = decision_margin(handler, *read_features(held[0]))
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
