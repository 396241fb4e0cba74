"""Scaffold(ψ), option II: the device pass and the server's control step against numpy references;
c in the job's checkpoint, c_k in the device's state store."""

import numpy as np
import pytest

from aggregator.jobs.fedavg import FedAvgConfig
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from aggregator.jobs.scaffold import ScaffoldConfig, ScaffoldJob
from edge_client.state import DeviceStateStore
from edge_client.tasks.head_training import LocalTraining
from edge_client.tasks.numpy_head import NumpyHeadStepper, batch_schedule
from edge_client.tasks.scaffold_training import ScaffoldTrainingTask, scaffold_pass
from protocols.payloads.fedavg import LocalRuleRecipe
from protocols.payloads.scaffold import KIND

from stateful_jobs import ce_grads, minibatches, pixel_extractor, run_round

C, D, SIZE = 3, 8, 8


def reference_pass(W, b, c, ck, Z, y, r):
    """float64: y ← y − lr (∇f(y) + wd·y − c_k + c) per mini-batch; c_k⁺ = c_k − c + (w − y)/(K lr)."""
    x = {"weight": W.astype(np.float64), "bias": b.astype(np.float64)}
    K = 0
    for rows in minibatches(len(y), r.batch_size, r.epochs, r.seed):
        grads = ce_grads(x, Z, y, rows, r.temperature)
        x = {k: x[k] - r.lr * (grads[k] + r.weight_decay * x[k] - ck[k] + c[k]) for k in x}
        K += 1
    w = {"weight": W, "bias": b}
    return x, {k: ck[k] - c[k] + (w[k] - x[k]) / (K * r.lr) for k in x}


def rand_head(rng, scale=0.1):
    return {"weight": (scale * rng.normal(size=(C, D))).astype(np.float32),
            "bias": (scale * rng.normal(size=C)).astype(np.float32)}


@pytest.mark.parametrize("recipe", [LocalTraining(epochs=2, batch_size=10, lr=0.05, seed=1),
                                    LocalTraining(epochs=1, batch_size=16, lr=0.1, weight_decay=0.2, seed=2)])
def test_device_pass_matches_numpy_reference(recipe):
    rng = np.random.default_rng(recipe.seed)
    Z, y = rng.normal(size=(53, D)).astype(np.float32), rng.integers(0, C, 53)
    w, c, ck = rand_head(rng), rand_head(rng, 0.5), rand_head(rng, 0.5)
    out, new_ck = scaffold_pass(w["weight"], w["bias"], c, ck, Z, y, recipe)
    ref, ref_ck = reference_pass(w["weight"], w["bias"], c, ck, Z.astype(np.float64), y, recipe)
    for k in ("weight", "bias"):
        np.testing.assert_allclose(out[k], ref[k], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(new_ck[k], ref_ck[k], rtol=1e-3, atol=1e-3)


def test_device_pass_with_asam_and_prox_matches_the_formulas():
    """Scaffold composed with the job's local rule (FedASAM + FedProx), float64 from the papers:
    y ← y − lr (∇f(y + ε̂) + μ(y − w) + wd·y − c_k + c), ε̂ = ρ T² g/‖T g‖, T = |y| + η over weight
    and bias together; option II's c_k⁺ from the K corrected steps as without a rule."""
    r = LocalTraining(epochs=2, batch_size=12, lr=0.05, weight_decay=0.01, seed=4,
                      rule=LocalRuleRecipe("asam", sam_rho=0.5, asam_eta=0.2, prox_mu=0.3))
    rng = np.random.default_rng(r.seed)
    Z, y = rng.normal(size=(41, D)).astype(np.float32), rng.integers(0, C, 41)
    w, c, ck = rand_head(rng, 0.5), rand_head(rng, 0.5), rand_head(rng, 0.5)
    out, new_ck = scaffold_pass(w["weight"], w["bias"], c, ck, Z, y, r)
    Z64, x0 = Z.astype(np.float64), {k: v.astype(np.float64) for k, v in w.items()}
    x, K = dict(x0), 0
    for rows in minibatches(len(y), r.batch_size, r.epochs, r.seed):
        g = ce_grads(x, Z64, y, rows, r.temperature)
        t = {k: np.abs(x[k]) + 0.2 for k in x}
        norm = np.sqrt(sum(np.sum((t[k] * g[k]) ** 2) for k in x))
        g = ce_grads({k: x[k] + 0.5 * t[k] ** 2 * g[k] / norm for k in x}, Z64, y, rows, r.temperature)
        x = {k: x[k] - r.lr * (g[k] + 0.3 * (x[k] - x0[k]) + r.weight_decay * x[k] - ck[k] + c[k]) for k in x}
        K += 1
    for k in ("weight", "bias"):
        np.testing.assert_allclose(out[k], x[k], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(new_ck[k], ck[k] - c[k] + (x0[k] - x[k]) / (K * r.lr), rtol=1e-3, atol=1e-3)
    plain, _ = scaffold_pass(w["weight"], w["bias"], c, ck, Z, y, LocalTraining(epochs=2, batch_size=12, lr=0.05,
                                                                                   weight_decay=0.01, seed=4))
    assert np.abs(plain["weight"] - out["weight"]).max() > 1e-3          # the rule changed the pass


def test_with_zero_controls_it_is_the_fedavg_step():
    rng = np.random.default_rng(5)
    Z, y = rng.normal(size=(40, D)).astype(np.float32), rng.integers(0, C, 40)
    w, zero = rand_head(rng), {"weight": np.zeros((C, D), np.float32), "bias": np.zeros(C, np.float32)}
    recipe = LocalTraining(epochs=2, batch_size=8, lr=0.05, seed=3)
    out, _ = scaffold_pass(w["weight"], w["bias"], zero, zero, Z, y, recipe)
    plain = NumpyHeadStepper(w["weight"], w["bias"], recipe)
    for batch in batch_schedule(len(y), recipe):
        plain.step(Z[batch], y[batch])
    np.testing.assert_array_equal(out["weight"], plain.weight)
    np.testing.assert_array_equal(out["bias"], plain.bias)




EXTRACTOR = pixel_extractor(SIZE, D)


def device(i, root):
    rng = np.random.default_rng(i)
    n = 25 + 5 * i
    x, y = rng.integers(0, 256, (n, SIZE, SIZE), dtype=np.uint8), rng.integers(0, C, n)
    return ScaffoldTrainingTask(x, y, lambda *a, **k: EXTRACTOR, DeviceStateStore(root / f"dev{i}"))


def make_job(**overrides):
    return ScaffoldJob(ScaffoldConfig(**{"num_classes": C, "feature_dim": D, "image_size": SIZE,
                                         "clients_per_round": 2, "rounds": 4, "local_epochs": 1, "batch_size": 8,
                                         "client_lr": 0.05, "total_devices": 4, **PLAIN_MEAN, **overrides}))




def test_server_steps_match_the_formulas_and_devices_keep_their_controls(tmp_path):
    handlers = {f"dev{i}": device(i, tmp_path) for i in range(4)}
    job = make_job(server_lr=0.7)
    ck = {d: {"weight": np.zeros((C, D)), "bias": np.zeros(C)} for d in handlers}
    for _ in range(3):
        w, c = {k: job.params[k].astype(np.float64) for k in ("weight", "bias")}, dict(job.control)
        sent = run_round(job, handlers, KIND)
        n = {d: body["n"] for d, (_, _, body, _) in sent.items()}
        for k in ("weight", "bias"):
            mean_y = sum(n[d] * out[k].astype(np.float64) for d, (_, _, _, out) in sent.items()) / sum(n.values())
            np.testing.assert_allclose(job.params[k], w[k] + 0.7 * (mean_y - w[k]), rtol=1e-5, atol=1e-6)
            mean_dc = np.mean([out["delta_control." + k] for _, _, _, out in sent.values()], axis=0)
            np.testing.assert_allclose(job.control[k], c[k] + len(sent) / 4 * mean_dc, rtol=1e-5, atol=1e-6)
        for d, (_, tensors, body, out) in sent.items():
            stored = handlers[d].store.load(job.config.job_id, job.device_state.run).arrays
            for k in ("weight", "bias"):
                ck[d][k] = ck[d][k] + out["delta_control." + k]
                np.testing.assert_allclose(stored[k], ck[d][k], rtol=1e-5, atol=1e-6)
    assert np.abs(job.control["weight"]).sum() > 0


def test_control_and_run_survive_a_checkpoint(tmp_path):
    handlers = {f"dev{i}": device(i, tmp_path) for i in range(4)}
    job = make_job()
    run_round(job, handlers, KIND)
    restored = make_job()
    restored.load_state_dict(job.state_dict())
    assert restored.device_state.run == job.device_state.run
    for k in ("weight", "bias"):
        np.testing.assert_array_equal(restored.control[k], job.control[k])


def test_one_device_moves_c_by_at_most_its_clipped_share(tmp_path):
    handlers = {f"dev{i}": device(i, tmp_path) for i in range(4)}
    job = make_job(control_clip_norm=1.0, clients_per_round=4)

    def huge(d, out):
        return {**out, "delta_control.weight": np.full((C, D), 1e6, np.float32)} if d == "dev0" else out

    sent = run_round(job, handlers, KIND, tamper=huge)
    honest = [clip for d, (_, _, _, out) in sent.items() if d != "dev0"
              for clip in [np.sqrt(sum(np.sum(out["delta_control." + k].astype(np.float64) ** 2)
                                       for k in ("weight", "bias")))]]
    total = np.sqrt(sum(np.sum(job.control[k].astype(np.float64) ** 2) for k in ("weight", "bias")))
    assert total <= (1.0 + sum(min(1.0, h) for h in honest)) / 4 + 1e-6


def test_one_device_cannot_steer_c_with_a_default_config(tmp_path):
    """A review's finding: with the defaults (bounds on, control_clip_norm 1000) one of ten devices
    sent the same Δc direction every round and moved c by its clip's share each time (‖c‖ 2 → 500,
    the model after it: ‖w‖ 0.75 → 134 in five rounds). Each Δc_k is now scaled to at most the
    update's norm-bound multiple of the round's median ‖Δc‖: the step is recomputed here with numpy,
    and the attacker's pull on c is no more than one honest device's at the bound."""
    handlers = {f"dev{i}": device(i, tmp_path) for i in range(10)}
    job = ScaffoldJob(ScaffoldConfig(num_classes=C, feature_dim=D, image_size=SIZE, clients_per_round=10,
                                     rounds=5, batch_size=8, client_lr=0.05, direction_screen=False))
    # the Δc bound alone: with the screen, the devices it leaves out move no c (the test below)
    assert job.config.norm_bound_multiplier == 1.0 and job.config.control_clip_norm == 1000.0
    direction = np.full((C, D), 1e6 / np.sqrt(C * D), np.float32)

    def steer(d, out):
        return {**out, "delta_control.weight": direction, "delta_control.bias": np.zeros(C, np.float32)} \
            if d == "dev0" else out

    def norm(tensors):
        return np.sqrt(sum(np.sum(np.asarray(t, np.float64) ** 2) for t in tensors.values()))

    for _ in range(5):
        c = {k: job.control[k].astype(np.float64) for k in ("weight", "bias")}
        sent = run_round(job, handlers, KIND, tamper=steer)
        deltas = {d: {k: out["delta_control." + k].astype(np.float64) for k in ("weight", "bias")}
                  for d, (_, _, _, out) in sent.items()}
        clipped = {d: {k: v * min(1.0, 1000.0 / norm(t)) for k, v in t.items()} for d, t in deltas.items()}
        norms = np.sort([norm(t) for t in clipped.values()])
        limit = 1.0 * norms[(len(norms) - 1) // 2]           # the lower of the two middle norms
        bounded = {d: {k: v * min(1.0, limit / norm(t)) for k, v in t.items()} for d, t in clipped.items()}
        for k in ("weight", "bias"):
            mean = np.mean([t[k] for t in bounded.values()], axis=0)
            np.testing.assert_allclose(job.control[k], c[k] + mean, rtol=1e-5, atol=1e-5)
        assert norm(bounded["dev0"]) <= limit * (1 + 1e-9)
    assert norm(job.control) < 5 * limit and norm(job.params) < 10


def test_a_device_the_direction_screen_leaves_out_moves_no_control(tmp_path):
    """A review's finding: c was the mean of every accepted device's Δc, so a device sending a
    sign-flipped head (left out of the model by the direction screen, every round) still pulled c
    along its own Δc, bounded but accumulating. Its Δc is now left out with its update: c moves by
    the bounded Δc of the devices the screen kept alone (numpy below: the screen, the bound, c)."""
    handlers = {f"dev{i}": device(i, tmp_path) for i in range(5)}
    job = ScaffoldJob(ScaffoldConfig(num_classes=C, feature_dim=D, image_size=SIZE, clients_per_round=5,
                                     rounds=1, batch_size=8, client_lr=0.05, total_devices=5))
    assert job.config.direction_screen and job.config.norm_bound_multiplier == 1.0
    direction = np.full((C, D), 1e4 / np.sqrt(C * D), np.float32)

    def flip(d, out):
        if d != "dev0":
            return out
        w = job.round_start()                   # what it trained from: its update sign-flipped, scaled
        return {**out, **{k: (w[k] - 10 * (out[k] - w[k])).astype(np.float32) for k in ("weight", "bias")},
                "delta_control.weight": direction, "delta_control.bias": np.zeros(C, np.float32)}

    def norm(tensors):
        return np.sqrt(sum(np.sum(np.asarray(t, np.float64) ** 2) for t in tensors.values()))

    c = {k: job.control[k].astype(np.float64) for k in ("weight", "bias")}
    start = {k: job.round_start()[k].astype(np.float64) for k in ("weight", "bias")}
    sent = run_round(job, handlers, KIND, tamper=flip)
    # the screen, in numpy: each Δ at most the lower-median norm, kept when ⟨Δ_k, median⟩ > 0
    deltas = {d: np.concatenate([(out[k].astype(np.float64) - start[k]).ravel() for k in ("bias", "weight")])
              for d, (_, _, _, out) in sent.items()}
    norms = np.sort([np.linalg.norm(v) for v in deltas.values()])
    scaled = {d: v * min(1.0, norms[(len(norms) - 1) // 2] / np.linalg.norm(v)) for d, v in deltas.items()}
    median = np.median(np.stack(list(scaled.values())), axis=0)
    kept = sorted(d for d, v in scaled.items() if v @ median > 0)
    assert kept == ["dev1", "dev2", "dev3", "dev4"]
    controls = {d: {k: sent[d][3]["delta_control." + k].astype(np.float64) for k in ("weight", "bias")} for d in kept}
    control_norms = np.sort([norm(t) for t in controls.values()])
    limit = control_norms[(len(control_norms) - 1) // 2]
    bounded = [{k: v * min(1.0, limit / norm(t)) for k, v in t.items()} for t in controls.values()]
    for k in ("weight", "bias"):                # c + (|S| / K) · mean over S, |S| = 4 kept, K = 5
        np.testing.assert_allclose(job.control[k], c[k] + sum(t[k] for t in bounded) / 5, rtol=1e-5, atol=1e-6)


def test_a_round_whose_median_control_is_zero_keeps_the_others(tmp_path):
    """A review's finding: the bound's limit is 0 when most Δc are 0, and clipping to 0 wiped every
    Δc of the round; a 0 limit is no bound, as for the updates."""
    handlers = {f"dev{i}": device(i, tmp_path) for i in range(3)}
    job = ScaffoldJob(ScaffoldConfig(num_classes=C, feature_dim=D, image_size=SIZE, clients_per_round=3,
                                     rounds=2, batch_size=8, client_lr=0.05, total_devices=3))

    def zero_but_dev2(d, out):
        return out if d == "dev2" else {**out, **{"delta_control." + k: np.zeros_like(out["delta_control." + k])
                                                  for k in ("weight", "bias")}}

    sent = run_round(job, handlers, KIND, tamper=zero_but_dev2)
    kept = sent["dev2"][3]
    assert np.abs(kept["delta_control.weight"]).sum() > 0
    for k in ("weight", "bias"):
        np.testing.assert_allclose(job.control[k], kept["delta_control." + k].astype(np.float64) / 3,
                                   rtol=1e-5, atol=1e-7)


def test_c_stays_the_mean_of_the_devices_controls_across_stale_restarts(tmp_path):
    """Scaffold's invariant c = (1/N) Σ_k c_k (Alg. 1: every c_k starts at 0, c moves by (1/N) Σ Δc_k).
    A device sampled after more than state_max_staleness rounds restarts c_k from 0; its Δc is
    measured from the stale c_k the server's c still counts, not from 0 (a review's finding: c then
    kept every stale c_k/N and drifted, 0.83 of its norm after 16 rounds). Measured against the
    controls the devices hold, whatever their age."""
    handlers = {f"dev{i}": device(i, tmp_path) for i in range(4)}
    job = make_job(clients_per_round=1, rounds=16, state_max_staleness=1)
    restarts = 0
    for _ in range(16):
        sent = run_round(job, handlers, KIND)
        restarts += sum(body["restarted"] for _, _, body, _ in sent.values())
    held = [handlers[d].store.load(job.config.job_id, job.device_state.run) for d in handlers]
    for k in ("weight", "bias"):
        mean_ck = sum(e.arrays[k].astype(np.float64) for e in held if e is not None) / 4
        np.testing.assert_allclose(job.control[k], mean_ck, rtol=1e-4, atol=1e-6)
    assert restarts > 4 and np.abs(job.control["weight"]).sum() > 0        # restarts past the first visits


def test_a_stale_control_restarts_and_a_redelivery_answers_what_the_first_delivery_did(tmp_path):
    h = device(0, tmp_path)
    job = make_job(clients_per_round=1, state_max_staleness=2)
    run_round(job, {"dev0": h}, KIND)
    job.next_participants({"dev0"})
    job.round += 5
    task = job.task_for("dev0")
    first, again = h(*task), h(*task)
    assert first[0]["restarted"] is again[0]["restarted"] is True
    for name in first[1]:
        np.testing.assert_array_equal(first[1][name], again[1][name])
    assert np.abs(first[1]["delta_control.weight"]).sum() > 0


def test_dp_is_refused():
    with pytest.raises(ValueError, match="dp"):
        ScaffoldConfig(num_classes=C, feature_dim=D, dp_noise_multiplier=1.0, dp_clip_norm=1.0)
    assert FedAvgConfig(num_classes=C, feature_dim=D, dp_noise_multiplier=1.0, dp_clip_norm=1.0).dp


@pytest.mark.parametrize("secure", [False, True])
def test_a_result_the_wire_refuses_leaves_the_devices_control_as_it_was(tmp_path, secure):
    """A review's finding: the device kept c_k⁺ before encoding its result, so a Δc past the wire's
    bound (c_k = 10⁶ after one round, c_k⁺ = −10⁶ after the next: each within 2^20, their difference
    not) failed the task with the state already moved to the round the server never counted; the
    secure handler restored only on a decline. The state stays round 1's."""
    from protocols.payloads.scaffold import ScaffoldParams
    from protocols.payloads.stateful import StateBinding
    from protocols.payloads.task_params import ModelSpec
    from edge_client.tasks.secure_fedavg_training import state_restored_on_decline

    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (30, SIZE, SIZE), dtype=np.uint8), rng.integers(0, C, 30)
    store = DeviceStateStore(tmp_path)
    handler = ScaffoldTrainingTask(x, y, lambda *a, **k: EXTRACTOR, store)

    def task(round_, c_value):        # lr so small that y == x in float32: c_k⁺ = c_k − c
        params = ScaffoldParams(model=ModelSpec(num_classes=C, backbone="b", image_size=SIZE), feature_dim=D,
                                training=LocalTraining(epochs=1, batch_size=30, lr=1e-15), job_id="jobS",
                                state=StateBinding(run="0123abcd", round=round_)).to_params()
        tensors = {"weight": np.ones((C, D), np.float32), "bias": np.ones(C, np.float32),
                   "control.weight": np.full((C, D), c_value, np.float32),
                   "control.bias": np.full(C, c_value, np.float32)}
        return params, tensors

    handler(*task(1, -1.0e6))
    kept = store.load("jobS", "0123abcd")
    assert kept.round == 1 and float(kept.arrays["weight"].flat[0]) == 1.0e6
    with pytest.raises(ValueError):
        if secure:
            with state_restored_on_decline(handler, task(2, 2.0e6)[0], KIND):
                store.save("jobS", "0123abcd", 2, {k: -v for k, v in kept.arrays.items()})   # as a later step would
                raise ValueError("Δc beyond the wire's bound")
        else:
            handler(*task(2, 2.0e6))
    after = store.load("jobS", "0123abcd")
    assert after.round == 1 and all(np.array_equal(after.arrays[k], kept.arrays[k]) for k in kept.arrays)
