"""DP jobs end to end over mosquitto: a DP Fed3R job whose released statistics are the devices'
clipped sums plus noise of the stated scale, and a DP FedAvg job that stops when its privacy
budget would be exceeded; both report the accountant's ε in results.json."""

import json
import threading

import dp_accounting
import numpy as np
from dp_accounting import rdp
from ops_fleet import Features, assert_noise_of_variance, clipped_sums, close_fails_once, kept_windows

from aggregator.jobs.registry import build_job
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from edge_client.agent import DeviceAgent
from edge_client.tasks.fed3r_stats import Fed3RStatsTask
from edge_client.tasks.head_training import HeadTrainingTask
from protocols.mqtt_link import BrokerConfig

D, C = 6, 3


def device_data(i, n=30):
    rng = np.random.default_rng(11 + i)
    y = rng.integers(0, C, n)
    return (3 * (rng.normal(size=(n, D)) + 2 * np.eye(C, D)[y])).astype(np.float32), y


def gaussian_epsilon(z, rounds, q, delta):
    accountant = rdp.RdpAccountant()
    event = dp_accounting.GaussianDpEvent(z)
    accountant.compose(event if q == 1 else dp_accounting.PoissonSampledDpEvent(q, event), rounds)
    return accountant.get_epsilon(delta)


def run_service(job, broker, tmp_path, ids, handlers, store=None, timeout_s: float = 120):
    svc = AggregatorService(job, BrokerConfig.from_url(broker.url), tmp_path,
                            ServiceSettings(evaluate_every_contribution=False), enrolled=set(ids), store=store)
    result = {}
    t = threading.Thread(target=lambda: result.update(svc.run(timeout_s=timeout_s)), daemon=True)
    t.start()
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url), handlers(i)).start() for i, d in enumerate(ids)]
    t.join(timeout_s + 30)
    for a in agents:
        a.stop()
    assert not t.is_alive(), "the service did not end"
    return result


def head_training(i):
    return {"fedavg.head": HeadTrainingTask(*device_data(i), lambda b, s, w: Features(D))}


def capping_device(i: int, folder) -> Fed3RStatsTask:
    """Device i's Fed3R task; a DP job caps its samples, which a device answers only with a state
    folder to keep its sample windows in (``folder``/dev<i>; edge_client/sample_windows.py)."""
    return Fed3RStatsTask(*device_data(i), lambda b, s, w: Features(D), windows=kept_windows(folder / f"dev{i}"))


def test_dp_fed3r_over_mosquitto_releases_clipped_sums_plus_noise(broker, tmp_path):
    ids = [f"dev{i}" for i in range(5)]
    F, N, z = 4.0, 20, 0.8
    cfg = {"job_id": "dpf", "num_classes": C, "feature_dim": D, "clients_per_round": 2, "round_timeout_s": 30,
           "expected_devices": 5, "dp_noise_multiplier": z, "dp_target_epsilon": 8.0, "feature_clip_norm": F,
           "max_samples": N, "dp_mechanism": "gaussian"}    # one stddev on every entry (ssp: test_dp_fed3r_ssp.py)
    job = build_job("fed3r", cfg)
    result = run_service(job, broker, tmp_path, ids, lambda i: {"fed3r.stats": capping_device(i, tmp_path)})
    assert result["state"] == "done" and len(job.contributed) == 5
    # reference: every device's first N rows, clipped to F, bias appended
    A, B = clipped_sums(map(device_data, range(5)), C, N, F)
    assert job.strategy.releases == 3
    sigma2 = job.strategy.releases * job.config.mechanism().scale().b ** 2   # one draw per released round
    assert_noise_of_variance(job.strategy.released, A, B, sigma2)
    saved = json.loads((tmp_path / "results.json").read_text())
    privacy = saved["final"]["privacy"]
    assert privacy["epsilon"] == gaussian_epsilon(z, 1, 1.0, 1e-5) and privacy["delta"] == 1e-5
    assert all("privacy" in e for e in saved["history"])


def test_dp_fedavg_over_mosquitto_stops_at_its_budget(broker, tmp_path):
    ids = [f"dev{i}" for i in range(4)]
    z, population, target = 2.0, 4, 3.0        # q = 1/2: ε(4) = 2.81 <= 3 < ε(5)
    cfg = {"job_id": "dpa", "num_classes": C, "feature_dim": D, "rounds": 50, "clients_per_round": 2,
           "round_timeout_s": 30, "local_epochs": 1, "batch_size": 8, "client_lr": 0.05, "expected_devices": 4,
           "dp_noise_multiplier": z, "dp_clip_norm": 0.5, "dp_population": population, "dp_target_epsilon": target,
           "dp_adaptive_clip": True}
    job = build_job("fedavg", cfg)
    result = run_service(job, broker, tmp_path, ids,
                         lambda i: {"fedavg.head": HeadTrainingTask(*device_data(i), lambda b, s, w: Features(D))})
    assert result["state"] == "done"
    rounds = len(result["rounds"])
    q = 2 / population
    assert gaussian_epsilon(z, rounds, q, 1e-5) <= target < gaussian_epsilon(z, rounds + 1, q, 1e-5)
    saved = json.loads((tmp_path / "results.json").read_text())
    privacy = saved["final"]["privacy"]
    assert privacy["releases"] == rounds and privacy["budget_exhausted"]
    assert privacy["epsilon"] == gaussian_epsilon(z, rounds, q, 1e-5)
    assert privacy["clip_norm"] != 0.5                     # adaptive clipping moved C
    assert sum(len(r["accepted"]) for r in result["rounds"]) == 2 * rounds


def test_a_dp_round_whose_close_cannot_be_committed_publishes_nothing_of_its_draw(broker, tmp_path, monkeypatch):
    """Round 1's noise is drawn, then its close's transaction fails (once). Nothing made from that
    draw may leave the process: the job is rebuilt from the store, round 1 closes again with a
    draw of its own, and what is stored and published is that one release per round (before, the
    failure escaped the close: the round never ended and the service's end published the
    uncommitted noisy model, which the next start then drew again)."""
    from aggregator.storage.store import Store

    ids = [f"dev{i}" for i in range(4)]
    cfg = {"job_id": "dpc", "num_classes": C, "feature_dim": D, "rounds": 3, "clients_per_round": 2,
           "round_timeout_s": 30, "local_epochs": 1, "batch_size": 8, "client_lr": 0.05, "expected_devices": 4,
           "dp_noise_multiplier": 1.0, "dp_clip_norm": 0.5, "seed": 2}
    failed = close_fails_once(monkeypatch)
    store = Store(tmp_path / "state.db")
    result = run_service(build_job("fedavg", cfg), broker, tmp_path / "out", ids, head_training, store, 60)
    assert failed == [1] and result["state"] == "done", result
    stored = store.evaluations("dpc")
    assert [e["round"] for e in stored] == [1, 2, 3]          # round 1 evaluated once: its second draw's
    logged = [json.loads(line) for line in (tmp_path / "out" / "rounds.jsonl").read_text().splitlines()]
    assert [e["round"] for e in logged if e["event"] == "evaluation"] == [1, 2, 3]
    assert result["final"]["privacy"]["releases"] == 3
    versions = store.models("dpc")
    assert [v["round"] for v in versions if not v["final"]] == [1, 2, 3]


def test_a_close_whose_commit_keeps_failing_stops_the_job_publishing_nothing(broker, tmp_path, monkeypatch):
    """A store that refuses every close rebuilt the job at every tick, forever (each rebuild a fresh
    draw, the service never ending): after three failures in a row the job stops, with the reason,
    and nothing made from any of those draws is published."""
    from aggregator.service.job_runner import CLOSE_ATTEMPTS
    from aggregator.storage.store import Store, StoreError

    ids = [f"dev{i}" for i in range(2)]
    cfg = {"job_id": "dpx", "num_classes": C, "feature_dim": D, "rounds": 2, "clients_per_round": 2,
           "round_timeout_s": 30, "local_epochs": 1, "batch_size": 8, "client_lr": 0.05, "expected_devices": 2,
           "dp_noise_multiplier": 1.0, "dp_clip_norm": 0.5}
    attempts = []

    def always_fails(self, job_id, round_, *args, **kwargs):
        attempts.append(round_)
        raise StoreError("disk I/O error")

    monkeypatch.setattr(Store, "close_round", always_fails)
    store = Store(tmp_path / "state.db")
    result = run_service(build_job("fedavg", cfg), broker, tmp_path / "out", ids, head_training, store, 60)
    assert attempts == [1] * CLOSE_ATTEMPTS
    row = store.job("dpx")
    assert row["state"] == "stopped" and f"({CLOSE_ATTEMPTS} times in a row)" in row["summary"]["error"]
    assert store.evaluations("dpx") == [] and store.models("dpx") == []
    assert result == {} and not (tmp_path / "out" / "model.npz").exists()


def test_a_dp_round_that_cannot_close_after_its_draw_stops_publishing_nothing(broker, tmp_path, monkeypatch):
    """The round's noise is drawn, then its close fails before the commit (here its evaluation
    raises): the job stops with the reason and publishes nothing made from that draw (it wrote the
    noisy model and its evaluation for a round the store still held open, which a resume would
    then draw again)."""
    from aggregator.jobs.fedavg import FedAvgJob
    from aggregator.storage.store import Store

    evaluate, broke = FedAvgJob.evaluate, []

    def breaks_once(self, features, labels):
        if not broke:
            broke.append(self.round)
            raise FloatingPointError("the evaluation broke")
        return evaluate(self, features, labels)

    monkeypatch.setattr(FedAvgJob, "evaluate", breaks_once)
    ids = [f"dev{i}" for i in range(2)]
    cfg = {"job_id": "dpy", "num_classes": C, "feature_dim": D, "rounds": 2, "clients_per_round": 2,
           "round_timeout_s": 30, "local_epochs": 1, "batch_size": 8, "client_lr": 0.05, "expected_devices": 2,
           "dp_noise_multiplier": 1.0, "dp_clip_norm": 0.5}
    store = Store(tmp_path / "state.db")
    result = run_service(build_job("fedavg", cfg), broker, tmp_path / "out", ids, head_training, store, 60)
    row = store.job("dpy")
    assert row["state"] == "stopped" and "the evaluation broke" in row["summary"]["error"]
    assert broke == [1] and store.rounds("dpy")[0].state == "open"
    assert result == {} and store.evaluations("dpy") == [] and store.models("dpy") == []
    assert not (tmp_path / "out" / "model.npz").exists() and not (tmp_path / "out" / "results.json").exists()
