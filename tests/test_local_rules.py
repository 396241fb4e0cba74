"""The devices' local step rules (edge_client/tasks/local_rules.py): FedSAM, FedASAM and FedProx
steps of every head trainer against a float64 numpy reference written out here, the training
program's SAM step (ExecuTorch) against its eager twin's, and the rule's trip from job to device."""

from __future__ import annotations

import numpy as np
import pytest

from aggregator.jobs.fedavg import FedAvgConfig
from aggregator.jobs.registry import build_job
from edge_client.agent import TaskDeclined
from edge_client.tasks.head_training import HeadTrainingTask, LocalTraining, SessionStepper, _TorchHeadStepper, \
    train_head
from edge_client.tasks.local_rules import Proximal, SharpnessAware, rule_for
from edge_client.tasks.numpy_head import NumpyHeadStepper
from protocols.payloads.fedavg import LocalRuleRecipe

C, D, T = 4, 6, 0.5


def reference_gradient(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """∇ of mean CE(softmax((x wᵀ + b)/T), y), float64, row by row."""
    gw, gb = np.zeros_like(w), np.zeros_like(b)
    for xi, yi in zip(x, y):
        z = (w @ xi + b) / T
        p = np.exp(z - z.max())
        p /= p.sum()
        p[yi] -= 1.0
        gw += np.outer(p, xi) / T / len(y)
        gb += p / T / len(y)
    return gw, gb


def reference_step(rule: str, w, b, x, y, lr, wd, rho=0.0, eta=0.0, mu=0.0, w0=None, b0=None):
    """One step of the named rule in float64: ascent (SAM/ASAM), gradient there, proximal pull, SGD with wd."""
    w, b = w.astype(np.float64), b.astype(np.float64)
    gw, gb = reference_gradient(w, b, x, y)
    if rule in ("sam", "asam"):
        tw, tb = (np.abs(w) + eta, np.abs(b) + eta) if rule == "asam" else (np.ones_like(w), np.ones_like(b))
        norm = np.sqrt(np.sum((tw * gw) ** 2) + np.sum((tb * gb) ** 2))
        ew, eb = rho * tw * tw * gw / norm, rho * tb * tb * gb / norm
        gw, gb = reference_gradient(w + ew, b + eb, x, y)
    if mu:
        gw, gb = gw + mu * (w - w0), gb + mu * (b - b0)
    return w - lr * (gw + wd * w), b - lr * (gb + wd * b)


@pytest.fixture
def batch():
    rng = np.random.default_rng(5)
    return (rng.normal(size=(C, D)).astype(np.float32), rng.normal(size=C).astype(np.float32),
            rng.normal(size=(7, D)).astype(np.float32), rng.integers(0, C, 7))


@pytest.mark.parametrize("stepper_class", [NumpyHeadStepper, _TorchHeadStepper])
@pytest.mark.parametrize("rule", [dict(local_rule="sam", sam_rho=0.3), dict(local_rule="asam", sam_rho=0.7, asam_eta=0.2),
                                  dict(local_rule="sgd", prox_mu=0.5), dict(local_rule="sam", sam_rho=0.3, prox_mu=0.5)])
def test_a_step_equals_the_float64_reference(stepper_class, rule, batch):
    w, b, x, y = batch
    recipe = LocalTraining(lr=0.2, weight_decay=0.01, temperature=T, rule=LocalRuleRecipe(**rule))
    stepper = stepper_class(w, b, recipe)
    # two steps: the proximal pull is zero at the global head, so the second step is the one that shows it
    ref_w, ref_b = reference_step(rule["local_rule"], w, b, x, y, 0.2, 0.01, rule.get("sam_rho", 0),
                                  rule.get("asam_eta", 0), rule.get("prox_mu", 0), w, b)
    stepper.step(x, y)
    np.testing.assert_allclose(stepper.parameters()["weight"], ref_w, rtol=1e-5, atol=1e-6)
    ref_w, ref_b = reference_step(rule["local_rule"], ref_w, ref_b, x[:4], y[:4], 0.2, 0.01, rule.get("sam_rho", 0),
                                  rule.get("asam_eta", 0), rule.get("prox_mu", 0), w, b)
    stepper.step(x[:4], y[:4])
    got = stepper.parameters()
    np.testing.assert_allclose(got["weight"], ref_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["bias"], ref_b, rtol=1e-5, atol=1e-6)
    plain = stepper_class(w, b, LocalTraining(lr=0.2, weight_decay=0.01, temperature=T))
    plain.step(x, y)
    plain.step(x[:4], y[:4])
    assert np.abs(plain.parameters()["weight"] - got["weight"]).max() > 1e-4      # the rule changed the step


def test_sam_evaluates_two_gradients_and_a_zero_gradient_is_no_ascent():
    calls = []

    def gradient_at(params):
        calls.append({k: v.copy() for k, v in params.items()})
        return 0.0, {"w": np.zeros(3, np.float32)}

    params = {"w": np.ones(3, np.float32)}
    _, d = SharpnessAware(0.5).direction(params, gradient_at, params)
    assert len(calls) == 2 and np.array_equal(calls[1]["w"], params["w"]) and not d["w"].any()
    assert Proximal(0.1, SharpnessAware(0.5)).evaluations_per_step == 2


def test_rule_travels_from_job_to_device_and_a_bad_one_is_declined():
    job = build_job("fedavg", {"num_classes": C, "feature_dim": D, "rounds": 1, "clients_per_round": 1,
                               "local_rule": "asam", "sam_rho": 0.7, "asam_eta": 0.1, "prox_mu": 0.01})
    job.next_participants({"d1"})
    params, _ = job.task_for("d1")
    assert LocalTraining.from_params(params).rule == LocalRuleRecipe("asam", 0.7, 0.1, 0.01)
    for bad in ({"local_rule": "adam"}, {"local_rule": "sam", "sam_rho": 0.0}, {"prox_mu": -1.0}):
        with pytest.raises(ValueError):
            FedAvgConfig(num_classes=C, feature_dim=D, **bad)
    rng = np.random.default_rng(0)

    class Features:
        feature_dim = D

        def extract(self, images):
            return rng.normal(size=(len(images), D)).astype(np.float32)

    task = HeadTrainingTask(np.zeros((5, 1)), np.arange(5) % C, lambda *a, **k: Features())
    head = {"weight": np.zeros((C, D), np.float32), "bias": np.zeros(C, np.float32)}
    for bad in ({"local_rule": "nesterov"}, {"sam_rho": "big"}, {"local_rule": "sam", "sam_rho": float("nan")}):
        with pytest.raises(TaskDeclined):
            task({**params, **bad}, head)


def test_training_program_sam_step_equals_the_eager_twins(mobilenet_bundle_32px):
    """The exported head program (ExecuTorch) and its eager twin, two SAM steps and one ASAM+prox step
    each: the program computes both gradients of a step, the rule's code is shared."""
    from edge_client.runtime import TrainingSession

    manifest = mobilenet_bundle_32px / "manifest.json"
    sessions = {rt: TrainingSession.load(manifest, prefer=(rt,)) for rt in ("executorch", "eager")}
    assert {s.runtime for s in sessions.values()} == {"executorch", "eager"}
    session = sessions["eager"]
    rng = np.random.default_rng(2)
    Cs, Ds = session.num_classes, session.feature_dim
    # Features in the range of MobileNet's (non-negative, small): on 1280 unit-normal features at
    # T = 0.1 the softmax saturates, ‖g‖ is tiny, and g/‖g‖ amplifies the program's float32
    # rounding (up to 6e-5 after a step; plain SGD there differs by 2e-6 already).
    w = rng.normal(scale=0.01, size=(Cs, Ds)).astype(np.float32)
    b = rng.normal(scale=0.01, size=Cs).astype(np.float32)
    x = (0.3 * rng.random((11, Ds))).astype(np.float32)     # batches of 6 and 5 rows: padded program calls
    y = rng.integers(0, Cs, 11)
    for rule in (LocalRuleRecipe("sam", sam_rho=0.05), LocalRuleRecipe("asam", sam_rho=0.5, prox_mu=0.1)):
        recipe = LocalTraining(epochs=2, batch_size=6, lr=0.05, temperature=session.manifest.temperature, rule=rule)
        trained = {rt: train_head(w, b, x, y, recipe, s) for rt, s in sessions.items()}
        assert trained["executorch"].runtime == "executorch"
        # the acceptance criterion's gradient tolerance (tests/test_export_training.py), after 4 steps
        np.testing.assert_allclose(trained["executorch"].weight, trained["eager"].weight, atol=1e-5)
        np.testing.assert_allclose(trained["executorch"].bias, trained["eager"].bias, atol=1e-5)
        plain = train_head(w, b, x, y, LocalTraining(epochs=2, batch_size=6, lr=0.05,
                                                     temperature=session.manifest.temperature), sessions["eager"])
        assert np.abs(plain.weight - trained["eager"].weight).max() > 1e-3      # the rule moved the head
    # and the program's SAM step is the numpy trainer's (independent gradient code)
    recipe = LocalTraining(batch_size=11, lr=0.05, temperature=session.manifest.temperature,
                           rule=LocalRuleRecipe("sam", sam_rho=0.05))
    stepper = SessionStepper(sessions["executorch"], {"weight": w, "bias": b}, recipe)
    stepper.step(x, y)
    reference = NumpyHeadStepper(w, b, recipe)
    reference.step(x, y)
    np.testing.assert_allclose(stepper.parameters()["weight"], reference.parameters()["weight"], atol=1e-5)
    assert isinstance(rule_for(recipe.rule), SharpnessAware)


def test_tail_program_sam_step_equals_the_eager_twins(tail_bundle):
    """FT(φ) (the tail trains, the head is frozen) with FedSAM through the exported tail training
    program (ExecuTorch) and its eager twin: the frozen head is neither perturbed nor moved."""
    from edge_client.runtime import TrainingSession
    from edge_client.tasks.numpy_head import batch_schedule

    sessions = {rt: TrainingSession.load(tail_bundle, prefer=(rt,), kind="tail_training") for rt in ("executorch", "eager")}
    assert {s.runtime for s in sessions.values()} == {"executorch", "eager"}
    rng = np.random.default_rng(4)
    start = sessions["eager"].get_parameters()       # the pretrained tail; the bundle's head is zeros (no tail gradient)
    start.update(weight=rng.normal(scale=0.05, size=start["weight"].shape).astype(np.float32),
                 bias=rng.normal(scale=0.05, size=start["bias"].shape).astype(np.float32))
    trained = frozenset(name for name in start if name.startswith("tail."))
    rows = (0.5 * rng.random((10, *sessions["eager"].input_shape))).astype(np.float32)
    labels = rng.integers(0, sessions["eager"].num_classes, 10)
    recipe = LocalTraining(batch_size=5, lr=0.05, temperature=sessions["eager"].manifest.temperature,
                           rule=LocalRuleRecipe("sam", sam_rho=0.05))
    after = {}
    for rt, session in sessions.items():
        stepper = SessionStepper(session, start, recipe, trained)
        for batch in batch_schedule(len(labels), recipe):
            stepper.step(rows[batch], labels[batch])
        after[rt] = stepper.parameters()
    plain = SessionStepper(sessions["eager"], start, LocalTraining(batch_size=5, lr=0.05,
                                                                   temperature=recipe.temperature), trained)
    for batch in batch_schedule(len(labels), recipe):
        plain.step(rows[batch], labels[batch])
    moved = max(np.abs(plain.parameters()[k] - after["eager"][k]).max() for k in trained)
    assert moved > 1e-3                                          # SAM's step is not SGD's
    for name in start:
        np.testing.assert_allclose(after["executorch"][name], after["eager"][name], atol=1e-6, err_msg=name)
        if name not in trained:
            np.testing.assert_array_equal(after["eager"][name], start[name])


def test_session_stepper_gives_a_rule_the_gradient_at_whatever_point_it_asks_for():
    """A rule may go back to w after a perturbed point: the program must compute at w again, and the
    step start from w (a quadratic loss ½‖p − 1‖² held in a stand-in runtime)."""
    from edge_client.tasks.local_rules import LocalRule

    class Quadratic:
        runtime = "stand-in"

        def __init__(self):
            self.p = None

        def set_parameters(self, params):
            self.p = {k: np.array(v) for k, v in params.items()}

        def get_parameters(self):
            return {k: v.copy() for k, v in self.p.items()}

        def loss_and_gradients(self, features, labels):
            return 0.0, {k: v - 1.0 for k, v in self.p.items()}

        def sgd_step(self, directions, lr):
            for k, d in directions.items():
                self.p[k] = self.p[k] - np.float32(lr) * d

    seen = []

    class ThereAndBack(LocalRule):
        def direction(self, params, gradient_at, global_params):
            gradient_at({k: v + 5.0 for k, v in params.items()})
            loss, g = gradient_at(params)
            seen.append(g)
            return loss, g

    stepper = SessionStepper(Quadratic(), {"w": np.zeros(2, np.float32)}, LocalTraining(lr=0.5, weight_decay=0.0))
    stepper.rule = ThereAndBack()
    stepper.step(np.zeros((1, 1), np.float32), np.zeros(1, np.int64))
    np.testing.assert_array_equal(seen[0]["w"], [-1.0, -1.0])                 # computed at w = 0, not at 5
    np.testing.assert_array_equal(stepper.parameters()["w"], [0.5, 0.5])       # stepped from w = 0


def test_session_stepper_asam_prox_and_correction_on_a_trained_subset_equal_the_float64_reference():
    """The tail trainer's step (FT(φ), Scaffold on the tail) against the papers' formulas in float64:
    ε̂ = ρ T² g/‖T g‖, T = |w| + η over the *trained* tensors only (ASAM, Kwon et al. 2021), d = ∇L(w + ε̂)
    + μ(w − w_global) (FedProx) + (c − c_k) (Scaffold's correction), w ← w − lr (d + wd·w); the frozen
    tensor is neither perturbed, nor counted in ‖T g‖, nor moved. The twin-runtime tests above share
    the rule's code; this one is written from the formulas. The stand-in runtime's loss couples the
    two tensors, L = Σ softplus(t ⊙ h), so a perturbed or moved frozen h would change t's gradient."""

    def grads64(t, h):
        s = 1.0 / (1.0 + np.exp(-(t * h)))               # σ(t h): d softplus(t h)/d(t h)
        return h * s, t * s

    class Softplus:
        runtime = "stand-in"

        def set_parameters(self, params):
            self.p = {k: np.array(v, np.float32) for k, v in params.items()}

        def get_parameters(self):
            return {k: v.copy() for k, v in self.p.items()}

        def loss_and_gradients(self, features, labels):
            gt, gh = grads64(self.p["tail"].astype(np.float64), self.p["head"].astype(np.float64))
            return 0.0, {"tail": gt.astype(np.float32), "head": gh.astype(np.float32)}

        def sgd_step(self, directions, lr):
            for k, d in directions.items():
                self.p[k] = self.p[k] - np.float32(lr) * d

    rng = np.random.default_rng(11)
    start = {"tail": rng.normal(size=6).astype(np.float32), "head": rng.normal(size=6).astype(np.float32)}
    correction = {"tail": (0.3 * rng.normal(size=6)).astype(np.float32)}           # c − c_k
    rho, eta, mu, lr, wd = 0.4, 0.2, 0.5, 0.3, 0.05
    recipe = LocalTraining(lr=lr, weight_decay=wd, rule=LocalRuleRecipe("asam", sam_rho=rho, asam_eta=eta,
                                                                        prox_mu=mu))
    stepper = SessionStepper(Softplus(), start, recipe, trained=frozenset({"tail"}), correction=correction)
    w0, h = start["tail"].astype(np.float64), start["head"].astype(np.float64)
    w = w0.copy()
    for _ in range(3):                   # the pull μ(w − w0) is zero on the first step only
        stepper.step(np.zeros((1, 1), np.float32), np.zeros(1, np.int64))
        g, _ = grads64(w, h)
        scale = np.abs(w) + eta
        eps = rho * scale * scale * g / np.linalg.norm(scale * g)
        d = grads64(w + eps, h)[0] + mu * (w - w0) + correction["tail"]
        w = w - lr * (d + wd * w)
        got = stepper.parameters()
        np.testing.assert_allclose(got["tail"], w, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got["head"], start["head"])
