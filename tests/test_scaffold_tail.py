"""Scaffold on the tail (``scaffold.tail``: Scaffold(φ), Scaffold(M)), option II: the device's pass
on the exported tail program against an eager torch reference (the backbone's own last stage,
autograd, the corrected step written out), the server's control step against numpy, c_k in the
device's state store, and bad inputs declined or refused. The tail bundle is conftest's session one."""

import copy

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from aggregator.compute.tail_program import TailProgram
from aggregator.jobs.registry import build_job
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from aggregator.jobs.scaffold_tail import ScaffoldTailConfig, ScaffoldTailJob
from edge_client.agent import TaskDeclined
from edge_client.data import load_fashion_mnist
from edge_client.models import build_backbone
from edge_client.models.preprocess import to_model_input
from edge_client.runtime import TrainingSession
from edge_client.state import DeviceStateStore
from edge_client.tasks.scaffold_tail import ScaffoldTailTask
from edge_client.tasks.tail_training import TrunkActivations
from protocols.envelope import EnvelopeError
from protocols.payloads.scaffold import KIND_TAIL

from stateful_jobs import run_round

SIZE, C, T = 32, 10, 0.1
TAIL = "tail.stages.0.0.weight"
STATE = {"run": "0123abcd", "round": 1}


@pytest.fixture(scope="module")
def shared(tail_bundle):
    """One tail_training session and one trunk for every handler here (a device host shares them alike)."""
    images, labels = load_fashion_mnist("train")
    return {"bundle": tail_bundle, "session": TrainingSession.load(tail_bundle, kind="tail_training"),
            "trunk": TrunkActivations(tail_bundle), "program": TailProgram(tail_bundle.parent / "tail_eval.pt2"),
            "images": images[:60], "labels": labels[:60].astype(np.int64)}


def handler(shared, rows, store):
    return ScaffoldTailTask(shared["images"][rows], shared["labels"][rows], shared["bundle"], store,
                            trunk=shared["trunk"], session=shared["session"])


def trained_names(train):
    return [TAIL] + (["bias", "weight"] if train == "tail+head" else [])


def model(program, seed=0):
    rng = np.random.default_rng(seed)
    return {**program.tail_parameters, "weight": rng.normal(0, 0.05, (C, 1280)).astype(np.float32),
            "bias": rng.normal(0, 0.05, C).astype(np.float32)}


def params(train, round_=1, **extra):
    return {"num_classes": C, "backbone": "mobilenet_v2", "image_size": SIZE, "tail_stages": 1, "train": train,
            "epochs": 1, "batch_size": 10, "lr": 0.01, "weight_decay": 4e-5, "temperature": T, "seed": 5,
            "job_id": "sc-tail", "state": {**STATE, "round": round_}, **extra}


def reference_pass(images, labels, start, c, ck, p, names):
    """(y, c_k⁺): the backbone's own last stage (eval-mode BatchNorm), autograd and the corrected
    step y ← y − lr (g + wd·y − c_k + c) per mini-batch; c_k⁺ = c_k − c + (x − y)/(K lr)."""
    backbone = build_backbone("mobilenet_v2")
    last = copy.deepcopy(backbone.features[-1]).eval()
    trunk = torch.nn.Sequential(*list(backbone.features)[:-1]).eval()
    with torch.no_grad():
        acts = trunk(torch.from_numpy(to_model_input(images, SIZE, backbone.mean, backbone.std)))
        last[0].weight.copy_(torch.from_numpy(start[TAIL]))
    x = {TAIL: last[0].weight, "weight": torch.tensor(start["weight"]), "bias": torch.tensor(start["bias"])}
    for name in names:
        x[name].requires_grad_(True)
    drift = {k: torch.from_numpy(c[k].astype(np.float32) - ck[k].astype(np.float32)) for k in names}
    order_rng, steps = np.random.default_rng(p["seed"]), 0
    for _ in range(p["epochs"]):
        order = order_rng.permutation(len(labels))
        for s in range(0, len(order), p["batch_size"]):
            rows = torch.from_numpy(order[s:s + p["batch_size"]])
            feats = last(acts[rows]).mean(dim=(2, 3))
            loss = F.cross_entropy(F.linear(feats, x["weight"], x["bias"]) / T, torch.from_numpy(labels)[rows])
            grads = torch.autograd.grad(loss, [x[k] for k in names])
            with torch.no_grad():
                for k, g in zip(names, grads):
                    x[k] -= p["lr"] * (g + p["weight_decay"] * x[k] + drift[k])
            steps += 1
    y = {k: x[k].detach().numpy().astype(np.float64) for k in names}
    return y, {k: ck[k] - c[k] + (start[k].astype(np.float64) - y[k]) / (steps * p["lr"]) for k in names}


@pytest.mark.parametrize("train", ["tail", "tail+head"])
def test_device_pass_matches_an_eager_reference_and_keeps_c_k(shared, train, tmp_path):
    rng = np.random.default_rng(7)
    names, rows = trained_names(train), np.arange(30)
    task = handler(shared, rows, DeviceStateStore(tmp_path))
    start, ck = model(shared["program"]), {k: np.zeros_like(v) for k, v in model(shared["program"]).items()}
    for round_ in (1, 2):               # round 1 starts from c_k = 0, round 2 from what round 1 stored
        c = {k: (0.5 * rng.normal(size=start[k].shape) * np.abs(start[k]).mean() / 0.05).astype(np.float32)
             for k in names}
        body, out = task(params(train, round_), {**start, **{"control." + k: c[k] for k in names}})
        assert set(out) == set(names) | {"delta_control." + k for k in names} and body["n"] == 30
        assert body["restarted"] is (round_ == 1)
        y, new_ck = reference_pass(shared["images"][rows], shared["labels"][rows], start, c, ck, params(train), names)
        for k in names:
            np.testing.assert_allclose(out[k], y[k], atol=2e-5)                     # FT(φ)'s handler tolerance
            assert not np.allclose(out[k], start[k])
            scale = 1.0 / (3 * 0.01)        # c_k⁺ carries y's error times 1/(K lr)
            np.testing.assert_allclose(out["delta_control." + k], new_ck[k] - ck[k], atol=2e-5 * scale)
            ck[k] = ck[k] + out["delta_control." + k].astype(np.float64)
        stored = task.store.load("sc-tail", STATE["run"]).arrays
        for k in names:
            np.testing.assert_allclose(stored[k], ck[k], rtol=1e-6, atol=1e-6)
        start = {**start, **{k: out[k] for k in names}}


def test_device_declines_bad_controls_and_params(shared, tmp_path):
    task = handler(shared, np.arange(10), DeviceStateStore(tmp_path))
    start = model(shared["program"])
    good = {"control." + TAIL: np.zeros_like(start[TAIL])}
    cases = [({}, "control." + TAIL),                                                  # no control
             ({"control." + TAIL: np.zeros(3, np.float32)}, "shaped like"),
             ({"control." + TAIL: np.full_like(start[TAIL], np.nan)}, "finite float32"),
             ({"control." + TAIL: np.zeros(start[TAIL].shape, np.float64)}, "float32")]
    for control, match in cases:
        with pytest.raises(TaskDeclined, match=match):
            task(params("tail"), {**start, **control})
    with pytest.raises(TaskDeclined, match="control.weight"):           # FT(M) controls the head too
        task(params("tail+head"), {**start, **good})
    for bad, match in [({"state": {**STATE, "extra": 1}}, "unknown state fields"), ({"job_id": ""}, "job_id"),
                       ({"train": "head"}, "train must be"), ({"lr": 1e30}, "diverged")]:
        with pytest.raises(TaskDeclined, match=match):
            task({**params("tail"), **bad}, {**start, **good})
    no_store = handler(shared, np.arange(10), None)
    with pytest.raises(TaskDeclined, match="no state store"):
        no_store(params("tail"), {**start, **good})
    assert task.store.load("sc-tail", STATE["run"]) is None              # nothing declined was kept


def make_job(shared, train, **overrides):
    cfg = dict(job_id="sc-tail", num_classes=C, feature_dim=1280, image_size=SIZE, rounds=3, clients_per_round=3,
               local_epochs=1, batch_size=10, client_lr=0.01, init="zeros", train=train, tail_stages=1,
               total_devices=5, tail_program_file=str(shared["bundle"].parent / "tail_eval.pt2"), **PLAIN_MEAN)
    return ScaffoldTailJob(ScaffoldTailConfig(**{**cfg, **overrides}), program=shared["program"])


@pytest.mark.parametrize("train", ["tail", "tail+head"])
def test_job_round_steps_model_and_control_as_numpy_does(shared, train, tmp_path):
    handlers = {f"dev{i}": handler(shared, np.arange(10 * i, 10 * i + 10), DeviceStateStore(tmp_path / str(i)))
                for i in range(4)}
    job = make_job(shared, train, server_lr=0.7)
    names = trained_names(train)
    assert job.controlled == tuple(n for n in job.params if n in names)
    frozen = {k: v.copy() for k, v in job.params.items() if k not in names}
    for _ in range(2):
        w, c = {k: job.params[k].astype(np.float64) for k in names}, dict(job.control)
        sent = run_round(job, handlers, KIND_TAIL)
        assert all(set(tensors) == set(job.params) | {"control." + k for k in names}
                   for _, tensors, _, _ in sent.values())
        n = {d: body["n"] for d, (_, _, body, _) in sent.items()}
        for k in names:
            mean_y = sum(n[d] * out[k].astype(np.float64) for d, (_, _, _, out) in sent.items()) / sum(n.values())
            np.testing.assert_allclose(job.params[k], w[k] + 0.7 * (mean_y - w[k]), rtol=1e-5, atol=1e-6)
            mean_dc = np.mean([out["delta_control." + k].astype(np.float64) for _, _, _, out in sent.values()], axis=0)
            np.testing.assert_allclose(job.control[k], c[k] + len(sent) / 5 * mean_dc, rtol=1e-5, atol=1e-6)
    for k, v in frozen.items():                                          # FT(φ): the head never moves
        np.testing.assert_array_equal(job.params[k], v)
    assert np.abs(job.control[TAIL]).sum() > 0
    restored = make_job(shared, train, server_lr=0.7)
    restored.load_state_dict(job.state_dict())
    assert restored.device_state.run == job.device_state.run
    for k in names:
        np.testing.assert_array_equal(restored.control[k], job.control[k])


def test_job_refuses_bad_results_and_configs(shared, tmp_path):
    h = handler(shared, np.arange(10), DeviceStateStore(tmp_path))

    def tampered(change):
        return lambda d, out: change(dict(out))

    bad = [(lambda o: {k: v for k, v in o.items() if k != "delta_control." + TAIL}, "missing"),
           (lambda o: {**o, "delta_control.weight": np.zeros((C, 1280), np.float32)}, "unexpected"),
           (lambda o: {**o, "delta_control." + TAIL: np.full_like(o[TAIL], np.inf)}, "NaN or Inf"),
           (lambda o: {**o, "delta_control." + TAIL: o[TAIL][:5]}, "shape")]
    for change, match in bad:
        job = make_job(shared, "tail", clients_per_round=1)      # a refused result leaves its round open
        before = {k: v.copy() for k, v in job.control.items()}
        with pytest.raises(EnvelopeError, match=match):
            run_round(job, {"dev0": h}, KIND_TAIL, tamper=tampered(change))
        np.testing.assert_array_equal(job.control[TAIL], before[TAIL])
    with pytest.raises(ValueError, match="dp"):
        make_job(shared, "tail", dp_noise_multiplier=1.0, dp_clip_norm=1.0)
    with pytest.raises(ValueError, match="train must be"):
        make_job(shared, "head")
    with pytest.raises(ValueError, match="tail_program_file"):
        build_job("scaffold-tail", {"job_id": "x", "num_classes": C, "feature_dim": 1280})


def test_simulate_flag_picks_scaffold_on_the_tail_and_secure_is_refused_before_the_run():
    import dataclasses

    from fedfleet.cli import build_parser, simulate_overrides
    from fedfleet.pipeline import PHASE_KINDS, run_pipeline
    from fedfleet.sim_config import load_config

    args = build_parser().parse_args(["simulate", "--config", "smoke", "--pipeline", "fed3r-ft-oll",
                                      "--ft-algorithm", "scaffold", "--ft-mode", "phi"])
    cfg = load_config(args.config, simulate_overrides(args))
    assert (cfg.ft_algorithm, cfg.ft_mode) == ("scaffold", "phi") and KIND_TAIL in PHASE_KINDS["fedavg-ft"]
    with pytest.raises(ValueError, match="not with secure"):      # refused before any data or fleet
        run_pipeline(dataclasses.replace(cfg, secure=True), quiet=True)


def test_a_stale_c_k_restarts_from_zero_and_its_delta_is_counted_from_it(shared, tmp_path):
    """As the head's (tests/test_scaffold.py): past max_staleness the device trains from c_k = 0 but
    sends Δc = c_k⁺ − c_k(stale), the c_k the server's c still counts."""
    rng = np.random.default_rng(3)
    names, rows = trained_names("tail"), np.arange(30)
    task = handler(shared, rows, DeviceStateStore(tmp_path))
    start = model(shared["program"])
    c = {k: (0.5 * rng.normal(size=start[k].shape) * np.abs(start[k]).mean() / 0.05).astype(np.float32) for k in names}
    tensors = {**start, **{"control." + k: c[k] for k in names}}
    _, first = task(params("tail", 1, state={**STATE, "round": 1, "max_staleness": 2}), tensors)
    stale = {k: first["delta_control." + k].astype(np.float64) for k in names}          # c_k after round 1
    body, out = task(params("tail", 9, state={**STATE, "round": 9, "max_staleness": 2}), tensors)
    assert body["restarted"] is True
    zeros = {k: np.zeros_like(v) for k, v in stale.items()}
    _, fresh_ck = reference_pass(shared["images"][rows], shared["labels"][rows], start, c, zeros, params("tail"), names)
    for k in names:
        np.testing.assert_allclose(out["delta_control." + k], fresh_ck[k] - stale[k], atol=2e-5 / (3 * 0.01))
        assert np.abs(stale[k]).max() > 100 * 2e-5 / (3 * 0.01)        # counting from 0 would be told apart
