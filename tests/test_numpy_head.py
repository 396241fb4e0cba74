"""The torch-free head step (edge_client.tasks.numpy_head) against the eager torch head step on the
same data, and train_head on a device where ``import torch`` fails."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_client.tasks.head_training import LocalTraining, _TorchHeadStepper, local_sgd
from edge_client.tasks.numpy_head import NumpyHeadStepper

ROOT = Path(__file__).resolve().parents[1]


def _problem(seed=0, n=130, d=24, c=7):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(c, d)).astype(np.float32) * 0.1, rng.normal(size=c).astype(np.float32) * 0.1,
            rng.normal(size=(n, d)).astype(np.float32), rng.integers(0, c, n).astype(np.int64))


@pytest.mark.parametrize("recipe", [LocalTraining(), LocalTraining(epochs=3, batch_size=16, lr=0.05,
                                                                   weight_decay=0.0, temperature=1.0, seed=4)])
def test_numpy_head_step_equals_the_eager_torch_step(recipe):
    weight, bias, features, labels = _problem()
    ours, theirs = NumpyHeadStepper(weight, bias, recipe), _TorchHeadStepper(weight, bias, recipe)
    assert ours.step(features[:50], labels[:50]) == pytest.approx(theirs.step(features[:50], labels[:50]), rel=1e-5)
    steps_a, loss_a = local_sgd(ours, len(labels), features, labels, recipe)
    steps_b, loss_b = local_sgd(theirs, len(labels), features, labels, recipe)
    assert steps_a == steps_b and loss_a == pytest.approx(loss_b, rel=1e-4)
    for name, value in theirs.parameters().items():
        np.testing.assert_allclose(ours.parameters()[name], value, rtol=1e-4, atol=1e-5)
    assert not np.allclose(ours.parameters()["weight"], weight)          # it did train


def test_train_head_runs_in_numpy_where_torch_cannot_be_imported():
    weight, bias, features, labels = _problem(seed=1)
    expected = local_sgd(_TorchHeadStepper(weight, bias, LocalTraining()), len(labels), features, labels,
                         LocalTraining())[1]
    code = """
import sys, json
sys.modules['torch'] = None
import numpy as np
from edge_client.tasks.head_training import LocalTraining, train_head
rng = np.random.default_rng(1)
c, d, n = 7, 24, 130
w = rng.normal(size=(c, d)).astype(np.float32) * 0.1; b = rng.normal(size=c).astype(np.float32) * 0.1
f = rng.normal(size=(n, d)).astype(np.float32); y = rng.integers(0, c, n).astype(np.int64)
t = train_head(w, b, f, y, LocalTraining())
print(json.dumps({"runtime": t.runtime, "loss": t.mean_loss, "torch": sys.modules['torch'] is None}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["runtime"] == "numpy" and got["torch"]
    assert got["loss"] == pytest.approx(expected, rel=1e-4)
