"""The ``ladd`` simulate pipeline end to end over a real mosquitto (``--quick`` size)."""

import dataclasses
import json

import numpy as np
import pytest

from fedfleet.ladd.cli import add_ladd_arguments, ladd_config_from_args
from fedfleet.ladd.config import METHODS, QUICK, LaddSimConfig
from fedfleet.ladd.metrics import confusion, miou, split_cluster_models
from fedfleet.ladd.run import run_ladd


def test_confusion_and_miou_against_sklearn():
    from sklearn.metrics import confusion_matrix, jaccard_score

    rng = np.random.default_rng(0)
    y, p = rng.integers(0, 4, 500), rng.integers(0, 4, 500)
    y[:20] = 255
    cm = confusion(y, p, 4)
    keep = y != 255
    np.testing.assert_array_equal(cm, confusion_matrix(y[keep], p[keep], labels=range(4)))
    value, per_class = miou(cm)
    np.testing.assert_allclose(per_class, jaccard_score(y[keep], p[keep], average=None, labels=range(4)))
    assert value == pytest.approx(per_class.mean())
    _, absent = miou(confusion(np.zeros(5, int), np.zeros(5, int), 3))
    assert absent[0] == 1.0 and np.isnan(absent[1:]).all()        # classes never seen do not count


def test_cli_arguments_map_onto_the_config():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--out")                                   # as `fedfleet simulate` already has
    add_ladd_arguments(parser)
    cfg = ladd_config_from_args(parser.parse_args(["--quick", "--seeds", "3,4", "--rounds", "5", "--out", "x",
                                                   "--cluster-scope", "all", "--baseline-no-kd"]))
    assert cfg.seeds == (3, 4) and cfg.rounds == 5 and cfg.out_dir == "x" and cfg.cluster_scope == "all"
    assert cfg.baseline_kd is False and cfg.devices_per_domain == QUICK["devices_per_domain"]


@pytest.mark.broker
def test_quick_pipeline_over_mosquitto(broker, tmp_path):
    cfg = LaddSimConfig(**{**QUICK, "broker": broker.url, "out_dir": str(tmp_path)})
    report = run_ladd(cfg, quiet=True)
    seed = report["seeds"]["0"]
    for m in METHODS:
        assert 0.0 <= seed["methods"][m]["miou"] <= 1.0
        assert set(seed["methods"][m]["per_domain"]) == set(cfg.domains)
    clustering = seed["clustering"]
    assert clustering["k"] == len(cfg.domains) and clustering["purity"] == 1.0
    assert clustering["silhouette"] > 0.5
    n_devices = cfg.devices_per_domain * len(cfg.domains)
    # every device sent its style once; every round trained clients_per_round devices
    ladd = json.loads((tmp_path / "seed0" / "ladd" / "job_report.json").read_text())
    rounds = ladd["round_log"]
    assert rounds[0]["kind"] == "ladd.style" and rounds[0]["accepted"] == n_devices
    train_rounds = [r for r in rounds if r["kind"] == "ladd.train"]
    assert len(train_rounds) == cfg.rounds
    assert all(sum(r["per_cluster"].values()) == cfg.clients_per_round for r in train_rounds)
    # θ_c of a cluster that never had a participant is the pre-trained one, bit for bit;
    # the others moved, and only through their own cluster's devices (tested in test_ladd_aggregation)
    models, centroids = split_cluster_models(dict(np.load(tmp_path / "seed0" / "ladd" / "model.npz")))
    pretrained = dict(np.load(tmp_path / "seed0" / "fda_pretrained.npz"))
    touched = {int(c) for r in train_rounds for c in r["per_cluster"]}
    assert centroids.shape == (len(cfg.domains), 27)
    for c, arrays in models.items():
        same = all(np.array_equal(arrays[k], pretrained[k]) for k in arrays if k.startswith("head."))
        assert same == (c not in touched)
    costs = seed["costs"]
    assert costs["train_tasks"] == cfg.rounds * cfg.clients_per_round * 2       # LADD + FedAvg+ST
    assert costs["bytes_up_per_device"] > 0 and costs["device_train_s_mean"] > 0
    assert (tmp_path / "report.md").exists() and (tmp_path / "ladd_miou.png").exists()
    assert dataclasses.asdict(cfg)["broker"] == broker.url
