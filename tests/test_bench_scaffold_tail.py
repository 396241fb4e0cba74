"""bench/_ft_fed.py's in-process Scaffold(φ) device (the claim bench/claims/scaffold_tail.py runs):
the device's ScaffoldTailTask on an eager session, checked against a plain torch loop of option II."""

import pathlib
import sys

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

from _ft_fed import (EagerScaffoldTailDevice, EagerTailDevice, EagerTailProgram, EagerTailSession,  # noqa: E402
                     TailClassifierModule)

from aggregator.jobs.fedavg_tail import TailFedAvgConfig, TailFedAvgJob  # noqa: E402
from aggregator.jobs.scaffold_tail import ScaffoldTailConfig, ScaffoldTailJob  # noqa: E402
from edge_client.state import DeviceStateStore  # noqa: E402
from protocols.payloads.fedavg import batch_schedule  # noqa: E402
from protocols.payloads.scaffold import CONTROL, DELTA_CONTROL, KIND_TAIL, ScaffoldTailParams  # noqa: E402

C, D, ROWS = 3, 4, 37


def program(seed=0):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    head = {"weight": rng.normal(size=(C, D)).astype(np.float32), "bias": rng.normal(size=C).astype(np.float32)}
    return EagerTailProgram(TailClassifierModule(nn.Sequential(nn.Flatten(), nn.Linear(6, D)), head)), head


def job(kind, prog, head, **over):
    fields = dict(num_classes=C, image_size=32, feature_dim=D, rounds=2, clients_per_round=1, seed=0, init="fed3r",
                  client_lr=0.5, tail_stages=1, train="tail", tail_program_file="in-process", **over)
    if kind == "scaffold":
        return ScaffoldTailJob(ScaffoldTailConfig(**fields, total_devices=1), initial_head=head, program=prog)
    return TailFedAvgJob(TailFedAvgConfig(**fields), initial_head=head, program=prog)


def data(seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(ROWS, 1, 2, 3)).astype(np.float32), rng.integers(0, C, ROWS)


def reference(prog, start, control, acts, labels, recipe):
    """Option II by hand: y ← y − lr (g + c − c_k + wd·y) per mini-batch (c_k = 0), c_k⁺ = −c + (x − y)/(K lr)."""
    y = {k: torch.tensor(v) for k, v in start.items()}
    trained = [k for k in y if k.startswith("tail.")]
    batches = batch_schedule(len(labels), recipe.epochs, recipe.batch_size, recipe.seed)
    for rows in batches:
        for k in trained:
            y[k].requires_grad_(True)
        logits = torch.func.functional_call(prog.module, y, (torch.from_numpy(acts[rows]),))
        loss = F.cross_entropy(logits / recipe.temperature, torch.from_numpy(labels[rows]))
        grads = torch.autograd.grad(loss, [y[k] for k in trained])
        with torch.no_grad():
            for k, g in zip(trained, grads):
                y[k] = (y[k] - recipe.lr * (g + torch.from_numpy(control[k]) + recipe.weight_decay * y[k])).detach()
    y = {k: y[k].numpy() for k in trained}
    ck = {k: -control[k] + (start[k] - y[k]) / (len(batches) * recipe.lr) for k in trained}
    return y, ck


def test_zero_control_is_ft_phi_and_a_control_corrects_every_step(tmp_path):
    prog, head = program()
    acts, labels = data()
    session = EagerTailSession(prog, 0.1)
    device = EagerScaffoldTailDevice(acts, labels, session, DeviceStateStore(tmp_path / "d"))
    scaffold, fedavg = job("scaffold", prog, head), job("fedavg", prog, head)
    for j in (scaffold, fedavg):
        assert j.next_participants({"d"}) == ["d"]
    params, tensors = scaffold.task_for("d")
    body, out = device(params, tensors)                         # round 1: c = 0, no stored c_k
    ft_body, ft_out = EagerTailDevice(acts, labels, prog)(*fedavg.task_for("d"))
    assert body["restarted"] and body["n"] == ft_body["n"] == ROWS
    tail = sorted(k for k in prog.shapes() if k.startswith("tail."))
    assert sorted(k for k in out if not k.startswith(DELTA_CONTROL)) == sorted(ft_out) == tail   # head frozen
    for k in tail:
        np.testing.assert_allclose(out[k], ft_out[k], rtol=1e-5, atol=1e-6)

    rng = np.random.default_rng(7)
    control = {k: rng.normal(scale=0.3, size=tensors[k].shape).astype(np.float32) for k in tail}
    tensors2 = {**tensors, **{CONTROL + k: v for k, v in control.items()}}
    fresh = EagerScaffoldTailDevice(acts, labels, session, DeviceStateStore(tmp_path / "e"))
    _, out2 = fresh(params, tensors2)
    start = {k: v for k, v in tensors.items() if not k.startswith(CONTROL)}
    recipe = fresh.prepare(params, start, ScaffoldTailParams, KIND_TAIL).params.training
    y, ck = reference(prog, start, control, acts, labels, recipe)
    for k in tail:
        np.testing.assert_allclose(out2[k], y[k], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(out2[DELTA_CONTROL + k], ck[k], rtol=1e-3, atol=1e-4)
        assert not np.allclose(out2[k], out[k], atol=1e-4)     # the correction moved y


def test_temperature_other_than_the_programs_is_declined(tmp_path):
    from edge_client.agent import TaskDeclined

    prog, head = program()
    acts, labels = data()
    device = EagerScaffoldTailDevice(acts, labels, EagerTailSession(prog, 0.5), DeviceStateStore(tmp_path / "d"))
    scaffold = job("scaffold", prog, head)
    scaffold.next_participants({"d"})
    with pytest.raises(TaskDeclined):
        device(*scaffold.task_for("d"))
