"""Secure Scaffold(ψ) and secure Ditto(ψ) (scaffold-secure, ditto-secure): in process, with the
real SecAgg client and server (tests/stateful_jobs.py run_secure_round).

* the device's vector is what its plain handler computed, packed ([n·y | clip(Δc) | n] for
  Scaffold, [n·ψ_k | n] for Ditto), and the state it keeps is the plain handler's;
* the job's server step on an unmasked sum equals a numpy reference of Scaffold / FedAvg on it;
* rounds of the secure job equal rounds of the plain job over the same devices (each with its
  own store) within the fixed-point grid: head, server control, devices' c_k / v_k;
* bad inputs: a Δc sum beyond its bound, a vector of the wrong length, a replayed message of an
  earlier round: one clear error (or a dropout), nothing of it applied.
"""

import re

import shutil

import numpy as np
import pytest

from aggregator.jobs.ditto import DittoConfig, DittoJob
from aggregator.jobs.registry import build_job
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from aggregator.jobs.scaffold import ScaffoldConfig, ScaffoldJob
from aggregator.jobs.secure_rounds import LateProtocolMessage
from edge_client.agent import TaskDeclined
from edge_client.secure_inputs import LOST_REASON, SECURE_INPUTS_FILE, SecureInputLedger
from edge_client.state import DeviceStateStore
from edge_client.tasks.ditto_training import DittoTrainingTask
from edge_client.tasks.scaffold_training import ScaffoldTrainingTask
from edge_client.tasks.secure_fedavg_training import SecureFedAvgTraining, SecureScaffoldTraining
from edge_client.tasks.secure_update import SecAggSessions
from ops_fleet import SecureKeys
from protocols.envelope import EnvelopeError
from protocols.payloads.ditto import KIND as DITTO_KIND
from protocols.payloads.scaffold import KIND as SCAFFOLD_KIND
from protocols.payloads.secagg import pack_controlled, pack_weighted
from protocols.rounds import RoundClosed
from protocols.secagg import ClientState

from stateful_jobs import pixel_extractor, run_round, run_secure_round

C, D, SIZE = 3, 8, 8
DEVICES = [f"dev{i}" for i in range(5)]
EXTRACTOR = pixel_extractor(SIZE, D)
HEAD = ("weight", "bias")
GRID = 1e-6          # the fixed-point sums' resolution at these bounds, with room for float32 rounding


def local_data(i):
    rng = np.random.default_rng(i)
    n = 20 + 4 * i
    return rng.integers(0, 256, (n, SIZE, SIZE), dtype=np.uint8), rng.integers(0, C, n)


def held_out(i):
    rng = np.random.default_rng(100 + i)
    return rng.integers(0, 256, (8, SIZE, SIZE), dtype=np.uint8), rng.integers(0, C, 8)


def plain_handler(kind: str, i: int, root):
    store = DeviceStateStore(root / f"dev{i}")
    if kind == SCAFFOLD_KIND:
        return ScaffoldTrainingTask(*local_data(i), lambda *a, **k: EXTRACTOR, store)
    return DittoTrainingTask(*local_data(i), lambda *a, **k: EXTRACTOR, store, *held_out(i))


COMMON = {"num_classes": C, "feature_dim": D, "image_size": SIZE, "clients_per_round": 4, "rounds": 3,
          "local_epochs": 1, "batch_size": 8, "client_lr": 0.05, "server_lr": 0.8, "seed": 3}
KINDS = {  # wire kind: (secure job kind, plain job and config, its own fields, the device's SecAgg wrapper)
    SCAFFOLD_KIND: ("scaffold-secure", ScaffoldJob, ScaffoldConfig, {"total_devices": 6, "control_clip_norm": 0.5},
                    SecureScaffoldTraining),
    DITTO_KIND: ("ditto-secure", DittoJob, DittoConfig, {"ditto_lambda": 0.5, "personal_epochs": 2},
                 SecureFedAvgTraining)}


def secure_job(kind, tmp_path, keys, **over):
    name, _, _, fields, _ = KINDS[kind]
    return build_job(name, {**COMMON, **fields, "job_id": "sec", "max_samples": 100, "max_abs_param": 50.0,
                            "phase_timeout_s": 5, **keys.job_fields(tmp_path), **over})


def plain_job(kind, **over):
    _, job_type, config_type, fields, _ = KINDS[kind]
    return job_type(config_type(**{**COMMON, **fields, "job_id": "sec", **PLAIN_MEAN, **over}))


def secure_clients(kind, keys, root, devices=DEVICES, wrapper=None):
    wrap = wrapper or KINDS[kind][4]
    return {d: wrap(keys.devices[d], keys.aggregator.public_key_bytes, plain_handler(kind, i, root))
            for i, d in enumerate(devices)}


@pytest.fixture
def keys(tmp_path):
    return SecureKeys.create(tmp_path, DEVICES)


def finished(client):
    """``client``'s open rounds as if each FINISHED on the device (its unmask answer went out, its
    input in the sum): the state they kept stays (secure Scaffold puts back that of any other end)."""
    for session in client.sessions.sessions.values():
        session.state = ClientState.FINISHED


# ----------------------------------------------------------------------------- the device's vector
def test_the_secure_scaffold_device_masks_its_plain_update_and_clipped_control_delta(tmp_path, keys):
    job = secure_job(SCAFFOLD_KIND, tmp_path, keys, control_clip_norm=1e-3)
    assert job.kind == "scaffold.head.secure" and job.vector_length == 2 * (C * D + C) + 1
    assert job.bound == 100 * 50.0          # max(max_samples · max_abs_param, control_clip_norm)
    job.next_participants(set(DEVICES))
    params, tensors = job.task_for("dev0")
    assert params["vector_order"] == list(HEAD) and params["control_clip_norm"] == 1e-3
    plain, wrapped = plain_handler(SCAFFOLD_KIND, 0, tmp_path / "plain"), plain_handler(SCAFFOLD_KIND, 0, tmp_path / "s")
    client = SecureScaffoldTraining(keys.devices["dev0"], keys.aggregator.public_key_bytes, wrapped)
    body, out = plain(params, tensors)
    delta = {k: out["delta_control." + k].astype(np.float64) for k in HEAD}
    norm = np.sqrt(sum(np.sum(v ** 2) for v in delta.values()))
    assert norm > 1e-3                      # the clip is exercised: the plain server's clip, on the device
    clipped = {k: v * (1e-3 / norm) for k, v in delta.items()}
    want = pack_controlled({k: out[k] for k in HEAD}, clipped, HEAD, body["n"])
    np.testing.assert_allclose(client.vector(params, tensors), want, rtol=1e-12, atol=0)
    for k in HEAD:          # c_k kept exactly as the plain handler keeps it (unclipped)
        np.testing.assert_array_equal(wrapped.store.load("sec", None).arrays[k], plain.store.load("sec", None).arrays[k])


def test_the_secure_ditto_device_masks_its_global_head_and_keeps_its_personal_one(tmp_path, keys):
    job = secure_job(DITTO_KIND, tmp_path, keys)
    assert job.kind == "ditto.head.secure" and job.vector_length == C * D + C + 1
    job.next_participants(set(DEVICES))
    params, tensors = job.task_for("dev1")
    plain, wrapped = plain_handler(DITTO_KIND, 1, tmp_path / "plain"), plain_handler(DITTO_KIND, 1, tmp_path / "s")
    client = SecureFedAvgTraining(keys.devices["dev1"], keys.aggregator.public_key_bytes, wrapped)
    body, out = plain(params, tensors)
    np.testing.assert_array_equal(client.vector(params, tensors), pack_weighted(out, HEAD, body["n"]))
    for k in HEAD:
        np.testing.assert_array_equal(wrapped.store.load("sec", None).arrays[k], plain.store.load("sec", None).arrays[k])


@pytest.mark.parametrize("kind, change, reason", [
    (SCAFFOLD_KIND, {"control_clip_norm": None}, "control_clip_norm"),
    (SCAFFOLD_KIND, {"control_clip_norm": -1.0}, "control_clip_norm"),
    (SCAFFOLD_KIND, {"max_abs_param": 1e-4}, "round's bound"),
    (SCAFFOLD_KIND, {"vector_order": ["weight"]}, "vector_order"),
    (DITTO_KIND, {"max_abs_param": 1e-4}, "round's bound"),
    (DITTO_KIND, {"max_samples": 3}, "exceed the round's bound"),
])
def test_a_device_declines_a_secure_task_it_cannot_sum_within_the_bounds(tmp_path, keys, kind, change, reason):
    job = secure_job(kind, tmp_path, keys)
    job.next_participants(set(DEVICES))
    params, tensors = job.task_for("dev0")
    client = secure_clients(kind, keys, tmp_path, ["dev0"])["dev0"]
    with pytest.raises(TaskDeclined, match=reason):
        client.on_task("sec", job.round, {**params, **change}, tensors)
    assert client.sessions.sessions == {}


@pytest.mark.parametrize("kind", [SCAFFOLD_KIND, DITTO_KIND])
def test_a_device_with_more_samples_than_the_round_allows_declines_before_keeping_state(tmp_path, keys, kind):
    """A device that can never be summed (more local samples than max_samples) declines before its
    plain handler trains: its store keeps nothing, so its c_k / v_k do not drift while it declines."""
    job = secure_job(kind, tmp_path, keys)
    job.next_participants(set(DEVICES))
    params, tensors = job.task_for("dev0")
    client = secure_clients(kind, keys, tmp_path, ["dev0"])["dev0"]
    with pytest.raises(TaskDeclined, match="exceed the round's bound"):
        client.on_task("sec", job.round, {**params, "max_samples": 3}, tensors)
    assert client.training.store.load(job.config.job_id, None) is None


@pytest.mark.parametrize("kind", [SCAFFOLD_KIND, DITTO_KIND])
def test_a_device_declining_after_it_trained_puts_its_state_back(tmp_path, keys, kind):
    """The |θ| bound is only known after training, when the plain handler has saved this round's
    c_k / v_k: the decline puts the store back. A first round leaves nothing; a later one leaves the
    entry of the round the device did send, byte for byte (else its c_k would step without the
    server's c counting it, and its next round would start from a step never summed)."""
    job = secure_job(kind, tmp_path, keys)
    job.next_participants(set(DEVICES))
    params, tensors = job.task_for("dev0")
    client = secure_clients(kind, keys, tmp_path, ["dev0"])["dev0"]
    store, job_id = client.training.store, job.config.job_id
    with pytest.raises(TaskDeclined, match="round's bound"):
        client.on_task("sec", job.round, {**params, "max_abs_param": 1e-4}, tensors)
    assert store.load(job_id, None) is None
    client.on_task("sec", job.round, params, tensors)          # this round is sent: its state is kept
    finished(client)
    sent = store.load(job_id, None)
    assert sent is not None and sent.round == params["state"]["round"]
    later = {**params, "state": {**params["state"], "round": params["state"]["round"] + 1}, "max_abs_param": 1e-4}
    with pytest.raises(TaskDeclined, match="round's bound"):
        client.on_task("sec", job.round + 1, later, tensors)
    kept = store.load(job_id, None)
    assert (kept.run, kept.round, sorted(kept.arrays)) == (sent.run, sent.round, sorted(sent.arrays))
    for name, value in sent.arrays.items():
        assert kept.arrays[name].tobytes() == value.tobytes(), name
    client.on_task("sec", job.round + 1, {**later, "max_abs_param": params["max_abs_param"]}, tensors)
    assert store.load(job_id, None).round == later["state"]["round"]     # a sent round still moves it


def one_round_on_dev0(kind, tmp_path, keys):
    """A secure job of ``kind`` whose first round dev0 has answered (its state kept): the job, that
    round's params and tensors, and dev0's client."""
    job = secure_job(kind, tmp_path, keys)
    job.next_participants(set(DEVICES))
    params, tensors = job.task_for("dev0")
    client = secure_clients(kind, keys, tmp_path, ["dev0"])["dev0"]
    client.on_task("sec", job.round, params, tensors)          # a sent round: its state is kept
    return job, params, tensors, client


@pytest.mark.parametrize("kind", [SCAFFOLD_KIND, DITTO_KIND])
def test_a_device_whose_secure_input_ledger_is_unreadable_declines_before_it_trains(tmp_path, keys, kind):
    """A device restarted with its secure-input ledger unreadable declines every secure task
    (LOST_REASON) before its plain handler trains: the c_k / v_k it keeps stay those of the round it
    did send, byte for byte. It used to train first, the handler saving the next round's state,
    and decline only then, its state advanced for a round it never contributed to."""
    job, params, tensors, client = one_round_on_dev0(kind, tmp_path, keys)
    store, job_id = client.training.store, job.config.job_id
    sent = store.load(job_id, None)
    ledger = tmp_path / SECURE_INPUTS_FILE
    ledger.write_text('{"inputs": [["a", "b"]]}')              # damaged while the device was down
    client.sessions = SecAggSessions("dev0", inputs=SecureInputLedger(ledger))
    later = {**params, "state": {**params["state"], "round": params["state"]["round"] + 1}}
    with pytest.raises(TaskDeclined) as declined:
        client.on_task("sec", job.round + 1, later, tensors)
    assert str(declined.value) == LOST_REASON
    kept = store.load(job_id, None)
    assert (kept.run, kept.round, sorted(kept.arrays)) == (sent.run, sent.round, sorted(sent.arrays))
    for name, value in sent.arrays.items():
        assert kept.arrays[name].tobytes() == value.tobytes(), name


@pytest.mark.parametrize("kind", [SCAFFOLD_KIND, DITTO_KIND])
def test_a_decline_whose_state_cannot_be_put_back_drops_it_and_still_declines(tmp_path, keys, kind):
    """The device's storage is gone by the time the decline puts its entry back (unmounted, say):
    the store's OSError does not replace the decline, and the job's entry is dropped so the next
    round starts fresh rather than from a step never summed (Java's putBack does the same)."""
    job = secure_job(kind, tmp_path, keys)
    job.next_participants(set(DEVICES))
    params, tensors = job.task_for("dev0")
    client = secure_clients(kind, keys, tmp_path, ["dev0"])["dev0"]
    store, job_id = client.training.store, job.config.job_id
    client.on_task("sec", job.round, params, tensors)          # a sent round: an entry to put back
    finished(client)
    assert store.load(job_id, None) is not None

    class StorageVanishes(type(client.training)):
        def __call__(self, *args, **kwargs):
            out = super().__call__(*args, **kwargs)
            shutil.rmtree(self.store.root)          # after the handler saved this round's state
            return out

    client.training.__class__ = StorageVanishes
    later = {**params, "state": {**params["state"], "round": params["state"]["round"] + 1}, "max_abs_param": 1e-4}
    with pytest.raises(TaskDeclined, match="round's bound"):
        client.on_task("sec", job.round + 1, later, tensors)
    client.training.__class__ = StorageVanishes.__base__
    store.root.mkdir(parents=True)                              # the storage is back: the device goes on
    client.on_task("sec", job.round + 1, {**later, "max_abs_param": params["max_abs_param"]}, tensors)
    assert store.load(job_id, None).round == later["state"]["round"]


# ----------------------------------------------------------------------------- the server step
def test_scaffold_secure_server_step_is_scaffold_on_the_unmasked_sum(tmp_path, keys):
    """The group sum of three devices' [n·y | Δc | n] (Δc already clipped, as devices send it): the
    job's w and c after the round equal numpy's Scaffold step over the three."""
    job = secure_job(SCAFFOLD_KIND, tmp_path, keys, server_lr=0.7, total_devices=8)
    members = job.next_participants(set(DEVICES))
    rng = np.random.default_rng(0)
    w = {k: job.params[k].astype(np.float64) for k in HEAD}
    c0 = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in w.items()}
    job.control = dict(c0)
    sent = {d: (int(rng.integers(5, 50)), {k: rng.normal(size=v.shape) for k, v in w.items()},
                {k: 0.1 * rng.normal(size=v.shape) for k, v in w.items()}) for d in members[:3]}
    total = sum(pack_controlled(y, dc, HEAD, n) for n, y, dc in sent.values())
    job.group_summed(job.round, total, tuple(sorted(sent)))
    job.close_round(RoundClosed(job.round, tuple(sorted(sent)), (), (), ()))
    n_all = sum(n for n, _, _ in sent.values())
    for k in HEAD:
        mean_y = sum(n * y[k] for n, y, _ in sent.values()) / n_all
        np.testing.assert_allclose(job.params[k], w[k] + 0.7 * (mean_y - w[k]), rtol=1e-6, atol=1e-6)
        mean_dc = np.mean([dc[k] for _, _, dc in sent.values()], axis=0)
        np.testing.assert_allclose(job.control[k], c0[k] + 3 / 8 * mean_dc, rtol=1e-6, atol=1e-6)
    assert job.samples == n_all and sorted(job.contributed) == sorted(sent)


def test_ditto_secure_server_step_is_fedavg_on_the_unmasked_sum(tmp_path, keys):
    job = secure_job(DITTO_KIND, tmp_path, keys, server_lr=0.6)
    members = job.next_participants(set(DEVICES))
    rng = np.random.default_rng(1)
    w = {k: job.params[k].astype(np.float64) for k in HEAD}
    sent = {d: (int(rng.integers(5, 50)), {k: rng.normal(size=v.shape) for k, v in w.items()}) for d in members}
    job.group_summed(job.round, sum(pack_weighted(y, HEAD, n) for n, y in sent.values()), tuple(sorted(sent)))
    job.close_round(RoundClosed(job.round, tuple(sorted(sent)), (), (), ()))
    n_all = sum(n for n, _ in sent.values())
    for k in HEAD:
        mean = sum(n * y[k] for n, y in sent.values()) / n_all
        np.testing.assert_allclose(job.params[k], w[k] + 0.6 * (mean - w[k]), rtol=1e-6, atol=1e-6)


def snapshot(job):
    return ({k: v.copy() for k, v in job.params.items()}, {k: v.copy() for k, v in getattr(job, "control", {}).items()},
            job.samples, dict(job.contributed))


def assert_unchanged(job, before):
    params, control, samples, contributed = before
    assert all(np.array_equal(job.params[k], v) for k, v in params.items())
    assert all(np.array_equal(job.control[k], v) for k, v in control.items())
    assert job.samples == samples and job.contributed == contributed


def test_a_control_sum_beyond_its_bound_is_discarded_and_nothing_moves(tmp_path, keys):
    """Modified devices may mask any Δc: the sum's ‖Σ Δc‖ > |S|·C is caught, the round fails with
    that reason, and neither w nor c nor the counts move."""
    job = secure_job(SCAFFOLD_KIND, tmp_path, keys, control_clip_norm=0.5)
    members = tuple(job.next_participants(set(DEVICES))[:3])
    before = snapshot(job)
    ones = {k: np.ones_like(job.params[k], dtype=np.float64) for k in HEAD}
    total = sum(pack_controlled(ones, {k: v * (1 if d != members[0] else 10) for k, v in ones.items()}, HEAD, 10)
                for d in members)
    job.group_summed(job.round, total, members)
    assert job.settled(job.round) == () and "out of bound" in job.secure_failure(job.round)
    job.close_round(RoundClosed(job.round, (), members, (), ()))
    assert_unchanged(job, before)


@pytest.mark.parametrize("kind", [SCAFFOLD_KIND, DITTO_KIND])
@pytest.mark.parametrize("attack", ["negative count", "zero count", "inflated count", "mean beyond max_abs_param"])
def test_a_group_sum_no_honest_members_can_send_is_discarded_without_clipping(tmp_path, keys, kind, attack):
    """Without update_clip_norm (the default) the count and the mean are still checked: one modified
    member's count slot of 1 − Σ(others' n), within the fixed-point bound, would make Σ n_k = 1
    and the mean the weighted sum itself (a head 120× its members'). Caught, the round fails with
    the reason and nothing moves; an honest group of the same members passes (the control). A count
    of 0 (a review's finding) settled the round as a success, nothing applied and nothing said."""
    job = secure_job(kind, tmp_path, keys)
    members = tuple(job.next_participants(set(DEVICES))[:4])
    honest = {k: np.full(job.params[k].shape, 0.9) for k in HEAD}
    zeros = {k: np.zeros_like(v) for k, v in honest.items()}

    def vector(y, n):
        return pack_controlled(y, zeros, HEAD, n) if kind == SCAFFOLD_KIND else pack_weighted(y, HEAD, n)

    evil = vector(honest, 30)
    if attack == "negative count":
        evil[-1] = 1 - 30 * (len(members) - 1)
    elif attack == "zero count":
        evil[-1] = -30 * (len(members) - 1)
    elif attack == "inflated count":
        evil[-1] = 2 * len(members) * job.config.max_samples
    else:
        evil = vector({k: 1000 * v for k, v in honest.items()}, 30)
    before = snapshot(job)
    job.group_summed(job.round, evil + sum(vector(honest, 30) for _ in members[1:]), members)
    assert job.settled(job.round) == () and "out of bound" in job.secure_failure(job.round)
    job.close_round(RoundClosed(job.round, (), members, (), ()))
    assert_unchanged(job, before)
    members = tuple(job.next_participants(set(DEVICES))[:4])       # the control: the honest group passes
    job.group_summed(job.round, sum(vector(honest, 30) for _ in members), members)
    assert job.settled(job.round) == members


@pytest.mark.parametrize("kind", [SCAFFOLD_KIND, DITTO_KIND])
def test_secure_rounds_equal_plain_rounds_over_the_same_devices(tmp_path, keys, kind):
    """Three secure rounds (κ = 4 of 5) against the plain job's rounds over each round's survivors,
    devices with their own stores on both sides: w (and c), and each device's state, within the grid."""
    job, plain = secure_job(kind, tmp_path, keys), plain_job(kind)
    clients = secure_clients(kind, keys, tmp_path / "secure")
    replay = {d: plain_handler(kind, i, tmp_path / "plain") for i, d in enumerate(DEVICES)}
    for _ in range(3):
        survivors = run_secure_round(job, clients)
        assert len(survivors) == 4, job.failed_rounds
        assert set(run_round(plain, replay, kind, only=DEVICES)) == set(survivors)   # same seeded sample
    for k in HEAD:
        np.testing.assert_allclose(job.params[k], plain.params[k], rtol=0, atol=GRID)
        if kind == SCAFFOLD_KIND:
            np.testing.assert_allclose(job.control[k], plain.control[k], rtol=0, atol=GRID)
            assert np.abs(job.control[k]).max() > 100 * GRID          # c moved
    assert np.abs(job.params["weight"] - plain_job(kind).params["weight"]).max() > 100 * GRID    # w moved
    for d in DEVICES:       # the device state (c_k / v_k) both sides keep, bit for bit
        ours, theirs = clients[d].training.store.load("sec", None), replay[d].store.load("sec", None)
        assert (ours is None) == (theirs is None)
        if ours is not None:
            assert all(np.array_equal(ours.arrays[k], theirs.arrays[k]) for k in theirs.arrays)


# ----------------------------------------------------------------------------- bad input on the wire
class ShortVector(SecureScaffoldTraining):
    """Modified device code: its vector is one entry short of the round's."""

    def vector(self, params, tensors):
        return super().vector(params, tensors)[:-1]


def test_a_device_with_a_vector_of_the_wrong_length_drops_out_and_the_sum_holds_the_others(tmp_path, keys):
    """Its SecAgg client refuses to encode the vector (the round's signed length) and it sends
    nothing more: a dropout. The round's sum is the plain round's over the other members."""
    job, plain = secure_job(SCAFFOLD_KIND, tmp_path, keys), plain_job(SCAFFOLD_KIND)
    clients = secure_clients(SCAFFOLD_KIND, keys, tmp_path / "secure")
    bad = "dev1"
    clients[bad] = ShortVector(keys.devices[bad], keys.aggregator.public_key_bytes, clients[bad].training)
    survivors = run_secure_round(job, clients)
    replay = {d: plain_handler(SCAFFOLD_KIND, i, tmp_path / "plain") for i, d in enumerate(DEVICES)}
    sent = run_round(plain, replay, SCAFFOLD_KIND, only=DEVICES, silent=(bad,))
    assert bad in plain._participants and bad not in survivors and sorted(sent) == sorted(survivors)
    for k in HEAD:
        np.testing.assert_allclose(job.params[k], plain.params[k], rtol=0, atol=GRID)
        np.testing.assert_allclose(job.control[k], plain.control[k], rtol=0, atol=GRID)


def test_a_replayed_message_of_an_earlier_round_is_refused_and_changes_nothing(tmp_path, keys):
    job = secure_job(SCAFFOLD_KIND, tmp_path, keys)
    clients = secure_clients(SCAFFOLD_KIND, keys, tmp_path)
    captured = []
    run_secure_round(job, clients, intercept=lambda d, env: captured.append((d, env)))
    before = snapshot(job)
    device, env = next((d, e) for d, e in captured if e.body["secagg"]["type"] == "secagg.masked_input")
    with pytest.raises(LateProtocolMessage, match="has ended"):
        job.on_protocol(device, env, 0.0)
    forged = type(env)(type=env.type, sender=device, body={"secagg": {**env.body["secagg"], "round_id": 7}},
                       tensors=env.tensors)
    with pytest.raises(EnvelopeError, match="no secure round 7"):
        job.on_protocol(device, forged, 0.0)
    assert_unchanged(job, before)
    assert len(run_secure_round(job, clients)) == 4          # the next round runs as if nothing happened


# ----------------------------------------------------------------------------- the pipelines
@pytest.mark.parametrize("argv, phase, kind", [
    (["--pipeline", "fed3r-ft-oll", "--ft-algorithm", "scaffold"], "fedavg-ft", "scaffold-secure"),
    (["--pipeline", "fed3r-ditto-oll"], "ditto", "ditto-secure"),
    (["--pipeline", "fed3r-ft-ditto-oll", "--ft-algorithm", "scaffold"], "ditto", "ditto-secure"),
])
def test_simulate_secure_runs_scaffold_and_ditto_as_their_secure_kinds(tmp_path, argv, phase, kind):
    """``fedfleet simulate ... --secure`` is no longer refused: the pipeline checks pass and the phase
    runs the secure job kind, whose config (the pipeline's fields) the registry accepts; Scaffold on
    the tail stays plain-only and is refused before the run."""
    import dataclasses

    from fedfleet.cli import build_parser, simulate_overrides
    from types import SimpleNamespace

    from fedfleet.pipeline import (PERSONAL_PHASES, PHASE_KINDS, PIPELINES, _Phases, check_pipeline_config,
                                   run_pipeline)
    from fedfleet.sim_config import load_config
    from aggregator.jobs.registry import KINDS, validate_job_config

    args = build_parser().parse_args(["simulate", "--config", "smoke", "--secure", *argv])
    cfg = load_config(args.config, simulate_overrides(args))
    names = PIPELINES[args.pipeline]
    check_pipeline_config(cfg, names)
    assert set(KINDS[kind].task_kinds) <= set(PHASE_KINDS[phase])        # the report counts its devices' work
    if phase == "ditto":
        _, fields = PERSONAL_PHASES["ditto"](cfg)
        validate_job_config(kind, {**fields, "rounds": cfg.pp_rounds, "clients_per_round": cfg.clients_per_round})
    else:
        validate_job_config(kind, {"total_devices": cfg.devices, "client_lr": cfg.ft_client_lr})
        common = ("num_classes", "backbone", "image_size", "weights_sha256", "feature_dim", "expected_devices",
                  "start_timeout_s", "seed")
        phases = _Phases(cfg, SimpleNamespace(out=tmp_path, fed3r_job=dict.fromkeys(common)), names, None, None)
        phases.plan_fine_tuning()
        assert phases.ft_kind == kind
    if "--ft-algorithm" in argv:
        with pytest.raises(ValueError, match="not with secure"):          # refused before any data or fleet
            run_pipeline(dataclasses.replace(cfg, ft_mode="phi"), quiet=True)


class ZeroNoise:
    """Distributed DP's noise drawn as zero (as tests/fuzz_device.py's ZeroSkellam): the sum is then
    the clipped updates' alone, rounded to the round's grid."""

    def poisson(self, lam, size):
        return np.zeros(size, np.int64)


def test_ditto_secure_under_distributed_dp_steps_by_the_clipped_updates_over_kappa(tmp_path, keys):
    """ditto-secure takes secure FedAvg's distributed DP: each device masks [clip(ψ_k − ψ) | 1] (plus
    its noise share, zero here), the server moves ψ by server_lr · Σ clip(ψ_k − ψ) / κ."""
    job = secure_job(DITTO_KIND, tmp_path, keys, dp_noise_multiplier=0.5, dp_clip_norm=0.05, server_lr=1.0)
    clients = {d: SecureFedAvgTraining(keys.devices[d], keys.aggregator.public_key_bytes,
                                       plain_handler(DITTO_KIND, i, tmp_path / "secure"), noise_rng=ZeroNoise())
               for i, d in enumerate(DEVICES)}
    w = {k: job.params[k].astype(np.float64) for k in HEAD}
    chosen = plain_job(DITTO_KIND).next_participants(set(DEVICES))       # the same seeded sample
    survivors = run_secure_round(job, clients)
    assert sorted(survivors) == sorted(chosen)
    replay = {d: plain_handler(DITTO_KIND, i, tmp_path / "plain") for i, d in enumerate(DEVICES)}
    plain = plain_job(DITTO_KIND)
    sent = run_round(plain, replay, DITTO_KIND, only=DEVICES)
    deltas = []
    for d, (_, _, _, out) in sent.items():
        delta = {k: out[k].astype(np.float64) - w[k] for k in HEAD}
        norm = np.sqrt(sum(np.sum(v ** 2) for v in delta.values()))
        deltas.append({k: v * min(1.0, 0.05 / norm) for k, v in delta.items()})
        assert norm > 0.05                          # the clip bites
    for k in HEAD:
        np.testing.assert_allclose(job.params[k], w[k] + sum(dl[k] for dl in deltas) / 4, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", [SCAFFOLD_KIND, DITTO_KIND])
def test_a_restored_secure_job_continues_with_the_same_model_control_and_run(tmp_path, keys, kind):
    """What ``--state`` keeps at a round close (the checkpoint and bookkeeping) gives back w, c and
    the devices' state binding: the next round's task is the same."""
    import json

    job = secure_job(kind, tmp_path, keys)
    run_secure_round(job, secure_clients(kind, keys, tmp_path))
    restored = secure_job(kind, tmp_path, keys)
    restored.load_state_dict(job.state_dict())
    restored.restore_bookkeeping(json.loads(json.dumps(job.bookkeeping())))
    for k in HEAD:
        np.testing.assert_array_equal(restored.params[k], job.params[k])
        if kind == SCAFFOLD_KIND:
            np.testing.assert_array_equal(restored.control[k], job.control[k])
    assert restored.device_state.run == job.device_state.run and restored.round == job.round == 1
    assert restored.next_participants(set(DEVICES)) == job.next_participants(set(DEVICES))
    (p1, t1), (p2, t2) = restored.task_for("dev0"), job.task_for("dev0")
    assert p1 == p2 and all(np.array_equal(t1[k], t2[k]) for k in t2)


def test_a_secure_vector_beyond_what_secagg_sums_is_refused_when_the_job_is_built(tmp_path, keys, monkeypatch):
    """Scaffold doubles the head in its vector ([n·y | Δc | n]). With SecAgg's limit set to Ditto's
    vector here (the real 2^27 entries would need a head of 17,000 x 4,096 and a gigabyte), Ditto's
    job builds and Scaffold's is refused with the reason when it is built, not at its first round."""
    import aggregator.jobs.secure_rounds as secure_rounds

    ditto = secure_job(DITTO_KIND, tmp_path, keys)
    monkeypatch.setattr(secure_rounds, "MAX_VECTOR_LENGTH", ditto.vector_length)
    assert secure_job(DITTO_KIND, tmp_path, keys).vector_length == ditto.vector_length
    with pytest.raises(ValueError, match="more than SecAgg's"):
        secure_job(SCAFFOLD_KIND, tmp_path, keys)


def test_each_secure_head_kind_declines_bad_params_in_its_own_name():
    """A device that cannot read a secure round's params names the wire kind it was sent (the
    operator reads which kind its devices refuse), for every kind the FedAvg-family client serves."""
    from edge_client.handlers import SECURE_VARIANTS
    from protocols.identity import DeviceIdentity

    identity = DeviceIdentity.generate("dev-label")
    served = {}
    for secure_kind, client in SECURE_VARIANTS.values():
        handler = client(identity, DeviceIdentity.generate("aggregator").public_key_bytes, None, None)
        if isinstance(handler, SecureFedAvgTraining):
            served[secure_kind] = handler
    assert {"fedavg.secure", "fedavg.tail.secure", "pp.head.secure", "ditto.head.secure",
            "scaffold.head.secure"} <= set(served)
    for secure_kind, handler in served.items():
        assert handler.kind == secure_kind
        with pytest.raises(TaskDeclined, match=rf"bad {re.escape(secure_kind)} params"):
            handler.vector({"max_samples": "many"}, {})


class ApplicationStop(BaseException):
    """An application's own BaseException (not an Exception): the agent takes it as the task's
    failure, declines and goes on (protocols/message_loop.py ENDS_THE_LOOP), so the device keeps
    serving the job with whatever state the failed task left."""


@pytest.mark.parametrize("kind", [SCAFFOLD_KIND, DITTO_KIND])
def test_a_handler_base_exception_after_it_saved_puts_its_state_back(tmp_path, keys, kind):
    """The plain handler saved this round's c_k / v_k, then a BaseException that is no Exception
    ends the task: nothing is sent, so the job's entry goes back to the round the device did send,
    byte for byte, as for a decline (it stayed advanced: the device's next round started from a
    step the server never counted)."""
    job, params, tensors, client = one_round_on_dev0(kind, tmp_path, keys)
    store, job_id = client.training.store, job.config.job_id
    finished(client)
    sent = store.load(job_id, None)

    class StopsAfterSaving(type(client.training)):
        def __call__(self, *args, **kwargs):
            super().__call__(*args, **kwargs)
            raise ApplicationStop("the application stopped the work after the handler saved")

    client.training.__class__ = StopsAfterSaving
    later = {**params, "state": {**params["state"], "round": params["state"]["round"] + 1}}
    with pytest.raises(ApplicationStop):
        client.on_task("sec", job.round + 1, later, tensors)
    kept = store.load(job_id, None)
    assert (kept.run, kept.round, sorted(kept.arrays)) == (sent.run, sent.round, sorted(sent.arrays))
    for name, value in sent.arrays.items():
        assert kept.arrays[name].tobytes() == value.tobytes(), name
