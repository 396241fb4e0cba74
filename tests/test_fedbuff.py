"""FedBuff (asynchronous buffered aggregation): the staleness rules against a plain numpy
reference, the fedavg-async job's version bookkeeping, and a job over mosquitto end to end."""

import json
import math
import time

import numpy as np
import pytest

from aggregator.jobs.fedavg_async import AsyncFedAvgConfig, AsyncFedAvgJob
from aggregator.jobs.registry import build_job
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from aggregator.storage.store import Store
from aggregator.strategies.fedbuff import FedBuff, staleness_weight
from edge_client.features import FeatureExtractor
from edge_client.tasks.head_training import HeadTrainingTask
from protocols import messages as M
from protocols.envelope import EnvelopeError, decode, encode
from protocols.payloads.fedavg import KIND, encode_head_update
from protocols.rounds import RoundClosed

from ops_fleet import close_fails_once, serve_until_done

C, D, SIZE = 3, 8, 8


def reference_fedbuff(x0, arrivals, K, lr, max_stale, a):
    """Plain numpy FedBuff: models[v] is version v; each arrival is (trained, base version)."""
    models, buf, stale = [{k: v.astype(np.float64) for k, v in x0.items()}], [], 0
    for trained, v in arrivals:
        tau = len(models) - 1 - v
        if tau > max_stale:
            stale += 1
            continue
        buf.append({k: (1.0 + tau) ** -a * (trained[k].astype(np.float64) - models[v][k]) for k in x0})
        if len(buf) == K:
            models.append({k: models[-1][k] + lr / K * sum(u[k] for u in buf) for k in x0})
            buf = []
    return models, stale


def head(rng):
    return {"weight": rng.normal(size=(C, D)).astype(np.float32), "bias": rng.normal(size=C).astype(np.float32)}


def test_staleness_weight_is_one_over_sqrt_one_plus_staleness():
    for tau in range(6):
        assert staleness_weight(tau) == pytest.approx(1 / np.sqrt(1 + tau), rel=1e-15)
    assert staleness_weight(3, exponent=1.0) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        staleness_weight(-1)


@pytest.mark.parametrize("K, max_stale, lr", [(1, 0, 1.0), (3, 2, 1.0), (4, 1, 0.5)])
def test_fedbuff_equals_numpy_reference_with_stale_updates_dropped(K, max_stale, lr):
    rng = np.random.default_rng(K * 10 + max_stale)
    x0 = head(rng)
    fb = FedBuff(x0, K, lr, max_stale)
    arrivals = []
    outcomes = []
    for _ in range(40):
        # a device based on a random recent version (sometimes beyond max_staleness)
        v = int(rng.integers(max(0, fb.version - max_stale - 2), fb.version + 1))
        trained = head(rng)
        arrivals.append((trained, v))
        if fb.version - v > max_stale:
            with pytest.raises(KeyError):
                fb.model_for(v)                    # not kept: memory bounded by max_staleness + 1 versions
        outcomes.append(fb.add(trained, v))
    models, stale = reference_fedbuff(x0, arrivals, K, lr, max_stale, 0.5)
    assert fb.version == len(models) - 1 and fb.version >= 3
    assert fb.stale_dropped == stale == outcomes.count("stale") > 0
    assert outcomes.count("stepped") == fb.version
    for k in x0:
        np.testing.assert_allclose(fb.params[k], models[-1][k].astype(np.float32), rtol=1e-6, atol=1e-6)


def test_a_bad_update_changes_nothing_and_state_round_trips_mid_buffer():
    rng = np.random.default_rng(1)
    fb = FedBuff(head(rng), buffer_size=3, max_staleness=2)
    fb.add(head(rng), 0)
    before = fb.state_dict()
    bad = head(rng)
    bad["bias"][1] = np.nan
    for update in (bad, {"weight": head(rng)["weight"]}, {**head(rng), "bias": np.zeros(C + 1, np.float32)}):
        with pytest.raises(ValueError):
            fb.add(update, 0)
    with pytest.raises(ValueError):
        fb.add(head(rng), 5)                       # a version that never existed
    after = fb.state_dict()
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)
    # a restored strategy continues exactly where the original is
    twin = FedBuff(head(np.random.default_rng(99)), buffer_size=3, max_staleness=2)
    twin.load_state_dict(after)
    for _ in range(7):
        u, v = head(rng), max(0, fb.version - 1)
        assert fb.add(u, v) == twin.add(u, v)
    for k in fb.params:
        np.testing.assert_array_equal(fb.params[k], twin.params[k])


def result_env(job, device, round_, tensors, n, version):
    body, out = encode_head_update(tensors["weight"], tensors["bias"], n)
    body["model_version"] = version
    return decode(encode(M.result_message(device, M.TaskRef(job.config.job_id, round_, "t"), KIND, body, out)))


def test_job_dispatches_the_current_version_and_checks_the_echo():
    job = AsyncFedAvgJob(AsyncFedAvgConfig(num_classes=C, feature_dim=D, clients_per_round=2, buffer_size=2,
                                           max_staleness=1, rounds=5))
    rng = np.random.default_rng(0)
    first = job.next_dispatches({"a", "b", "c"})
    assert len(first) == 2
    rounds = {d: job.open_dispatch(d) for d in first}
    assert job.next_dispatches({"a", "b", "c"}) == []                     # concurrency used up
    d0, d1 = first
    params, tensors = job.task_for(d0)
    assert params["model_version"] == 0
    with pytest.raises(EnvelopeError, match="version"):                  # the server's record decides
        job.parse_result(result_env(job, d0, rounds[d0], head(rng), 5, version=1))
    with pytest.raises(EnvelopeError, match="model_version"):
        env = result_env(job, d0, rounds[d0], head(rng), 5, version=0)
        del env.body["model_version"]
        job.parse_result(env)
    job.apply(d0, job.parse_result(result_env(job, d0, rounds[d0], head(rng), 5, 0)))
    job.close_round(RoundClosed(rounds[d0], (d0,), (), (), ()))
    r2 = job.open_dispatch(d0)                                            # d0 again, still version 0
    job.apply(d0, job.parse_result(result_env(job, d0, r2, head(rng), 5, 0)))
    job.close_round(RoundClosed(r2, (d0,), (), (), ()))
    assert job.version == 1 and job.task_for(d1)[0]["model_version"] == 0
    r3 = job.open_dispatch(d0)
    assert job.task_for(d0)[0]["model_version"] == 1
    np.testing.assert_array_equal(job.task_for(d0)[1]["weight"], job.params["weight"])
    # d1 (version 0, staleness 1) is still applied; once one more step passes it would be hopeless
    assert not job.hopeless(rounds[d1])
    job.apply(d1, job.parse_result(result_env(job, d1, rounds[d1], head(rng), 5, 0)))
    assert job.buffer.buffered == 1 and job.buffer.stale_dropped == 0
    # a restart replaying an update already in the checkpoint does not apply it twice
    state = job.state_dict()
    twin = build_job("fedavg-async", job.config.to_dict())
    twin.load_state_dict(state)
    twin.keep_dispatches({r3: d0})
    twin.apply(d1, twin.parse_result(result_env(job, d1, rounds[d1], head(rng), 5, 0)))
    assert twin.buffer.buffered == 1


def test_a_device_whose_update_waits_in_the_buffer_is_not_asked_again_after_a_restart():
    """One device holds at most one slot of each buffer (``in_buffer``); the checkpoint names the
    buffer's devices, and a restarted job must keep them out of the next dispatches too (it once
    started with none marked, so the device whose update waited in the buffer was asked again)."""
    config = AsyncFedAvgConfig(num_classes=C, feature_dim=D, clients_per_round=3, buffer_size=3,
                               max_staleness=2, rounds=5)
    rng = np.random.default_rng(5)
    live = AsyncFedAvgJob(config)
    r_a, r_b = live.open_dispatch("a"), live.open_dispatch("b")
    live.apply("a", live.parse_result(result_env(live, "a", r_a, head(rng), 5, 0)))
    live.close_round(RoundClosed(r_a, ("a",), (), (), ()))
    assert live.next_dispatches({"a", "b", "c"}) == ["c"]              # a waits in the buffer, b trains
    restarted = AsyncFedAvgJob(config)
    restarted.load_state_dict(live.state_dict())
    restarted.keep_dispatches({r_b: "b"})
    assert restarted.buffer.buffered == 1
    assert restarted.next_dispatches({"a", "b", "c"}) == ["c"]


def test_a_restart_replaying_an_answered_round_still_open_never_applies_an_update_twice():
    """The replay walks the stored rounds in order: a round answered but not yet closed when the
    process died is applied again early and closed only at the next tick, after the later rounds'
    closes were replayed. The checkpoint taken at that close must still keep every applied round
    from a second replay (it once set its floor below rounds it no longer marked)."""
    config = AsyncFedAvgConfig(num_classes=C, feature_dim=D, clients_per_round=3, buffer_size=2,
                               max_staleness=2, rounds=5)
    rng = np.random.default_rng(3)
    live = AsyncFedAvgJob(config)
    bookkeeping, results, stored = {}, {}, []          # per round; stored: rounds with a contribution

    def open_(job, device):
        r = job.open_dispatch(device)
        bookkeeping[r] = job.bookkeeping()
        return r

    def answer(job, r, device):
        results[r] = (device, result_env(job, device, r, head(rng), 5, bookkeeping[r]["version"]))
        stored.append(r)
        job.apply(device, job.parse_result(results[r][1]))

    def restart(state, floor, open_rounds):
        """What aggregator/service/recovery.py does: the checkpoint, then the rounds above its floor."""
        job = AsyncFedAvgJob(config)
        job.load_state_dict(state)
        for r in sorted(bookkeeping):
            if r > floor:
                job.restore_bookkeeping(bookkeeping[r])
                if r in stored:
                    job.apply(results[r][0], job.parse_result(results[r][1]))
                if r not in open_rounds:
                    job.close_round(RoundClosed(r, (), (), (), ()))
        job.keep_dispatches(open_rounds)
        return job

    r1, r2, r3 = (open_(live, d) for d in ("a", "b", "c"))
    answer(live, r3, "c")
    live.close_round(RoundClosed(r3, ("c",), (), (), ()))
    r4 = open_(live, "d")
    answer(live, r2, "b")
    live.close_round(RoundClosed(r2, ("b",), (), (), ()))
    r5 = open_(live, "c")
    checkpoint = live.state_dict(), live.replay_floor
    answer(live, r1, "a")                     # stored, then the process dies before its round closes
    first = restart(*checkpoint, {r1: "a", r4: "d", r5: "c"})
    first.close_round(RoundClosed(r1, ("a",), (), (), ()))           # the restored round's next tick
    second = restart(first.state_dict(), first.replay_floor, {r4: "d", r5: "c"})
    for job in (first, second):
        assert (job.version, job.buffer.buffered, job.buffer.applied) == (1, 1, 3)
        for k, v in live.buffer.state_dict().items():
            np.testing.assert_array_equal(job.buffer.state_dict()[k], v)


def pixel_extractor():
    proj = np.random.default_rng(99).normal(size=(3 * SIZE * SIZE, D)).astype(np.float32) / 20
    return FeatureExtractor(lambda x: x.reshape(len(x), -1) @ proj, image_size=SIZE,
                            mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), feature_dim=D)


class SlowDevice(HeadTrainingTask):
    """Real local head training, then a device-specific delay (heterogeneous speeds)."""

    def __init__(self, seed, delay_s):
        rng = np.random.default_rng(seed)
        extractor = pixel_extractor()
        super().__init__(rng.integers(0, 256, (24, SIZE, SIZE), dtype=np.uint8), rng.integers(0, C, 24),
                         lambda *a: extractor)
        self.delay_s = delay_s

    def __call__(self, params, tensors=None):
        out = super().__call__(params, tensors)
        time.sleep(self.delay_s)
        return out


class SlowFirst(SlowDevice):
    """Slow on its first task only (its dispatch expires), quick on the later ones."""

    def __call__(self, params, tensors=None):
        out = super().__call__(params, tensors)
        self.delay_s = 0.0
        return out


def test_async_job_over_mosquitto_equals_numpy_fedbuff_of_the_stored_arrivals(broker, tmp_path):
    devices = {"dev0": 0.05, "dev1": 0.1, "dev2": 3.0}                       # the slow one goes stale
    config = AsyncFedAvgConfig(num_classes=C, feature_dim=D, image_size=SIZE, clients_per_round=3, buffer_size=2,
                               max_staleness=1, rounds=6, round_timeout_s=20, expected_devices=3, batch_size=8,
                               **PLAIN_MEAN)       # the paper's step: every bounded-influence layer off
    store = Store(tmp_path / "agg.db")
    svc, result = serve_until_done(AsyncFedAvgJob(config), broker.url, tmp_path,
                                   {d: {KIND: SlowDevice(i, delay)} for i, (d, delay) in enumerate(devices.items())},
                                   store)
    assert result["state"] == "done"
    job = svc.job
    assert job.version >= 6
    # the reference: the stored contributions in arrival order, each against the version it was dispatched
    versions = {r.round: r.bookkeeping["version"] for r in store.rounds(config.job_id)}
    assert all(len(r.participants) == 1 for r in store.rounds(config.job_id))
    stored = sorted(store.contributions(config.job_id), key=lambda c: c.seq)
    arrivals = []
    for c in stored:
        env = decode(c.payload)
        assert env.body["model_version"] == versions[c.round]                  # the device echoed it
        arrivals.append(({k: env.tensors[k] for k in ("weight", "bias")}, versions[c.round]))
    models, stale = reference_fedbuff(initial(config), arrivals, 2, 1.0, 1, 0.5)
    applied = len(models) - 1
    assert applied >= 6 and job.buffer.stale_dropped == stale
    for k in ("weight", "bias"):
        np.testing.assert_allclose(job.buffer.model_for(6)[k], models[6][k].astype(np.float32), rtol=1e-6, atol=1e-6)
    # no device waited for another: the fast ones contributed many times; the slow one's model went
    # stale past max_staleness, so its dispatch was given up (acknowledged late, never applied)
    assert job.contributed["dev0"] >= 3 and job.contributed.get("dev2", 0) == 0
    given_up = [r for r in store.rounds(config.job_id) if r.state == "closed" and "dev2" in r.outcome["dropped"]]
    assert given_up


def initial(config):
    return AsyncFedAvgJob(config).params


ASYNC_CRASHES = ["contribution_stored:3", "round_closing:3", "round_opened:2"]


def test_async_job_killed_at_crash_points_resumes_its_buffer_exactly(broker, tmp_path):
    """SIGKILLed between storing an update and checkpointing it, mid-close, and while
    opening a dispatch: each restart resumes the very buffer, so the final model is numpy FedBuff of
    the stored arrivals (each applied once, in arrival order)."""
    import sqlite3

    from ops_fleet import Fleet, prepare, run_aggregator

    devices = [f"dev{i:02d}" for i in range(4)]
    prepare(tmp_path, devices, kind="fedavg-async", server_momentum=0.0, rounds=7, buffer_size=2,
            max_staleness=2, clients_per_round=3, round_timeout_s=30, **PLAIN_MEAN)  # rounds: server steps
    state = tmp_path / "state.db"
    with Fleet(broker.url, devices, kind="fedavg-async"):
        for crash in [*ASYNC_CRASHES, None]:
            rc, log = run_aggregator(tmp_path, broker.url, state, crash=crash, timeout=120)
            assert rc == (0 if crash is None else -9), (crash, log[-3000:])
    db = sqlite3.connect(state)
    versions = {r: json.loads(b)["version"] for r, b in db.execute("SELECT round, bookkeeping FROM rounds")}
    config = AsyncFedAvgConfig(**json.loads((tmp_path / "job.json").read_text()))
    arrivals = []
    for c in sorted(Store(state).contributions(config.job_id), key=lambda c: c.seq):     # arrival order
        env = decode(c.payload)
        arrivals.append(({k: env.tensors[k] for k in ("weight", "bias")}, versions[c.round]))
    models, _ = reference_fedbuff(initial(config), arrivals, 2, config.server_lr, 2, 0.5)
    final = np.load(tmp_path / "out" / "model.npz")
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["state"] == "done" and len(models) - 1 >= 7
    version = results["final"]["version"]
    for k in ("weight", "bias"):
        np.testing.assert_allclose(final[k], models[version][k].astype(np.float32), rtol=1e-6, atol=1e-6)


def test_the_async_job_bounds_an_attackers_influence_with_fedavg_psi_layers_and_defaults():
    """The fedavg-async job's FedBuff composes FedAvg(ψ)'s layers with its defaults (issue 37): a
    step with one attacker among K=4 (a 1,000x update) moves the model as RobustAggregation and
    RoundHistory, called here on the same buffered updates, say, by at most the honest updates'
    largest norm; the plain FedBuff moves it by about the attacker's 1,000/K."""
    from aggregator.strategies.robust_fedavg import RobustAggregation, RoundHistory

    config = AsyncFedAvgConfig(num_classes=C, feature_dim=D, clients_per_round=4, buffer_size=4)
    job = AsyncFedAvgJob(config)
    assert isinstance(job.buffer.aggregation, RobustAggregation) and isinstance(job.buffer.history, RoundHistory)
    assert job.buffer.history.momentum == config.history_momentum == 0.7 and config.norm_bound_multiplier == 1.0
    rng = np.random.default_rng(7)
    x0 = {k: np.asarray(v, dtype=np.float64) for k, v in job.buffer.params.items()}
    honest = [{k: v + rng.normal(0, 0.01, v.shape) for k, v in x0.items()} for _ in range(3)]
    attacker = {k: v - 1000 * (h - v) for (k, v), h in zip(x0.items(), honest[0].values())}
    plain = FedBuff(x0, buffer_size=4)
    for trained in (*honest, attacker):
        job.buffer.add(trained, 0)
        plain.add(trained, 0)
    aggregation, history = config.robust_aggregation(), config.round_history()
    combined, report = aggregation.aggregate(x0, [(t, 1) for t in (*honest, attacker)])
    expected = history.step(x0, combined)
    for k in x0:
        np.testing.assert_allclose(job.buffer.params[k], expected[k].astype(np.float32), rtol=1e-6, atol=1e-7)
    assert report["norm_bounded"] >= 1 and report["screened"] == 1          # the attacker: clipped and left out
    norm = lambda p: np.sqrt(sum(((p[k].astype(np.float64) - x0[k]) ** 2).sum() for k in x0))
    assert norm(job.buffer.params) <= max(norm(h) for h in honest) + 1e-6
    assert norm(plain.params) > 100 * max(norm(h) for h in honest)
    # its state (the buffered updates, the history's momentum) survives a checkpoint mid-buffer
    job.buffer.add(honest[1], 1)
    twin = AsyncFedAvgJob(config)
    twin.buffer.load_state_dict(job.buffer.state_dict())
    for fb in (job.buffer, twin.buffer):
        for trained in (honest[0], honest[2], attacker):
            fb.add(trained, 1)
    for k in x0:
        np.testing.assert_array_equal(twin.buffer.params[k], job.buffer.params[k])


def test_a_step_of_one_update_is_bounded_by_the_reference_of_earlier_steps():
    """A review's finding: with buffer_size 1 every step was a round of one update, bounded by its
    own median: one device's head moved by 10^5 moved the model by 10^5. Now a step of fewer than
    three updates is bounded by the reference (FedAvg's SmallRoundReference): the first steps move
    nothing until three devices have sent one (the attacker's first among them), then the honest
    device's step and the attacker's second are clipped to the lower median of those three norms
    (numpy: the history's momentum over the two steps that moved). The reference and the pool
    survive a checkpoint."""
    config = AsyncFedAvgConfig(num_classes=C, feature_dim=D, clients_per_round=1, buffer_size=1)
    job, twin = AsyncFedAvgJob(config), AsyncFedAvgJob(config)
    rng = np.random.default_rng(11)
    x0 = {k: np.asarray(v, dtype=np.float64) for k, v in job.buffer.params.items()}
    honest = {d: {k: v + rng.normal(0, 0.01, v.shape) for k, v in x0.items()} for d in ("a", "b", "c")}
    evil = {k: v + 1e5 for k, v in x0.items()}
    for device, trained in (("evil", evil), ("a", honest["a"])):
        job.buffer.add(trained, job.buffer.version, device)
    twin.buffer.load_state_dict(job.buffer.state_dict())        # mid pool: {evil, a}
    for fb in (job.buffer, twin.buffer):
        fb.add(honest["b"], fb.version, "b")
        assert all(np.array_equal(fb.params[k], np.asarray(x0[k], np.float32)) for k in x0)   # held: 3 steps
        fb.add(honest["c"], fb.version, "c")
        after_c = {k: np.asarray(v, np.float64) for k, v in fb.params.items()}
        fb.add({k: v + 1e5 for k, v in after_c.items()}, fb.version, "evil")
    flat = lambda p: np.concatenate([np.asarray(p[k], np.float64).ravel() for k in sorted(p)])
    norms = sorted(np.linalg.norm(flat(t) - flat(x0)) for t in (evil, honest["a"], honest["b"]))
    limit = norms[1]                                             # the lower median of three: an honest norm
    step_c = flat(honest["c"]) - flat(x0)
    s = step_c * min(1.0, limit / np.linalg.norm(step_c))
    x1 = (flat(x0) + s).astype(np.float32).astype(np.float64)
    step_evil = np.full_like(x1, 1e5)
    s = 0.7 * s + 0.3 * step_evil * limit / np.linalg.norm(step_evil)
    want = x1 + s
    np.testing.assert_allclose(flat(job.buffer.params), want, rtol=1e-6, atol=1e-6)
    assert np.linalg.norm(flat(job.buffer.params) - flat(x0)) < 2 * limit           # 10^5 before
    assert flat(twin.buffer.params).tobytes() == flat(job.buffer.params).tobytes()


class FastAttacker:
    """Answers every task at once with the same step away from the model."""

    def __call__(self, params, tensors=None):
        w, b = np.asarray(tensors["weight"], np.float64), np.asarray(tensors["bias"], np.float64)
        body, out = encode_head_update(w - 50.0, b - 50.0, 24)
        body["model_version"] = params["model_version"]
        return body, out


def test_one_fast_device_holds_at_most_one_slot_of_each_buffer(broker, tmp_path):
    """Asked again the moment it answered, one fast device filled 12 of 16 slots and made the
    buffers' medians (the norm bound, the direction screen) its own; a device with an update in
    the open buffer is not asked again before the buffer steps."""
    import collections

    config = AsyncFedAvgConfig(num_classes=C, feature_dim=D, image_size=SIZE, clients_per_round=5, buffer_size=4,
                               max_staleness=4, rounds=4, round_timeout_s=20, expected_devices=5, batch_size=8)
    store = Store(tmp_path / "agg.db")
    handlers = {f"dev{i}": {KIND: SlowDevice(i, 1.0)} for i in range(4)}
    handlers["evil"] = {KIND: FastAttacker()}
    svc, result = serve_until_done(AsyncFedAvgJob(config), broker.url, tmp_path, handlers, store, timeout_s=90)
    assert result["state"] == "done", result
    counts = collections.Counter(c.device for c in store.contributions(config.job_id))
    assert counts["evil"] <= config.rounds, dict(counts)
    assert all(counts[f"dev{i}"] >= 1 for i in range(4)), dict(counts)


def broken_task(params, tensors=None):
    raise RuntimeError("this install cannot train")


def test_a_device_whose_task_always_fails_waits_longer_before_each_next_dispatch(broker, tmp_path):
    """A declined dispatch frees its device at once; the next was given at the next tick, so one
    device whose task always fails had 240 dispatches in 10 s (a stored round, the model sent and a
    checkpoint each). Now it waits 1 s, then 2, 4, ... after each, while the others train the job to its end."""
    config = AsyncFedAvgConfig(num_classes=C, feature_dim=D, image_size=SIZE, clients_per_round=5, buffer_size=4,
                               max_staleness=4, rounds=4, round_timeout_s=20, expected_devices=5, batch_size=8)
    store = Store(tmp_path / "agg.db")
    handlers = {f"dev{i}": {KIND: SlowDevice(i, 1.0)} for i in range(4)}
    handlers["broken"] = {KIND: broken_task}
    svc, result = serve_until_done(AsyncFedAvgJob(config), broker.url, tmp_path, handlers, store, timeout_s=90)
    assert result["state"] == "done", result
    rounds = store.rounds(config.job_id)
    opened = [r.opened_at for r in rounds if r.participants == ("broken",)]
    assert all(r.outcome["declined"] == ["broken"] for r in rounds if r.participants == ("broken",) and r.outcome)
    span = rounds[-1].opened_at - rounds[0].opened_at
    assert 1 <= len(opened) <= 2 + math.log2(1 + span), (len(opened), span)
    gaps = np.diff(opened)
    assert all(gap >= 0.9 * 2 ** i for i, gap in enumerate(gaps)), gaps


def test_a_dispatch_close_that_cannot_be_committed_leaves_the_old_runner_void(broker, tmp_path, monkeypatch):
    """A review's finding: a dispatch's close whose commit failed rebuilt the job, but the old
    runner's tick went on, closing the other expired dispatches and opening new ones on the old
    job; the rebuilt runner then met rounds it did not know ("not open", UNIQUE round) and the tick
    guard stopped the job. Now the old runner acts no more and the rebuilt one carries on."""
    failed = close_fails_once(monkeypatch)
    config = AsyncFedAvgConfig(num_classes=C, feature_dim=D, image_size=SIZE, clients_per_round=3, buffer_size=2,
                               max_staleness=4, rounds=2, round_timeout_s=0.3, expected_devices=5, batch_size=8)
    store = Store(tmp_path / "agg.db")
    handlers = {f"dev{i}": {KIND: SlowFirst(i, 1.0)} for i in range(5)}      # the first dispatches expire together
    svc, result = serve_until_done(AsyncFedAvgJob(config), broker.url, tmp_path, handlers, store, timeout_s=60)
    assert failed and result["state"] == "done", result
    rounds = store.rounds(config.job_id)
    assert [r.round for r in rounds] == list(range(1, len(rounds) + 1))
    assert store.job(config.job_id)["state"] == "done"


def test_dp_is_refused_for_fedavg_async_whose_steps_would_never_clip_or_noise():
    """A review's finding: the config took dp_noise_multiplier and the job reported an ε, while
    FedBuff stepped on the raw buffered updates (no clip, no noise)."""
    from aggregator.jobs.registry import build_job

    with pytest.raises(ValueError, match="no DP mechanism"):
        build_job("fedavg-async", {"num_classes": 3, "feature_dim": 8, "dp_noise_multiplier": 1.0,
                                   "dp_clip_norm": 0.1})
