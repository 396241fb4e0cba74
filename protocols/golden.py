"""Golden test vectors: fixed messages encoded to bytes on disk (protocols/golden/).

A client in another language proves its codec by decoding every ``*.bin`` to the content in
``index.json`` and re-encoding that content to the identical bytes. Regenerate (only when the
protocol version changes) with ``python -m protocols.golden``.
Training vectors (a task, its features and the head the Python device trains) are in
``golden/training/``, written by ``edge_client/golden_training.py`` (they need the device's code).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import numpy as np

from .envelope import Envelope, encode
from .payloads.fed3r import encode_factor, encode_stats
from .payloads.fedavg import batch_schedule, encode_head_update, encode_model_update, head_tensors
from .payloads.personalize import PersonalizationReport, encode_report

_TS = 1767225600.0  # 2026-01-01T00:00:00Z
# the head tasks' params (fedavg.head, fedavg.tail, FedBuff's versioned task)
_RECIPE = {"num_classes": 3, "feature_dim": 2, "backbone": "mobilenet_v2", "image_size": 64, "weights_sha256": "",
           "epochs": 1, "batch_size": 50, "lr": 0.01, "weight_decay": 4e-5, "temperature": 0.1, "seed": 7}


def golden_messages() -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    body, tensors = _fed3r_messages(out)
    out["ack_accepted"] = encode(Envelope("ack", "aggregator", {"ref": "11" * 16, "status": "accepted", "reason": ""},
                                          id="22" * 16, ts=_TS + 6))
    out["presence_online"] = encode(Envelope("presence", "dev0001", {"state": "online", "info": {"kinds": ["fed3r.stats"]}},
                                             id="33" * 16, ts=_TS))
    head, head_body, head_update = _head_messages(out)
    _tail_and_async_messages(out, head, head_body, head_update, body, tensors)
    # A chunked message cut into 200-byte slices (4 chunks); chunk ids are derived, not random, here.
    big = Envelope("result", "dev0001", body=body, tensors=tensors, id="44" * 16, ts=_TS + 7)
    data = encode(big)
    for i, part in enumerate(_deterministic_chunks(data, big.id, "dev0001", 200)):
        out[f"chunk_{i}_of_result"] = part
    out["chunked_whole"] = data
    out["result_signed_edge_cases"] = _signed_edge_cases()
    return out


def _fed3r_messages(out: dict[str, bytes]) -> tuple[dict, dict]:
    """fed3r.stats: the task, the statistics (dense), the factor forms; returns the statistics'
    body and tensors (the chunked and streaming vectors reuse them)."""
    task = Envelope("task", "aggregator", id="00" * 16, ts=_TS,
                    body={"job": "fed3r-demo", "round": 1, "kind": "fed3r.stats", "deadline": _TS + 120,
                          "params": {"num_classes": 3, "backbone": "mobilenet_v2", "image_size": 64,
                                     "weights_sha256": "", "fit_intercept": True, "random_features": None,
                                     "format": "sparse", "dtype": "float64"}})
    out["task_fed3r"] = encode(task)
    Z = np.array([[1.0, 2.0], [0.5, -1.0], [3.0, 0.25]])
    y = np.array([0, 2, 2])
    Za = np.hstack([Z, np.ones((3, 1))])
    b = np.stack([Za[y == c].sum(0) for c in (0, 2)])
    body, tensors = encode_stats(Za.T @ Za, np.array([0, 2]), b, 3, 3)
    body.update({"job": "fed3r-demo", "round": 1, "task": "00" * 16, "kind": "fed3r.stats"})
    result = Envelope("result", "dev0001", body=body, tensors=tensors, id="11" * 16, ts=_TS + 5)
    out["result_fed3r_stats"] = encode(result)
    # the exact factor form of two samples (Z = R, Q = I: class 0 and class 2, bias column last)
    R = np.array([[2.0, 1.0, 0.5, 1.0], [0.0, 1.5, 0.25, 1.0]])
    factor_body, factor_tensors = encode_factor(R, np.eye(2), np.array([0, 2]), 2, 3)
    factor_body.update({"job": "fed3r-demo", "round": 1, "task": "00" * 16, "kind": "fed3r.stats"})
    out["result_fed3r_factor"] = encode(Envelope("result", "dev0002", body=factor_body, tensors=factor_tensors,
                                                 id="12" * 16, ts=_TS + 5))
    # the canonical factor with a zero column and a dependent one: Z = [[2, 0, 1, 0.5, 1], [0, 0, 0, 1.5, 1]]
    # (column 1 zero in both rows, column 2 parallel to column 0, so the pivots are columns 0 and 3)
    R = np.array([[2.0, 1.0, 0.5, 1.0], [0.0, 0.0, 1.5, 1.0]])
    factor_body, factor_tensors = encode_factor(R, np.eye(2), np.array([0, 2]), 2, 3, zero_columns=np.array([1]))
    factor_body.update({"job": "fed3r-demo", "round": 1, "task": "00" * 16, "kind": "fed3r.stats"})
    out["result_fed3r_factor_zero_columns"] = encode(Envelope("result", "dev0003", body=factor_body,
                                                              tensors=factor_tensors, id="13" * 16, ts=_TS + 5))
    # signed zeros: Z = [[0, 1], [0.5, 1]] (classes 0 and 2, bias column last) gives R exactly and a
    # QtY whose zero the pivot's sign flip made -0.0; a canonical payload writes it +0.0
    R = np.array([[0.5, 1.0, 1.0], [0.0, 1.0, 1.0]])
    factor_body, factor_tensors = encode_factor(R, np.array([[-0.0, 1.0], [1.0, 0.0]]), np.array([0, 2]), 2, 3)
    factor_body.update({"job": "fed3r-demo", "round": 1, "task": "00" * 16, "kind": "fed3r.stats"})
    out["result_fed3r_factor_signed_zero"] = encode(Envelope("result", "dev0004", body=factor_body,
                                                             tensors=factor_tensors, id="14" * 16, ts=_TS + 5))
    return body, tensors


def _head_messages(out: dict[str, bytes]) -> tuple[dict, dict, dict]:
    """fedavg.head out and back, oll.personalize; returns the head and the head update's body and tensors."""
    # fedavg.head: a (3 classes, 2 features) head out and back; oll.personalize: counts only
    head = head_tensors(np.array([[0.5, -1.0], [0.25, 2.0], [-0.75, 0.0]]), np.array([0.125, -0.5, 0.0]))
    out["task_fedavg_head"] = encode(Envelope("task", "aggregator", id="66" * 16, ts=_TS, tensors=head,
                                              body={"job": "ft-demo", "round": 2, "kind": "fedavg.head",
                                                    "deadline": _TS + 120, "params": _RECIPE}))
    head_body, head_update = encode_head_update(head["weight"] * 0.5, head["bias"] + 0.25, 40)
    head_body.update({"job": "ft-demo", "round": 2, "task": "66" * 16, "kind": "fedavg.head"})
    out["result_fedavg_head"] = encode(Envelope("result", "dev0001", body=head_body, tensors=head_update,
                                                id="77" * 16, ts=_TS + 5))
    params = {"num_classes": 3, "feature_dim": 2, "backbone": "mobilenet_v2", "image_size": 64, "weights_sha256": "",
              "fallback": "global", "fp_epochs": 25, "batch_size": 64, "fp_lrs": [0.0001, 0.001],
              "fp_folds": 5, "weight_decay": 4e-5, "temperature": 0.1, "seed": 0}
    out["task_oll_personalize"] = encode(Envelope("task", "aggregator", id="88" * 16, ts=_TS, tensors=head,
                                                  body={"job": "oll-demo", "round": 1, "kind": "oll.personalize",
                                                        "deadline": _TS + 120, "params": params}))
    report, _ = encode_report(PersonalizationReport(80, 20, 2, {"global": 12, "oll": 17, "oll_fp": 19}, 0, 0.001))
    report.update({"job": "oll-demo", "round": 1, "task": "88" * 16, "kind": "oll.personalize"})
    out["result_oll_personalize"] = encode(Envelope("result", "dev0001", body=report, id="99" * 16, ts=_TS + 9))
    return head, head_body, head_update


def _tail_and_async_messages(out: dict[str, bytes], head: dict, head_body: dict, head_update: dict, body: dict,
                             tensors: dict) -> None:
    """fedavg.tail, secure LADD's task, FedBuff's versioned task and result, streaming Fed3R's increment."""
    # fedavg.tail: a (3, 2) head under a one-tensor tail (a 1x1 conv 1 -> 2 channels); FT(φ)
    # sends back the tail only
    tail_model = {"tail.stages.0.0.weight": np.array([[[[0.5]]], [[[-0.25]]]], dtype=np.float32), **head}
    out["task_fedavg_tail"] = encode(Envelope("task", "aggregator", id="aa" * 16, ts=_TS, tensors=tail_model,
                                              body={"job": "ft-phi-demo", "round": 3, "kind": "fedavg.tail",
                                                    "deadline": _TS + 120,
                                                    "params": {**_RECIPE, "tail_stages": 1, "train": "tail"}}))
    tail_body, tail_update = encode_model_update({"tail.stages.0.0.weight": tail_model["tail.stages.0.0.weight"] * 0.75},
                                                 40)
    tail_body.update({"job": "ft-phi-demo", "round": 3, "task": "aa" * 16, "kind": "fedavg.tail"})
    out["result_fedavg_tail"] = encode(Envelope("result", "dev0001", body=tail_body, tensors=tail_update,
                                                id="bb" * 16, ts=_TS + 5))
    out["task_ladd_train_secure"] = _secure_ladd_task()
    # fedavg-async: the task names the model version it carries, the result echoes it
    out["task_fedavg_async"] = encode(Envelope("task", "aggregator", id="c0" * 16, ts=_TS, tensors=head,
                                               body={"job": "async-demo", "round": 9, "kind": "fedavg.head",
                                                     "deadline": _TS + 120, "params": {**_RECIPE, "model_version": 4}}))
    out["result_fedavg_async"] = encode(Envelope("result", "dev0001", id="c1" * 16, ts=_TS + 5, tensors=head_update,
                                                 body={**head_body, "job": "async-demo", "round": 9,
                                                       "task": "c0" * 16, "model_version": 4}))
    # streaming Fed3R: an increment of the device's samples after the 3 the job already holds
    out["result_fed3r_increment"] = encode(Envelope("result", "dev0001", id="c2" * 16, ts=_TS + 5, tensors=tensors,
                                                    body={**body, "round": 2, "from_sample": 3}))


# The deterministic key of the signed vector (Ed25519 signatures are deterministic): public key
# in index.json, so another codec can verify the vector's signature.
GOLDEN_SIGNING_SEED = bytes(range(32))
SIGNED = {"result_signed_edge_cases"}


def _signed_edge_cases() -> bytes:
    """A signed message that pins what trips other languages' codecs (docs/protocol.md): raw
    non-ASCII and escaped strings, astral-plane keys, floats at both ends of the positional range
    and beyond, integers at the uint64 / int64 limits, and tensors of every wire dtype, a scalar and
    an empty one."""
    from .identity import DeviceIdentity

    identity = DeviceIdentity.from_private_bytes("dev0001", GOLDEN_SIGNING_SEED)
    body = {"note": "Zürich \u2603 \U0001F600 \u2028 \x7f tab\t nl\n quote\" slash/ back\\ \x01",
            "\U0001F600": 1, "\uffff": 2, "é": [1.5e-07, 1e16, 1e15, 0.0001, 4e-05, -0.0, 123456789.125, 5e-324],
            "big": 2**64 - 1, "neg": -2**63, "nested": {"b": None, "a": [True, False, {}], "": []}}
    tensors = {"f32": np.array([[0.5, -1.25], [3.0, 1e-3]], np.float32), "f64": np.array([1e-310, -0.0, 0.1]),
               "i8": np.array([-128, 127, -1], np.int8), "u8": np.arange(250, 256, dtype=np.uint8),
               "i32": np.array([[-2**31, 2**31 - 1]], np.int32), "i64": np.array([-2**63, 2**63 - 1], np.int64),
               "u32": np.array([2**32 - 1, 0, 2**31], np.uint32),
               "u64": np.array([2**64 - 1, 0, 2**63], np.uint64), "empty": np.zeros((0, 4), np.float32),
               "scalar": np.array(2.5)}
    return encode(Envelope("result", identity.device_id, body=body, tensors=tensors, id="cc" * 16, ts=_TS + 11),
                  signer=identity.sign)


def golden_public_key() -> bytes:
    from .identity import DeviceIdentity

    return DeviceIdentity.from_private_bytes("dev0001", GOLDEN_SIGNING_SEED).public_key_bytes


def _secure_ladd_task() -> bytes:
    """ladd.train.secure: a 2-cluster slot layout (slot 1 disabled) in the task params."""
    from .payloads.ladd import SelfTrainingRecipe, layout_digest, layout_to_json
    from .payloads.secagg import ClusterSlotLayout

    layout = [("tail.conv.weight", (2, 3)), ("tail.bn.running_mean", (2,)), ("head.conv.weight", (3, 2)),
              ("head.conv.bias", (3,))]
    trainable = [("tail.conv.weight", (2, 3)), ("head.conv.weight", (3, 2)), ("head.conv.bias", (3,))]
    slots = ClusterSlotLayout(trainable[:1], trainable[1:], (True, False))
    params = {"model": {"num_classes": 3, "image_size": 32}, "weights_sha256": "", "cluster": 0,
              "layout": layout_to_json(layout), "layout_sha256": layout_digest(layout),
              "trainable": [n for n, _ in trainable], "teacher": "model", "kd_sha256": "",
              **SelfTrainingRecipe(kd_lambda=0.0, seed=5).to_params(),
              "group": slots.group_id(), "slots": slots.to_json(), "max_samples": 100, "max_abs_param": 100.0}
    model = (np.arange(17, dtype=np.float32) - 8) / 4
    return encode(Envelope("task", "aggregator", id="aa" * 16, ts=_TS, tensors={"model": model},
                           body={"job": "sladd-demo", "round": 2, "kind": "ladd.train.secure",
                                 "deadline": _TS + 120, "params": params}))


def _deterministic_chunks(data: bytes, parent: str, sender: str, size: int) -> list[bytes]:
    import hashlib
    import math

    n = math.ceil(len(data) / size)
    digest = hashlib.sha256(data).hexdigest()
    return [encode(Envelope("chunk", sender, {"parent": parent, "index": i, "count": n, "total": len(data),
                                              "sha256": digest},
                            {"data": np.frombuffer(data[i * size:(i + 1) * size], np.uint8)},
                            id=f"{i + 0x55:02x}" * 16, ts=_TS + 7))
            for i in range(n)]


# What a local-training recipe's seed means (protocols.payloads.fedavg.batch_schedule): the
# mini-batches of a few recipes, for devices in other languages; seeds past 64 bits included.
SAMPLE_ORDER_FILE = "sample_order.json"


def golden_sample_order() -> list[dict]:
    cases = [(0, 10, 1, 3), (7, 50, 3, 8), (2**40 + 5, 1000, 2, 64), (123456789012345678901234567890, 37, 2, 50)]
    return [{"seed": seed, "rows": rows, "epochs": epochs, "batch_size": batch,
             "batches": [b.tolist() for b in batch_schedule(rows, epochs, batch, seed)]}
            for seed, rows, epochs, batch in cases]


def golden_dir() -> Path:
    return Path(str(resources.files("protocols").joinpath("golden")))


def write(directory: Path | None = None) -> None:
    directory = directory or golden_dir()
    directory.mkdir(parents=True, exist_ok=True)
    index = {}
    for name, data in golden_messages().items():
        (directory / f"{name}.bin").write_bytes(data)
        hlen = int.from_bytes(data[4:8], "little")
        index[name] = {"file": f"{name}.bin", "bytes": len(data), "header": json.loads(data[8:8 + hlen])}
        if name in SIGNED:
            index[name]["public_key"] = golden_public_key().hex()
    (directory / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))
    (directory / SAMPLE_ORDER_FILE).write_text(json.dumps(golden_sample_order()))


if __name__ == "__main__":
    write()
    print(f"wrote golden vectors to {golden_dir()}")
