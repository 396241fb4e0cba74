"""The Java device library's ``fedavg.head`` task against the Python device on the same inputs
(the tolerance: tests/java_tasks.py):

* the mini-batch order: the library's NumpyGenerator gives numpy's ``default_rng(seed)``
  permutations bit for bit, so both devices visit the same rows in the same steps
  (``protocols.payloads.fedavg.batch_schedule``, golden vector ``sample_order.json``);
* ``fedavg.head`` (FedAvg(ψ), and FedBuff's ``model_version`` echoed): the Java device's trained
  head equals the Python device's (its numpy step, what a torch-free device runs, and the eager
  torch step of a full install) on the same features, initial head and recipe, within
  ``head_tolerance``; its result passes the aggregator's parser; a malformed task is declined with
  a reason;
* the signed FedSAM / FedASAM+FedProx golden training vectors, and a task past the work budget
  declined by both devices before training.
"""

from __future__ import annotations

import numpy as np
import pytest

import java_build
from test_differential_fuzz import head_tolerance
from java_tasks import C, D, RECIPE, device_data, java, java_cp, run_java_task  # noqa: F401 (java_cp: a fixture)

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))


def test_sample_order_is_the_golden_vectors(java_cp):
    """The golden sample_order.json is what the protocol's batch_schedule (numpy's default_rng)
    gives now, and the Java device's LocalTraining takes exactly those mini-batches."""
    import json

    from protocols import golden

    path = golden.golden_dir() / golden.SAMPLE_ORDER_FILE
    assert json.loads(path.read_text()) == golden.golden_sample_order()
    out = java(java_cp, "--sample-order", path)
    assert out.split("\n")[:-1] == [f"ORDER {i} ok" for i in range(len(golden.golden_sample_order()))], out


@pytest.mark.parametrize("rule", [{}, {"local_rule": "sam", "sam_rho": 0.2},
                                  {"local_rule": "asam", "sam_rho": 0.5, "asam_eta": 0.2, "prox_mu": 0.1}])
def test_fedavg_head_equals_the_python_device(java_cp, tmp_path, rule):
    """Plain SGD, FedSAM, FedASAM+FedProx (edge_client/tasks/local_rules.py) steps of the Java head trainer."""
    from edge_client.tasks.head_training import LocalTraining, _TorchHeadStepper, local_sgd, train_head
    from edge_client.tasks.numpy_head import NumpyHeadStepper
    from protocols.payloads.fedavg import parse_head_update

    Z, y = device_data(0)
    rng = np.random.default_rng(3)
    head = {"weight": (rng.normal(size=(C, D)) * 0.1).astype(np.float32), "bias": rng.normal(size=C).astype(np.float32)}
    out, result = run_java_task(java_cp, tmp_path, {**RECIPE, **rule, "model_version": 4}, head, (Z, y))
    update = parse_head_update(result, C, D)                     # what the aggregator accepts
    assert update.n == len(y) and result.body["model_version"] == 4      # FedBuff's staleness echo
    recipe = LocalTraining.from_params({**RECIPE, **rule})
    steps, java_loss = int(out.split()[2]), float(out.split()[4])
    for stepper_class in (NumpyHeadStepper, _TorchHeadStepper):  # torch-free device, full install
        stepper = stepper_class(head["weight"], head["bias"], recipe)
        py_steps, py_loss = local_sgd(stepper, len(y), Z, y, recipe)
        ref = stepper.parameters()
        assert steps == py_steps == 15 and abs(java_loss - py_loss) <= 1e-5
        tol = head_tolerance(RECIPE, head, Z, steps, RECIPE["batch_size"], ref, update.tensors())
        for k, got in (("weight", update.weight), ("bias", update.bias)):
            diff = np.abs(got - ref[k]).max()
            assert diff <= tol, (stepper_class.__name__, k, diff, tol)
            assert np.abs(ref[k] - head[k]).max() > 10 * tol   # it trained: the tolerance can fail
    trained = train_head(head["weight"], head["bias"], Z, y, recipe)     # what HeadTrainingTask runs here
    assert np.abs(update.weight - trained.weight).max() <= tol
    if not rule:
        _, without_version = run_java_task(java_cp, tmp_path, RECIPE, head, (Z, y))
        assert "model_version" not in without_version.body
    else:      # the rule changed the step, by more than the tolerance
        plain = train_head(head["weight"], head["bias"], Z, y, LocalTraining.from_params(RECIPE))
        assert np.abs(plain.weight - update.weight).max() > 10 * tol


@pytest.mark.parametrize("change, tensors, reason", [
    ({"lr": -1.0}, None, "lr must be a finite number > 0"),
    ({"seed": -3}, None, "seed must be an integer >= 0"),
    ({"feature_dim": D + 1}, None, "shape"),
    ({"num_classes": 2}, None, "outside the job's 2 classes"),
    ({}, {"weight": np.zeros((C, D), np.float32)}, "no head tensor 'bias'"),
    ({}, {"weight": np.full((C, D), np.nan, np.float32), "bias": np.zeros(C, np.float32)}, "NaN or Inf"),
    ({"lr": 1e30}, None, "diverged"),
    ({"local_rule": "nesterov"}, None, "local_rule must be one of"),
    ({"local_rule": "sam", "sam_rho": 0.0}, None, "needs sam_rho > 0"),
    ({"prox_mu": -0.5}, None, "prox_mu must be a finite number"),
])
def test_malformed_fedavg_head_tasks_are_declined_with_a_reason(java_cp, tmp_path, change, tensors, reason):
    head = tensors if tensors is not None else {"weight": np.zeros((change.get("num_classes", C), D), np.float32),
                                                "bias": np.zeros(change.get("num_classes", C), np.float32)}
    out, _ = run_java_task(java_cp, tmp_path, {**RECIPE, **change}, head, device_data(0))
    assert out.startswith("DECLINED") and reason in out, out


@pytest.mark.parametrize("name", ["task_fedavg_head_sam", "task_fedavg_head_asam_prox"])
def test_java_sam_step_reproduces_the_golden_training_vector(java_cp, tmp_path, name):
    """The signed FedSAM / FedASAM+FedProx fedavg.head tasks of protocols/golden/training/ (written
    by edge_client/golden_training.py from the Python device's numpy step): the Java device verifies
    each task's signature and trains the golden head within head_tolerance; the files on disk are
    what the generator produces now."""
    import json

    from edge_client import golden_training
    from edge_client.tasks.head_training import LocalTraining, local_sgd
    from edge_client.tasks.numpy_head import NumpyHeadStepper
    from protocols.envelope import decode
    from protocols.identity import DeviceIdentity

    folder = golden_training.training_dir()
    want_index, files = golden_training.training_vectors()
    assert json.loads((folder / "index.json").read_text()) == json.loads(json.dumps(want_index))
    assert all((folder / f).read_bytes() == data for f, data in files.items())
    case = want_index[name]
    (tmp_path / "cases").write_text(f"{folder / case['task']} {folder / case['features']} {tmp_path / 'result.bin'}\n")
    device = DeviceIdentity.from_private_bytes("java0", bytes(32))
    out = java(java_cp, "--batch", tmp_path / "cases", case["public_key"], device.private_bytes().hex())
    lines = out.splitlines()
    assert lines[0] == "CASE 0" and lines[1] == "DONE", out
    assert int(lines[2].split()[1]) == case["steps"] and abs(float(lines[2].split()[3]) - case["loss"]) <= 1e-5
    result = decode((tmp_path / "result.bin").read_bytes())
    want = {k: np.array(case[k], np.float32) for k in ("weight", "bias")}
    start = golden_training.start_head()
    Z, y = golden_training.features()
    tol = head_tolerance(case["params"], start, Z, case["steps"], case["params"]["batch_size"], want, result.tensors)
    for k in ("weight", "bias"):
        assert np.abs(result.tensors[k] - want[k]).max() <= tol, (k, tol)
    plain = {**case["params"], "local_rule": "sgd", "prox_mu": 0.0}       # the rule moved the head far past tol
    stepper = NumpyHeadStepper(start["weight"], start["bias"], LocalTraining.from_params(plain))
    local_sgd(stepper, len(y), Z, y, LocalTraining.from_params(plain))
    assert np.abs(stepper.parameters()["weight"] - want["weight"]).max() > 10 * tol


def test_a_head_task_past_the_work_budget_is_declined_by_both_devices_before_training(java_cp, tmp_path):
    """A review's finding: the step budget counts SGD steps, not their cost: 50,000 classes, a batch
    of every row and 10,000 epochs is 10,000 steps and held a device's only task thread for 84
    minutes. Both devices decline a head task past MAX_LOCAL_WORK (epochs x rows x C(d + 1)
    multiply-adds) before any step, with the same count."""
    import time

    from edge_client.agent import TaskDeclined
    from edge_client.tasks.head_training import LocalTraining, train_head
    from protocols.payloads.fedavg import MAX_LOCAL_WORK

    classes, rows, epochs = 100_000, 2000, 10_000
    work = epochs * rows * classes * (D + 1)
    assert work > MAX_LOCAL_WORK and epochs * 1 <= 1_000_000          # within the step budget: one batch an epoch
    rng = np.random.default_rng(5)
    Z, y = rng.normal(size=(rows, D)), rng.integers(0, 10, rows)
    head = {"weight": np.zeros((classes, D), np.float32), "bias": np.zeros(classes, np.float32)}
    params = {**RECIPE, "num_classes": classes, "epochs": epochs, "batch_size": rows}
    t0 = time.monotonic()
    out, _ = run_java_task(java_cp, tmp_path, params, head, (Z, y))
    count = f"is {work:.2e} multiply-adds, more than a device takes (1e+13)"
    assert out.startswith("DECLINED") and count in out, out
    with pytest.raises(TaskDeclined) as declined:
        train_head(head["weight"], head["bias"], Z, y, LocalTraining.from_params(params))
    assert count in str(declined.value)
    assert time.monotonic() - t0 < 60                      # declined before training, on both devices

