"""Ditto (ditto.head): the device's two passes against a float64 numpy reference; rounds through
the wire and over a real broker, each device's personal head kept on (and only on) it; the job's
personal WMA recomputed from the devices' saved heads; bad parameters declined."""

import json
import threading

import numpy as np
import pytest

from aggregator.jobs.ditto import DittoConfig, DittoJob
from aggregator.jobs.registry import build_job
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from edge_client.agent import DeviceAgent, TaskDeclined
from edge_client.state import DeviceStateStore
from edge_client.tasks.ditto_training import DittoTrainingTask, ditto_pass
from edge_client.tasks.head_training import LocalTraining
from fedfleet.emulation.broker import MosquittoBroker
from protocols import messages as M
from protocols.envelope import EnvelopeError, decode, encode
from protocols.mqtt_link import BrokerConfig
from protocols.payloads.ditto import KIND, DittoRecipe
from protocols.payloads.fedavg import LocalRuleRecipe

from stateful_jobs import ce_grads, minibatches, oll_after, pixel_extractor, run_round

C, D, SIZE = 3, 8, 8


def sgd(W, b, Z, y, r, epochs, lr, seed, anchor=None, mu=0.0):
    """float64 mini-batch SGD on T-scaled cross-entropy + wd, plus μ (θ − anchor) when μ > 0."""
    x = {"weight": W.astype(np.float64), "bias": b.astype(np.float64)}
    for rows in minibatches(len(y), r.batch_size, epochs, seed):
        grads = ce_grads(x, Z, y, rows, r.temperature)
        pull = {k: mu * (x[k] - anchor[k]) if mu else 0.0 for k in x}
        x = {k: x[k] - lr * (grads[k] + pull[k] + r.weight_decay * x[k]) for k in x}
    return x


def reference(psi, v, Z, y, r, ditto):
    """Ditto's device round: ψ_k by the global pass (with FedProx's μ if the job sets one), v_k by
    SGD on f_k(v) + λ/2‖v − ψ‖² from v (its own batch order, seed + 1)."""
    Z = Z.astype(np.float64)
    anchor = {k: a.astype(np.float64) for k, a in psi.items()}
    trained = sgd(psi["weight"], psi["bias"], Z, y, r, r.epochs, r.lr, r.seed, anchor, r.rule.prox_mu)
    mine = sgd(v["weight"], v["bias"], Z, y, r, ditto.personal_epochs, ditto.personal_lr, r.seed + 1, anchor,
               ditto.ditto_lambda)
    return trained, mine


def rand_head(rng, scale=0.3):
    return {"weight": (scale * rng.normal(size=(C, D))).astype(np.float32),
            "bias": (scale * rng.normal(size=C)).astype(np.float32)}


@pytest.mark.parametrize("recipe, ditto", [
    (LocalTraining(epochs=2, batch_size=10, lr=0.05, seed=1), DittoRecipe(0.1, 3, 0.05)),
    (LocalTraining(epochs=1, batch_size=16, lr=0.1, weight_decay=0.2, seed=2, rule=LocalRuleRecipe(prox_mu=0.5)),
     DittoRecipe(2.0, 1, 0.02)),
])
def test_device_passes_match_numpy_reference(recipe, ditto):
    rng = np.random.default_rng(recipe.seed)
    Z, y = rng.normal(size=(53, D)).astype(np.float32), rng.integers(0, C, 53)
    psi, v = rand_head(rng), rand_head(rng)
    trained, mine = ditto_pass(psi["weight"], psi["bias"], v, Z, y, recipe, ditto)
    ref_trained, ref_mine = reference(psi, v, Z, y, recipe, ditto)
    for k in ("weight", "bias"):
        np.testing.assert_allclose(trained[k], ref_trained[k], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(mine[k], ref_mine[k], rtol=1e-4, atol=1e-5)
    assert not np.allclose(mine["weight"], trained["weight"], atol=1e-3)     # two different heads


def test_a_large_lambda_holds_the_personal_head_near_the_global_one():
    rng = np.random.default_rng(4)
    Z, y = rng.normal(size=(40, D)).astype(np.float32), rng.integers(0, C, 40)
    psi, v = rand_head(rng), rand_head(rng)
    recipe = LocalTraining(epochs=1, batch_size=8, lr=0.05, seed=3)
    distance = {}
    for lam in (0.01, 15.0):
        _, mine = ditto_pass(psi["weight"], psi["bias"], v, Z, y, recipe, DittoRecipe(lam, 5, 0.05))
        distance[lam] = np.linalg.norm(mine["weight"] - psi["weight"])
    assert distance[15.0] < 0.5 * distance[0.01]


EXTRACTOR = pixel_extractor(SIZE, D)


def device(i, root, holdout=True):
    rng = np.random.default_rng(i)
    n = 30 + 7 * i
    x, y = rng.integers(0, 256, (n, SIZE, SIZE), dtype=np.uint8), rng.integers(0, C, n)
    hx, hy = rng.integers(0, 256, (9 + i, SIZE, SIZE), dtype=np.uint8), rng.integers(0, C, 9 + i)
    return DittoTrainingTask(x, y, lambda *a, **k: EXTRACTOR, DeviceStateStore(root / f"dev{i}"),
                             *((hx, hy) if holdout else (None, None)))


def make_job(**overrides):
    return DittoJob(DittoConfig(**{
        "num_classes": C, "feature_dim": D, "image_size": SIZE, "clients_per_round": 3, "rounds": 5,
        "local_epochs": 1, "batch_size": 8, "client_lr": 0.05, "personal_epochs": 2, "ditto_lambda": 0.5,
        **PLAIN_MEAN, **overrides}))


def wma_from_saved_heads(job, handlers, psi):
    """(personal WMA, global WMA) recomputed from each device's stored v_k and the global ψ its last task carried."""
    correct = total = correct_global = 0
    for h in handlers.values():
        v = h.store.load(job.config.job_id, job.device_state.run).arrays
        f = EXTRACTOR.extract(h.holdout_images)
        correct += int(((f @ v["weight"].T + v["bias"]).argmax(1) == h.holdout_labels).sum())
        correct_global += int(((f @ psi["weight"].T + psi["bias"]).argmax(1) == h.holdout_labels).sum())
        total += len(h.holdout_labels)
    return correct / total, correct_global / total


def test_rounds_average_the_global_head_and_keep_each_personal_head_on_its_device(tmp_path):
    handlers = {f"dev{i}": device(i, tmp_path) for i in range(3)}
    job = make_job()
    mine = {d: None for d in handlers}
    for r in range(3):
        psi = {k: v.copy() for k, v in job.params.items()}
        sent = run_round(job, handlers, KIND)
        expected, total = {"weight": 0.0, "bias": 0.0}, 0
        for d, (params, tensors, body, out) in sent.items():
            assert set(out) == {"weight", "bias"} and body["restarted"] is (r == 0)
            h = handlers[d]
            start = mine[d] or tensors                                  # first round: v_k starts at ψ
            ref_out, ref_mine = ditto_pass(tensors["weight"], tensors["bias"], start, EXTRACTOR.extract(h.images),
                                           h.labels, LocalTraining.from_params(params), DittoRecipe.from_params(params))
            for k in ("weight", "bias"):
                np.testing.assert_array_equal(out[k], ref_out[k])
                expected[k] = expected[k] + body["n"] * ref_out[k].astype(np.float64)
            stored = h.store.load(job.config.job_id, job.device_state.run).arrays
            for k in ("weight", "bias"):
                np.testing.assert_array_equal(stored[k], ref_mine[k])    # v_k continued from last round's
            mine[d] = ref_mine
            total += body["n"]
        for k in ("weight", "bias"):
            np.testing.assert_allclose(job.params[k], expected[k] / total, rtol=1e-5, atol=1e-6)
    report = job.evaluate(None, None)
    personal, global_ = wma_from_saved_heads(job, handlers, psi)
    assert report["heldout_devices"] == 3
    assert report["personal_wma"] == pytest.approx(personal, abs=1e-12)
    assert report["global_wma"] == pytest.approx(global_, abs=1e-12)


def test_redelivered_task_gives_the_same_result_and_a_device_without_holdout_reports_none(tmp_path):
    h = device(0, tmp_path, holdout=False)
    job = make_job(clients_per_round=1)
    run_round(job, {"dev0": h}, KIND)
    job.next_participants({"dev0"})
    params, tensors = job.task_for("dev0")
    first, again = h(params, tensors), h(params, tensors)          # killed before the ack: sent again
    for k in ("weight", "bias"):
        np.testing.assert_array_equal(first[1][k], again[1][k])
    assert first[0] == again[0] and first[0]["restarted"] is False and first[0]["n_test"] == 0


def test_a_result_carrying_the_personal_head_is_refused(tmp_path):
    job = make_job(clients_per_round=1)
    job.next_participants({"dev0"})
    body, out = device(0, tmp_path)(*job.task_for("dev0"))
    for extra, match in (({"personal.weight": out["weight"]}, "unexpected"), ({}, "0..n_test")):
        bad = {**body, "correct": body["n_test"] + 1} if not extra else body
        env = decode(encode(M.result_message("dev0", M.TaskRef("ditto", 1, "t"), KIND, bad, {**out, **extra})))
        with pytest.raises(EnvelopeError, match=match):
            job.parse_result(env)


@pytest.mark.parametrize("change", [
    {"ditto_lambda": -0.1}, {"ditto_lambda": float("nan")}, {"ditto_lambda": True}, {"ditto_lambda": 1e9},
    {"personal_epochs": 0}, {"personal_epochs": 2.5}, {"personal_lr": 0.0}, {"personal_lr": "0.1"},
    {"ditto_lambda": None}, {"lr": -1.0}])
def test_device_declines_bad_params_and_keeps_no_state(tmp_path, change):
    job = make_job(clients_per_round=1)
    job.next_participants({"dev0"})
    params, tensors = job.task_for("dev0")
    params = {k: v for k, v in {**params, **change}.items() if v is not None}    # None: the field left out
    h = device(0, tmp_path)
    with pytest.raises(TaskDeclined, match="bad ditto.head params"):
        h(params, tensors)
    assert h.store.load(job.config.job_id, None) is None


@pytest.mark.parametrize("config, match", [
    ({"ditto_lambda": 0.0}, "ditto_lambda"), ({"personal_epochs": 0}, "personal_epochs"),
    ({"personal_lr": -1.0}, "personal_lr"), ({"state_max_staleness": -1}, "state_max_staleness")])
def test_config_refuses_bad_parameters(config, match):
    with pytest.raises(ValueError, match=match):
        make_job(**config)
    with pytest.raises(ValueError, match=match):          # the API's path: limits, then the config's checks
        build_job("ditto", {"num_classes": C, "feature_dim": D, **config})


def test_a_restored_job_keeps_its_run_and_reports_the_same_wma(tmp_path):
    handlers = {f"dev{i}": device(i, tmp_path) for i in range(3)}
    job = make_job(clients_per_round=2)
    for _ in range(2):
        run_round(job, handlers, KIND)
    job.next_participants(set(handlers))
    restored = make_job(clients_per_round=2)
    restored.load_state_dict(job.state_dict())
    restored.contributed = dict(job.contributed)
    restored.restore_bookkeeping(json.loads(json.dumps(job.bookkeeping())))
    assert restored.device_state.run == job.device_state.run
    assert restored.evaluate(None, None) == job.evaluate(None, None)
    assert restored.task_for("dev0")[0]["state"] == job.task_for("dev0")[0]["state"]


def test_rounds_over_a_real_broker_report_the_wma_of_the_saved_personal_heads(tmp_path):
    handlers = {f"dev{i}": device(i, tmp_path) for i in range(2)}
    job = make_job(job_id="ditto-broker", clients_per_round=2, rounds=2, round_timeout_s=20, expected_devices=2,
                   start_timeout_s=20)
    with MosquittoBroker() as broker:
        svc = AggregatorService(job, BrokerConfig.from_url(broker.url), tmp_path / "agg",
                                ServiceSettings(tick_s=0.05), enrolled=set(handlers))
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=60)), daemon=True)
        thread.start()
        agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url), {KIND: h}, tick_s=0.05).start()
                  for d, h in handlers.items()]
        try:
            thread.join(60)
        finally:
            for agent in agents:
                agent.stop()
    assert job.round == 2 and not job._open, result
    saved = {d: h.store.load(job.config.job_id, job.device_state.run) for d, h in handlers.items()}
    assert all(entry.round == 2 for entry in saved.values())               # each wrote its head both rounds
    report = job.evaluate(None, None)
    personal = sum(int(((EXTRACTOR.extract(h.holdout_images) @ saved[d].arrays["weight"].T
                         + saved[d].arrays["bias"]).argmax(1) == h.holdout_labels).sum())
                   for d, h in handlers.items()) / sum(len(h.holdout_labels) for h in handlers.values())
    assert report["personal_wma"] == pytest.approx(personal, abs=1e-12)
    assert report["heldout_devices"] == 2


def test_the_oll_job_evaluates_each_device_with_its_own_head(tmp_path):
    h = device(0, tmp_path)
    job = make_job(clients_per_round=1, rounds=2)
    for _ in range(2):
        run_round(job, {"dev0": h}, KIND)
    body, v, task, _ = oll_after(job, h, EXTRACTOR)
    f = EXTRACTOR.extract(h.holdout_images)
    assert body["correct"]["personal"] == int(((f @ v["weight"].T + v["bias"]).argmax(1) == h.holdout_labels).sum())
    np.testing.assert_array_equal(task.head.global_weight, v["weight"])      # OLL starts from the personal head
    assert not np.array_equal(v["weight"], job.params["weight"])


def test_the_ditto_pipelines_refuse_what_they_cannot_run_before_the_run():
    import dataclasses

    from fedfleet.pipeline import run_pipeline
    from fedfleet.sim_config import load_config

    cfg = load_config("smoke", {})
    for bad, match in (({"ft_mode": "phi"}, "not after FT"),
                       ({"fp_part": "tail"}, "fp_part")):
        with pytest.raises(ValueError, match=match):      # refused before any data or fleet
            run_pipeline(dataclasses.replace(cfg, **bad), quiet=True, pipeline="fed3r-ditto-oll")


def test_a_dp_job_releases_no_held_out_accuracy(tmp_path):
    """The devices' held-out counts are exact (no clipping, no noise): a DP job keeps them to itself
    rather than publish what one device's data moves deterministically; the same job without DP reports them."""
    handlers = {f"dev{i}": device(i, tmp_path) for i in range(3)}
    plain, private = make_job(), make_job(job_id="ditto-dp", dp_noise_multiplier=1.0, dp_clip_norm=1.0)
    run_round(plain, handlers, KIND)
    run_round(private, handlers, KIND)
    assert plain.evaluate(None, None)["heldout_devices"] == 3 and private.heldout
    report = private.evaluate(None, None)
    assert not {"personal_wma", "global_wma", "heldout_devices"} & set(report)
    assert report["heldout_wma"].startswith("withheld")


def test_one_devices_claimed_held_out_count_weighs_at_most_the_held_out_bound():
    """A review's finding: the WMA weights each device by the n_test it reports, so one of ten
    devices reporting n_test = 10^9 with nothing right made both WMAs its own (~1e-6 against 0.9 and
    0.8 from the others). Its count weighs at most heldout_weight_bound_multiplier (10) x the
    reports' median, whatever bounds the model's average: the bound was the model's weight bound,
    so a job averaging plainly (PLAIN_MEAN, make_job) had none (a second review's finding). The WMA
    is recomputed here with numpy; with the held-out bound off (0) it is Σ correct / Σ n."""
    reports = {f"dev{i}": (10, 9, 8) for i in range(9)} | {"liar": (10**9, 0, 0)}
    default = DittoJob(DittoConfig(num_classes=C, feature_dim=D, image_size=SIZE))
    plain_mean = make_job()
    unbounded = make_job(heldout_weight_bound_multiplier=0.0)
    for job in (default, plain_mean, unbounded):
        for device, counts in reports.items():
            job.record_heldout(device, *counts)
    n = np.array([r[0] for r in reports.values()], float)
    w = np.minimum(n, 10 * np.median(n))
    for key, column in (("personal_wma", 1), ("global_wma", 2)):
        correct = np.array([r[column] for r in reports.values()], float)
        want = float(np.sum(w * correct / n) / w.sum())
        assert default.evaluate(None, None)[key] == pytest.approx(want, rel=1e-12)
        assert plain_mean.evaluate(None, None)[key] == pytest.approx(want, rel=1e-12)
        assert unbounded.evaluate(None, None)[key] == correct.sum() / n.sum()
    assert default.evaluate(None, None)["personal_wma"] == pytest.approx(81 / 190)
