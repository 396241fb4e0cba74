"""Secure jobs on shards (aggregator/shards/secure_groups.py) over a real mosquitto with real
device agents and real SecAgg: each round's group runs its server machine on the shard
``round % 2``, the coordinator applies the unmasked group sums. The model must be the bytes of one
aggregator's run of the same job (same groups, same integers), the coordinator must never see a
masked vector, and a shard SIGKILLed while hosting a group must fail that group with its reason,
the job going on to the plain sums."""

import json
import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest

from aggregator.jobs.device_state_fields import RUN_KEY
from aggregator.shards.buckets import shard_of
from fedfleet.emulation.broker import MosquittoBroker

from edge_client.tasks.secure_fedavg_training import SecureScaffoldTraining
from protocols.payloads.secagg import SECAGG_TYPE

from ops_fleet import (REPO, Features, Fleet, SecureKeys, aggregator_cmd, aggregator_env, feature_handlers, features_of,
                       prepare, reference_sums, run_aggregator, secure_fed3r_handlers, with_secure)
from shard_runs import RAY_ALL, needs_ray

DEVICES = [f"dev{i:02d}" for i in range(3, 9)]      # dev08 is shard 1's, the others shard 0's
SHARDS = ["--shards", "2"]


def outputs(out_dir, files=("model.npz", "statistics.npz")):
    return [dict(np.load(out_dir / f)) for f in files if (out_dir / f).exists()], \
        json.loads((out_dir / "results.json").read_text())


def assert_same_bytes(got, want):
    assert [sorted(a) for a in got] == [sorted(a) for a in want]
    for g, w in zip(got, want):
        for name in set(w) - {RUN_KEY}:     # pp's run id: a random nonce of each run, never the model's
            assert g[name].tobytes() == w[name].tobytes(), name         # bit for bit


def state_feature_handlers(workdir):
    """The real device handlers on the synthetic features, each device with its own state store
    (pp keeps its personal part there) in ``workdir``: every run starts from empty stores."""
    from edge_client.handlers import HandlerConfig, device_handlers
    from edge_client.state import DeviceStateStore

    def handlers(device: str) -> dict:
        return device_handlers(features_of(device), lambda *_, **__: Features(), HandlerConfig(),
                               DeviceStateStore(workdir / "device-state" / device))
    return handlers


def tail_handlers(request):
    """FT(M)'s device handlers on the suite's 32 px tail bundle: 12 Fashion-MNIST images a device."""
    from edge_client.data import load_fashion_mnist
    from edge_client.handlers import HandlerConfig, LocalData, SharedExtractors, device_handlers

    manifest = request.getfixturevalue("tail_bundle")
    images, labels = load_fashion_mnist("train")
    extractors = SharedExtractors(lambda *_: Features(), None)

    def handlers(device: str) -> dict:
        i = DEVICES.index(device)
        data = LocalData(images[12 * i:12 * i + 12], labels[12 * i:12 * i + 12].astype(np.int64), np.arange(12))
        return device_handlers(data, extractors, HandlerConfig(tail_manifest=str(manifest)))
    return handlers, manifest


SYNC_KINDS = ("fed3r-sync", "fedncm-sync")        # Fed3R-Sync's device task and groups; FedNCM solves them as class means


def run_secure(workdir, keys, kind: str, extra=(), plain=None, secure=None, **job) -> tuple[int, str]:
    """The job on a fresh broker and state, its devices verifying that every message they get is
    signed by the aggregator's key (a shard hosting a group signs as the aggregator). ``plain``:
    ``workdir -> device -> handlers`` (default: the real handlers on the synthetic features);
    ``secure``: ``(device, its protocol handlers) -> protocol handlers`` (a modified device's)."""
    prepare(workdir, DEVICES, kind=kind, max_samples=100, **{"phase_timeout_s": 20, **job}, **keys.job_fields(workdir.parent))
    if kind in SYNC_KINDS:
        handlers = lambda device: ({}, secure_fed3r_handlers(device, keys))   # noqa: E731
    else:
        handlers = with_secure(keys, (plain or (lambda _w: feature_handlers))(workdir))
    if secure is not None:
        handlers = modified(handlers, secure)
    with MosquittoBroker() as broker, Fleet(broker.url, DEVICES, kind=kind, secure=keys, handlers=handlers,
                                            aggregator_key=keys.aggregator.public_key_bytes):
        # a phase closes when its last member answers; its timeout only bounds a slow machine's
        # training (FT(M) on the tail program took over 5 s per device under the whole suite's load)
        return run_aggregator(workdir, broker.url, workdir / "state.db", extra=extra, timeout=420)


def modified(handlers, secure):
    def build(device: str) -> tuple[dict, dict]:
        plain, protocol = handlers(device)
        return plain, secure(device, protocol)
    return build


def one_and_sharded(tmp_path, kind: str, sharded=SHARDS, plain=None, **job):
    """(one aggregator's, two shards') outputs of the same job with the same keys."""
    keys = SecureKeys.create(tmp_path, DEVICES)
    runs = []
    for name, extra in (("one", ()), ("sharded", sharded)):
        (tmp_path / name).mkdir()
        rc, log = run_secure(tmp_path / name, keys, kind, extra, plain, **job)
        assert rc == 0, log[-3000:]
        assert "rejected message" not in log            # no secagg message reached the coordinator
        runs.append(outputs(tmp_path / name / "out"))
    return runs


@pytest.mark.parametrize("kind", SYNC_KINDS)
def test_secure_fed3r_sync_on_two_shards_gives_one_aggregators_model_bit_for_bit(tmp_path, kind):
    """Two groups of three: round 1's hosted by shard 1, whose bucket holds one device of the six
    (the others' messages reach it by the group's subscriptions), round 2's by shard 0. FedNCM-Sync
    runs the same groups, solved as class means: the same placement, the same bytes."""
    assert {shard_of(d, 2) for d in DEVICES} == {0, 1}
    (want, _), (got, results) = one_and_sharded(tmp_path, kind)
    assert_same_bytes(got, want)
    assert sorted(results["contributed"]) == DEVICES and results["state"] == "done"
    stats = got[1]
    A_ref, B_ref = reference_sums(DEVICES, dtype=np.float32)                      # and right
    np.testing.assert_allclose(stats["A"], A_ref, rtol=1e-10, atol=1e-8)
    np.testing.assert_allclose(stats["B"], B_ref, rtol=1e-10, atol=1e-8)


# the secure FedAvg family's stateful kinds: their own fields (each device keeps v_k / c_k / v_k in its store)
STATEFUL = {"pp-secure": {"pp_algorithm": "fedalt"}, "scaffold-secure": {"total_devices": 6, "control_clip_norm": 0.5},
            "ditto-secure": {"ditto_lambda": 0.5}}


def secure_round_job(kind: str, request) -> tuple:
    """(device handlers, the kind's job fields) of a secure FedAvg family kind: every one is a
    ``SecureFedAvgJob`` whose groups shards host the same way (``group_placement.py``)."""
    fields = {"rounds": 2, "clients_per_round": 3, "local_epochs": 1, "max_abs_param": 50.0}
    if kind == "fedavg-secure":
        return None, fields
    if kind in STATEFUL:
        return state_feature_handlers, {**fields, **STATEFUL[kind]}
    handlers, manifest = tail_handlers(request)
    return (lambda _workdir: handlers), {
        **fields, "num_classes": 10, "feature_dim": 1280, "image_size": 32, "batch_size": 6, "client_lr": 0.01,
        "train": "tail+head", "tail_stages": 1, "init": "zeros", "tail_program_file": str(manifest.parent / "tail_eval.pt2"),
        "phase_timeout_s": 150}     # FT(M) on the tail program: its advertise phase holds the devices' training


def device_states(workdir) -> dict[str, dict[str, np.ndarray]]:
    """Each device's kept state (v_k, c_k) as its store holds it after the run: job -> arrays."""
    from edge_client.state import DeviceStateStore

    states = {}
    for device in DEVICES:
        store = DeviceStateStore(workdir / "device-state" / device)
        for job in store.jobs():
            states[f"{device}/{job}"] = store.load(job, None).arrays
    return states


SECURE_ROUND_KINDS = ["fedavg-secure", "pp-secure", "fedavg-tail-secure", "scaffold-secure", "ditto-secure"]


def check_secure_rounds(tmp_path, kind: str, request, sharded=SHARDS) -> None:
    """Two rounds of three of the six devices, each round's group on its own shard; a stateful
    kind's devices keep the same state (pp's v_k, Scaffold's c_k, Ditto's v_k), bit for bit."""
    plain, fields = secure_round_job(kind, request)
    (want, want_results), (got, results) = one_and_sharded(tmp_path, kind, sharded=sharded, plain=plain, **fields)
    # who contributed first: a member the slow machine's load timed out changes the model legitimately
    assert results["contributed"] == want_results["contributed"] and results["state"] == "done", (results, want_results)
    assert sum(results["contributed"].values()) == 2 * 3
    assert_same_bytes(got, want)
    if kind in STATEFUL:
        kept, want_kept = device_states(tmp_path / "sharded"), device_states(tmp_path / "one")
        assert len(kept) == len(results["contributed"])         # every contributor keeps its state
        assert_same_bytes(list(kept.values()), list(want_kept.values()))
        assert list(kept) == list(want_kept)


@pytest.mark.parametrize("kind", SECURE_ROUND_KINDS)
def test_secure_fedavg_kinds_on_two_shards_give_one_aggregators_model_bit_for_bit(tmp_path, kind, request):
    check_secure_rounds(tmp_path, kind, request)


def test_a_device_sending_undecryptable_share_rows_is_left_out_on_shards_as_by_one_aggregator(tmp_path):
    """dev03 flips every share row it sends. Round 1 (all six, hosted by shard 1): the other five
    accuse it, the host names it and fails the round at the unmasking; the coordinator learns the
    name with the outcome and leaves dev03 out of rounds 2 and 3, as one aggregator does: the
    same failure, the same contributors, the same model bytes."""
    from protocols.payloads.secagg import SECURE_FEDAVG_KIND
    from test_secagg_share_accusation_over_mqtt import CorruptingSessions

    def attacker(device, protocol):
        if device == "dev03":
            sessions = CorruptingSessions(protocol[SECURE_FEDAVG_KIND].identity)
            protocol[SECURE_FEDAVG_KIND].sessions = protocol[SECAGG_TYPE] = sessions
        return protocol

    keys = SecureKeys.create(tmp_path, DEVICES)
    fields = {"rounds": 3, "clients_per_round": len(DEVICES), "local_epochs": 1, "max_abs_param": 50.0}
    runs = []
    for name, extra in (("one", ()), ("sharded", SHARDS)):
        (tmp_path / name).mkdir()
        rc, log = run_secure(tmp_path / name, keys, "fedavg-secure", extra, secure=attacker, **fields)
        assert rc == 0, log[-3000:]
        assert "dev03 sent share rows a majority of their recipients could not decrypt" in log, log[-3000:]
        runs.append(outputs(tmp_path / name / "out", ("model.npz",)))
    (want, want_results), (got, results) = runs
    for r in (want_results, results):
        rounds = {e["round"]: e for e in r["rounds"]}
        assert "could not decrypt: dev03" in rounds[1]["secure_failure"] and rounds[1]["accepted"] == []
        assert [sorted(rounds[k]["accepted"]) for k in (2, 3)] == [DEVICES[1:]] * 2
    assert results["contributed"] == want_results["contributed"] and "dev03" not in results["contributed"]
    assert_same_bytes(got, want)


class InflatedCount(SecureScaffoldTraining):
    """Modified device code: its honest [n·y | clip(Δc) | n] with the count slot forged to twice
    what the whole fleet may hold (within SecAgg's fixed-point bound, so only the group-sum check
    can catch it: Σ n_k > |S| · max_samples; test_secure_stateful's "inflated count" attack)."""

    def vector(self, params, tensors):
        vector = super().vector(params, tensors)
        vector[-1] = 2 * len(DEVICES) * params["max_samples"]
        return vector


def test_a_forged_count_slot_is_discarded_on_shards_as_by_one_aggregator(tmp_path):
    """Secure Scaffold, one round of all six devices on shard 1, dev08 (shard 1's bucket) forging
    its count slot. The host unmasks the sum; the coordinator's job checks it (``group_summed``:
    the count and the mean, then Σ Δc) before anything is kept, as one aggregator does: the
    group is discarded with the reason, and neither w nor c nor the counts move (the job's only
    round summed nobody: it ends failed, saying so)."""
    from aggregator.jobs.registry import build_job
    from protocols.payloads.secagg import SECURE_SCAFFOLD_KIND

    def forger(device, protocol):
        if device == "dev08":
            honest = protocol[SECURE_SCAFFOLD_KIND]
            protocol[SECURE_SCAFFOLD_KIND] = InflatedCount(honest.identity, honest.aggregator_public_key,
                                                           honest.training, honest.sessions)
        return protocol

    keys, workdir = SecureKeys.create(tmp_path, DEVICES), tmp_path / "sharded"
    fields = {**STATEFUL["scaffold-secure"], "rounds": 1, "clients_per_round": len(DEVICES), "local_epochs": 1,
              "max_abs_param": 50.0}
    rc, log = run_secure(workdir, keys, "scaffold-secure", SHARDS, state_feature_handlers, forger, **fields)
    assert rc == 1 and "job ops failed: no device contributed" in log, log[-3000:]
    assert "secure round 1: group sum discarded: the group's Σ n_k = " in log and "rejected message" not in log
    (got,), results = outputs(workdir / "out", ("model.npz",))
    assert results["contributed"] == {} and results["state"] == "failed"
    (entry,) = results["rounds"]
    assert entry["secure_failure"].startswith("group sum out of bound: the group's Σ n_k = ")
    initial = build_job("scaffold-secure", json.loads((workdir / "job.json").read_text())).model_arrays()
    assert_same_bytes([{k: got[k] for k in initial}], [initial])        # w and c as they started
    assert device_states(workdir)                                       # the members did train


# `make test-ray` (shard_runs.RAY_ALL) runs every secure kind shards host on Ray actors: the same
# placement and group paths as Fed3R-Sync's
RAY_KINDS = [*SYNC_KINDS, *SECURE_ROUND_KINDS] if RAY_ALL else ["fed3r-sync"]


@pytest.mark.slow
@pytest.mark.ray_cluster
@needs_ray
@pytest.mark.parametrize("kind", RAY_KINDS)
def test_secure_kinds_on_ray_actor_shards_give_one_aggregators_model_bit_for_bit(tmp_path, ray_test_cluster, kind,
                                                                                 request):
    """The shards as Ray actors on the two-node test cluster, one per node: the same bytes."""
    sharded = [*SHARDS, "--ray", ray_test_cluster]
    if kind not in SYNC_KINDS:
        return check_secure_rounds(tmp_path, kind, request, sharded)
    (want, _), (got, results) = one_and_sharded(tmp_path, kind, sharded=sharded)
    assert_same_bytes(got, want)
    assert sorted(results["contributed"]) == DEVICES and results["state"] == "done"


def test_a_shard_takes_only_its_hosted_groups_secagg_messages_and_refuses_bad_ones_changing_nothing(tmp_path):
    """Sans-IO, real keys and envelopes: shard 1 (whose bucket holds dev08 alone) hosts round 1's
    group of dev03, dev04, dev08. It reads the members' outboxes, takes their secagg messages (a
    malformed one or one claiming another sender is dropped, the group running on), leaves a
    foreign member's other messages to its own shard, forwards what its bucket's devices send; a
    shard hosting nothing drops every secagg message. An aborted group ends failed, with its reason."""
    from aggregator.jobs.registry import build_job
    from aggregator.shards.shard import Forward, Publish, ShardIngest
    from aggregator.storage.store import Store
    from protocols import messages as M
    from protocols.envelope import Envelope, encode
    from protocols.topics import Topics
    from ops_fleet import job_config

    keys, topics = SecureKeys.create(tmp_path, DEVICES), Topics()
    config = {**job_config(DEVICES, "fed3r-sync"), "max_samples": 100, **keys.job_fields(tmp_path)}
    coordinator = build_job("fed3r-sync", config)
    members = ["dev03", "dev04", "dev08"]
    assert sorted(coordinator.next_participants(set(members))) == members
    group, context = coordinator.release_group()
    assert context == {}                                # Fed3R-Sync's host needs nothing besides the config
    host, idle = ShardIngest(1, 2, Store(tmp_path / "s1.db")), ShardIngest(0, 2, Store(tmp_path / "s0.db"))
    for shard in (host, idle):
        shard.set_job(config["job_id"], "fed3r-sync", config)
    assert host.groups.open(group, context) == [] and host.reads("dev03") and not host.owns("dev03")
    started = host.groups.tick(0.0)                     # the server machine's first phase, to every member
    assert sorted(d for d, _ in started) == members

    def sent(shard, device, env):
        return shard.feed(topics.outbox(device), encode(env), 1.0)

    garbage = Envelope(type=SECAGG_TYPE, sender="dev03", body={"secagg": {"round_id": 1, "phase": "nonsense"}})
    assert sent(host, "dev03", garbage) == Publish([])
    forged = Envelope(type=SECAGG_TYPE, sender="dev04", body=garbage.body)       # on dev03's outbox
    assert sent(host, "dev03", forged) is None
    assert host.job_id and host.groups.job.secure_round_live(1) and host.groups.outcomes() == []
    decline = M.decline_message("dev03", M.TaskRef(config["job_id"], 1, "t"), "busy")
    assert sent(host, "dev03", decline) is None                  # dev03's own shard forwards it
    assert isinstance(sent(idle, "dev03", decline), Forward)
    assert sent(host, "dev05", decline) is None                  # not a member, not its bucket: its shard's
    assert sent(idle, "dev03", garbage) == Publish([])           # a group hosted elsewhere: dropped
    aborted = host.groups.abort(1, "deadline")                   # the members are told to erase their secrets
    assert sorted(d for d, _ in aborted) == members
    assert host.groups.outcomes() == [("group", host.job_id, "failed", 1, (), "aborted: deadline")] and host.groups.held is None
    assert not host.reads("dev03") and host.reads("dev08")      # the group's other buckets' devices are let go
    assert sent(host, "dev03", garbage) is None                  # a late message of theirs: their shards'
    assert isinstance(sent(host, "dev08", decline), Forward)     # its own bucket's, as ever


class HeldProtocol:
    """A device's secagg handler that holds the group's first message (its server machine's start:
    the group is running on its shard) until ``gate`` is set."""

    def __init__(self, handler, gate: threading.Event, reached: threading.Event):
        self.handler, self.gate, self.reached = handler, gate, reached

    def on_message(self, env):
        self.reached.set()
        self.gate.wait(60)
        return self.handler.on_message(env)


def held_fed3r_handlers(keys, gate: threading.Event, reached: threading.Event):
    def build(device: str) -> tuple[dict, dict]:
        handlers = secure_fed3r_handlers(device, keys)
        return {}, {**handlers, SECAGG_TYPE: HeldProtocol(handlers[SECAGG_TYPE], gate, reached)}
    return build


def test_a_shard_sigkilled_hosting_a_group_fails_it_with_the_reason_and_the_job_goes_on(tmp_path):
    """Round 1's group runs on shard 1; it is SIGKILLed mid-round. The group fails at once with
    the reason (its secrets died with the shard), nothing of it applied; the restarted shard and
    shard 0 host the next groups, which take every device: the plain sums."""
    keys = SecureKeys.create(tmp_path, DEVICES)
    prepare(tmp_path, DEVICES, kind="fed3r-sync", max_samples=100, phase_timeout_s=5, **keys.job_fields(tmp_path))
    state, gate, reached = tmp_path / "state.db", threading.Event(), threading.Event()
    with MosquittoBroker() as broker, Fleet(broker.url, DEVICES, handlers=held_fed3r_handlers(keys, gate, reached),
                                            aggregator_key=keys.aggregator.public_key_bytes):
        proc = subprocess.Popen(aggregator_cmd(tmp_path, broker.url, state, SHARDS), env=aggregator_env(), cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert reached.wait(60), "round 1's group never started"
            os.kill(int((tmp_path / "state.db.shards" / "shard-1.pid").read_text()), signal.SIGKILL)
            time.sleep(1.0)                     # the coordinator notices within its tick; no key has come
            gate.set()
            out, _ = proc.communicate(timeout=120)           # aggregator_cmd's default wait: the service ends itself first
        finally:
            gate.set()
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "shard 1 exited" in out
    assert "secure round 1 failed on its shard: shard 1 hosting the group exited" in out
    _, results = outputs(tmp_path / "out")
    assert sorted(results["contributed"]) == DEVICES and results["state"] == "done"
    stats = dict(np.load(tmp_path / "out" / "statistics.npz"))
    A_ref, B_ref = reference_sums(DEVICES, dtype=np.float32)       # every device once, in the later groups
    np.testing.assert_allclose(stats["A"], A_ref, rtol=1e-10, atol=1e-8)
    np.testing.assert_allclose(stats["B"], B_ref, rtol=1e-10, atol=1e-8)


def test_simulate_shards_takes_the_secure_kinds_shards_host_and_says_why_not_for_the_others(tmp_path):
    """``fedfleet simulate --secure --shards K``: Fed3R-Sync, FedNCM-Sync and the secure FedAvg family
    (secure Scaffold and Ditto too) get the shard options (their registry entries' ``shard_groups``;
    secure LADD's: tests/test_secure_ladd_shards.py); FedBuff runs in one process and says why."""
    import dataclasses

    from fedfleet.sim_config import PRESETS

    from fedfleet.simulate import aggregator_shards
    from ops_fleet import C, D

    keys = SecureKeys.create(tmp_path, DEVICES)
    cfg = dataclasses.replace(PRESETS["smoke"], shards=2, secure=True)
    common = {"job_id": "s", "num_classes": C, "feature_dim": D, "max_samples": 100, **keys.job_fields(tmp_path)}
    for kind in SYNC_KINDS:
        assert aggregator_shards(cfg, kind, common) == (["--shards", "2"], ""), kind
    for kind in ("fedavg-secure", "pp-secure", "scaffold-secure", "ditto-secure"):
        assert aggregator_shards(cfg, kind, {**common, "rounds": 1}) == (["--shards", "2"], ""), kind
    options, why = aggregator_shards(cfg, "fedavg-async", {**common, "rounds": 1})
    assert options == [] and "'fedavg-async'" in why and "no additive state" in why
    from aggregator.jobs.registry import build_job
    from aggregator.shards.pool import check_shardable
    dp = build_job("fed3r-sync", {**common, "dp_noise_multiplier": 1.0, "feature_clip_norm": 8.0})
    with pytest.raises(ValueError, match="differential privacy"):     # a dropped group's devices would be re-noised
        check_shardable(dp, "fed3r-sync")


def _sharded_coordinator(tmp_path, members, **over):
    """A Fed3R-Sync job's shard coordinator with round 1's group released, its pool recording what
    it is told (the coordinator's decisions, sans-IO), and the job's config (``over``: its changes)."""
    import queue

    from aggregator.jobs.registry import build_job
    from aggregator.shards.secure_groups import ShardedSecureJob
    from ops_fleet import job_config

    class RecordingPool:
        shards = 2

        def __init__(self):
            self.placed, self.told, self.group_outcomes = {}, [], queue.Queue()

        def open_group(self, shard, config, context):
            self.placed[config.round_id] = shard
            self.told.append(("open", config.round_id, config, context))

        def tell_group(self, round_id, command, *args):
            if round_id in self.placed:
                self.told.append((command, round_id, *args))

        def group_ended(self, round_id):
            self.placed.pop(round_id, None)

    keys = SecureKeys.create(tmp_path, DEVICES)
    config = {**job_config(DEVICES, "fed3r-sync", **over), "max_samples": 100, **keys.job_fields(tmp_path)}
    pool = RecordingPool()
    coordinator = ShardedSecureJob(build_job("fed3r-sync", config), "fed3r-sync", pool)
    assert sorted(coordinator.next_participants(set(members))) == members
    return coordinator, pool, config, keys


def test_a_member_gone_before_its_group_is_placed_is_told_to_the_shard_that_hosts_it(tmp_path):
    """A review's finding: a member that went offline (or declined) between the round's tasks and
    the tick that places its group on a shard was forgotten, so the host held the advertise phase
    open for it until the phase's timeout, where one aggregator closes it when the others answer."""
    from aggregator.jobs.registry import build_job
    from aggregator.shards.shard import ShardIngest
    from aggregator.storage.store import Store
    from protocols.payloads.secagg import from_envelope, to_envelope
    from protocols.secagg import ClientSecAgg

    members = ["dev03", "dev04", "dev08"]
    coordinator, pool, config, keys = _sharded_coordinator(tmp_path, members)
    assert coordinator.secure_round_live(1)
    coordinator.member_offline("dev04", 0.5)                  # before the group's first tick
    coordinator.on_protocol_tick(1.0)                         # places it
    assert [told[0] for told in pool.told] == ["open", "group_offline"] and pool.told[1][1:] == (1, "dev04")
    _, _, group, context = pool.told[0]
    host = ShardIngest(1, 2, Store(tmp_path / "s1.db"))
    host.set_job(config["job_id"], "fed3r-sync", config)
    host.groups.open(group, context)
    one = build_job("fed3r-sync", config)                     # one aggregator, told the same at the same time
    assert sorted(one.next_participants(set(members))) == members
    one.member_offline("dev04", 0.5)
    machines = {"one aggregator": (one.on_protocol_tick(1.0), one.on_protocol),
                "sharded": (_host_told(host, pool.told[1:], 1.0), host.groups.job.on_protocol)}
    for name, (started, on_protocol) in machines.items():
        for device, env in started:
            if device == "dev04":
                continue
            start = from_envelope(env)
            client = ClientSecAgg(keys.devices[device], "aggregator", keys.aggregator.public_key_bytes,
                                  job_id=start.job_id, round_id=start.round_id, group_id=start.group_id)
            for reply in client.handle(start):
                on_protocol(device, to_envelope(reply), 1.0)
    assert one.secure.state.value == host.groups.job.secure.state.value == "wait_shares"


def _host_told(host, told, now):
    """The host's first phase after the coordinator's notices reached it, as the pool delivers them."""
    for command, round_id, device in told:
        assert command == "group_offline"
        host.groups.offline(round_id, device, now)
    return host.groups.tick(now)


def _group_with_a_copied_key(start, on_protocol, keys, vectors, owner, copier, now=1.0) -> None:
    """Round 1's group from its first messages (``start``) to its end through ``on_protocol``, each
    member a real SecAgg client of its Fed3R-Sync ``vectors``; ``copier`` advertises ``owner``'s cipher
    key (signed by itself), after the owner, and then goes silent."""
    from protocols.payloads.secagg import from_envelope, to_envelope
    from protocols.secagg import ClientSecAgg
    from secagg_rounds import resign

    clients, adverts = {}, {}
    for device, env in start:
        first = from_envelope(env)
        clients[device] = ClientSecAgg(keys.devices[device], "aggregator", keys.aggregator.public_key_bytes,
                                       job_id=first.job_id, round_id=first.round_id, group_id=first.group_id,
                                       input_vector=vectors[device])
        [adverts[device]] = clients[device].handle(first)
    adverts[copier] = resign(adverts[copier], keys.devices[copier], cipher_public_key=adverts[owner].cipher_public_key)
    sends = []
    for device in sorted(adverts):
        sends += on_protocol(device, to_envelope(adverts[device]), now)
    while sends:
        replies = [(device, reply) for device, env in sends if device != copier
                   for reply in clients[device].handle(from_envelope(env))]
        sends = [out for device, reply in replies for out in on_protocol(device, to_envelope(reply), now)]


def test_a_copied_key_on_shards_is_in_the_round_log_as_on_one_aggregator(tmp_path):
    """A review's finding: a member advertising another member's public key is refused by the
    group's server machine, and one aggregator's round log names it (``secure_refused``, with why);
    on shards that machine runs on the host, and the coordinator's round log left it out. The same
    group run by one aggregator and by a host for the coordinator: the same survivors, the same
    sum, the same ``secure_refused``."""
    from aggregator.jobs.registry import build_job
    from aggregator.service.active_job import ActiveJob
    from aggregator.shards.shard import ShardIngest
    from aggregator.storage.store import Store
    from protocols.payloads.secagg import pack_sync_vector
    from protocols.rounds import RoundClosed
    from ops_fleet import C, D

    members = ["dev03", "dev04", "dev05", "dev06", "dev08"]
    owner, copier = "dev04", "dev06"
    coordinator, pool, config, keys = _sharded_coordinator(tmp_path, members, clients_per_round=len(members))
    rng = np.random.default_rng(3)
    vectors = {}
    for device in members:
        z = np.hstack([rng.uniform(-1, 1, (4, D)), np.ones((4, 1))])
        vectors[device] = pack_sync_vector((z.T @ z)[np.triu_indices(D + 1)], np.eye(C)[rng.integers(0, C, 4)].T @ z, 4)

    one = build_job("fed3r-sync", config)
    assert sorted(one.next_participants(set(members))) == members
    _group_with_a_copied_key(one.on_protocol_tick(1.0), one.on_protocol, keys, vectors, owner, copier)

    coordinator.on_protocol_tick(1.0)                         # places the group on its host
    _, _, group, context = pool.told[0]
    host = ShardIngest(1, 2, Store(tmp_path / "s1.db"))
    host.set_job(config["job_id"], "fed3r-sync", config)
    host.groups.open(group, context)
    _group_with_a_copied_key(host.groups.tick(1.0), host.groups.feed, keys, vectors, owner, copier)
    for outcome in host.groups.outcomes():                   # what the host's loop sends its coordinator
        assert outcome[0] == "group"
        pool.group_outcomes.put(outcome[1:])
    coordinator.on_protocol_tick(2.0)

    survivors = tuple(sorted(set(members) - {copier}))
    entries = {}
    for name, job in (("one aggregator", one), ("shards", coordinator)):
        assert job.settled(1) == survivors, name
        entries[name] = ActiveJob(job=job, kind="fed3r-sync", out_dir=None).round_entry(
            RoundClosed(1, survivors, (copier,), (), ()), 0.0, 3.0)
    assert one.strategy.packed_upper().tobytes() == coordinator.inner.strategy.packed_upper().tobytes()
    refused = entries["one aggregator"].get("secure_refused")
    assert refused is not None and set(refused) == {copier} and owner in refused[copier] and "cipher" in refused[copier]
    assert entries["shards"].get("secure_refused") == refused


def test_culprits_a_host_names_for_a_round_closed_meanwhile_are_kept_out_of_later_rounds(tmp_path):
    """A review's finding: a host's failure report for a round the coordinator had closed at its
    deadline was dropped before its culprits were noted, so the device they named was drawn again."""
    coordinator, pool, _, _ = _sharded_coordinator(tmp_path, ["dev03", "dev04", "dev08"])
    coordinator.on_protocol_tick(1.0)
    coordinator.abort_secure_round(1, "deadline")             # the coordinator closed it first
    pool.group_outcomes.put((coordinator.inner.config.job_id, "failed", 1, ("dev04",), "aborted: deadline"))
    coordinator.on_protocol_tick(2.0)
    assert coordinator.culprits == {"dev04"}
    assert "dev04" not in coordinator.inner.next_participants(set(DEVICES))


def test_a_group_its_shard_cannot_build_fails_with_the_reason_and_the_shard_lives(tmp_path):
    """A review's finding: a member the shard's device keys lack (the key file edited, the shard
    restarted) raised SecAgg's ConfigError out of ShardGroups.open, which ended the shard process."""
    from aggregator.jobs.registry import build_job
    from aggregator.shards.shard import ShardIngest
    from aggregator.storage.store import Store
    from ops_fleet import job_config

    config = {**job_config(DEVICES, "fed3r-sync"), "max_samples": 100,
              **SecureKeys.create(tmp_path, DEVICES).job_fields(tmp_path)}
    coordinator = build_job("fed3r-sync", config)
    coordinator.next_participants({"dev03", "dev04", "dev08"})
    group, context = coordinator.release_group()
    keys_file = tmp_path / "device_keys.json"
    keys = json.loads(keys_file.read_text())
    keys.pop("dev04")
    keys_file.write_text(json.dumps(keys))
    host = ShardIngest(1, 2, Store(tmp_path / "s1.db"))
    host.set_job(config["job_id"], "fed3r-sync", config)
    assert host.groups.open(group, context) == []
    assert host.groups.job.secure_failure(1).startswith("its shard cannot host it: ")
    assert "dev04" in host.groups.job.secure_failure(1)


def test_a_jobs_per_round_secure_bookkeeping_nobody_reads_stays_bounded():
    """A review's finding: a shard hosting groups never read its phases' times, and a round aborted
    after it closed left its (empty) survivors: a few hundred bytes a round, for the job's life."""
    from aggregator.jobs.secure_rounds import KEPT_ROUNDS, BoundedByRound

    table = BoundedByRound()
    for round_ in range(1, 3 * KEPT_ROUNDS):
        table.setdefault(round_, {})["advertise_keys"] = 0.5
        table[round_]["share_keys"] = 1.0
    assert list(table) == list(range(2 * KEPT_ROUNDS, 3 * KEPT_ROUNDS))
    assert table[3 * KEPT_ROUNDS - 1] == {"advertise_keys": 0.5, "share_keys": 1.0}
