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
from fedfleet.sim_config import load_config
from fedfleet.simulate import Prepared, check_devices_per_process, split_params
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


def test_every_simconfig_field_declares_its_limit_and_every_preset_keeps_them():
    from aggregator.jobs.config_limits import undeclared_fields
    from fedfleet.sim_config import PRESETS, SimConfig

    assert undeclared_fields(SimConfig) == []
    for name in PRESETS:
        assert load_config(name, {}) == PRESETS[name]          # each preset passes its own fields' limits
    # the optional fields take None: no feature cache (bench/async_vs_sync.py's devices), no tail bundle
    assert dataclasses.replace(PRESETS["smoke"], cache_dir=None, tail_bundle=None, broker=None).cache_dir is None


# A review's findings: fields that reached the run unchecked (devices_per_broker 0: a ZeroDivisionError
# after the data was split and files written; image_size or devices without a bound: a MemoryError) and
# job fields the aggregator refused only after the fleet had started (lam -1: a RuntimeError with its log).
@pytest.mark.parametrize("fields,named", [
    ({"devices_per_broker": 0}, "devices_per_broker"), ({"image_size": 100_000}, "image_size"),
    ({"devices": 10 ** 9}, "devices"), ({"workers": True}, "workers"), ({"dropout_prob": 1.0}, "dropout_prob"),
    ({"slowdown": [2.0]}, "slowdown"), ({"slowdown": [0.5, 2.0]}, "slowdown"), ({"bandwidth_bps": "fast"}, "bandwidth_bps"),
    ({"split": "zipf"}, "split"), ({"runtime": "tensorrt"}, "runtime"), ({"topic_root": "a/#"}, "topic_root"),
    ({"lam": -1.0}, "lam"), ({"ft_client_lr": 0}, "ft_client_lr"), ({"fp_lrs": []}, "fp_lrs"),
    ({"ft_server_optimizer": "lion"}, "ft_server_optimizer"), ({"dp_release": "never"}, "dp_release"),
    ({"rf_dim": 10 ** 6}, "rf_dim"), ({"tail_stages": 99}, "tail_stages"),
])
def test_a_field_outside_its_limit_is_one_clear_error_naming_it(tmp_path, fields, named):
    path = tmp_path / "fleet.json"
    path.write_text(__import__("json").dumps({"devices": 10, **fields}))
    with pytest.raises(UserError, match=f"'{named}'") as refused:
        load_config(str(path), {})
    assert str(path) in str(refused.value)
    with pytest.raises(UserError, match=f"'{named}'"):           # the same value as an option over a preset
        load_config("smoke", {named: tuple(v) if isinstance(v := fields[named], list) else v})


def test_a_job_field_takes_the_limit_the_aggregator_checks():
    """Not a copy: the SimConfig field's limit is the job field's, so what the job refuses is refused
    before the fleet starts, and what it takes is taken."""
    from aggregator.jobs.registry import validate_job_config

    for kind, job_field, sim_field, bad, good in [("fed3r", "lam", "lam", 0.0, 1e-12),
                                                  ("fedavg", "client_lr", "ft_client_lr", 101.0, 100.0),
                                                  ("personalize", "fp_epochs", "fp_epochs", 10_001, 10_000)]:
        with pytest.raises(ValueError, match=job_field):
            validate_job_config(kind, {job_field: bad})
        with pytest.raises(UserError, match=sim_field):
            load_config("smoke", {sim_field: bad})
        validate_job_config(kind, {job_field: good})
        assert getattr(load_config("smoke", {sim_field: good}), sim_field) == good


def test_json_arrays_become_the_tuples_a_preset_holds(tmp_path):
    path = tmp_path / "fleet.json"
    path.write_text(__import__("json").dumps({"slowdown": [1.0, 1.5], "fp_lrs": [0.01]}))
    cfg = load_config(str(path), {})
    assert cfg.slowdown == (1.0, 1.5) and cfg.fp_lrs == (0.01,)


def test_an_out_dir_that_is_a_file_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match="out_dir"):
        load_config("smoke", {"out_dir": str(tmp_path / "afile")})
    assert (tmp_path / "afile").read_text() == "x"
