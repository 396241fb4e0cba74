"""Multi-round leakage of secure aggregation, on the device (``edge_client/secure_inputs.py``).

A Fed3R-Sync device without DP sends the same statistics whenever it is asked. An aggregator that
regroups five such devices into the five groups of four (each leaving one out) gets five sums
whose total is four times everyone's, so each device's statistics are the total less the sum
without it: exact, by subtraction. Real devices here: ``SecureFed3R`` handlers, their SecAgg
clients, and a real ``ServerSecAgg`` as the aggregator, over the wire envelopes."""

import base64
import json

import numpy as np

from edge_client.secure_inputs import (FORGOTTEN_BITS, FORGOTTEN_REASON, LOST_REASON, MAX_INPUTS, OTHER_MEMBERS_REASON,
                                       SECURE_INPUTS_FILE, SecureInputLedger, input_key)
from edge_client.tasks.fed3r_stats import Fed3RStatsTask
from edge_client.tasks.secure_fed3r import SecureFed3R
from edge_client.tasks.secure_update import SecAggSessions
from protocols.identity import DeviceIdentity, IdentityRegistry
from protocols.payloads.secagg import from_envelope, sync_vector_length, to_envelope, unpack_sync_vector
from protocols.payloads.secure_tasks import SecureFed3RParams
from protocols.payloads.task_params import ModelSpec
from protocols.secagg import AggregateReady, Message, RoundConfig, ServerSecAgg, Timeout, UnmaskRequest
from protocols.secagg.fixedpoint import fed3r_bound
from protocols.secagg.server import FINAL_STATES

from ops_fleet import Features

D, C, N = 2, 2, 10
P = D + 1                      # the features and the bias
DEVICES = ["u", "v", "w", "y", "z"]
AGGREGATOR = DeviceIdentity.generate("aggregator")
IDENTITIES = {d: DeviceIdentity.generate(d) for d in DEVICES}
PARAMS = SecureFed3RParams(model=ModelSpec(num_classes=C, backbone="test", image_size=8), group="g",
                           max_samples=100, format="dense").to_params()


def data(device):
    rng = np.random.default_rng(DEVICES.index(device))
    return rng.uniform(0, 3, (N, D)).astype(np.float32), rng.integers(0, C, N)


def reference_statistics(device):
    """numpy's A (upper triangle, row by row), B and n of the device's samples."""
    x, y = data(device)
    z = np.hstack([x.astype(np.float64), np.ones((N, 1))])
    return (z.T @ z)[np.triu_indices(P)], np.eye(C)[y].T @ z, N


class Unguarded(SecureInputLedger):
    """What a device did before the ledger: every input leaves, in any round."""

    def _masked_input(self, key, participants):
        return None, False

    def _unmask(self, key, survivors, first):
        return None


def fleet(ledger=lambda device: SecureInputLedger()):
    return {d: SecureFed3R(IDENTITIES[d], AGGREGATOR.public_key_bytes,
                           Fed3RStatsTask(*data(d), lambda b, s, w: Features(D)),
                           SecAggSessions(d, inputs=ledger(d))) for d in DEVICES}


def secure_round(devices, members, round_id, *, silent=(), withhold_unmask=(), resend_task=(), params=None):
    """One round of ``members`` run by a real SecAgg server: the sum it unmasks (float64), or None.
    ``silent``: members that never answer; ``withhold_unmask``: members never sent their
    UnmaskRequest (the others' shares unmask them); ``resend_task``: members sent their task again
    once the round is under way; ``params``: the task's, changed."""
    params = {**PARAMS, **(params or {}), "group": f"g{round_id}"}
    for device in members:
        if device not in silent:
            assert devices[device].on_task(f"job{round_id}", round_id, params, {}) == []
    config = RoundConfig.create(job_id=f"job{round_id}", round_id=round_id, group_id=params["group"],
                                aggregator_id="aggregator", members=members,
                                vector_length=sync_vector_length(P, C), bound=fed3r_bound(100, 3.0))
    server = ServerSecAgg(config, AGGREGATOR, IdentityRegistry({d: IDENTITIES[d].public_key_bytes for d in members}))
    outgoing, resent = server.start(), False
    while server.state not in FINAL_STATES:
        phase, replies = server.phase, []
        for message in outgoing:
            if not isinstance(message, Message) or message.recipient in silent:
                continue
            if isinstance(message, UnmaskRequest) and message.recipient in withhold_unmask:
                continue
            for env in devices[message.recipient].on_message(to_envelope(message)):
                replies.extend(server.handle(from_envelope(env)))
        if not resent:
            for device in resend_task:
                assert devices[device].on_task(f"job{round_id}", round_id, params, {}) == []
            resent = True
        if server.phase == phase and server.state not in FINAL_STATES:
            replies.extend(server.handle(Timeout(phase)))
        outgoing = replies
    outcome = server.outcome
    return outcome.decode() if isinstance(outcome, AggregateReady) else None


def differencing_attack(devices):
    """The five groups of four; each device's statistics as total - the sum without it, or None
    where a group's sum was not revealed."""
    sums = {}
    for round_id, left_out in enumerate(DEVICES, start=1):
        sums[left_out] = secure_round(devices, [d for d in DEVICES if d != left_out], round_id)
    if any(s is None for s in sums.values()):
        return sums, None
    total = sum(sums.values()) / (len(DEVICES) - 1)
    return sums, {d: total - sums[d] for d in DEVICES}


def test_regrouped_sums_give_away_each_devices_statistics_without_the_ledger():
    """The attack, on devices that send their input to any round: u's exact A, B and n."""
    _, recovered = differencing_attack(fleet(lambda d: Unguarded()))
    a_upper, b, n = unpack_sync_vector(recovered["u"], P, C)
    want_a, want_b, want_n = reference_statistics("u")
    assert n == want_n
    np.testing.assert_allclose(a_upper, want_a, atol=1e-6)
    np.testing.assert_allclose(b, want_b, atol=1e-6)


def test_a_device_reveals_its_input_over_one_member_set_only():
    """With the ledger, the first group's sum is revealed (it is the group sum, nothing more); every
    later group holds members whose same statistics were already summed with others: refused."""
    sums, recovered = differencing_attack(fleet())
    assert recovered is None
    assert sums["u"] is not None                                  # the first group: v, w, y, z
    assert [d for d in DEVICES[1:] if sums[d] is not None] == []


def test_the_same_members_again_are_answered_across_a_restart(tmp_path):
    """A re-run over the very same members reveals the same sum (nothing new): answered, by
    restarted devices too (the ledger is in their state folders); another group is not."""
    for d in DEVICES:
        (tmp_path / d).mkdir()
    kept = lambda d: SecureInputLedger(tmp_path / d / SECURE_INPUTS_FILE)     # noqa: E731
    group = ["u", "v", "w", "y"]
    first = secure_round(fleet(kept), group, 1)
    np.testing.assert_allclose(unpack_sync_vector(first, P, C)[0],
                               sum(reference_statistics(d)[0] for d in group), atol=1e-6)
    restarted = fleet(kept)
    np.testing.assert_array_equal(secure_round(restarted, group, 2), first)
    assert secure_round(restarted, ["u", "v", "w", "z"], 3) is None


def test_a_round_failed_before_the_masked_input_is_retried_in_another_group():
    """Two of four members silent: the round fails at the key phase, no input left; u's retry in
    another group is answered (the normal Fed3R-Sync retry)."""
    devices = fleet()
    assert secure_round(devices, ["u", "v", "w", "y"], 1, silent={"v", "w"}) is None
    total = secure_round(devices, ["u", "v", "w", "z"], 2)
    np.testing.assert_allclose(unpack_sync_vector(total, P, C)[0],
                               sum(reference_statistics(d)[0] for d in "uvwz"), atol=1e-6)


def test_an_input_unmasked_without_the_device_goes_to_those_members_only():
    """The server withholds u's UnmaskRequest and unmasks the group with the other members' shares
    of u's self-mask: u never saw the survivors. Its same input then joins no other group (the
    brief's rule, kept at the unmask answer, would have let it); new samples make another input."""
    devices = fleet()
    group = ["u", "v", "w", "y"]
    revealed = secure_round(devices, group, 1, withhold_unmask={"u"})
    np.testing.assert_allclose(unpack_sync_vector(revealed, P, C)[0],
                               sum(reference_statistics(d)[0] for d in group), atol=1e-6)
    regrouped = fleet()
    regrouped["u"] = devices["u"]
    without_u = secure_round(regrouped, ["u", "v", "w", "z"], 2)          # u leaves, the others' sum goes on
    assert unpack_sync_vector(without_u, P, C)[2] == 3 * N
    # the task's ignored fields (a sparse format, a larger bound, another job) do not rename the input
    regrouped = {**fleet(), "u": devices["u"]}
    without_u = secure_round(regrouped, ["u", "v", "w", "z"], 3, params={"format": "sparse", "max_samples": 101})
    assert unpack_sync_vector(without_u, P, C)[2] == 3 * N
    regrouped = {**fleet(), "u": devices["u"]}
    devices["u"].stats.add_samples(*data("v"))                            # new samples: another input
    total = secure_round(regrouped, ["u", "v", "w", "z"], 4)
    assert unpack_sync_vector(total, P, C)[2] == 5 * N


def test_a_task_sent_again_mid_round_keeps_the_live_round():
    """The aggregator's re-sent task for a (job, round, group) under way: a duplicate; the device
    used to replace its SecAgg client with fresh keys and drop out of the round."""
    devices = fleet()
    group = ["u", "v", "w", "y"]
    total = secure_round(devices, group, 1, resend_task={"u"})
    assert total is not None
    assert unpack_sync_vector(total, P, C)[2] == N * len(group)       # u's samples counted


def test_the_ledger_is_kept_and_fails_closed(tmp_path):
    path = tmp_path / SECURE_INPUTS_FILE
    first = SecureInputLedger(path).release("a" * 32)
    assert first.masked_input(frozenset("uvwz")) is None
    assert first.unmask(frozenset("uvw")) is None                    # z dropped: the sum is over u, v, w
    kept = SecureInputLedger(path)                                   # a restarted device
    assert kept.release("a" * 32).masked_input(frozenset("uvwz")) == OTHER_MEMBERS_REASON
    again = kept.release("a" * 32)
    assert again.masked_input(frozenset("uvw")) is None
    assert again.unmask(frozenset("uv")) == OTHER_MEMBERS_REASON      # only the set kept, whole
    path.write_text('{"inputs": [["a", "b"]]}')
    damaged = SecureInputLedger(path)
    assert damaged.lost is not None
    assert damaged.release("c" * 32).masked_input(frozenset("uvw")) == LOST_REASON
    path.unlink()                                                    # moved aside: a fresh ledger
    assert damaged.reload() is None
    assert damaged.release("c" * 32).masked_input(frozenset("uvw")) is None


class SteppedRound:
    """One round of a real SecAgg server over ``devices``, a phase at a time, so that a test can
    interleave two rounds; ``lost_masked``: members whose masked input the network loses (it left
    the device, its ledger saw it go, the server never gets it)."""

    def __init__(self, devices, members, job, round_id, lost_masked=()):
        params = {**PARAMS, "group": "g"}
        for device in members:
            assert devices[device].on_task(job, round_id, params, {}) == []
        config = RoundConfig.create(job_id=job, round_id=round_id, group_id="g", aggregator_id="aggregator",
                                    members=members, vector_length=sync_vector_length(P, C),
                                    bound=fed3r_bound(100, 3.0))
        self.devices, self.lost_masked = devices, set(lost_masked)
        self.server = ServerSecAgg(config, AGGREGATOR,
                                   IdentityRegistry({d: IDENTITIES[d].public_key_bytes for d in members}))
        self.outgoing = self.server.start()

    def step(self):
        phase, replies = self.server.phase, []
        for message in self.outgoing:
            if isinstance(message, Message):
                for env in self.devices[message.recipient].on_message(to_envelope(message)):
                    reply = from_envelope(env)
                    if not (reply.TYPE == "secagg.masked_input" and reply.sender in self.lost_masked):
                        replies.extend(self.server.handle(reply))
        if self.server.phase == phase and self.server.state not in FINAL_STATES:
            replies.extend(self.server.handle(Timeout(phase)))
        self.outgoing = replies

    def until(self, state=None):
        """Phases run until the server waits in ``state`` (None: until the round is over)."""
        while self.server.state is not state and self.server.state not in FINAL_STATES:
            self.step()

    def finish(self):
        self.until()
        outcome = self.server.outcome
        return outcome.decode() if isinstance(outcome, AggregateReady) else None


def test_two_rounds_of_one_input_at_once_are_revealed_over_one_member_set():
    """Two jobs' rounds of the same statistics, interleaved by the aggregator. Round A's masked
    inputs leave (its first: each device keeps U1), y's is lost on the way; round B's leave too (the
    set kept), and B is unmasked over all four. Then A's survivors, u, v, w, used to become the set
    kept (its first round's narrowing), and A's sum was revealed as well: B − A is y's exact
    statistics. Once another round has sent its masked input on the set kept, it is fixed: A is refused."""
    from protocols.secagg import ServerState
    devices = fleet()
    group = ["u", "v", "w", "y"]
    a = SteppedRound(devices, group, "jobA", 1, lost_masked={"y"})
    a.until(ServerState.WAIT_CONSISTENCY)                   # every masked input left; A's U3 = u, v, w
    b = SteppedRound(devices, group, "jobB", 1)
    total_b = b.finish()
    np.testing.assert_allclose(unpack_sync_vector(total_b, P, C)[0],
                               sum(reference_statistics(d)[0] for d in group), atol=1e-6)
    total_a = a.finish()
    if total_a is not None:                                  # the attack: y's statistics, exactly
        a_upper, _, n = unpack_sync_vector(total_b - total_a, P, C)
        np.testing.assert_allclose(a_upper, reference_statistics("y")[0], atol=1e-6)
        assert n == N
    assert total_a is None


def test_a_first_rounds_survivors_become_the_set_kept_unless_another_round_relied_on_it():
    ledger = SecureInputLedger()
    first, second = ledger.release("a" * 32), ledger.release("a" * 32)
    assert first.masked_input(frozenset("uvwy")) is None
    assert second.masked_input(frozenset("uvwy")) is None          # on the set kept: it is fixed now
    assert first.unmask(frozenset("uvw")) == OTHER_MEMBERS_REASON
    assert second.unmask(frozenset("uvwy")) is None
    alone = SecureInputLedger().release("b" * 32)                  # no other round: narrowed as before
    assert alone.masked_input(frozenset("uvwy")) is None and alone.unmask(frozenset("uvw")) is None


def push_out(ledger, count=MAX_INPUTS):
    """The aggregator's ``count`` secure tasks with other inputs (one param differs), each answered
    by the device: its ledger keeps each one, the oldest pushed out."""
    for i in range(count):
        other = ledger.release(input_key("fedavg.secure", {"lr": 0.1, "nonce": i}, {}))
        assert other.masked_input(frozenset("uvwz")) is None


def test_an_input_pushed_out_of_the_ledger_is_never_sent_again(tmp_path):
    """The eviction attack: u's statistics revealed over u, v, w, y; then 1,024 secure tasks with
    other inputs push them out of u's ledger (it keeps the newest MAX_INPUTS), and the same
    statistics are asked for again over u, v, w, z. The ledger used to take them for a new input:
    both sums revealed, their difference with the other groups' isolates u. Now the forgotten key
    stays in the file's filter, across a restart: u sits the round out, the others' sum goes on
    (v, w, z here hold no kept set: new partners, or ones pushed out alike)."""
    for d in DEVICES:
        (tmp_path / d).mkdir()
    kept = lambda d: SecureInputLedger(tmp_path / d / SECURE_INPUTS_FILE)     # noqa: E731
    devices = fleet(kept)
    first = secure_round(devices, ["u", "v", "w", "y"], 1)
    assert unpack_sync_vector(first, P, C)[2] == 4 * N
    statistics = devices["u"].sessions.inputs
    (key,) = [k for k in statistics._kept]                                     # u's statistics' key
    push_out(statistics)
    assert statistics.kept(key) is None                                        # forgotten ...
    regrouped = {**fleet(), "u": fleet(kept)["u"]}           # u restarted; its partners here bound nothing yet
    again = secure_round(regrouped, ["u", "v", "w", "z"], 2)
    assert unpack_sync_vector(again, P, C)[2] == 3 * N                         # ... and never sent again
    assert kept("u").release(key).masked_input(frozenset("uvwy")) == FORGOTTEN_REASON   # to its old set neither


def test_a_first_round_whose_input_was_pushed_out_before_its_unmask_is_refused():
    """Round A's masked input leaves on u, v, w, y, round B's on the same set (the set is fixed);
    1,024 other inputs push the key out before A's unmask. A may not narrow the set to its
    survivors then (B's sum minus A's would be y's input): forgotten, refused."""
    ledger = SecureInputLedger()
    a, b = ledger.release("a" * 32), ledger.release("a" * 32)
    assert a.masked_input(frozenset("uvwy")) is None and b.masked_input(frozenset("uvwy")) is None
    push_out(ledger)
    assert a.unmask(frozenset("uvw")) == FORGOTTEN_REASON
    assert b.unmask(frozenset("uvwy")) == FORGOTTEN_REASON
    assert ledger.release("a" * 32).masked_input(frozenset("uvwy")) == FORGOTTEN_REASON


def test_a_malformed_forgotten_filter_fails_closed(tmp_path):
    """The filter is the base64 of exactly 2^20 bits, canonical; anything else: LOST_REASON, the
    file left as it is."""
    path = tmp_path / SECURE_INPUTS_FILE
    good = base64.b64encode(bytes(FORGOTTEN_BITS // 8)).decode()
    for forgotten in (good[:-4], good[:-1] + "A", good[:-4] + "AAAA", good[:-4] + "AA==", "*" + good[1:], 7, None,
                      good[:-4] + "AB==", "é" + good[1:]):
        text = json.dumps({"forgotten": forgotten, "inputs": [["a" * 32, "b" * 32]]})
        path.write_text(text)
        ledger = SecureInputLedger(path)
        assert ledger.lost is not None, forgotten
        assert ledger.release("c" * 32).masked_input(frozenset("uvw")) == LOST_REASON
        assert path.read_text() == text
    path.write_text(json.dumps({"forgotten": good}))
    assert SecureInputLedger(path).lost is not None
    path.write_text(json.dumps({"forgotten": good, "inputs": []}))                  # well formed: served
    assert SecureInputLedger(path).release("c" * 32).masked_input(frozenset("uvw")) is None
