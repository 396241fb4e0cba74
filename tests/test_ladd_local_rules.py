"""FedSAM / FedASAM / FedProx on LADD's decoder: the device's steps against a float64 reference
written out here (autograd for the loss's gradient, the rules' arithmetic by hand), and the job's
``local_rule`` fields reaching the device through a real task."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from aggregator.jobs.config_limits import validate_config
from aggregator.jobs.ladd import LaddConfig, LaddJob
from aggregator.jobs.secure_ladd import SecureLaddConfig
from edge_client.models.segmentation import SegmentationModel, SegmentationSpec, self_training_loss
from edge_client.tasks.ladd_training import LaddTrainTask, SelfTrainingRecipe, self_train
from protocols.payloads.fedavg import LocalRuleRecipe

SPEC = SegmentationSpec(num_classes=3, image_size=16, head_channels=4, aspp_rates=(2,))


@pytest.fixture(scope="module")
def batch():
    net = SegmentationModel(SPEC, seed=0)
    rng = np.random.default_rng(8)
    frozen = net.frozen_features(rng.integers(0, 256, (5, 16, 16, 3), np.uint8))
    pseudo = rng.integers(0, 3, (5, 16, 16))
    pseudo[:, :4] = 255
    kd_probs = F.softmax(torch.randn(5, 3, 16, 16, generator=torch.Generator().manual_seed(2)), 1)
    kd_mask = torch.from_numpy((rng.random((5, 16, 16)) > 0.5).astype(np.float32))
    return frozen, pseudo, kd_probs, kd_mask


def reference_steps(frozen, pseudo, kd_probs, kd_mask, recipe: SelfTrainingRecipe, names):
    """The same mini-batches in float64: d = ∇L(w + ε̂) (+ μ(w − w₀)), momentum SGD on d."""
    net = SegmentationModel(SPEC, seed=0).double().eval()
    params = dict(net.named_parameters())
    net.set_trainable(names)
    w = {k: params[k].detach().clone() for k in names}
    w0 = {k: v.clone() for k, v in w.items()}
    rule = recipe.rule
    pseudo_t = torch.from_numpy(pseudo)

    def grad_at(values, rows):
        with torch.no_grad():
            for k in names:
                params[k].copy_(values[k])
        loss, _, _ = self_training_loss(net.logits_from_features(frozen[rows].double()), pseudo_t[rows],
                                        kd_probs[rows].double(), kd_mask[rows].double(), recipe.kd_lambda)
        return dict(zip(names, torch.autograd.grad(loss, [params[k] for k in names])))

    velocity = None
    order = np.random.default_rng(recipe.seed).permutation(len(frozen))
    for start in range(0, len(frozen), recipe.batch_size):
        rows = torch.from_numpy(np.sort(order[start:start + recipe.batch_size]))
        g = grad_at(w, rows)
        if rule.local_rule != "sgd":
            t = {k: (w[k].abs() + rule.asam_eta) if rule.local_rule == "asam" else torch.ones_like(w[k])
                 for k in names}
            norm = torch.sqrt(sum(((t[k] * g[k]) ** 2).sum() for k in names))
            g = grad_at({k: w[k] + rule.sam_rho * t[k] ** 2 * g[k] / norm for k in names}, rows)
        d = {k: g[k] + rule.prox_mu * (w[k] - w0[k]) for k in names}
        velocity = d if velocity is None else {k: recipe.momentum * velocity[k] + d[k] for k in names}
        w = {k: w[k] - recipe.lr * velocity[k] for k in names}
    return {k: v.numpy() for k, v in w.items()}


@pytest.mark.parametrize("rule", [LocalRuleRecipe("sam", sam_rho=0.5),
                                  LocalRuleRecipe("asam", sam_rho=1.0, asam_eta=0.1, prox_mu=0.5)])
def test_decoder_steps_equal_a_float64_reference(batch, rule):
    frozen, pseudo, kd_probs, kd_mask = batch
    recipe = SelfTrainingRecipe(epochs=1, batch_size=3, lr=0.5, momentum=0.9, kd_lambda=10.0, seed=1, rule=rule)
    net = SegmentationModel(SPEC, seed=0)
    names = net.trainable_names("head")
    got = self_train(net, names, frozen, pseudo, kd_probs, kd_mask, recipe)
    assert got.steps == 2 and got.gradient_evaluations == 4
    want = reference_steps(frozen, pseudo, kd_probs, kd_mask, recipe, names)
    plain = reference_steps(frozen, pseudo, kd_probs, kd_mask, SelfTrainingRecipe(**{
        **{k: getattr(recipe, k) for k in ("epochs", "batch_size", "lr", "momentum", "kd_lambda", "seed")}}), names)
    moved = max(float(np.abs(want[k] - plain[k]).max()) for k in names)
    assert moved > 1e-3                  # the rule changes the result far beyond the tolerance below
    for k in names:
        np.testing.assert_allclose(got.arrays[k], want[k], rtol=1e-4, atol=1e-6)


def test_a_ladd_job_sends_its_rule_and_the_device_runs_it():
    net = SegmentationModel(SPEC, seed=0)
    initial = net.exchanged_state()
    trainable = net.trainable_names("head")
    fields = dict(model=SPEC.to_dict(), clustering="none", rounds=1, clients_per_round=1, kd_lambda=0.0,
                  local_rule="asam", sam_rho=0.3, asam_eta=0.05, prox_mu=0.01)
    validate_config("ladd", LaddConfig, fields)                  # what the API and the CLI check
    with pytest.raises(ValueError, match="local_rule"):
        validate_config("ladd", LaddConfig, {**fields, "local_rule": "adam"})
    with pytest.raises(ValueError, match="sam_rho"):
        LaddConfig(**{**fields, "sam_rho": 0.0})
    assert SecureLaddConfig(**fields).recipe(0).rule == LocalRuleRecipe("asam", 0.3, 0.05, 0.01)
    job = LaddJob(LaddConfig(**fields), initial=(initial, trainable))
    assert job.next_participants({"d0"}) == ["d0"]
    params, tensors = job.task_for("d0")
    assert SelfTrainingRecipe.from_params(params).rule == LocalRuleRecipe("asam", 0.3, 0.05, 0.01)
    images = np.random.default_rng(5).integers(0, 256, (4, 16, 16, 3), np.uint8)
    device = LaddTrainTask(images, lambda spec: SegmentationModel(spec, seed=0))
    body, out = device(params, tensors)
    assert body["steps"] == 1 and body["gradient_evaluations"] == 2        # two passes per SAM step
    plain, _ = device({**params, "local_rule": "sgd", "prox_mu": 0.0}, tensors)
    assert plain["gradient_evaluations"] == 1


def test_the_ladd_command_line_selects_the_rule_for_both_jobs():
    import argparse

    from fedfleet.ladd.cli import add_ladd_arguments, ladd_config_from_args
    from fedfleet.ladd.run import job_configs

    parser = argparse.ArgumentParser()
    add_ladd_arguments(parser)
    cfg = ladd_config_from_args(parser.parse_args(["--quick", "--local-rule", "sam", "--sam-rho", "0.3",
                                                   "--prox-mu", "0.01"]))
    assert (cfg.local_rule, cfg.sam_rho, cfg.prox_mu) == ("sam", 0.3, 0.01)
    for fields in job_configs(cfg, 0, 8).values():          # LADD and its FedAvg+ST baseline
        assert LaddConfig(**fields).recipe(0).rule == LocalRuleRecipe("sam", 0.3, cfg.asam_eta, 0.01)
    assert ladd_config_from_args(parser.parse_args(["--quick"])).local_rule == "sgd"
