"""The differential fuzzer's devices compute a DP Fed3R-Sync case whose cap bites.

A device without a state folder answers only a window of all its samples
(edge_client/sample_windows.py): a capped window of fewer is declined. The fuzzer's three devices
(tests/fuzz_device.py for the Python and torch-free ones, TaskRunner --batch for the Java one)
took each ``fed3r.secure`` case without one, so every case whose ``max_samples`` was below the
device's count was declined by all three alike: "agreement", with the capped statistics, the one
thing the cap changes, compared nowhere. Each case is a fresh device with a kept ledger now.

Checked here on one such case through the fuzzer's own runner (``run_devices``): each device
computes it, the Python vector is numpy's capped statistics on the grid, and the three agree
(``fuzz_secure.compare``)."""

from __future__ import annotations

import json

import numpy as np

from test_differential_fuzz import BASE, features, keys, run_devices  # noqa: F401 (keys: a fixture)
from test_java_device import write_features


def test_every_fuzz_device_computes_a_capped_secure_fed3r_case(keys, tmp_path):  # noqa: F811
    import fuzz_secure

    from protocols import messages as M
    from protocols.envelope import Envelope, encode
    from protocols.payloads.secagg import pack_sync_vector
    from protocols.secagg import RoundConfig
    from protocols.secagg.fixedpoint import max_scale_bits

    C, d, n, cap, bits = 3, 4, 20, 12, 16
    Z, y = features(np.random.default_rng(5), n, d, C)
    clip = 2.0
    params = {**BASE, "num_classes": C, "fit_intercept": True, "random_features": None, "format": "sparse",
              "dtype": "float64", "factor": False, "group": "g1", "max_samples": cap, "cap_samples": True,
              "feature_clip_norm": clip, "dp": {"stddev": 1e-9, "scale_bits": bits}}
    p = d + 1
    length = p * (p + 1) // 2 + C * p + 1
    bound = 2.0 ** 10
    config = RoundConfig.create(job_id="fuzz", round_id=1, group_id="g1", aggregator_id="aggregator",
                                members=fuzz_secure.MEMBERS, vector_length=length, bound=bound,
                                scale_bits=min(bits, max_scale_bits(len(fuzz_secure.MEMBERS), bound))).to_dict()
    task = M.task_message("aggregator", "fuzz", 1, "fed3r.secure", params, 2e9)
    (tmp_path / "t.task").write_bytes(encode(Envelope(task.type, task.sender, task.body, {}),
                                             signer=keys["aggregator"].sign))
    feats = write_features(tmp_path / "t.feat", Z, y)
    (tmp_path / "t.round").write_text(json.dumps(config))
    for device in ("python", "numpy", "java"):
        (tmp_path / f"{device}.cases").write_text(
            f"{tmp_path / 't.task'} {feats} {tmp_path / f't.{device}'} {tmp_path / 't.round'}\n")

    statuses = run_devices(tmp_path, keys)
    got = {device: statuses[device][0] for device in statuses}
    assert {device: g["status"] for device, g in got.items()} == dict.fromkeys(got, "done"), got

    # numpy's reference: the first `cap` rows, each clipped to `clip`, with an intercept column
    Zc = Z[:cap].astype(np.float64)
    Zc = Zc * np.minimum(1.0, clip / np.maximum(np.linalg.norm(Zc, axis=1, keepdims=True), 1e-300))
    X = np.hstack([Zc, np.ones((cap, 1))])
    A, b = X.T @ X, np.eye(C)[y[:cap]].T @ X
    want = np.rint(np.ldexp(pack_sync_vector(A[np.triu_indices(p)], b, 0), bits)) / 2.0 ** bits
    python = np.frombuffer((tmp_path / "t.python.vector").read_bytes(), "<f8")
    assert python.shape == want.shape and np.abs(python - want).max() <= 2.0 ** -bits + 1e-9

    report = {"failures": [], "worst": 0.0}
    fuzz_secure.compare("fed3r.secure", (params, {}, (Z, y), config), got, report)
    assert not report["failures"], report["failures"]
