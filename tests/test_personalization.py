"""OLL personalization as a job: the wire payload, the device handler, the aggregator job.

References are independent of ``edge_client.oll``: the global head's and OLL's predictions are
recomputed with numpy (argmax over all classes / over the local labels only), and the WMA is a
plain Σ correct / Σ n."""

import numpy as np
import pytest

from aggregator.jobs.personalize import PersonalizeConfig, PersonalizeJob, load_model
from edge_client.agent import TaskDeclined
from edge_client.oll import choose_fp_lr
from edge_client.tasks.head_training import LocalTraining
from edge_client.tasks.personalization import PersonalizeTask
from protocols import messages as M
from protocols.envelope import EnvelopeError, decode, encode
from protocols.payloads.personalize import KIND, PersonalizationReport, encode_report, parse_report

C, D = 6, 8


class IdentityFeatures:
    """'Images' that already are feature vectors: the handler's extractor returns them as they are."""

    feature_dim = D

    def extract(self, images):
        return np.asarray(images, dtype=np.float32)


def factory(*_):
    return IdentityFeatures()


def device_data(seed: int, labels=(1, 4), n_train=60, n_test=30):
    """Gaussian class clusters around per-class means, only the device's labels."""
    rng = np.random.default_rng(seed)
    means = np.random.default_rng(99).normal(0, 2.0, (C, D))
    def draw(n):
        y = rng.choice(labels, n)
        return (means[y] + rng.normal(0, 1.5, (n, D))).astype(np.float32), y
    return (*draw(n_train), *draw(n_test))


def head(seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(0, 1, (C, D)).astype(np.float32), rng.normal(0, 0.1, C).astype(np.float32)


def task_params(**over):
    return {"num_classes": C, "feature_dim": D, "backbone": "b", "image_size": 8, "weights_sha256": "",
            "fallback": "global", "fp_epochs": 3, "batch_size": 16, "fp_lrs": [1e-2, 1e-3],
            "fp_folds": 4, "weight_decay": 0.0, "temperature": 0.1, "seed": 3, **over}


def result_envelope(body, tensors=None):
    ref = M.TaskRef("oll-job", 1, "t1")
    return decode(encode(M.result_message("dev1", ref, KIND, body, tensors or {})))


# ----------------------------------------------------------------------------- device handler
def test_handler_counts_match_an_independent_numpy_reference():
    xtr, ytr, xte, yte = device_data(0, labels=(1, 4, 5))
    W, b = head(1)
    body, tensors = PersonalizeTask(xtr, ytr, xte, yte, factory)(task_params(fp_epochs=0), {"weight": W, "bias": b})
    assert tensors == {}
    logits = xte @ W.T + b
    assert body["correct"]["global"] == int((logits.argmax(1) == yte).sum())
    local = np.unique(ytr)
    masked = np.full_like(logits, -np.inf)
    masked[:, local] = logits[:, local]
    assert body["correct"]["oll"] == int((masked.argmax(1) == yte).sum())
    assert body["local_classes"] == 3 and body["n_test"] == len(yte) and body["n_train"] == len(ytr)
    assert body["fp_lr"] is None and "oll_fp" not in body["correct"]


def test_fine_tuning_improves_a_bad_head_and_reports_the_chosen_rate():
    xtr, ytr, xte, yte = device_data(1)
    W, b = head(2)
    task = PersonalizeTask(xtr, ytr, xte, yte, factory)
    body, _ = task(task_params(fp_epochs=20), {"weight": W, "bias": b})
    assert body["fp_lr"] in (1e-2, 1e-3)
    # two well-separated clusters: fine-tuning must fix what a random head gets wrong
    assert body["correct"]["oll_fp"] >= max(body["correct"]["oll"], int(0.9 * len(yte)))
    assert task.head is not None and set(task.head.label_map.global_ids) == {1, 4}
    parse_report(result_envelope(body), C, with_fp=True)        # what the device sends is valid


@pytest.mark.parametrize("params, tensors, match", [
    (task_params(), {}, "no head tensor 'weight'"),
    (task_params(), {"weight": np.zeros((C + 1, D), np.float32), "bias": np.zeros(C + 1, np.float32)}, "the task's params say"),
    (task_params(), {"weight": np.full((C, D), np.nan, np.float32), "bias": np.zeros(C, np.float32)}, "NaN"),
    (task_params(fallback="maybe"), None, "fallback"),
    (task_params(fp_lrs=[]), None, "fp_lrs"),
    (task_params(num_classes="x"), None, "bad oll.personalize params"),
    (task_params(num_classes=3), None, "the task's params say"),
])
def test_handler_declines_bad_tasks(params, tensors, match):
    xtr, ytr, xte, yte = device_data(2)
    W, b = head()
    with pytest.raises(TaskDeclined, match=match):
        PersonalizeTask(xtr, ytr, xte, yte, factory)(params, {"weight": W, "bias": b} if tensors is None else tensors)


def test_held_out_label_outside_local_labels_errors_or_falls_back():
    xtr, ytr, xte, yte = device_data(3, labels=(1, 4))
    xte, yte = np.vstack([xte, xte[:1]]), np.append(yte, 5)      # one held-out sample of a class never trained on
    W, b = head()
    task = PersonalizeTask(xtr, ytr, xte, yte, factory)
    with pytest.raises(TaskDeclined, match="not among the device's local labels"):
        task(task_params(fallback="error", fp_epochs=0), {"weight": W, "bias": b})
    body, _ = task(task_params(fallback="global", fp_epochs=0), {"weight": W, "bias": b})
    assert body["fallback"] == 1


def test_choose_fp_lr_prefers_the_rate_that_validates_better():
    xtr, ytr, _, _ = device_data(4)
    W, b = head(5)
    recipe = LocalTraining(epochs=10, batch_size=16, lr=0.1, weight_decay=0.0, seed=1)
    # 1e-9 cannot move a random head in 10 epochs; 1e-2 can: validation must tell them apart
    lr, scores = choose_fp_lr(W, b, xtr, ytr, recipe, [1e-9, 1e-2], 4)
    assert lr == 1e-2 and scores[1e-2] > scores[1e-9]
    assert choose_fp_lr(W, b, xtr, ytr, recipe, [5e-3], 4) == (5e-3, {})
    for bad_lrs, bad_folds in (([float("nan")], 4), ([1e-3, 1e-4], 1), ([1e-3, 1e-4], True)):
        with pytest.raises(ValueError):
            choose_fp_lr(W, b, xtr, ytr, recipe, bad_lrs, bad_folds)


# ----------------------------------------------------------------------------- wire payload
def good_body(**over):
    body, _ = encode_report(PersonalizationReport(50, 20, 2, {"global": 10, "oll": 15, "oll_fp": 18}, 0, 1e-3))
    return {**body, **over}


@pytest.mark.parametrize("body, tensors, match", [
    (good_body(n_test=0), None, "out of range"),
    (good_body(local_classes=C + 1), None, "local_classes"),
    (good_body(correct={"global": 10, "oll": 15}), None, "expected"),
    (good_body(correct={"global": 10, "oll": 21, "oll_fp": 1}), None, "0..n_test"),
    (good_body(correct={"global": True, "oll": 1, "oll_fp": 1}), None, "integer"),
    (good_body(fp_lr=-1.0), None, "fp_lr"),
    (good_body(fp_lr="fast"), None, "fp_lr"),
    (good_body(fallback=-1), None, "fallback"),
    (good_body(), {"weight": np.zeros((C, D), np.float32)}, "no tensors"),
])
def test_malformed_reports_are_rejected(body, tensors, match):
    with pytest.raises(EnvelopeError, match=match):
        parse_report(result_envelope(body, tensors), C, with_fp=True)


def test_a_rate_that_is_no_float_or_not_the_tasks_is_one_clear_refusal():
    """A 400-digit JSON integer raised OverflowError out of the check (counted malformed, no refusal
    sent back, the device waited out the round): the envelope refuses it now, as an integer outside
    the contract's range; a rate the task never offered passed."""
    with pytest.raises(EnvelopeError, match=r"outside -2\^63"):
        parse_report(result_envelope(good_body(fp_lr=10 ** 400)), C, with_fp=True)
    with pytest.raises(EnvelopeError, match="none of the task's fp_lrs"):
        parse_report(result_envelope(good_body(fp_lr=0.5)), C, with_fp=True, fp_lrs=(1e-4, 1e-3))
    assert parse_report(result_envelope(good_body()), C, with_fp=True, fp_lrs=(1e-4, 1e-3)).fp_lr == 1e-3


def test_report_without_fp_must_not_claim_a_rate():
    body = good_body(correct={"global": 10, "oll": 15})
    assert parse_report(result_envelope({**body, "fp_lr": None}), C, with_fp=False).fp_lr is None
    with pytest.raises(EnvelopeError, match="without FP"):
        parse_report(result_envelope(body), C, with_fp=False)


# ----------------------------------------------------------------------------- aggregator job
def test_job_reports_plain_weighted_mean_accuracy(tmp_path):
    W, b = head()
    np.savez(tmp_path / "fed3r.npz", coef=W, intercept=b, raw_weights=np.zeros((D + 1, C)))
    job = PersonalizeJob(PersonalizeConfig(num_classes=C, feature_dim=D, head_file=str(tmp_path / "fed3r.npz"),
                                           clients_per_round=2))
    rng = np.random.default_rng(0)
    truth = {}
    devices = {f"d{i}" for i in range(5)}
    while not job.finished(devices, devices):
        for dev in job.next_participants(devices):
            params, tensors = job.task_for(dev)
            assert np.array_equal(tensors["weight"], W) and params["fp_lrs"] == [1e-4, 1e-3]
            n = int(rng.integers(5, 40))
            counts = {m: int(rng.integers(0, n + 1)) for m in ("global", "oll", "oll_fp")}
            truth[dev] = (n, counts)
            body, _ = encode_report(PersonalizationReport(100, n, 2, counts, 0, 1e-3))
            job.apply(dev, job.parse_result(result_envelope(body)))
    assert job.contributions == 5 and job.round == 3              # κ = 2: 2 + 2 + 1
    summary = job.evaluate(None, None)
    total = sum(n for n, _ in truth.values())
    for m in ("global", "oll", "oll_fp"):
        assert summary["wma"][m] == sum(c[m] for _, c in truth.values()) / total
    assert summary["accuracy"] == summary["wma"]["oll_fp"] and summary["fp_lr_chosen"] == {"0.001": 5}


def test_one_devices_claimed_held_out_count_weighs_at_most_the_jobs_bound(tmp_path):
    """Each device's n_test is its own claim: one of ten claiming 10^9 with nothing right made every
    WMA its own (~1e-8; before this bound the job took Σ correct / Σ n as claimed). Its count weighs at
    most weight_bound_multiplier x the reports' median (10 by default): the WMA recomputed with
    numpy; with the bound off, Σ correct / Σ n."""
    W, b = head()
    np.savez(tmp_path / "fed3r.npz", coef=W, intercept=b, raw_weights=np.zeros((D + 1, C)))
    reports = {f"d{i}": (20, {"global": 10, "oll": 15, "oll_fp": 18}) for i in range(9)}
    reports["liar"] = (10**9, {"global": 0, "oll": 0, "oll_fp": 0})
    summaries = []
    for multiplier in (10.0, 0.0):
        job = PersonalizeJob(PersonalizeConfig(num_classes=C, feature_dim=D, head_file=str(tmp_path / "fed3r.npz"),
                                               clients_per_round=10, weight_bound_multiplier=multiplier))
        assert sorted(job.next_participants(set(reports))) == sorted(reports)
        for dev, (n, counts) in reports.items():
            body, _ = encode_report(PersonalizationReport(100, n, 2, counts, 0, 1e-3))
            job.apply(dev, job.parse_result(result_envelope(body)))
        summaries.append(job.evaluate(None, None))
    n = np.array([r[0] for r in reports.values()], float)
    w = np.minimum(n, 10 * np.median(n))
    for m in ("global", "oll", "oll_fp"):
        correct = np.array([r[1][m] for r in reports.values()], float)
        assert summaries[0]["wma"][m] == pytest.approx(float(np.sum(w * correct / n) / w.sum()), rel=1e-12)
        assert summaries[1]["wma"][m] == correct.sum() / n.sum()
    assert summaries[0]["wma"]["oll_fp"] == pytest.approx(9 * 18 / (9 * 20 + 200))
    assert summaries[0]["heldout_counts_bounded"] == 1 and "heldout_counts_bounded" not in summaries[1]


def test_with_two_held_out_reports_the_smaller_count_bounds_the_larger():
    """A review's finding: the bound took np.median, the mean of two counts, so with two reports a
    claim of 10^9 beside an honest 20 was not bounded and both WMAs were the liar's (0.99999 against
    the honest device's 0.7). Now the smaller count bounds: the liar weighs at most multiplier x 20."""
    from aggregator.jobs.personal_wma import bounded_wma, bounded_weights

    totals, correct = [20, 10**9], [14, 10**9]
    weights = bounded_weights(totals, 2.0)
    assert weights == [20.0, 40.0]
    assert bounded_wma(correct, totals, weights) == pytest.approx((20 * 0.7 + 40 * 1.0) / 60, rel=1e-12)
    assert bounded_weights([20, 30], 2.0) is None           # within the bound: Σ correct / Σ n as claimed


def test_job_head_file_formats_and_bad_heads(tmp_path):
    W, b = head()
    np.savez(tmp_path / "fedavg.npz", weight=W, bias=b)
    loaded_head, loaded_tail = load_model(str(tmp_path / "fedavg.npz"))
    assert np.array_equal(loaded_head["weight"], W) and loaded_tail == {}
    np.savez(tmp_path / "other.npz", x=W)
    with pytest.raises(ValueError, match="no head"):
        load_model(str(tmp_path / "other.npz"))
    with pytest.raises(ValueError, match="head_file"):
        PersonalizeJob(PersonalizeConfig(num_classes=C, feature_dim=D))
    with pytest.raises(ValueError, match="is \\(6, 8\\)"):
        PersonalizeJob(PersonalizeConfig(num_classes=C, feature_dim=D + 1, head_file=str(tmp_path / "fedavg.npz")))
    np.savez(tmp_path / "nan.npz", weight=np.full((C, D), np.inf, np.float32), bias=b)
    with pytest.raises(ValueError, match="NaN or Inf"):
        PersonalizeJob(PersonalizeConfig(num_classes=C, feature_dim=D, head_file=str(tmp_path / "nan.npz")))
    for bad in ({"fp_lrs": []}, {"fp_lrs": [-1.0]}, {"fp_lrs": ["x"]}, {"fallback": "guess"},
                {"fp_folds": 1}, {"fp_epochs": -1}):
        with pytest.raises(ValueError):
            PersonalizeConfig(**bad)


def test_job_refuses_reports_that_do_not_match_its_fp_setting(tmp_path):
    W, b = head()
    np.savez(tmp_path / "h.npz", weight=W, bias=b)
    job = PersonalizeJob(PersonalizeConfig(num_classes=C, feature_dim=D, head_file=str(tmp_path / "h.npz"),
                                           fp_epochs=0))
    with pytest.raises(EnvelopeError):
        job.parse_result(result_envelope(good_body()))          # claims OLL+FP for an OLL-only job


def test_golden_vectors_of_head_and_personalization_messages_parse():
    """What a client in another language tests its codec against is valid under the payload rules."""
    from protocols import golden
    from protocols.payloads.fedavg import parse_head_update

    d = golden.golden_dir()
    task = decode((d / "task_oll_personalize.bin").read_bytes())
    assert task.body["kind"] == KIND and task.tensors["weight"].shape == (3, 2)
    report = parse_report(decode((d / "result_oll_personalize.bin").read_bytes()), 3, with_fp=True)
    assert report.correct == {"global": 12, "oll": 17, "oll_fp": 19} and report.fp_lr == 0.001
    update = parse_head_update(decode((d / "result_fedavg_head.bin").read_bytes()), 3, 2)
    head_task = decode((d / "task_fedavg_head.bin").read_bytes())
    assert update.n == 40 and np.array_equal(update.weight, head_task.tensors["weight"] * 0.5)
