"""`fedfleet simulate --ray`: the device hosts as Ray actors on a two-node local Ray cluster (a head
and a second node joined with ``ray start --address``, both on this machine) give the same Fed3R
model as the same fleet hosted by local worker processes, and the actors ran on both nodes."""

import dataclasses

import numpy as np
import pytest

pytest.importorskip("ray")

from fedfleet.sim_config import PRESETS  # noqa: E402

from fedfleet.simulate import run  # noqa: E402


@pytest.mark.slow
@pytest.mark.ray_cluster
def test_ray_fleet_gives_the_local_fleets_model(tmp_path, ray_test_cluster):
    base = dataclasses.replace(PRESETS["smoke"], devices=8, train_limit=400, test_limit=100, clients_per_round=4,
                               dropout_prob=0.0, slowdown=(1.0, 1.0), holdout_fraction=0.0, workers=2,
                               cache_dir=str(tmp_path / "cache"))
    local = run(dataclasses.replace(base, out_dir=str(tmp_path / "local")), quiet=True)
    on_ray = run(dataclasses.replace(base, out_dir=str(tmp_path / "ray"), ray=ray_test_cluster), quiet=True)
    assert local["contributed"] == on_ray["contributed"] == 8
    assert on_ray["rel_weight_error"] <= 1e-9
    W_local = np.load(tmp_path / "local" / "model.npz")["raw_weights"]
    W_ray = np.load(tmp_path / "ray" / "model.npz")["raw_weights"]
    # the same model up to the order of floating-point sums (results arrive in another order)
    assert np.linalg.norm(W_ray - W_local) / np.linalg.norm(W_local) <= 1e-9
    assert local["fed3r_accuracy"] == on_ray["fed3r_accuracy"]
    assert len({p["node_id"] for p in on_ray["ray_placement"]}) == 2        # one host actor per node
