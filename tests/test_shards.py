"""``aggregator serve --shards K`` over a real mosquitto with real device agents: K shard
processes receive, validate, store and sum the results of their buckets' devices; the coordinator
reduces their sums. The model must be the bytes of one unsharded aggregator's (the canonical
bucketed order does not depend on K), every device must count once, and a shard SIGKILLed
mid-ingest must resume from its store with the same bytes. With ``--ray`` the shards are Ray
actors on a two-node local Ray cluster, one per node: the same bytes as the local shards'."""

import json
import os
import signal
import sqlite3
import threading
import time

import numpy as np
import pytest

from aggregator.shards.buckets import shard_of
from aggregator.strategies.dp_noise import NOISE_SEED_ENV
from fedfleet.emulation.broker import MosquittoBroker

from ops_fleet import Fleet, prepare, reference_sums, run_aggregator, run_uninterrupted, start_aggregator_in
from shard_runs import DEVICES, ON_RAY, RAY_ALL_ONLY, SHARDED_JOB_TIMEOUT_S, needs_ray, shard_options, shard_rows
from test_shard_rounds import RAY_KINDS, check_rounds_on_two_shards, rounds_unsharded  # noqa: F401 (a fixture)



def outputs(out_dir):
    return dict(np.load(out_dir / "model.npz")), dict(np.load(out_dir / "statistics.npz")), \
        json.loads((out_dir / "results.json").read_text())


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory):
    return outputs(run_uninterrupted(tmp_path_factory.mktemp("unsharded"), DEVICES))


ON = ["local", pytest.param("ray", marks=ON_RAY)]  # processes here, or Ray actors


def assert_same_model(got, want):
    model, stats, results = got
    assert sorted(model) == sorted(want[0])
    for name in want[0]:
        assert model[name].tobytes() == want[0][name].tobytes(), name          # bit for bit
    for name in ("A", "B", "counts"):
        assert stats[name].tobytes() == want[1][name].tobytes(), name
    assert sorted(results["contributed"]) == DEVICES and results["state"] == "done"
    A_ref, B_ref = reference_sums(DEVICES)                                     # and right
    np.testing.assert_allclose(stats["A"], A_ref, rtol=1e-12)
    np.testing.assert_allclose(stats["B"], B_ref, rtol=1e-12)


def assert_each_device_once(state, shards: int) -> None:
    """The coordinator accepted each device once, every accepted result is in its owner's store,
    and nothing else is: a shard holds only its own devices, and the orphans a crash can leave (a
    result receipted that the coordinator never accepted, or stored by a shard killed before its
    receipt and re-sent under a new id) were deleted at their round's close."""
    rows = shard_rows(state, shards)
    for i, held in enumerate(rows):
        assert all(shard_of(d, shards) == i for d, _ in held), "a shard holds only its buckets' devices"
    receipts = sqlite3.connect(state).execute("SELECT device, message_id FROM contributions").fetchall()
    assert sorted(d for d, _ in receipts) == DEVICES
    stored = sorted(r for held in rows for r in held)
    assert sorted(receipts) == stored


@pytest.fixture(scope="module")
def local_shards_run(tmp_path_factory):
    """The job on two local shard processes: its outputs and its state file."""
    workdir = tmp_path_factory.mktemp("local-shards")
    prepare(workdir, DEVICES)
    with MosquittoBroker() as broker, Fleet(broker.url, DEVICES):
        rc, log = run_aggregator(workdir, broker.url, workdir / "state.db", extra=["--shards", "2"])
    assert rc == 0, log[-3000:]
    return outputs(workdir / "out"), workdir / "state.db"


def test_two_shards_give_one_aggregators_model_bit_for_bit(local_shards_run, unsharded):
    assert len({shard_of(d, 2) for d in DEVICES}) == 2            # both shards have devices
    got, state = local_shards_run
    assert_same_model(got, unsharded)
    assert_each_device_once(state, 2)


@pytest.mark.ray_cluster
@needs_ray
def test_a_ray_shard_slow_to_take_its_commands_holds_up_no_other_shards_commands(tmp_path, ray_test_cluster):
    """A Ray shard takes a command only once it took the one before (a threaded actor runs calls in
    no set order); that wait, up to a minute for an actor still starting, must not hold the pool's
    send lock, which every other shard's commands and the readers' hand-backs take. Two real actors
    on the test cluster: shard 0 does not take its first command until told; shard 1's commands,
    sent after shard 0's second, arrive meanwhile, and shard 0 then gets both in order."""
    import ray

    from aggregator.shards.ray_shards import RayShards
    from protocols.mqtt_link import BrokerConfig

    @ray.remote(num_cpus=0, max_concurrency=4)
    class HeldShard:            # speaks what the pool calls on a shard actor; takes commands when let
        def __init__(self, held: bool):
            import threading
            self.got, self.let = [], threading.Event()
            if not held:
                self.let.set()

        def command(self, command):
            self.let.wait(60)
            self.got.append(command)

        def release(self):
            self.let.set()

        def received(self):
            return list(self.got)

        def where(self):
            return {"node_id": ray.get_runtime_context().get_node_id()}

        def take(self, timeout_s):
            import time
            time.sleep(timeout_s)
            return []

        def join(self, timeout_s):
            return True

    pool = RayShards(ray_test_cluster, 2, BrokerConfig(), tmp_path)
    try:
        held, free = HeldShard.remote(True), HeldShard.remote(False)
        pool._attach(0, held)
        pool._attach(1, free)
        sent = time.monotonic()
        pool._send(0, ("first",))
        pool._send(0, ("second",))              # waits for "first" to be taken, not here
        for n in range(3):
            pool._send(1, ("other", n))
        assert time.monotonic() - sent < 5
        deadline = time.monotonic() + 30
        while ray.get(free.received.remote()) != [("other", 0), ("other", 1), ("other", 2)]:
            assert time.monotonic() < deadline, ray.get(free.received.remote())
            time.sleep(0.1)
        assert ray.get(held.received.remote()) == []        # shard 0 still holding its first
        ray.get(held.release.remote())
        while ray.get(held.received.remote()) != [("first",), ("second",)]:
            assert time.monotonic() < deadline, ray.get(held.received.remote())
            time.sleep(0.1)
        assert pool._exited(0) is None and pool._exited(1) is None
    finally:
        pool.close()


@pytest.mark.slow
@pytest.mark.ray_cluster
@needs_ray
def test_shards_as_ray_actors_on_two_nodes_give_the_local_shards_model_bit_for_bit(tmp_path, ray_test_cluster,
                                                                                  local_shards_run, unsharded):
    prepare(tmp_path, DEVICES)
    with MosquittoBroker() as broker, Fleet(broker.url, DEVICES):
        rc, log = run_aggregator(tmp_path, broker.url, tmp_path / "state.db", timeout=SHARDED_JOB_TIMEOUT_S,
                                 extra=["--shards", "2", "--ray", ray_test_cluster])
    assert rc == 0, log[-3000:]
    got = outputs(tmp_path / "out")
    assert_same_model(got, local_shards_run[0])                   # the local shards' bytes
    assert_same_model(got, unsharded)                             # and one aggregator's
    assert_each_device_once(tmp_path / "state.db", 2)
    placement = json.loads((tmp_path / "state.db.shards" / "placement.json").read_text())
    assert sorted(p["shard"] for p in placement) == [0, 1]
    assert len({p["node_id"] for p in placement}) == 2            # one actor on each node
    assert all(p["resources"].get(f"fedfleet_shard_{p['shard']}") == 1 for p in placement)


def kill_shard_once_it_stores(proc, state, victim: int, gates: dict) -> None:
    """SIGKILL shard ``victim`` of two once it stored a result, then open the ``gates`` (the devices
    held until then) and wait for the job's end, which must be a clean one (the aggregator ``proc``
    is killed if it is still there)."""
    try:
        # a deadline, not a wait: the loop leaves at the first stored row (a Ray actor's start
        # on CI's 2 loaded cores took over a minute once)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:           # the victim has stored some results, not all
            try:
                if shard_rows(state, 2)[victim]:
                    break
            except sqlite3.OperationalError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail("the shard never stored a result")
        os.kill(int((state.parent / "state.db.shards" / f"shard-{victim}.pid").read_text()), signal.SIGKILL)
        for g in gates.values():
            g.set()
        proc.wait(SHARDED_JOB_TIMEOUT_S)
    finally:
        for g in gates.values():            # never leave the agents waiting at the gate
            g.set()
        proc.kill()
    out = proc.output()
    assert proc.returncode == 0, out[-3000:]
    assert f"shard {victim} exited" in out          # ...and the job ended after its restart


@pytest.mark.parametrize("on", ON)
def test_a_shard_sigkilled_mid_ingest_resumes_bit_for_bit(tmp_path, unsharded, on, request):
    """A shard process, or a shard's Ray actor, dies: the coordinator restarts it on its store."""
    options = shard_options(on, request)
    prepare(tmp_path, DEVICES)
    state = tmp_path / "state.db"
    victim = shard_of(DEVICES[0], 2)
    held = [d for d in DEVICES if shard_of(d, 2) == victim][1:]     # the victim's later devices wait
    gates = {d: threading.Event() for d in held}
    with MosquittoBroker() as broker, Fleet(broker.url, DEVICES, gates=gates):
        proc = start_aggregator_in(tmp_path, broker.url, state, options, timeout=SHARDED_JOB_TIMEOUT_S)
        kill_shard_once_it_stores(proc, state, victim, gates)
    assert_same_model(outputs(tmp_path / "out"), unsharded)
    # the victim held orphans (a result it stored but was killed before receipting, whose device
    # then re-sent it under a new message id to the restarted shard): gone at the round's close
    assert_each_device_once(state, 2)


@pytest.mark.parametrize("on,crashes", [
    # on Ray the coordinator's side is the same ShardPool code: the actor-kill test above covers
    # what differs (an actor's restart on its node's store), at a third of this test's time
    ("local", ("contribution_stored:2", "ack_sent:3", "round_closing"))])
def test_the_coordinator_sigkilled_at_its_crash_points_resumes_the_shards_bit_for_bit(tmp_path, unsharded, on,
                                                                                     crashes, request):
    """The coordinator dies (and its shards with it) after storing a receipt, after acking, at a
    round's close; each restart brings the shards back on their stores."""
    options = shard_options(on, request)
    prepare(tmp_path, DEVICES)
    state = tmp_path / "state.db"
    crashed, logs = [], ""
    with MosquittoBroker() as broker, Fleet(broker.url, DEVICES):
        for crash in (*crashes, None):
            rc, log = run_aggregator(tmp_path, broker.url, state, crash=crash, extra=options,
                                     timeout=SHARDED_JOB_TIMEOUT_S)
            logs += log
            if rc == 0:
                break
            assert rc == -9, log[-3000:]
            crashed.append(crash)
        else:
            pytest.fail("the job did not finish")
    assert rc == 0 and len(crashed) >= min(2, len(crashes)), (crashed, log[-3000:])
    assert "receipts only" not in logs              # no device's result reached the coordinator itself
    assert_same_model(outputs(tmp_path / "out"), unsharded)
    assert_each_device_once(state, 2)


@pytest.mark.parametrize("kind", [pytest.param(kind, marks=ON_RAY) for kind in RAY_KINDS])
def test_fedavg_rounds_on_ray_actor_shards_give_one_aggregators_model_bit_for_bit(tmp_path, rounds_unsharded,
                                                                                  kind, request):
    """The FedAvg family's rounds (tests/test_shard_rounds.py) with the shards as Ray actors, here
    with the suite's other files that use the shared Ray cluster."""
    check_rounds_on_two_shards(tmp_path, rounds_unsharded, kind, "ray", request)


# FedNCM is Fed3R's device task and sums (Fed3RSums), solved as class means: `make test-ray`
# runs it over the broker on local shards and on Ray actors; the suite checks its sums' bytes
# without a broker (tests/test_shard_ingest.py)
FEDNCM_ON = [pytest.param("local", marks=RAY_ALL_ONLY), pytest.param("ray", marks=[RAY_ALL_ONLY, *ON_RAY])]


@pytest.mark.parametrize("on", FEDNCM_ON)
def test_fedncm_on_shards_gives_one_aggregators_class_means_bit_for_bit(tmp_path, on, request):
    ran = {}
    for name, extra in (("one", []), ("sharded", shard_options(on, request))):
        prepare(tmp_path / name, DEVICES, kind="fedncm")
        with MosquittoBroker() as broker, Fleet(broker.url, DEVICES):
            rc, log = run_aggregator(tmp_path / name, broker.url, tmp_path / name / "state.db",
                                     timeout=SHARDED_JOB_TIMEOUT_S, extra=extra)
        assert rc == 0, log[-3000:]
        ran[name] = outputs(tmp_path / name / "out")
    (model, stats, results), (want_model, want_stats, _) = ran["sharded"], ran["one"]
    assert sorted(model) == sorted(want_model) and {"A", "B", "counts"} <= set(want_stats)
    for got, want in ((model, want_model), (stats, want_stats)):     # (the shards' bookkeeping besides)
        for name in want:
            assert got[name].tobytes() == want[name].tobytes(), name       # bit for bit
    assert sorted(results["contributed"]) == DEVICES and results["state"] == "done"
    assert_each_device_once(tmp_path / "sharded" / "state.db", 2)


# DP Fed3R with its private center over the broker: each round's sum is the shards', noised once
# by the coordinator's job; the noise is seeded in both runs (FEDFLEET_TEST_DP_NOISE_SEED, tests
# only) so that their bits can be compared. The Ray variant runs under `make test-ray`.
DP_FED3R_ON = ["local", pytest.param("ray", marks=[RAY_ALL_ONLY, *ON_RAY])]
DP_NOISE_SEED = "23"


def dp_fed3r_fleet(broker_url: str, windows, gates: dict | None = None) -> Fleet:
    """The devices of test_dp_fed3r_center's DP Fed3R job (the device library's task, clipping and
    centring; their sample windows kept under ``windows``), the ``gates``' devices waiting for
    theirs before a centred round's task (never the center round's: holding one of its three would
    drop it and change every later round)."""
    from protocols.payloads.fed3r import KIND

    from test_dp_fed3r_center import handlers

    tasks = handlers(DEVICES, windows)

    def of(device):
        task = tasks[device]
        if device in (gates or {}):
            gate = gates[device]

            def task(params, tensors=None, run=task):
                if params.get("centered"):
                    gate.wait(240)
                return run(params, tensors)
        return {KIND: task}, {}
    return Fleet(broker_url, DEVICES, handlers=of)


def prepare_dp_fed3r(workdir) -> None:
    from test_dp_fed3r_center import config as dp_config

    prepare(workdir, DEVICES, **{**dp_config(), "clients_per_round": 10})     # 3 for the center, then the rest


@pytest.fixture(scope="module")
def dp_fed3r_unsharded(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("dp-fed3r-one")
    prepare_dp_fed3r(workdir)
    with MosquittoBroker() as broker, dp_fed3r_fleet(broker.url, workdir / "windows"):
        rc, log = run_aggregator(workdir, broker.url, workdir / "state.db", timeout=SHARDED_JOB_TIMEOUT_S,
                                 env={NOISE_SEED_ENV: DP_NOISE_SEED})
    assert rc == 0, log[-3000:]
    return outputs(workdir / "out")


def assert_same_dp_release(got, want) -> None:
    (model, stats, results), (want_model, want_stats, want_results) = got, want
    assert {"A", "B", "counts", "dp_feature_center", "dp_releases"} <= set(want_stats)
    assert int(want_stats["dp_releases"][0]) == 1 and int(want_stats["counts"][1]) == len(DEVICES) - 3
    for got_arrays, want_arrays in ((model, want_model), (stats, want_stats)):   # (the shards' bookkeeping besides)
        for name in want_arrays:
            assert got_arrays[name].tobytes() == want_arrays[name].tobytes(), name       # bit for bit
    assert sorted(results["contributed"]) == DEVICES and results["state"] == "done"
    assert results["final"]["privacy"] == want_results["final"]["privacy"]


@pytest.mark.parametrize("on", DP_FED3R_ON)
def test_dp_fed3r_on_shards_releases_one_aggregators_bytes(tmp_path, dp_fed3r_unsharded, on, request):
    prepare_dp_fed3r(tmp_path)
    with MosquittoBroker() as broker, dp_fed3r_fleet(broker.url, tmp_path / "windows"):
        rc, log = run_aggregator(tmp_path, broker.url, tmp_path / "state.db", timeout=SHARDED_JOB_TIMEOUT_S,
                                 extra=shard_options(on, request), env={NOISE_SEED_ENV: DP_NOISE_SEED})
    assert rc == 0, log[-3000:]
    assert_same_dp_release(outputs(tmp_path / "out"), dp_fed3r_unsharded)
    assert_each_device_once(tmp_path / "state.db", 2)


def test_dp_fed3r_on_shards_resumes_a_sigkilled_shard_bit_for_bit(tmp_path, dp_fed3r_unsharded):
    """A shard dies once it stored a result; restarted on its store it answers the round sums of the
    coordinator, whose job (and noise) lived on: the same release."""
    prepare_dp_fed3r(tmp_path)
    state, victim = tmp_path / "state.db", shard_of(DEVICES[0], 2)
    gates = {d: threading.Event() for d in [d for d in DEVICES if shard_of(d, 2) == victim][1:]}
    with MosquittoBroker() as broker, dp_fed3r_fleet(broker.url, tmp_path / "windows", gates):
        proc = start_aggregator_in(tmp_path, broker.url, state, ["--shards", "2"], timeout=SHARDED_JOB_TIMEOUT_S,
                                   env={NOISE_SEED_ENV: DP_NOISE_SEED})
        kill_shard_once_it_stores(proc, state, victim, gates)
    assert_same_dp_release(outputs(tmp_path / "out"), dp_fed3r_unsharded)
    assert_each_device_once(state, 2)
