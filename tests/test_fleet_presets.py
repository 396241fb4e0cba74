"""The cross-device presets' data: fleet-100k draws a long-tailed, label-skewed number of Fashion-
MNIST images per device, repeating images across devices, and the simulation's centralized
reference counts an image once per device holding it, as the federated sums do; its layout fits
one process's descriptor limit."""

import dataclasses

import numpy as np
import pytest

from edge_client.data import load_fashion_mnist
from fedfleet.emulation.broker import BrokerTree
from fedfleet.emulation.partition import make_split
from fedfleet.errors import UserError
from fedfleet.simulate import Prepared, check_devices_per_process, load_config, split_params
from fedfleet.simulate_report import job_report


def test_fleet_100k_assignment_is_long_tailed_and_repeats_images():
    cfg = load_config("fleet-100k", {})
    assert (cfg.devices, cfg.clients_per_round, cfg.dropout_prob, cfg.split) == (100_000, 10_000, 0.05, "long-tailed")
    _, labels = load_fashion_mnist("train")
    assert cfg.train_limit is None and len(labels) == 60_000
    parts = make_split(cfg.split, labels, cfg.devices, cfg.seed, **split_params(cfg))
    sizes = np.array([len(p) for p in parts])
    assert len(parts) == 100_000 and sizes.min() >= 1 and sizes.max() <= 50
    assert 4.5 <= sizes.mean() <= 5.5 and np.median(sizes) < sizes.mean()      # long tail to the right
    assert all(len(np.unique(p)) == len(p) for p in parts[:5000])              # no image twice on a device
    held = np.concatenate(parts)
    assert held.max() < 60_000 and len(np.unique(held)) < len(held)           # images repeat across devices
    # label skew: most devices with ≥ 10 images hold mostly one class (Dir(0.1))
    big = [p for p in parts if len(p) >= 10]
    top_share = np.array([np.bincount(labels[p]).max() / len(p) for p in big])
    assert np.median(top_share) > 0.6


class PixelFeatures:
    """A stand-in backbone: 16 pixels of the image, scaled (the reference only needs features that
    the devices' statistics were computed from)."""

    def extract(self, images):
        return images.reshape(len(images), -1)[:, 200:216].astype(np.float32) / 255


def test_centralized_reference_counts_a_repeated_image_once_per_device(tmp_path):
    rng = np.random.default_rng(3)
    X, y = rng.integers(0, 256, (40, 28, 28), dtype=np.uint8), rng.integers(0, 10, 40)
    shards = {f"d{k}": np.sort(rng.choice(40, int(rng.integers(1, 8)), replace=False)) for k in range(30)}
    held = np.concatenate(list(shards.values()))
    assert len(np.unique(held)) < len(held)
    feats, lam = PixelFeatures(), 0.01
    # the federated model from per-device sums, as the aggregator forms it
    A, B = lam * np.eye(17), np.zeros((17, 10))
    for idx in shards.values():
        Za = np.hstack([feats.extract(X[idx]).astype(np.float64), np.ones((len(idx), 1))])
        A, B = A + Za.T @ Za, B + Za.T @ np.eye(10)[y[idx]]
    np.savez(tmp_path / "model.npz", raw_weights=np.linalg.solve(A, B))
    cfg = dataclasses.replace(load_config("fleet-100k", {}), devices=30, lam=lam)
    prep = Prepared(tmp_path, X, y, X[:5], y[:5], feats.extract(X[:5]), shards, {}, [], feats, {})
    results = {"contributed": list(shards), "rounds": [], "rounds_earlier": 0, "bytes_in": 0, "bytes_out": 0, "rejections": {},
               "late": 0, "duplicates": 0, "final": {}, "history": []}
    workers = [{"dropouts": 0, "compute_s": 0.0, "bytes_up": 0}]
    report = job_report(cfg, results, workers, prep)
    assert report["central_samples"] == len(held) and report["rel_weight_error"] <= 1e-9
    # the same images counted once each make another model: the check above can fail
    once = {"once": np.unique(held)}
    other = job_report(cfg, dict(results, contributed=["once"]), workers, dataclasses.replace(prep, shards=once))
    assert other["rel_weight_error"] > 1e-3


def test_fleet_100k_fits_a_20000_descriptor_limit_per_process_and_a_lean_layout_is_refused():
    cfg = load_config("fleet-100k", {})
    brokers = BrokerTree.edges_for(cfg.devices, cfg.devices_per_broker)
    assert brokers == 6
    check_devices_per_process(cfg, cfg.workers, brokers, 20_000)          # 12,500 per worker, ~16,700 per edge
    with pytest.raises(UserError, match="raise --workers"):
        check_devices_per_process(cfg, 2, brokers, 20_000)
    with pytest.raises(UserError, match="devices_per_broker"):
        check_devices_per_process(dataclasses.replace(cfg, devices_per_broker=50_000), cfg.workers, 2, 20_000)


@pytest.mark.parametrize("keepalive", [0, -5, 70_000, "30", 2.5, None])
def test_a_keepalive_outside_mqtts_field_is_one_clear_error(tmp_path, keepalive):
    path = tmp_path / "fleet.json"
    path.write_text(__import__("json").dumps({"devices": 10, "keepalive_s": keepalive}))
    with pytest.raises(UserError, match="keepalive_s"):
        load_config(str(path), {})
    assert load_config("fleet-100k", {}).keepalive_s == 300
