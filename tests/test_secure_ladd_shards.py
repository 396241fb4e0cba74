"""Secure LADD on shards (aggregator/shards/secure_groups.py): the coordinator runs the plaintext
style round and the clustering, picks each training round's members and slot layout, and hands
the group to the shard ``round % 2`` with its hosting context (the layout, the members' clusters).
The host runs the group's server machine and LADD's gate before the unmasking: a round whose
cluster slot would sum a single survivor is aborted there, before any share is revealed.

Over a real mosquitto with real LADD devices (segmentation self-training, real SecAgg), the
sharded job's model must be one aggregator's bytes, with the same round aborted for the same
reason; sans-IO, a host refuses a context that does not match the group's signed configuration."""

import threading

import numpy as np
import pytest
from aggregator.jobs.ladd import save_initial_model
from aggregator.jobs.registry import build_job
from aggregator.shards.buckets import shard_of
from aggregator.shards.shard import ShardIngest
from aggregator.storage.store import Store
from edge_client.handlers import ladd_handlers
from edge_client.models.segmentation import SegmentationModel, SegmentationSpec
from edge_client.tasks.secure_ladd_training import SecureLaddTraining
from fedfleet.emulation.broker import MosquittoBroker
from fedfleet.emulation.synthetic_scenes import CLASSES, make_benchmark
from fedfleet.ladd.metrics import split_cluster_models
from protocols.files import file_sha256
from protocols.payloads.ladd import KIND_TRAIN
from protocols.payloads.secagg import SECAGG_TYPE, SECURE_LADD_KIND, ClusterSlotLayout

from ops_fleet import Fleet, SecureKeys, run_aggregator, with_secure, write_job
from test_ladd_secure import DroppingSessions
from shard_runs import ON_RAY, RAY_ALL_ONLY, shard_options
from secure_shard_runs import assert_same_bytes, outputs

SPEC = SegmentationSpec(num_classes=len(CLASSES), image_size=32, head_channels=8)
BENCH = make_benchmark(seed=0, image_size=32, n_source=1, target_domains=("night", "fog"), devices_per_domain=3,
                       images_per_device=(4, 6), test_per_domain=0)
IMAGES = {d.device_id: d.images for d in BENCH.devices}
DEVICES = sorted(IMAGES)                 # dev000-002 night, dev003-005 fog; shard 1 owns dev003 and dev005
NIGHT = [d.device_id for d in BENCH.devices if d.domain == "night"]
# job round 1 asks for styles; train round 2 is hosted by shard 0 and sums all six; in train round
# 3, hosted by shard 1, two of night's three vanish after the key exchange: night's slot would sum
# one update, so the host aborts the round before the unmasking
DROPS = {NIGHT[0]: {3}, NIGHT[1]: {3}}


def ladd_config(work, keys, **over) -> dict:
    model = SegmentationModel(SPEC, seed=0)
    save_initial_model(work / "pretrained.npz", model.exchanged_state(), model.trainable_names("tail+head"))
    return {"job_id": "sladd", "model": SPEC.to_dict(), "clustering": "styles", "k_min": 2, "k_max": 2, "n_init": 2,
            "rounds": 2, "clients_per_round": 6, "local_epochs": 1, "batch_size": 4, "teacher_every": 1,
            "round_timeout_s": 150, "expected_devices": len(DEVICES), "start_timeout_s": 30, "seed": 3,
            "max_samples": 100, "max_abs_param": 50.0, "phase_timeout_s": 8,     # round 3 waits it out, twice
            "initial_model_file": str(work / "pretrained.npz"),
            "initial_model_sha256": file_sha256(work / "pretrained.npz"), **(keys.job_fields(work) if keys else {}),
            **over}


def device_handlers(keys):
    """The real LADD device handlers (one shared network, as a device host has); the DROPS devices'
    sessions ignore their round's forwarded shares, i.e. they leave after the key exchange."""
    lock, shared = threading.Lock(), {}
    plain = with_secure(keys, lambda d: ladd_handlers(IMAGES[d], lambda s: shared.setdefault(s, SegmentationModel(s)),
                                                      lock))

    def build(device: str) -> tuple[dict, dict]:
        handlers, protocol = plain(device)
        if device in DROPS:
            sessions = DroppingSessions(device, DROPS[device])
            protocol = {SECURE_LADD_KIND: SecureLaddTraining(keys.devices[device], keys.aggregator.public_key_bytes,
                                                             handlers[KIND_TRAIN], sessions), SECAGG_TYPE: sessions}
        return handlers, protocol
    return build


def one_then_sharded(tmp_path, kind: str, config: dict, fleet: dict, sharded_options: list[str], kills=()):
    """(the sharded job's model, one aggregator's results, the sharded job's) of ``kind`` over mosquitto
    with the same devices (``fleet``: Fleet's keywords), the sharded run SIGKILLed at each of
    ``kills`` and restarted: the two models are the same bytes, and every device sent its style."""
    runs = []
    for name, options, crashes in (("one", [], ()), ("sharded", sharded_options, kills)):
        work, logs = tmp_path / name, ""
        write_job(work, DEVICES, kind, config)
        with MosquittoBroker() as broker, Fleet(broker.url, DEVICES, **fleet):
            for crash in (*crashes, None):
                rc, log = run_aggregator(work, broker.url, work / "state.db", crash=crash, extra=options, timeout=320)
                logs += log
                assert rc == (-9 if crash else 0), log[-3000:]
        assert "rejected message" not in logs   # no secagg message, no training result reached the coordinator itself
        runs.append(outputs(work / "out", ("model.npz",)))
    (want, one), (got, sharded) = runs
    assert_same_bytes(got, want)
    for results in (one, sharded):
        rounds = {r["round"]: r for r in results["rounds"]}
        assert results["state"] == "done" and sorted(rounds[1]["accepted"]) == DEVICES       # the styles
    return got, {r["round"]: r for r in one["rounds"]}, {r["round"]: r for r in sharded["rounds"]}


# local shard processes in the suite; Ray actors on the two-node test cluster in `make test-ray`
@pytest.mark.parametrize("on", ["local", pytest.param("ray", marks=[RAY_ALL_ONLY, *ON_RAY])])
def test_secure_ladd_on_two_shards_gives_one_aggregators_model_and_its_hosts_gate_aborts_thin_slots(tmp_path, on,
                                                                                                    request):
    keys = SecureKeys.create(tmp_path, DEVICES)
    got, one, sharded = one_then_sharded(tmp_path, "ladd-secure", ladd_config(tmp_path, keys),
                                         {"handlers": device_handlers(keys),
                                          "aggregator_key": keys.aggregator.public_key_bytes}, shard_options(on, request))
    for rounds in (one, sharded):
        assert sorted(rounds[2]["accepted"]) == DEVICES                                      # one sum of six
        assert rounds[3]["accepted"] == [] and "cluster slots" in rounds[3]["secure_failure"], rounds[3]
    assert [r.get("secure_failure") for r in sharded.values()] == [r.get("secure_failure") for r in one.values()]
    initial = dict(np.load(tmp_path / "pretrained.npz"))
    models, _ = split_cluster_models(got[0])
    assert len(models) == 2 and all(any(not np.array_equal(v, initial[k]) for k, v in model.items())
                                    for model in models.values())        # round 2's sum moved both clusters


@pytest.mark.parametrize("on", ["local", pytest.param("ray", marks=[RAY_ALL_ONLY, *ON_RAY])])
def test_plain_ladd_on_two_shards_gives_one_aggregators_model_after_the_coordinator_is_sigkilled(tmp_path, on,
                                                                                                 request):
    """Plain LADD (aggregator/shards/coordinator_ladd.py) over mosquitto with the same real devices:
    the styles reach the coordinator whole through the devices' shards, the training results stay
    on them as receipts, and each round closes on their per-slot statistics and sums (the norm
    bound on). The coordinator (its shards with it) is SIGKILLed closing the style round, then,
    restarted, closing the first training round: it clusters again from the styles it stored and
    closes the round on the shards' stores. The model is one aggregator's bytes, and each shard
    stored its own devices' results only. On Ray actors (``make test-ray``) without the kills."""
    from shard_runs import shard_rows

    kills = ("round_closing:1", "round_closing:2") if on == "local" else ()
    _, one, sharded = one_then_sharded(tmp_path, "ladd", plain_ladd_config(tmp_path), {"handlers": plain_handlers()},
                                       shard_options(on, request), kills)
    for rounds in (one, sharded):
        assert sorted(rounds[2]["accepted"]) == sorted(rounds[3]["accepted"]) == DEVICES
    rows = shard_rows(tmp_path / "sharded" / "state.db", 2)
    assert sorted(d for shard in rows for d, _ in shard) == sorted(DEVICES * 2)      # two training rounds
    assert all(shard_of(d, 2) == k for k, shard in enumerate(rows) for d, _ in shard)


def plain_ladd_config(work) -> dict:
    """The secure test's LADD job, less the secure fields."""
    import dataclasses

    from aggregator.jobs.ladd import LaddConfig

    plain = {f.name for f in dataclasses.fields(LaddConfig)}
    return {k: v for k, v in ladd_config(work, None).items() if k in plain}


def plain_handlers(gate: threading.Event | None = None, ungated=()):
    """The real LADD device handlers (one shared network); with ``gate``, every device but the
    ``ungated`` ones trains only once the gate opens."""
    lock, shared = threading.Lock(), {}

    def build(device: str) -> dict:
        handlers = ladd_handlers(IMAGES[device], lambda s: shared.setdefault(s, SegmentationModel(s)), lock)
        if gate is not None and device not in ungated:
            train = handlers[KIND_TRAIN]

            def gated(params, tensors):
                gate.wait(120)
                return train(params, tensors)
            handlers[KIND_TRAIN] = gated
        return handlers
    return with_secure(None, build)


def test_dp_ladd_on_shards_resumes_bit_for_bit_after_a_shard_is_sigkilled(tmp_path):
    """DP-LADD (adaptive C; the noise seeded alike in both runs, tests only): a shard is SIGKILLed
    once it stores its first training update, every other device's held back until then: restarted
    on its store, it answers the round's close (its clipped slot sums; the coordinator noises the
    root once): one aggregator's model and privacy state, bytes for bytes, each result stored once."""
    from ops_fleet import start_aggregator_in
    from shard_runs import shard_rows, sigkill_shard_holding

    from aggregator.strategies.dp_noise import NOISE_SEED_ENV

    config = {**plain_ladd_config(tmp_path), "dp_noise_multiplier": 1.0, "dp_clip_norm": 0.5, "dp_population": len(DEVICES),
              "dp_adaptive_clip": True, "dp_count_stddev": 2.0}
    seeded = {NOISE_SEED_ENV: "17"}
    write_job(tmp_path / "one", DEVICES, "ladd", config)
    with MosquittoBroker() as broker, Fleet(broker.url, DEVICES, handlers=plain_handlers()):
        rc, log = run_aggregator(tmp_path / "one", broker.url, tmp_path / "one" / "state.db", timeout=240, env=seeded)
    assert rc == 0, log[-3000:]
    victim = 1
    first = next(d for d in DEVICES if shard_of(d, 2) == victim)
    work, held_back = tmp_path / "sharded", threading.Event()
    write_job(work, DEVICES, "ladd", config)
    state = work / "state.db"
    with MosquittoBroker() as broker, Fleet(broker.url, DEVICES, handlers=plain_handlers(held_back, (first,))):
        proc = start_aggregator_in(work, broker.url, state, ["--shards", "2"], timeout=240, env=seeded)
        out = sigkill_shard_holding(proc, state, victim, 2, held_back, 240)
    assert proc.returncode == 0, out[-3000:]
    assert f"shard {victim} exited" in out
    (got, sharded), (want, one) = outputs(work / "out", ("model.npz",)), outputs(tmp_path / "one" / "out", ("model.npz",))
    assert_same_bytes(got, want)
    privacy = one["final"]["privacy"]
    assert sharded["final"]["privacy"] == privacy and privacy["releases"] == 2 and privacy["clip_norm"] != 0.5
    rows = shard_rows(state, 2)
    assert sorted(d for shard in rows for d, _ in shard) == sorted(DEVICES * 2)      # each once a training round


def test_a_host_refuses_a_hosting_context_that_is_not_its_groups_and_fails_the_group(tmp_path):
    """Sans-IO, real keys: the coordinator's context binds the host's gate to the signed group; a
    layout another group id names, or clusters for other devices, fail the group with the reason."""
    keys = SecureKeys.create(tmp_path, DEVICES)
    config = ladd_config(tmp_path, keys, clustering="none")           # no style round: round 1 trains
    coordinator = build_job("ladd-secure", config)
    assert sorted(coordinator.next_participants(set(DEVICES))) == DEVICES
    group, context = coordinator.release_group()
    assert context["clusters"] == {d: 0 for d in DEVICES}
    assert ClusterSlotLayout.from_json(context["slots"]).group_id() == group.group_id
    host = ShardIngest(1, 2, Store(tmp_path / "s1.db"))
    host.set_job(config["job_id"], "ladd-secure", config)
    host.groups.open(group, context)
    assert host.groups.job.slots.group_id() == group.group_id and host.reads("dev000")
    assert host.groups.job.assignment == context["clusters"]
    host.groups.abort(group.round_id, "deadline")
    assert host.groups.outcomes()[0][2] == "failed"

    other = ClusterSlotLayout.from_json(context["slots"])
    bad = [{**context, "slots": ClusterSlotLayout(other.global_layout, other.slot_layout, (False,)).to_json()},
           {**context, "clusters": {d: 0 for d in DEVICES[:-1]}},
           {**context, "clusters": {**context["clusters"], DEVICES[0]: 7}}]
    for wrong in bad:
        assert host.groups.open(group, wrong) == [] and not host.reads("dev000")
        (_, job_id, what, round_id, _culprits, reason), = host.groups.outcomes()
        assert (job_id, what, round_id) == ("sladd", "failed", group.round_id)
        assert reason.startswith("its shard cannot host it: secure round"), reason
