"""DP Fed3R releasing once, when the job ends (``dp_release`` "end", ``NoisyFed3R.release_at_end``):
closed rounds' sums are held exactly and noised once, so the model holds one release's noise
however many rounds ran. Against numpy and against a one-round release drawing the same noise;
over mosquitto: no model (no accuracy) before the end, one noisy sum after it, and the job's files
never hold the unreleased sums."""

import io
import json
import logging
import threading
import time

import numpy as np
import pytest
from ops_fleet import assert_noise_of_variance, clipped_sums
from test_dp_over_mqtt import C, D, capping_device, device_data, run_service

from aggregator.compute.privacy import UNPUBLISHED_PREFIX
from aggregator.jobs.registry import build_job
from aggregator.service.job_lifecycle import control_job, create_job
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from aggregator.storage.store import Store
from aggregator.strategies.dp_fed3r import CalibratedSSP, Fed3RSensitivity, NoisyFed3R
from edge_client.agent import DeviceAgent
from protocols.envelope import decode
from protocols.mqtt_link import BrokerConfig, MqttLink
from protocols.payloads.fed3r import Fed3RStats

P = D + 1


def stats(seed: int, n: int = 7) -> Fed3RStats:
    rng = np.random.default_rng(seed)
    Z = np.hstack([rng.normal(size=(n, D)), np.ones((n, 1))])
    y = rng.integers(0, C, n)
    A, B = Z.T @ Z, Z.T @ np.eye(C)[y]
    return Fed3RStats(n=n, p=P, a_upper=A[np.triu_indices(P)], class_ids=np.arange(C), b=B.T)


def strategy(release_at_end: bool, seed: int = 3) -> NoisyFed3R:
    mechanism = CalibratedSSP(1.5, Fed3RSensitivity.of(1, 4.0, True), 0.2)
    return NoisyFed3R(C, P, 0.01, True, True, mechanism, rng=np.random.default_rng(seed), release_at_end=release_at_end)


def test_held_rounds_are_exact_and_released_once_as_one_round_of_them_all():
    rounds = [[stats(1), stats(2)], [stats(3)], [stats(4), stats(5), stats(6)]]
    held = strategy(True)
    for members in rounds:
        for s in members:
            held.add(s)
        held.release()                                  # a round closes: nothing released
        assert held.releases == 0 and held.unreleased
    exact = sum(np.asarray(s.a_upper) for members in rounds for s in members)
    np.testing.assert_allclose(held.held.packed_upper(), exact, rtol=1e-13)
    assert held.n_contributions == 6 and held.n_samples == 42
    assert held.release_held() and not held.release_held()       # once; a second call has nothing to release
    assert held.releases == 1 and not held.unreleased and held.n_contributions == 6
    # the same noise draw on the same total, released as one round: the same model
    one_round = strategy(False)
    one_round.take_round_sum(held_sum_state(rounds))
    one_round.release()
    np.testing.assert_allclose(held.released.packed_upper(), one_round.released.packed_upper(), rtol=1e-12)
    np.testing.assert_allclose(held.solve().coef_, one_round.solve().coef_, rtol=1e-9, atol=1e-12)
    # where releasing every round left three rounds' noise
    per_round = strategy(False)
    for members in rounds:
        for s in members:
            per_round.add(s)
        per_round.release()
    assert per_round.releases == 3


def held_sum_state(rounds) -> dict:
    total = strategy(True).held
    for members in rounds:
        for s in members:
            total.add(s)
    return total.sums_state()


def test_a_restart_resumes_the_held_sums_and_the_files_never_hold_them():
    s = strategy(True)
    s.add(stats(1))
    s.release()
    state = s.state_dict()
    unpublished = [k for k in state if k.startswith(UNPUBLISHED_PREFIX)]
    assert unpublished and all(np.array_equal(state[k], v) for k, v in s.state_dict().items())
    resumed = strategy(True)
    resumed.load_state_dict(state)
    assert resumed.unreleased and np.array_equal(resumed.held.packed_upper(), s.held.packed_upper())
    # a job releasing each round checkpoints no held sums
    assert not [k for k in strategy(False).state_dict() if k.startswith(UNPUBLISHED_PREFIX)]


def test_a_job_holding_its_sums_has_no_model_to_write(tmp_path):
    """A job stopped before its end (it resumes later) writes its statistics file without the held
    sums and no model file: the zeros of an empty release are no model."""
    from aggregator.service.reporting import write_job_files

    job = build_job("fed3r", {**END_JOB, "feature_clip_norm": 100.0})
    job.strategy.add(stats(1))
    job.strategy.release()
    assert job.model_held and job.evaluate(None, None)["held_until_job_end"]
    write_job_files(tmp_path, job, {"state": "stopped"})
    assert not (tmp_path / "model.npz").exists() and json.loads((tmp_path / "results.json").read_text())
    with np.load(tmp_path / "statistics.npz") as files:
        assert not [k for k in files.files if k.startswith(UNPUBLISHED_PREFIX)]
    assert job.finalize() and not job.model_held
    write_job_files(tmp_path, job, {"state": "done"})
    with np.load(tmp_path / "model.npz") as files:
        np.testing.assert_array_equal(files["coef"], job.model_arrays()["coef"])


@pytest.mark.parametrize("kind,fields,message", [
    ("fed3r", {"dp_release": "later"}, "dp_release"),
    ("fed3r", {"dp_noise_multiplier": 0.0, "dp_release": "end"}, "need DP"),
    ("fed3r-sync", {"dp_release": "end"}, "central DP's rule"),
])
def test_a_release_the_job_cannot_make_is_refused(kind, fields, message):
    config = {"num_classes": C, "feature_dim": D, "dp_noise_multiplier": 1.0, "feature_clip_norm": 4.0,
              "max_samples": 5, **fields}
    with pytest.raises(ValueError, match=message):
        build_job(kind, config)


def test_dp_fed3r_over_mosquitto_releases_its_rounds_once_at_the_end(broker, tmp_path):
    ids = [f"dev{i}" for i in range(5)]
    F, N, z = 4.0, 20, 0.8
    cfg = {"job_id": "dp-end", "num_classes": C, "feature_dim": D, "clients_per_round": 2, "round_timeout_s": 30,
           "expected_devices": 5, "dp_noise_multiplier": z, "dp_target_epsilon": 8.0, "feature_clip_norm": F,
           "max_samples": N, "dp_mechanism": "gaussian", "dp_release": "end"}
    job = build_job("fed3r", cfg)
    result = run_service(job, broker, tmp_path, ids, lambda i: {"fed3r.stats": capping_device(i, tmp_path)})
    assert result["state"] == "done" and len(job.contributed) == 5
    A, B = clipped_sums(map(device_data, range(5)), C, N, F)
    # three rounds, one noisy sum: one draw's variance in every entry (three rounds' when each is released)
    assert job.strategy.releases == 1 and not job.strategy.unreleased
    assert_noise_of_variance(job.strategy.released, A, B, job.config.mechanism().scale().b ** 2)
    saved = json.loads((tmp_path / "results.json").read_text())
    before_end = saved["history"][:-1]
    assert len(before_end) >= 2 and all(e["held_until_job_end"] and "accuracy" not in e for e in before_end)
    assert saved["final"]["privacy"]["noisy_sums"] == 1 and "held_until_job_end" not in saved["final"]
    with np.load(tmp_path / "statistics.npz") as files:
        assert not [k for k in files.files if k.startswith(UNPUBLISHED_PREFIX)]
        np.testing.assert_array_equal(files["B"], job.strategy.released.B.cpu().numpy())


def test_simulate_refuses_a_release_it_does_not_know():
    import dataclasses

    from fedfleet.sim_config import PRESETS

    with pytest.raises(ValueError, match="'dp_release' must be one of"):     # the job field's own choices
        dataclasses.replace(PRESETS["smoke"], dp_epsilon=1.0, dp_release="never")


def test_simulate_per_round_release_asks_the_fleet_in_one_round():
    """``--dp-release round``: every round is a release of its own, so simulate asks the whole fleet
    in one round (after the center's), nobody twice, and opens it only with half of the rest."""
    import dataclasses

    from aggregator.compute.privacy import noise_multiplier_for
    from fedfleet.dp_fleet import dp_job_fields
    from fedfleet.sim_config import PRESETS

    cfg = dataclasses.replace(PRESETS["smoke"], dp_epsilon=4.0, dp_center_devices=5, dp_release="round")
    fields = dp_job_fields(cfg, "fed3r", {"num_classes": C, "feature_dim": D})
    assert (fields["clients_per_round"], fields["max_attempts"], fields["dp_min_round_devices"]) == (20, 1, 7)
    assert "dp_release" not in fields and fields["dp_delta"] == 1 / 20
    assert fields["dp_noise_multiplier"] == noise_multiplier_for(4.0, 1 / 20, 1, accounting="pld")
    end = dp_job_fields(dataclasses.replace(cfg, dp_release="end"), "fed3r", {"num_classes": C, "feature_dim": D})
    assert end["dp_release"] == "end" and "clients_per_round" not in end and "dp_min_round_devices" not in end


END_JOB = {"job_id": "dp-end", "num_classes": C, "feature_dim": D, "clients_per_round": 2, "round_timeout_s": 30,
           "expected_devices": 5, "dp_noise_multiplier": 0.8, "dp_target_epsilon": 8.0, "feature_clip_norm": 4.0,
           "max_samples": 20, "dp_mechanism": "gaussian", "dp_release": "end"}
IDS = [f"dev{i}" for i in range(5)]


def serve_with_store(broker, out, store: Store, devices: bool = True, timeout: float = 120,
                     settings: ServiceSettings = ServiceSettings(evaluate_every_contribution=False)) -> tuple[dict, object]:
    """An end-release job served with a durable store (and an evaluation set), its five devices
    online (``devices``) or not (a restart of a finished job needs none)."""
    job = build_job("fed3r", END_JOB)
    eval_set = tuple(np.concatenate(parts) for parts in zip(*(device_data(100 + i) for i in range(3))))
    svc = AggregatorService(job, BrokerConfig.from_url(broker.url), out, settings,
                            enrolled=set(IDS), store=store, eval_set=eval_set)
    if not devices:
        return svc.run(timeout_s=5), job
    result = {}

    def run() -> None:
        try:
            result.update(svc.run(timeout_s=timeout))
        except Exception as exc:        # what the service's own run would have raised
            result["raised"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url),
                          {"fed3r.stats": capping_device(i, out / "devices")}).start()
              for i, d in enumerate(IDS)]
    thread.join(timeout)
    for agent in agents:
        agent.stop()
    return result, job


def stored_models(store: Store) -> list[tuple[dict, dict]]:
    return [(m, dict(np.load(io.BytesIO(store.model_bytes(m["model_id"]))))) for m in store.models("dp-end")]


def test_a_restart_after_the_release_never_releases_again(broker, tmp_path):
    """The release at the end is checkpointed before anything made from it leaves the process: the
    service run again on the finished job (as after a crash at its very end) restores the
    released sums, draws no new noise, and its files hold the committed model. No round before the
    end stores a model version (there is none to deploy)."""
    store = Store(tmp_path / "state.db")
    result, job = serve_with_store(broker, tmp_path / "out", store)
    assert result["state"] == "done" and job.strategy.releases == 1
    models = stored_models(store)
    assert [m["final"] for m, _ in models] == [True]            # round closes stored no (empty) model
    committed = models[0][1]
    evaluations = store.evaluations("dp-end")
    again, restored = serve_with_store(broker, tmp_path / "out", store, devices=False)
    assert restored.strategy.releases == 1 and not restored.strategy.unreleased
    np.testing.assert_array_equal(restored.strategy.released.B.cpu().numpy(), job.strategy.released.B.cpu().numpy())
    assert store.evaluations("dp-end") == evaluations and again["final"]["accuracy"] == result["final"]["accuracy"]
    with np.load(tmp_path / "out" / "model.npz") as files:
        np.testing.assert_array_equal(files["coef"], committed["coef"])


def disk_error(self, *args, **kwargs):
    """A store write that fails as a full or broken disk makes it fail (a test patches it in)."""
    raise OSError("disk I/O error")


def test_a_commit_that_fails_after_the_release_is_not_released_again(broker, tmp_path, monkeypatch):
    """The final evaluation (the released model's accuracy) is stored, then the job's commit fails:
    the restart finishes the job from the released sums, so one draw's accuracy is all there is.
    The commit is part of the job's end: a disk's error there leaves the job running for a later
    try, nothing of it published (it used to raise out of the service's run)."""
    store = Store(tmp_path / "state.db")
    commit = Store.finish_job
    monkeypatch.setattr(Store, "finish_job", disk_error)
    result, _ = serve_with_store(broker, tmp_path / "out", store, timeout=60)
    assert result == {} and store.job("dp-end")["state"] == "running"
    assert not (tmp_path / "out" / "results.json").exists() and not (tmp_path / "out" / "model.npz").exists()
    monkeypatch.setattr(Store, "finish_job", commit)
    result, job = serve_with_store(broker, tmp_path / "out", store, timeout=60)
    assert result["state"] == "done" and job.strategy.releases == 1
    finals = [e for e in store.evaluations("dp-end") if "accuracy" in e]
    assert len(finals) == 1 and finals[0]["privacy"]["noisy_sums"] == 1
    [(model, arrays)] = stored_models(store)
    assert model["final"]
    np.testing.assert_array_equal(arrays["coef"], job.model_arrays()["coef"])


def test_a_release_whose_checkpoint_cannot_be_written_publishes_nothing_of_it(broker, tmp_path, monkeypatch):
    """The end's noise is drawn, then writing the released state fails: nothing made from that draw
    leaves the process (no evaluation, no model, no files; the job stays running in the store), and
    the next start makes the one release there is. Before, the service's own end finished the job a
    second time from the drawn model (committed done), while the checkpoint still held the exact
    sums: the service run again drew and published a second release."""
    store = Store(tmp_path / "state.db")
    commit = Store.replace_checkpoint_state
    monkeypatch.setattr(Store, "replace_checkpoint_state", disk_error)
    result, _ = serve_with_store(broker, tmp_path / "out", store, timeout=60)
    assert store.job("dp-end")["state"] == "running" and store.models("dp-end") == []
    assert not [e for e in store.evaluations("dp-end") if "accuracy" in e]
    assert not (tmp_path / "out" / "model.npz").exists() and not (tmp_path / "out" / "statistics.npz").exists()
    monkeypatch.setattr(Store, "replace_checkpoint_state", commit)
    result, job = serve_with_store(broker, tmp_path / "out", store, timeout=60)
    assert result["state"] == "done" and job.strategy.releases == 1
    finals = [e for e in store.evaluations("dp-end") if "accuracy" in e]
    assert len(finals) == 1 and finals[0]["privacy"]["noisy_sums"] == 1
    again, restored = serve_with_store(broker, tmp_path / "out", store, devices=False)
    assert restored.strategy.releases == 1 and not restored.strategy.unreleased
    np.testing.assert_array_equal(restored.strategy.released.B.cpu().numpy(), job.strategy.released.B.cpu().numpy())


def test_a_serving_service_retries_an_end_it_cannot_commit_after_growing_waits(broker, tmp_path, monkeypatch):
    """A review's finding: under ``keep_serving`` (the admin API's service) a job whose finalized
    state could not be committed stayed running in the store, so the very next turn of the loop
    rebuilt it, drew its release again and failed again — as fast as the loop turns, for as long as
    the disk stays broken. Now the job waits 1 s, then 2 s, ... before it is taken up again."""
    store = Store(tmp_path / "state.db")
    commit = Store.replace_checkpoint_state
    monkeypatch.setattr(Store, "replace_checkpoint_state", disk_error)
    serve_with_store(broker, tmp_path / "out", store, timeout=60)        # every device's sums stored
    assert store.job("dp-end")["state"] == "running"
    tries = []
    monkeypatch.setattr(Store, "replace_checkpoint_state", lambda *a, **k: (tries.append(time.monotonic()), disk_error(*a, **k))[1])
    svc = AggregatorService(None, BrokerConfig.from_url(broker.url), tmp_path / "out",
                            ServiceSettings(evaluate_every_contribution=False, keep_serving=True, tick_s=0.05),
                            enrolled=set(IDS), store=store)
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url), {}).start() for d in IDS]   # a restart waits for them
    start = time.monotonic()
    svc.run(timeout_s=4)
    for agent in agents:
        agent.stop()
    assert 2 <= len(tries) <= 3, [round(t - start, 2) for t in tries]     # at ~0, ~1, ~3 s
    assert all(b - a >= 0.9 * 2 ** i for i, (a, b) in enumerate(zip(tries, tries[1:])))
    assert store.job("dp-end")["state"] == "running"
    monkeypatch.setattr(Store, "replace_checkpoint_state", commit)       # the disk is mended: the next try ends it
    result, job = serve_with_store(broker, tmp_path / "out", store, timeout=30)
    assert result["state"] == "done" and store.job("dp-end")["state"] == "done" and job.strategy.releases == 1


def test_a_draw_that_fails_keeps_the_held_sums(monkeypatch):
    s = strategy(True)
    s.add(stats(1))
    s.release()
    held = s.held.packed_upper().copy()

    class Failing:
        def release(self, *args):
            raise MemoryError("no room for the noise")

    monkeypatch.setattr(s.mechanism, "scale", lambda: Failing())
    with pytest.raises(MemoryError):
        s.release_held()
    assert s.unreleased and np.array_equal(s.held.packed_upper(), held) and s.releases == 0


def end_that_raises(monkeypatch, error: BaseException) -> list[float]:
    """Every release at a job's end raises ``error`` (a test patches it in; a job releasing each
    round releases nothing there, as before); returns the times it was tried."""
    tries, release = [], NoisyFed3R.release_held

    def release_held(self):
        if not self.release_at_end:
            return release(self)
        tries.append(time.monotonic())
        raise error

    monkeypatch.setattr(NoisyFed3R, "release_held", release_held)
    return tries


def test_an_end_that_fails_for_good_fails_its_job_once_and_the_service_serves_on(broker, tmp_path, monkeypatch, caplog):
    """A review's finding: a job whose finalize raised (here its end release, a ValueError as of
    sums it cannot noise) raised out of the service's run, and every restart finalized it again
    and failed alike: a crash loop. Now, as a round close that raises, it ends its job failed with
    one reason (store, results.json, status), logged once with its traceback; the service serves
    its next job, and a restart never finalizes the failed one again."""
    store = Store(tmp_path / "state.db")
    tries = end_that_raises(monkeypatch, ValueError("the held sums are not finite"))
    next_job = {k: v for k, v in END_JOB.items() if k != "dp_release"} | {"job_id": "next"}    # releases each round
    for config in (END_JOB, next_job):
        create_job(store, "fed3r", config)
        control_job(store, None, config["job_id"], "start")
    out = tmp_path / "out"
    svc = AggregatorService(None, BrokerConfig.from_url(broker.url), out,
                            ServiceSettings(evaluate_every_contribution=False, keep_serving=True),
                            enrolled=set(IDS), store=store)
    ended: dict = {}

    def run() -> None:
        try:
            svc.run(timeout_s=90)
        except BaseException as exc:        # the old code: the failed end raised out of the service
            ended["raised"] = exc

    statuses = []           # the retained status message, as a dashboard reads it
    watcher = MqttLink("status-watcher", BrokerConfig.from_url(broker.url),
                       on_message=lambda topic, payload: statuses.append(decode(payload).body),
                       subscriptions=[(svc.topics.status, 1)])
    watcher.start()
    thread = threading.Thread(target=run, daemon=True)
    with caplog.at_level(logging.ERROR, logger="fedfleet.aggregator"):
        thread.start()
        agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url),
                              {"fed3r.stats": capping_device(i, out / "devices")}).start() for i, d in enumerate(IDS)]
        deadline = time.monotonic() + 90
        while thread.is_alive() and store.job("next")["state"] != "done" and time.monotonic() < deadline:
            time.sleep(0.1)
        serving = thread.is_alive() and svc.call(lambda: svc.live["time"]) > 0     # it still answers
        svc.stop()
        thread.join(30)
        for agent in agents:
            agent.stop()
        watcher.stop()
    assert "raised" not in ended and serving and store.job("next")["state"] == "done"
    row = store.job("dp-end")
    reason = "the job cannot end: ValueError: the held sums are not finite"
    assert row["state"] == "failed" and row["summary"]["error"] == reason and len(tries) == 1
    assert store.models("dp-end") == [] and store.models("next")
    saved = json.loads((out / "dp-end" / "results.json").read_text())
    assert saved["state"] == "failed" and saved["error"] == reason
    assert [b["state"] for b in statuses if b["job"] == "dp-end"][-1] == "failed"
    # nothing made from the state its end left is published: only its record
    assert not (out / "dp-end" / "model.npz").exists() and not (out / "dp-end" / "statistics.npz").exists()
    logged = [r for r in caplog.records if "dp-end" in r.getMessage()]
    assert [(r.getMessage(), r.exc_info[0]) for r in logged] == [(f"job dp-end failed: {reason}", ValueError)]
    # a restart with the job (as `aggregator serve` of its config) ends it as it was: no second try
    again, _ = serve_with_store(broker, out / "dp-end", store, devices=False)
    assert again["state"] == "failed" and again["error"] == reason and len(tries) == 1
    assert store.job("dp-end")["state"] == "failed" and store.job("dp-end")["summary"]["error"] == reason


@pytest.mark.parametrize("error", [OSError("disk I/O error"), MemoryError("no room for the noise")])
def test_an_end_that_fails_for_now_keeps_its_job_running_for_the_next_try(broker, tmp_path, monkeypatch, error):
    """The environment's failures (a disk's, the memory's) are what a later try gets past: the job
    stays running in the store with nothing of it published, and the next start ends it with one
    release. Before, the error raised out of the service's run."""
    store = Store(tmp_path / "state.db")
    release = NoisyFed3R.release_held
    tries = end_that_raises(monkeypatch, error)
    result, _ = serve_with_store(broker, tmp_path / "out", store, timeout=60)
    assert "raised" not in result and len(tries) == 1
    assert store.job("dp-end")["state"] == "running" and store.models("dp-end") == []
    assert not (tmp_path / "out" / "results.json").exists()
    monkeypatch.setattr(NoisyFed3R, "release_held", release)
    result, job = serve_with_store(broker, tmp_path / "out", store, timeout=60)
    assert result["state"] == "done" and store.job("dp-end")["state"] == "done" and job.strategy.releases == 1
