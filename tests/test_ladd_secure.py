"""Secure LADD: cluster-slot vectors (pure), the device's refusals, and whole rounds over mosquitto.

The over-the-broker test compares the job's model after a secure round with a plain numpy
weighted mean of the updates the devices computed (captured on the device side), checks that a
device dropping after the key exchange is recovered, that a cluster with one selected device
keeps θ_c, that a round whose slot would hold a single survivor is aborted before unmasking,
and that nothing the aggregator received was an unmasked update."""

import threading

import numpy as np
import pytest
from ops_fleet import RecordingService
from aggregator.service.settings import ServiceSettings

from aggregator.jobs.secure_ladd import SecureLaddConfig, SecureLaddJob
from edge_client.agent import DeviceAgent, TaskDeclined
from edge_client.models.segmentation import SegmentationModel, SegmentationSpec
from edge_client.tasks.ladd_training import LaddStyleTask, LaddTrainTask
from edge_client.tasks.secure_ladd_training import SecureLaddTraining
from edge_client.tasks.secure_update import SecAggSessions
from fedfleet.emulation.synthetic_scenes import CLASSES, make_benchmark
from protocols.chunking import MessageAssembler
from protocols.identity import DeviceIdentity, IdentityRegistry
from protocols.mqtt_link import BrokerConfig
from protocols.payloads.ladd import KIND_STYLE
from protocols.payloads.secagg import (SECAGG_TYPE, SECURE_LADD_KIND, ClusterSlotLayout, from_envelope,
                                       ladd_slot_bound)
from protocols.secagg import ForwardedShares, MaskedInput

RNG = np.random.default_rng(3)
GLOBAL = [("tail.conv.weight", (4, 3)), ("tail.conv.bias", (4,))]
SLOT = [("head.conv.weight", (5, 4)), ("head.classifier.bias", (5,))]


def random_update():
    return {name: RNG.normal(size=shape).astype(np.float32) for name, shape in GLOBAL + SLOT}


def weighted_sum(items, name):
    return sum(n * t[name].astype(np.float64) for t, n in items)


# ----------------------------------------------------------------------------- the slot layout
def test_slot_sum_gives_cluster_specific_sums_like_numpy():
    layout = ClusterSlotLayout(GLOBAL, SLOT, (True, False, True))
    devices = [(0, 3), (0, 7), (1, 4), (2, 5), (2, 2), (0, 1)]          # (cluster, n)
    updates = [(c, random_update(), n) for c, n in devices]
    total = np.sum([layout.pack(t, n, c) for c, t, n in updates], axis=0)
    assert total.shape == (layout.vector_length,) == (16 + 3 * 25 + 1 + 6,)
    sums = layout.unpack_sum(total)
    assert sums.n == 22
    assert sums.n_per_cluster.tolist() == [11, 0, 7] and sums.count_per_cluster.tolist() == [3, 0, 2]
    for name, _ in GLOBAL:          # every device adds to φ, the disabled cluster's device too
        np.testing.assert_allclose(sums.phi[name], weighted_sum([(t, n) for _, t, n in updates], name), rtol=1e-12)
    assert set(sums.theta) == {0, 2}                                   # a disabled slot is not read at all
    for c in (0, 2):
        for name, _ in SLOT:
            ref = weighted_sum([(t, n) for cc, t, n in updates if cc == c], name)
            np.testing.assert_allclose(sums.theta[c][name], ref, rtol=1e-12)
    # a device of the disabled cluster writes nothing cluster-specific: slot, weight and count are 0
    v = layout.pack(updates[2][1], 4, 1)
    assert not v[16:16 + 75].any() and v[-7] == 4 and not v[-6:].any()


def test_slot_layout_wire_form_and_binding():
    layout = ClusterSlotLayout(GLOBAL, SLOT, (True, True))
    back = ClusterSlotLayout.from_json(layout.to_json())
    assert back == layout and back.digest() == layout.digest()
    assert layout.group_id() == "ladd-slots-" + layout.digest()
    assert ClusterSlotLayout(GLOBAL, SLOT, (True, False)).group_id() != layout.group_id()
    assert ClusterSlotLayout(SLOT, GLOBAL, (True, True)).group_id() != layout.group_id()   # order matters
    scope_all = ClusterSlotLayout([], GLOBAL + SLOT, (True, True))     # θ = everything: no global part
    assert ClusterSlotLayout.from_json(scope_all.to_json()) == scope_all and scope_all.global_size == 0
    assert ladd_slot_bound(100, 20.0) == 2000.0 and ladd_slot_bound(100, 0.5) == 100.0   # n itself fits


@pytest.mark.parametrize("bad, match", [
    ({"global": [["a", [2]]], "slot": [["a", [2]]], "enabled": [True]}, "twice"),
    ({"global": [["a", [2]]], "slot": [], "enabled": []}, "clusters"),
    ({"global": [["a", [2]]], "slot": [], "enabled": [1]}, "boolean"),
    ({"global": [["a", [2]]], "slot": []}, "exactly"),
    ({"global": [["a", [-2]]], "slot": [], "enabled": [True]}, "bad global layout"),
    ({"global": [], "slot": [], "enabled": [True]}, "no tensors"),
    ({"global": [["a", [2 ** 20, 2 ** 8]]], "slot": [], "enabled": [True]}, "more than"),
    ("not a dict", "object"),
])
def test_malformed_slot_layouts_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        ClusterSlotLayout.from_json(bad)


def test_pack_refuses_wrong_shapes_nan_and_bad_cluster():
    layout = ClusterSlotLayout(GLOBAL, SLOT, (True, True))
    good = random_update()
    with pytest.raises(ValueError, match="shape"):
        layout.pack({**good, "head.conv.weight": np.zeros((4, 5), np.float32)}, 3, 0)
    with pytest.raises(ValueError, match="missing"):
        layout.pack({k: v for k, v in good.items() if k != "tail.conv.bias"}, 3, 0)
    with pytest.raises(ValueError, match="extra"):
        layout.pack({**good, "head.bn.weight": np.zeros(5, np.float32)}, 3, 0)
    nan = {**good, "head.classifier.bias": np.array([0, np.nan, 0, 0, 0], np.float32)}
    with pytest.raises(ValueError, match="NaN"):
        layout.pack(nan, 3, 0)
    inf = {**good, "tail.conv.bias": np.array([0, 0, np.inf, 0], np.float32)}
    with pytest.raises(ValueError, match="NaN or Inf"):
        layout.pack(inf, 3, 1)
    for cluster in (2, -1, True):
        with pytest.raises(ValueError, match="slots"):
            layout.pack(good, 3, cluster)
    for n in (0, 2.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            layout.pack(good, n, 0)
    with pytest.raises(ValueError, match="shape"):
        layout.unpack_sum(np.zeros(layout.vector_length - 1))
    with pytest.raises(ValueError, match="NaN"):
        layout.unpack_sum(np.full(layout.vector_length, np.nan))


def test_golden_secure_ladd_task_parses_and_binds_its_layout():
    from protocols import golden
    from protocols.envelope import decode
    from protocols.messages import parse_task
    from protocols.payloads.ladd import parse_train_task

    env = decode((golden.golden_dir() / "task_ladd_train_secure.bin").read_bytes())
    _, kind, params, _ = parse_task(env)
    assert kind == SECURE_LADD_KIND
    slots = ClusterSlotLayout.from_json(params["slots"])
    assert params["group"] == slots.group_id() and slots.enabled == (True, False)
    layout, flats = parse_train_task(params, dict(env.tensors))
    assert [n for n, _ in slots.global_layout + slots.slot_layout] == params["trainable"]
    assert {n for n, _ in layout} >= set(params["trainable"]) and flats["model"].shape == (17,)


def test_secure_flag_maps_onto_the_pipeline_config():
    import argparse

    from fedfleet.ladd.cli import add_ladd_arguments, ladd_config_from_args

    parser = argparse.ArgumentParser()
    add_ladd_arguments(parser)
    assert ladd_config_from_args(parser.parse_args(["--quick", "--secure"])).secure is True
    assert ladd_config_from_args(parser.parse_args(["--quick"])).secure is False


# ----------------------------------------------------------------------------- the device
SPEC = SegmentationSpec(num_classes=len(CLASSES), image_size=32, head_channels=8)
_MODELS: dict = {}
_MODEL_LOCK = threading.Lock()


def shared_model(spec):            # one network for every emulated device (as the pipeline's workers do)
    if spec not in _MODELS:
        _MODELS[spec] = SegmentationModel(spec)
    return _MODELS[spec]


def initial_model():
    model = SegmentationModel(SPEC, seed=0)
    return model.exchanged_state(), model.trainable_names("tail+head")


def make_job(identities, agg, **over):
    registry = IdentityRegistry({d: idt.public_key_bytes for d, idt in identities.items()})
    fields = dict(job_id="sladd", model=SPEC.to_dict(), clustering="styles", k_min=3, k_max=3, n_init=3, rounds=2,
                  clients_per_round=7, local_epochs=1, batch_size=4, teacher_every=1, round_timeout_s=60,
                  expected_devices=7, start_timeout_s=30, phase_timeout_s=2.5, max_samples=100, max_abs_param=50.0)
    fields.update(over)
    return SecureLaddJob(SecureLaddConfig(**fields), initial=initial_model(), identity=agg, registry=registry)


def three_member_round(**over):
    """(job, its identities, the aggregator's) with round 1 open on devices a, b and c."""
    ids = ["a", "b", "c"]
    identities = {d: DeviceIdentity.generate(d) for d in ids}
    agg = DeviceIdentity.generate("aggregator")
    job = make_job(identities, agg, clustering="none", **over)
    assert job.next_participants(set(ids)) == ids
    return job, identities, agg


def test_device_declines_out_of_bound_updates_and_foreign_groups():
    job, identities, agg = three_member_round()
    assert job.kind == SECURE_LADD_KIND
    params, tensors = job.task_for("a")
    images = make_benchmark(seed=1, image_size=32, n_source=1, target_domains=("fog",), devices_per_domain=1,
                            images_per_device=(3, 3), test_per_domain=0).devices[0].images
    secure = SecureLaddTraining(identities["a"], agg.public_key_bytes,
                                LaddTrainTask(images, shared_model, _MODEL_LOCK))
    vector = secure.vector(params, tensors)
    slots = ClusterSlotLayout.from_json(params["slots"])
    np.testing.assert_array_equal(vector, slots.pack(secure.last.arrays, 3, 0))
    with pytest.raises(TaskDeclined, match="bound"):
        secure.vector({**params, "max_abs_param": 1e-3}, tensors)
    with pytest.raises(TaskDeclined, match="exceed"):
        secure.vector({**params, "max_samples": 2}, tensors)
    with pytest.raises(TaskDeclined, match="group"):
        secure.vector({**params, "group": "g1"}, tensors)
    other = dict(params["slots"], enabled=[False])                  # the layout changed, the group did not
    with pytest.raises(TaskDeclined, match="group"):
        secure.vector({**params, "slots": other}, tensors)
    with pytest.raises(TaskDeclined, match="params"):
        secure.vector({**params, "slots": {"global": []}}, tensors)
    with pytest.raises(TaskDeclined, match="slots"):               # a tensor the device does not train
        wrong = ClusterSlotLayout(slots.global_layout[:-1], slots.slot_layout, slots.enabled)
        secure.vector({**params, "slots": wrong.to_json(), "group": wrong.group_id()}, tensors)


# ----------------------------------------------------------------------------- over mosquitto
class RecordingLadd(SecureLaddTraining):
    """Keeps each round's plaintext update on the device side (the test's reference)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.updates: dict[int, tuple[dict, int, int]] = {}

    def on_task(self, job, round_, params, tensors=None):
        out = super().on_task(job, round_, params, tensors)
        self.updates[round_] = ({k: v.copy() for k, v in self.last.arrays.items()}, self.last.n, self.last.cluster)
        return out


class DroppingSessions(SecAggSessions):
    """A device that vanishes after the key exchange in the given rounds: it never sends its
    masked input, so the aggregator must remove its pair masks from the survivors' sum."""

    def __init__(self, device_id, drop_rounds):
        super().__init__(device_id)
        self.drop_rounds = set(drop_rounds)

    def on_message(self, env):
        msg = from_envelope(env)
        if isinstance(msg, ForwardedShares) and msg.round_id in self.drop_rounds:
            return []
        return super().on_message(env)


def test_secure_ladd_rounds_over_mqtt_equal_numpy_cluster_means(broker, tmp_path):
    bench = make_benchmark(seed=0, image_size=32, n_source=1, target_domains=("night", "fog", "overexposed"),
                           devices_per_domain=3, images_per_device=(4, 6), test_per_domain=0)
    by_domain = {}
    for dev in bench.devices:
        by_domain.setdefault(dev.domain, []).append(dev)
    fleet = by_domain["night"] + by_domain["fog"] + by_domain["overexposed"][:1]     # clusters of 3, 3 and 1
    ids = [d.device_id for d in fleet]
    night = [d.device_id for d in by_domain["night"]]
    lone = by_domain["overexposed"][0].device_id
    # train round 1 is job round 2 (round 1 asks for styles); round 3 loses two of night's three
    drops = {night[0]: {2, 3}, night[1]: {3}}
    identities = {d: DeviceIdentity.generate(d) for d in ids}
    agg = DeviceIdentity.generate("aggregator")
    snapshots = {}

    def snapshot(job):
        snapshots[job.train_round] = ({k: v.copy() for k, v in job.phi.items()},
                                      {c: {k: v.copy() for k, v in t.items()} for c, t in job.theta.items()})
        return {}

    job = make_job(identities, agg)
    job.evaluator = snapshot
    service = RecordingService(job, broker.url, tmp_path, set(ids), ServiceSettings(evaluate_every_contribution=False),
                               timeout_s=120)
    agents, secure = [], {}
    for dev in fleet:
        d = dev.device_id
        sessions = DroppingSessions(d, drops.get(d, ()))
        secure[d] = RecordingLadd(identities[d], agg.public_key_bytes,
                                  LaddTrainTask(dev.images, shared_model, _MODEL_LOCK), sessions)
        agents.append(DeviceAgent(d, BrokerConfig.from_url(broker.url), {KIND_STYLE: LaddStyleTask(dev.images)},
                                  protocol_handlers={SECURE_LADD_KIND: secure[d], SECAGG_TYPE: sessions}).start())
    result = service.join(120)
    for a in agents:
        a.stop()
    assert result.get("state") == "done", result
    initial = job.pretrained

    # styles clustered by domain: night, fog and the lone overexposed device in three clusters
    clusters = {dev.domain: {job.assignment[d.device_id] for d in by_domain[dev.domain] if d.device_id in ids}
                for dev in fleet}
    assert all(len(c) == 1 for c in clusters.values()) and len(set().union(*clusters.values())) == 3
    c_lone = job.assignment[lone]

    # train round 1 (job round 2): night[0] dropped after the key exchange and was recovered
    rounds = {r["round"]: r for r in result["rounds"]}
    survivors = sorted(rounds[2]["accepted"])
    assert survivors == sorted(set(ids) - {night[0]}) and 2 in secure[night[0]].updates    # it trained, then left
    log = {e["round"]: e for e in job.round_log}
    assert log[2]["slots_disabled"] == [c_lone] and not log[2]["secure_failed"]
    updates = [secure[d].updates[2] for d in survivors]
    phi, theta = snapshots[1]
    trained = set(job.trainable)
    for name in phi:
        if name in trained:
            ref = sum(n * a[name].astype(np.float64) for a, n, _ in updates) / sum(n for _, n, _ in updates)
            np.testing.assert_allclose(phi[name], ref, rtol=0, atol=1e-6)
        else:
            np.testing.assert_array_equal(phi[name], initial[name])                # frozen: BatchNorm
    for c in set(job.assignment.values()) - {c_lone}:
        mine = [(a, n) for a, n, cc in updates if cc == c]
        assert len(mine) >= 2
        for name in theta[c]:
            if name in trained:
                ref = sum(n * a[name].astype(np.float64) for a, n in mine) / sum(n for _, n in mine)
                np.testing.assert_allclose(theta[c][name], ref, rtol=0, atol=1e-6)
    for name, value in theta[c_lone].items():                # one selected device: slot disabled, θ kept
        np.testing.assert_array_equal(value, initial[name])
    assert any(not np.array_equal(theta[c_lone][n], secure[lone].updates[2][0][n]) for n in theta[c_lone]
               if n in trained)

    # train round 2 (job round 3): night's slot would hold one survivor -> aborted before unmasking
    assert [r for r, _ in job.failed_rounds] == [3] and "cluster slots" in job.failed_rounds[0][1]
    assert rounds[3]["accepted"] == [] and log[3]["secure_failed"]
    for name in phi:
        np.testing.assert_array_equal(job.phi[name], phi[name])
    for c in theta:
        for name in theta[c]:
            np.testing.assert_array_equal(job.theta[c][name], theta[c][name])

    # the aggregator never received an update in the clear
    plain = [a[name].tobytes()[:64] for d in ids for a, _, _ in secure[d].updates.values() for name in a
             if a[name].size >= 16]
    asm, types, masked = MessageAssembler(), set(), 0
    for payload in service.seen:
        assert not any(p in payload for p in plain)
        env = asm.feed(payload)
        if env is None:
            continue
        types.add(env.type)
        assert env.type != "result" or env.body.get("kind") == KIND_STYLE
        if env.type == SECAGG_TYPE and isinstance(msg := from_envelope(env), MaskedInput):
            words = msg.masked_input.view(np.int64)
            # an unmasked fixed-point vector is small integers; a masked one is uniform in Z_2^64
            assert np.mean(np.abs(words.astype(np.float64)) < 2.0 ** 60) < 0.3
            masked += 1
    assert SECAGG_TYPE in types and masked == 6 + 5
