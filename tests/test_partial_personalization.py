"""FedSim / FedAlt partial personalization (pp.head): device step against a numpy reference, the
job's rounds through the wire, the personal part kept on (and only on) the device."""

import json

import numpy as np
import pytest
from softmax_reference import softmax_sgd_gradients

from aggregator.jobs.partial import PartialConfig, PartialPersonalizationJob
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from edge_client.agent import TaskDeclined
from edge_client.state import DeviceStateStore
from edge_client.tasks.partial_training import PartialTrainingTask, train_partial
from protocols import messages as M
from protocols.envelope import EnvelopeError, decode, encode
from protocols.payloads.partial import KIND, PartialRecipe
from protocols.payloads.personalize import KIND as OLL_KIND

from stateful_jobs import oll_after, pixel_extractor, run_round

C, D, SIZE = 3, 8, 8


def reference(W, b, Z, y, recipe):
    """Independent float64 reference: FedSim = SGD on both; FedAlt = SGD on b (W fixed), then on W."""
    def epochs(W, b, n_epochs, seed, train):
        rng = np.random.default_rng(seed)
        for _ in range(n_epochs):
            order = rng.permutation(len(y))
            for s in range(0, len(y), recipe.batch_size):
                gW, gb = softmax_sgd_gradients(W, b, Z, y, order[s:s + recipe.batch_size], recipe)
                W = W - recipe.lr * gW if "W" in train else W
                b = b - recipe.lr * gb if "b" in train else b
        return W, b

    W, b, Z = W.astype(np.float64), b.astype(np.float64), Z.astype(np.float64)
    if recipe.algorithm == "fedsim":
        return epochs(W, b, recipe.epochs, recipe.seed, "Wb")
    W, b = epochs(W, b, recipe.personal_epochs, recipe.seed, "b")
    return epochs(W, b, recipe.epochs, recipe.seed + 1, "W")


@pytest.mark.parametrize("recipe", [PartialRecipe("fedsim", epochs=2, batch_size=10, lr=0.05, seed=1),
                                    PartialRecipe("fedalt", epochs=1, personal_epochs=2, batch_size=16, lr=0.1,
                                                  weight_decay=0.2, seed=2),
                                    PartialRecipe("fedalt", epochs=2, personal_epochs=0, batch_size=7, lr=0.02,
                                                  temperature=1.0, seed=3)])
def test_local_pass_matches_numpy_reference(recipe):
    rng = np.random.default_rng(recipe.seed)
    Z, y = rng.normal(size=(61, D)).astype(np.float32), rng.integers(0, C, 61)
    W, b = (0.1 * rng.normal(size=(C, D))).astype(np.float32), (0.1 * rng.normal(size=C)).astype(np.float32)
    u, v = train_partial(W, b, Z, y, recipe)
    ref_u, ref_v = reference(W, b, Z, y, recipe)
    np.testing.assert_allclose(u, ref_u, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(v, ref_v, rtol=1e-4, atol=1e-5)
    if recipe.algorithm == "fedalt" and recipe.personal_epochs == 0:
        np.testing.assert_array_equal(v, b)




EXTRACTOR = pixel_extractor(SIZE, D)


def device(i, tmp_path, budget=2**20):
    rng = np.random.default_rng(i)
    x, y = rng.integers(0, 256, (30 + 7 * i, SIZE, SIZE), dtype=np.uint8), rng.integers(0, C, 30 + 7 * i)
    hx, hy = rng.integers(0, 256, (9, SIZE, SIZE), dtype=np.uint8), rng.integers(0, C, 9)
    store = DeviceStateStore(tmp_path / f"dev{i}", budget_bytes=budget)
    return PartialTrainingTask(x, y, lambda *a, **k: EXTRACTOR, store, hx, hy)


def make_job(**overrides):
    return PartialPersonalizationJob(PartialConfig(**{
        "num_classes": C, "feature_dim": D, "image_size": SIZE, "clients_per_round": 3, "rounds": 5,
        "local_epochs": 1, "batch_size": 8, "client_lr": 0.05, **PLAIN_MEAN, **overrides}))




def test_rounds_average_u_keep_each_v_on_its_device_and_continue_from_it(tmp_path):
    handlers = {f"dev{i}": device(i, tmp_path) for i in range(3)}
    job = make_job()
    global_bias = job.params["bias"].copy()
    v = {d: global_bias for d in handlers}
    for _ in range(2):
        sent = run_round(job, handlers, KIND)
        expected_u, total = 0.0, 0
        for d, (params, tensors, body, out) in sent.items():
            assert set(out) == {"weight"}                        # v_k never leaves the device
            h = handlers[d]
            recipe = PartialRecipe.from_params(params)
            u_ref, v_ref = train_partial(tensors["weight"], v[d], h.extractor_factory().extract(h.images),
                                         h.labels, recipe)
            np.testing.assert_array_equal(out["weight"], u_ref)
            stored = h.store.load(job.config.job_id, job.device_state.run)
            np.testing.assert_array_equal(stored.arrays["bias"], v_ref)
            v[d] = v_ref
            expected_u, total = expected_u + body["n"] * u_ref.astype(np.float64), total + body["n"]
        np.testing.assert_allclose(job.params["weight"], expected_u / total, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(job.params["bias"], global_bias)      # the global v never moves
    report = job.evaluate(None, None)
    assert 0 <= report["personal_wma"] <= 1 and report["heldout_devices"] == 3


def test_redelivered_task_gives_the_same_result(tmp_path):
    h = device(0, tmp_path)
    job = make_job(clients_per_round=1)
    run_round(job, {"dev0": h}, KIND)
    job.next_participants({"dev0"})
    params, tensors = job.task_for("dev0")
    first = h(params, tensors)
    again = h(params, tensors)                                     # killed before the ack: sent again
    np.testing.assert_array_equal(first[1]["weight"], again[1]["weight"])
    assert first[0] == again[0] and first[0]["restarted"] is False


def test_a_fresh_round_redelivered_starts_fresh_again_and_says_so(tmp_path):
    """A round that started fresh keeps no start value (previous.*): its redelivery starts fresh
    again, from the same task, with the same result and ``restarted`` as the first delivery's."""
    h = device(0, tmp_path)
    job = make_job(clients_per_round=1)
    job.next_participants({"dev0"})
    params, tensors = job.task_for("dev0")
    first = h(params, tensors)
    kept = h.store.load(job.config.job_id, job.device_state.run).arrays
    assert sorted(kept) == ["bias"]
    again = h(params, tensors)                                     # killed before the ack: sent again
    np.testing.assert_array_equal(first[1]["weight"], again[1]["weight"])
    assert first[0] == again[0] and first[0]["restarted"] is True


def test_stale_or_foreign_state_restarts_from_the_global_bias(tmp_path):
    h = device(0, tmp_path)
    job = make_job(clients_per_round=1, state_max_staleness=0)
    run_round(job, {"dev0": h}, KIND)
    job.next_participants({"dev0"})
    job.round += 1                                  # the device was not sampled for a round
    params, tensors = job.task_for("dev0")
    assert h(params, tensors)[0]["restarted"] is True
    other = make_job(clients_per_round=1)            # the same job id created again: another run
    other.next_participants({"dev0"})
    assert h(*other.task_for("dev0"))[0]["restarted"] is True


def test_declines_without_store_over_budget_and_on_bad_params(tmp_path):
    job = make_job(clients_per_round=1)
    job.next_participants({"dev0"})
    params, tensors = job.task_for("dev0")
    no_store = device(0, tmp_path)
    no_store.store = None
    with pytest.raises(TaskDeclined, match="state store"):
        no_store(params, tensors)
    with pytest.raises(TaskDeclined, match="budget"):
        device(1, tmp_path, budget=8)(params, tensors)
    assert list((tmp_path / "dev1").iterdir()) == []
    without_job = {k: v for k, v in params.items() if k != "job_id"}
    for broken in ({**params, "algorithm": "fedprox"}, {**params, "state": {"run": "zz", "round": 1}}, without_job):
        with pytest.raises(TaskDeclined, match="bad pp.head params"):
            device(2, tmp_path)(broken, tensors)


def test_a_result_carrying_the_personal_part_is_refused(tmp_path):
    job = make_job(clients_per_round=1)
    job.next_participants({"dev0"})
    params, tensors = job.task_for("dev0")
    body, out = device(0, tmp_path)(params, tensors)
    env = decode(encode(M.result_message("dev0", M.TaskRef("pp", 1, "t"), KIND, body,
                                         {**out, "bias": np.zeros(C, np.float32)})))
    with pytest.raises(EnvelopeError, match="unexpected"):
        job.parse_result(env)


def test_the_oll_job_evaluates_each_device_with_its_own_bias(tmp_path):
    h = device(0, tmp_path)
    job = make_job(clients_per_round=1, rounds=3)
    for _ in range(3):
        run_round(job, {"dev0": h}, KIND)
    body, stored, _, oll = oll_after(job, h, EXTRACTOR)
    v = stored["bias"]
    f = EXTRACTOR.extract(h.holdout_images)
    assert body["correct"]["personal"] == int(((f @ job.params["weight"].T + v).argmax(1) == h.holdout_labels).sum())
    env = decode(encode(M.result_message("dev0", M.TaskRef("personalize", 1, "t"), OLL_KIND, body, {})))
    oll.apply("dev0", oll.parse_result(env))
    assert set(oll.summary()["wma"]) == {"global", "personal", "oll"}


def test_a_restored_job_keeps_its_run_and_reports_the_same_wma(tmp_path):
    handlers = {f"dev{i}": device(i, tmp_path) for i in range(3)}
    job = make_job(clients_per_round=2)
    for _ in range(2):
        run_round(job, handlers, KIND)
    job.next_participants(set(handlers))               # round 3 opens: its bookkeeping is stored
    restored = make_job(clients_per_round=2)
    restored.load_state_dict(job.state_dict())
    restored.contributed = dict(job.contributed)        # the service keeps these itself (JSON)
    restored.restore_bookkeeping(json.loads(json.dumps(job.bookkeeping())))
    assert restored.device_state.run == job.device_state.run and restored.round == job.round
    assert restored.evaluate(None, None) == job.evaluate(None, None)
    assert restored.task_for("dev0")[0]["state"] == job.task_for("dev0")[0]["state"]


def test_the_secure_variant_masks_exactly_the_shared_weight_the_plain_task_trains(tmp_path):
    """pp-secure: the job asks for [n·u | n] only (the bias never enters the sum), and a device's
    SecAgg client packs what its plain pp.head handler trained, keeping its v_k as the plain one does."""
    from aggregator.jobs.registry import build_job
    from edge_client.tasks.secure_fedavg_training import SecureFedAvgTraining
    from ops_fleet import SecureKeys
    from protocols.payloads.secagg import pack_weighted

    devices = [f"dev{i}" for i in range(3)]
    keys = SecureKeys.create(tmp_path, devices)
    job = build_job("pp-secure", {"num_classes": C, "feature_dim": D, "image_size": SIZE, "clients_per_round": 3,
                                  "rounds": 2, "batch_size": 8, "max_samples": 100, "max_abs_param": 50.0,
                                  **keys.job_fields(tmp_path)})
    assert job.kind == "pp.head.secure" and job.vector_length == C * D + 1
    job.next_participants(set(devices))
    params, tensors = job.task_for("dev0")
    assert params["vector_order"] == ["weight"] and params["state"]["run"] == job.device_state.run
    plain, wrapped = device(0, tmp_path / "plain"), device(0, tmp_path / "secure")
    client = SecureFedAvgTraining(keys.devices["dev0"], keys.aggregator.public_key_bytes, wrapped)
    body, out = plain(params, tensors)
    np.testing.assert_array_equal(client.vector(params, tensors), pack_weighted(out, ["weight"], body["n"]))
    np.testing.assert_array_equal(wrapped.store.load("pp-secure", None).arrays["bias"],
                                  plain.store.load("pp-secure", None).arrays["bias"])


def test_an_old_rounds_task_is_declined_and_leaves_the_newer_state(tmp_path):
    """A review's finding: a task of an earlier round than the device's state (a captured signed task
    re-published, or one that lost its way) started afresh and its state replaced the newer one,
    rolling v_k back. It is declined now, and the state stays the later round's."""
    h = device(0, tmp_path)
    job = make_job(clients_per_round=1)
    params, tensors, _, _ = run_round(job, {"dev0": h}, KIND)["dev0"]
    for _ in range(2):
        run_round(job, {"dev0": h}, KIND)
    held = h.store.load(job.config.job_id, job.device_state.run)
    assert held.round == 3 and params["state"]["round"] == 1
    with pytest.raises(TaskDeclined, match="state of round 3, later than the task's round 1"):
        h(params, tensors)
    after = h.store.load(job.config.job_id, job.device_state.run)
    assert after.round == 3 and all(np.array_equal(after.arrays[k], held.arrays[k]) for k in held.arrays)


@pytest.mark.parametrize("kind", ["pp", "pp-secure"])
@pytest.mark.parametrize("fields", [{"local_rule": "sam"}, {"local_rule": "asam"}, {"prox_mu": 5.0}])
def test_a_local_rule_the_device_would_not_apply_is_refused(kind, fields):
    """A review's finding: pp inherited FedAvg's local_rule, sam_rho and prox_mu, stored and sent
    them, and every device trained with plain SGD whatever they said."""
    from aggregator.jobs.registry import full_config

    with pytest.raises(ValueError, match="plain SGD"):
        full_config(kind, fields)
    assert full_config(kind, {"local_rule": "sgd", "prox_mu": 0.0})["local_rule"] == "sgd"
