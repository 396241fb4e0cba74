"""The Java device's SecAgg client (clients/java, org.fedfleet.secagg) in rounds run by the Python
server (protocols/secagg/driver.py), over its wire form (signed `secagg` envelopes):

* honest rounds give exactly the plain modulo-2^r sum of the survivors' encoded inputs, in the
  64-bit ring and in a round's declared 32-bit ring (uint32 masked inputs), with the complete graph
  and with SecAgg+, also when a peer drops out after sharing its keys (the Java device then
  reveals its share of that peer's mask key);
* a round config with a ring_bits other than 32 or 64, or a 32-bit ring too narrow for its scale,
  is refused before any key is made, and so is a 32-bit round for a device whose input carries
  distributed-DP noise;
* a share row it cannot decrypt is accused (ShareAccusation) and the device stays in the round
  without that peer's shares;
* its secure-input ledger (state folder, SecureInputLedger) sums its same input over one member
  set only: a second group is left before the masked input leaves, the first group's members are
  answered again after a restart;
* a hostile server is refused: a request for both shares of one peer (the round is aborted and
  nothing revealed), forwarded shares of too few neighbours to mask with (no masked input), a key directory with a substituted key, a message not signed by the
  aggregator's key (refused, nothing changes).

The Java client runs in its own JVM behind tests/java_device/SecAggBridge.java.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

import java_build
from java_secagg_bridge import AGGREGATOR, BOUND, JAVA, M, JavaClient, round_with_java, setup_round
from edge_client.secure_inputs import OTHER_MEMBERS_REASON, SECURE_INPUTS_FILE, SecureInputLedger, member_digest, vector_key
from protocols.envelope import Envelope, EnvelopeError
from protocols.identity import DeviceIdentity
from protocols.payloads.secagg import SYNC_KIND, from_envelope
from protocols.secagg import ClientSecAgg, ClientState, RoundConfig
from protocols.secagg.driver import plain_fixed_point_sum, run_round
from protocols.secagg.errors import SecAggError
from protocols.secagg.events import AggregateReady, Phase
from protocols.secagg.messages import (MESSAGE_DOMAIN, ConsistencyCheckRequest, EncryptedShares, ForwardedShares,
                                       KeyDirectory, RoundStart, UnmaskRequest)
from protocols.secagg.wire_fields import b64

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))

@pytest.mark.parametrize("ring_bits", [64, 32])
@pytest.mark.parametrize("graph", ["complete", "regular"])
def test_java_client_gives_the_exact_sum_in_a_python_round(tmp_path, graph, ring_bits):
    config, identities, inputs, java = setup_round(tmp_path, graph, ring_bits=ring_bits)
    assert config.ring_bits == ring_bits
    dropped = "dev-py2"            # sends its shares, never its masked input
    run = round_with_java(java, config, identities, inputs, dropouts={dropped: Phase.MASKED_INPUT},
                          record_server_view=True)
    assert run.errors == [] and java.refusals == [] and java.state is ClientState.FINISHED
    assert isinstance(run.outcome, AggregateReady), run.outcome
    survivors = tuple(d for d in config.members if d != dropped)
    assert run.outcome.survivors == survivors
    expected = plain_fixed_point_sum(config, [inputs[d] for d in survivors])
    assert expected.dtype == np.dtype(f"<u{ring_bits // 8}") and run.outcome.sum_words.dtype == expected.dtype
    assert np.array_equal(run.outcome.sum_words, expected)
    sent = [f.to_message() for f in run.server_view]
    masked = [m.masked_input for m in sent if m.sender == JAVA and m.TYPE == "secagg.masked_input"]
    assert len(masked) == 1 and masked[0].dtype == expected.dtype and masked[0].shape == (M,)
    unmask = [m for m in sent if m.sender == JAVA and m.TYPE == "secagg.unmask_shares"]
    neighbours = config.neighbour_graph(config.members).neighbours(JAVA)
    if graph == "regular":
        assert len(neighbours) == 4
    assert len(unmask) == 1 and (dropped in unmask[0].key_owners) == (dropped in neighbours)
    assert dropped not in unmask[0].self_mask_owners


def test_java_client_accuses_a_share_row_it_cannot_decrypt_and_stays_in_the_sum(tmp_path):
    """A Python peer flips its share row for the Java device: the Java device sends a
    ShareAccusation of it just before its masked input, goes on without that peer's shares, and
    the round's sum is everyone's, exactly."""
    config, identities, inputs, java = setup_round(tmp_path, "complete")
    attacker = "dev-py0"

    def corrupt(msg):
        if not isinstance(msg, EncryptedShares) or msg.sender != attacker:
            return [msg]
        ciphertexts = msg.ciphertexts.copy()
        ciphertexts[msg.recipients.index(JAVA), 20] ^= 0xFF
        return [dataclasses.replace(msg, ciphertexts=ciphertexts).signed(identities[attacker])]

    run = round_with_java(java, config, identities, inputs, intercept=corrupt, record_server_view=True)
    assert run.errors == [] and java.refusals == [] and java.state is ClientState.FINISHED
    sent = [m for m in (f.to_message() for f in run.server_view) if m.sender == JAVA]
    types = [m.TYPE for m in sent]
    assert types[types.index("secagg.share_accusation") + 1] == "secagg.masked_input"
    assert sent[types.index("secagg.share_accusation")].accused == (attacker,)
    unmask = next(m for m in sent if m.TYPE == "secagg.unmask_shares")
    assert attacker not in unmask.self_mask_owners + unmask.key_owners      # it holds none of the attacker's shares
    assert run.server.culprits == set()                                      # one accuser of five
    assert isinstance(run.outcome, AggregateReady) and run.outcome.survivors == tuple(config.members)
    assert np.array_equal(run.outcome.sum_words, plain_fixed_point_sum(config, list(inputs.values())))


def test_java_device_keeps_its_live_round_when_its_task_comes_again(tmp_path):
    """The aggregator's task re-sent mid-round (a new envelope, same job, round and group): the
    Java device's live round is kept, and it is in the sum; it used to be replaced by a fresh
    client, which refused the key directory, and the device dropped out."""
    config, identities, inputs, java = setup_round(tmp_path, "complete")

    def retask(msg):
        if isinstance(msg, KeyDirectory) and msg.recipient == JAVA:
            java.retask()
        return [msg]

    run = round_with_java(java, config, identities, inputs, intercept=retask)
    assert java.refusals == [] and java.state is ClientState.FINISHED
    assert isinstance(run.outcome, AggregateReady) and run.outcome.survivors == tuple(config.members)
    assert np.array_equal(run.outcome.sum_words, plain_fixed_point_sum(config, list(inputs.values())))


ENDS = 1_000_000.0         # the Java device's round ends then (its task's deadline plus the grace)


def test_java_device_erases_a_round_past_its_deadline_and_refuses_late_messages(tmp_path):
    """The Java device's SecAggSessions end a round at its task's deadline plus the grace, through
    the client's abort path (as edge_client/tasks/secure_update.py): once the device's shares are
    out, a tick before the end keeps the round; a tick past it aborts it, no secret held, nothing
    open, and the late forwarded shares are refused as for an aborted round. The server sums the
    others (the Java device a dropout). It used to keep the round until four newer ones came."""
    config, identities, inputs, java = setup_round(tmp_path, "complete", ends=ENDS)
    ticks = []

    def vanish_and_come_back(msg):
        if isinstance(msg, ForwardedShares) and msg.recipient == JAVA:
            ticks.append((java.tick(ENDS - 1.0), java.state))
            ticks.append((java.tick(ENDS + 1.0), java.state))
        return [msg]

    run = round_with_java(java, config, identities, inputs, intercept=vanish_and_come_back)
    assert ticks == [((True, 1), ClientState.SHARES_SENT), ((False, 0), ClientState.ABORTED)]
    assert java.state is ClientState.ABORTED and len(java.refusals) == 1
    assert "forwarded_shares: round already ABORTED" in java.refusals[0]
    survivors = tuple(d for d in config.members if d != JAVA)
    assert isinstance(run.outcome, AggregateReady) and run.outcome.survivors == survivors
    assert np.array_equal(run.outcome.sum_words, plain_fixed_point_sum(config, [inputs[d] for d in survivors]))


def test_java_device_keeps_a_round_before_its_end(tmp_path):
    """Ticks up to just before the end at every message: the Java device's round completes and is in the sum."""
    config, identities, inputs, java = setup_round(tmp_path, "complete", ends=ENDS)

    def tick(msg):
        if msg.recipient == JAVA:
            assert java.tick(ENDS)[1] == 1           # at the end exactly: not past it
        return [msg]

    try:
        run = run_round(config, AGGREGATOR, identities, inputs, intercept=tick,
                        client_factory=lambda d, i: java if d == JAVA else None)
        after = java.tick(ENDS + 1.0)                   # a finished round is forgotten, not aborted
    finally:
        java.close()
    assert java.refusals == [] and java.state is ClientState.FINISHED and after == (False, 0)
    assert isinstance(run.outcome, AggregateReady) and run.outcome.survivors == tuple(config.members)
    assert np.array_equal(run.outcome.sum_words, plain_fixed_point_sum(config, list(inputs.values())))


def test_java_device_sums_its_same_input_over_one_member_set_only(tmp_path):
    """The differencing scenario (tests/test_secure_input_ledger.py) with the Java device as u, its
    same input asked into a group, then into another (the five-groups attack's second sum, which
    less the first would isolate differences of inputs). Its ledger answers the first group, and
    leaves the second before its masked input leaves, in the Python device's words (the others'
    sum goes on without it); restarted on its state folder, it answers the first group's members
    again. The file names the input and the set as the Python device does. Failing before: the Java
    device sent its input to every group."""
    rng = np.random.default_rng(7)
    java_seed = os.urandom(32)
    identities = {JAVA: DeviceIdentity.from_private_bytes(JAVA, java_seed),
                  **{f"dev-py{i}": DeviceIdentity.generate(f"dev-py{i}") for i in range(4)}}
    inputs = {d: rng.uniform(-BOUND, BOUND, M) for d in identities}
    configs = [RoundConfig.create(job_id=f"job{r}", round_id=r, group_id=f"g{r}", aggregator_id="aggregator",
                                  members=members, vector_length=M, bound=BOUND, graph="complete")
               for r, members in enumerate([[JAVA, "dev-py0", "dev-py1", "dev-py2"], [JAVA, "dev-py0", "dev-py1", "dev-py3"],
                                            [JAVA, "dev-py0", "dev-py1", "dev-py2"]], start=1)]
    state = tmp_path / "state"
    state.mkdir()

    def round_of(config, java):
        run = run_round(config, AGGREGATOR, {d: identities[d] for d in config.members}, inputs,
                        client_factory=lambda d, i: java if d == JAVA else None)
        assert isinstance(run.outcome, AggregateReady), run.outcome
        return run

    java = JavaClient(java_seed, configs[0], inputs[JAVA], tmp_path, ledger=state)
    try:
        first = round_of(configs[0], java)
        assert java.refusals == [] and java.state is ClientState.FINISHED
        java.retask(configs[1])
        second = round_of(configs[1], java)
    finally:
        java.close()
    assert np.array_equal(first.outcome.sum_words, plain_fixed_point_sum(configs[0], [inputs[d] for d in configs[0].members]))
    assert java.refusals == [f"ReleaseRefused {OTHER_MEMBERS_REASON}"] and java.state is ClientState.ABORTED
    assert second.outcome.survivors == ("dev-py0", "dev-py1", "dev-py3")
    assert np.array_equal(second.outcome.sum_words,
                          plain_fixed_point_sum(configs[1], [inputs[d] for d in second.outcome.survivors]))
    kept = SecureInputLedger(state / SECURE_INPUTS_FILE)           # the Python device's reader, key and digest
    assert kept.lost is None and kept.kept(vector_key(SYNC_KIND, inputs[JAVA])) == member_digest(configs[0].members)
    restarted = JavaClient(java_seed, configs[2], inputs[JAVA], tmp_path, ledger=state)
    try:
        again = round_of(configs[2], restarted)
    finally:
        restarted.close()
    assert restarted.refusals == [] and restarted.state is ClientState.FINISHED
    assert np.array_equal(again.outcome.sum_words, first.outcome.sum_words)


def both_shares(msg):
    """An UnmaskRequest that declares one of the Java device's surviving peers dropped too."""
    if not isinstance(msg, UnmaskRequest) or msg.recipient != JAVA:
        return [msg]
    return [dataclasses.replace(msg, dropped=msg.survivors.copy()).signed(AGGREGATOR)]


def substituted_key(msg):
    """A key directory whose first neighbour's cipher key the server swapped for its own."""
    if not isinstance(msg, KeyDirectory) or msg.recipient != JAVA:
        return [msg]
    first = dataclasses.replace(msg.neighbour_keys[0], cipher_public_key=os.urandom(32))
    return [dataclasses.replace(msg, neighbour_keys=(first, *msg.neighbour_keys[1:])).signed(AGGREGATOR)]


def impostor_signed(msg):
    """The key directory signed by an 'aggregator' that does not hold the aggregator's key."""
    if not isinstance(msg, KeyDirectory) or msg.recipient != JAVA:
        return [msg]
    return [msg.signed(DeviceIdentity.generate("aggregator"))]


def no_shares_forwarded(msg):
    """ForwardedShares naming none of the Java device's neighbours (its others are told it sent
    theirs): masked with its self mask alone, its input would be read once they reveal b_u."""
    if not isinstance(msg, ForwardedShares) or msg.recipient != JAVA:
        return [msg]
    return [dataclasses.replace(msg, senders=(), ciphertexts=msg.ciphertexts[:0]).signed(AGGREGATOR)]


def split_survivors(config):
    """SecAgg+: the survivor set shown to the Java device leaves out two runs of k/2 ring
    neighbours around it, which would split the survivors' graph into parts whose sums unmask."""
    graph = config.neighbour_graph(config.members)
    ring = list(graph._ring)
    at = ring.index(JAVA)
    removed = {ring[(at + offset) % len(ring)] for offset in (3, 4, 8, 9)}     # k = 4: runs of 2
    survivors = config.to_bitmap([m for m in config.members if m not in removed])
    assert not graph.connects(config.from_bitmap(survivors))

    def attack(msg):
        if not isinstance(msg, (ConsistencyCheckRequest, UnmaskRequest)) or msg.recipient != JAVA:
            return [msg]
        return [dataclasses.replace(msg, survivors=survivors).signed(AGGREGATOR)]
    return attack


def test_java_client_refuses_survivors_whose_graph_falls_apart(tmp_path):
    config, identities, inputs, java = setup_round(tmp_path, "regular", n=12)
    run = round_with_java(java, config, identities, inputs, intercept=split_survivors(config),
                          record_server_view=True)
    assert len(java.refusals) == 1 and "falls apart" in java.refusals[0], java.refusals
    assert java.state is ClientState.ABORTED
    sent = {f.to_message().TYPE for f in run.server_view if f.to_message().sender == JAVA}
    assert "secagg.unmask_shares" not in sent and "secagg.consistency_signature" not in sent


@pytest.mark.parametrize("attack, refusal, state", [
    (both_shares, "ProtocolViolation request asks for both shares", ClientState.ABORTED),
    (no_shares_forwarded, "ProtocolViolation only 0 neighbours' shares forwarded", ClientState.ABORTED),
    (substituted_key, "SecAggError", ClientState.ADVERTISED),
    (impostor_signed, "SecAggError", ClientState.ADVERTISED)])
def test_java_client_refuses_a_hostile_server(tmp_path, attack, refusal, state):
    config, identities, inputs, java = setup_round(tmp_path, "complete", n=5)
    run = round_with_java(java, config, identities, inputs, intercept=attack, record_server_view=True)
    assert len(java.refusals) == 1 and java.refusals[0].startswith(refusal), java.refusals
    assert java.state is state and any(who == JAVA for who, _ in run.errors)
    sent = {f.to_message().TYPE for f in run.server_view if f.to_message().sender == JAVA}
    assert "secagg.unmask_shares" not in sent         # nothing revealed to a hostile server
    if attack is no_shares_forwarded:                 # nor its input masked with b_u alone
        assert "secagg.masked_input" not in sent
    if state is ClientState.ADVERTISED:               # the directory was refused: no shares went out
        assert sent == {"secagg.advertise_keys"}


def round_start(config: RoundConfig, **config_fields) -> Envelope:
    """The aggregator's signed RoundStart to the Java device, its config's JSON object with
    config_fields put in by hand (values the Python RoundConfig refuses to hold)."""
    header = RoundStart(job_id=config.job_id, round_id=config.round_id, group_id=config.group_id,
                        sender=config.aggregator_id, recipient=JAVA, config=config).header()
    header["config"] = {**header["config"], **config_fields}
    signed = MESSAGE_DOMAIN + json.dumps({"header": header, "arrays": {}}, sort_keys=True, separators=(",", ":"),
                                         ensure_ascii=True, allow_nan=False).encode()
    return Envelope(type="secagg", sender=config.aggregator_id,
                    body={"secagg": {**header, "signature": b64(AGGREGATOR.sign(signed))}})


BAD_RING = "ring_bits must be the integer 32 or 64"


@pytest.mark.parametrize("fields, refusal", [
    ({"ring_bits": 48}, BAD_RING), ({"ring_bits": 16}, BAD_RING), ({"ring_bits": 0}, BAD_RING),
    ({"ring_bits": True}, BAD_RING), ({"ring_bits": "32"}, BAD_RING), ({"ring_bits": 32.0}, BAD_RING),
    ({"ring_bits": None}, BAD_RING),
    ({"ring_bits": 32}, r"scale_bits must be an integer in 0\.\.30"),    # the 64-bit ring's finest scale
    ({"ring_bits": 32, "scale_bits": 26}, "the 32-bit ring"),            # 50 * 2^26 >= 2^31 already
    ({"ring_bits": 32, "scale_bits": 22}, None),                         # 4 * 50 * 2^22 < 2^31: accepted
    ({"ring_bits": 64}, "written only for a 32-bit ring")])               # the default is never written
def test_java_client_refuses_a_bad_ring(tmp_path, fields, refusal):
    config, identities, inputs, java = setup_round(tmp_path, "complete", n=4)
    # the Python client decides the same RoundStart alike (one protocol: accepted, or refused
    # with the same reason) before the Java one is asked
    python = ClientSecAgg(identities[JAVA], "aggregator", AGGREGATOR.public_key_bytes, job_id=config.job_id,
                          round_id=config.round_id, group_id=config.group_id, input_vector=inputs[JAVA])
    if refusal is None:
        assert [type(m).__name__ for m in python.handle(from_envelope(round_start(config, **fields)))] == \
            ["AdvertiseKeys"]
    else:                          # refused when parsed (EnvelopeError) or when handled (SecAggError)
        with pytest.raises((EnvelopeError, SecAggError), match=refusal):
            python.handle(from_envelope(round_start(config, **fields)))
        assert python.state is ClientState.WAITING_CONFIG
    try:
        if refusal is None:
            assert [m.TYPE for m in java.send(round_start(config, **fields))] == ["secagg.advertise_keys"]
            assert java.state is ClientState.ADVERTISED
            return
        with pytest.raises(SecAggError, match=refusal):
            java.send(round_start(config, **fields))
        assert java.refusals[0].startswith("SecAggError") and java.state is ClientState.WAITING_CONFIG
        # nothing was committed: the round's own config still starts it
        assert [m.TYPE for m in java.send(round_start(config))] == ["secagg.advertise_keys"]
    finally:
        java.close()


@pytest.mark.parametrize("ring_bits", [64, 32])
def test_java_client_with_distributed_dp_noise_needs_the_64_bit_ring(tmp_path, ring_bits):
    config, _, _, java = setup_round(tmp_path, "complete", n=4, ring_bits=ring_bits, dp=True)
    try:
        start = RoundStart(job_id=config.job_id, round_id=config.round_id, group_id=config.group_id,
                           sender=config.aggregator_id, recipient=JAVA, config=config).signed(AGGREGATOR)
        if ring_bits == 64:
            assert [m.TYPE for m in java.handle(start)] == ["secagg.advertise_keys"]
            return
        with pytest.raises(SecAggError, match="distributed DP noise needs the 64-bit ring"):
            java.handle(start)
        assert java.state is ClientState.WAITING_CONFIG
    finally:
        java.close()


def decide_round_starts(tmp_path, starts, m: int = M) -> dict[str, tuple[str, str]]:
    """name -> (the Python client's decision, the Java client's) on each RoundStart envelope that
    ``starts(config)`` gives by name, each to a fresh client of the Java device's identity (inputs of
    ``m`` entries, the length of ``config``'s vector)."""
    config, identities, inputs, java = setup_round(tmp_path, "complete", n=4, m=m)
    decisions = {}
    try:
        for name, envelope in starts(config).items():
            python = ClientSecAgg(identities[JAVA], "aggregator", AGGREGATOR.public_key_bytes, job_id=config.job_id,
                                  round_id=config.round_id, group_id=config.group_id, input_vector=inputs[JAVA])
            try:
                python.handle(from_envelope(envelope))
                py = "accepted"
            except (EnvelopeError, SecAggError) as exc:
                py = f"refused ({type(exc).__name__}: {exc})"
            try:
                java.send(envelope)
                jv = "accepted"
                java.close()                               # a fresh Java client for the next case
                _, _, _, java = setup_round(tmp_path, "complete", n=4, m=m)
            except SecAggError as exc:
                jv = f"refused ({exc})"
            decisions[name] = (py, jv)
    finally:
        java.close()
    disagree = {k: v for k, v in decisions.items() if v[0].split()[0] != v[1].split()[0]}
    assert not disagree, f"Python vs Java: {disagree}"
    return decisions


def test_python_and_java_decide_non_canonical_round_configs_alike(tmp_path):
    """A review's finding: Python verified RoundStart's signature over its re-encoding of the parsed
    config (bound made a float, the seed re-hexed, a complete graph's degree never type-checked)
    while Java verified the JSON it received: a float degree passed Python only, an integer bound
    or an upper-case seed Java only. One JSON form now, refused alike."""
    decisions = decide_round_starts(tmp_path, lambda config: {
        name: round_start(config, **fields) for name, fields in {
            "degree float": {"degree": float(config.degree)},
            "share_threshold float": {"share_threshold": float(config.share_threshold)},
            "bound int": {"bound": int(config.bound)},
            "graph_seed upper": {"graph_seed": config.graph_seed.hex().upper().replace("0", "A")}}.items()})
    assert all(py.startswith("refused") for py, _ in decisions.values()), decisions


def with_signature(envelope: Envelope, signature: str) -> Envelope:
    """The RoundStart envelope with its secagg header's base64 signature text replaced."""
    return dataclasses.replace(envelope, body={"secagg": {**envelope.body["secagg"], "signature": signature}})


def test_python_and_java_take_only_canonical_base64(tmp_path):
    """A differential review's finding: Java's Base64 decoder takes a string without its padding,
    which Python's b64decode(validate=True) refuses; both took a last character whose unused bits
    are set (another text for the same bytes). Both take only the canonical RFC 4648 text now:
    padded, the standard alphabet, no whitespace, unused bits zero (docs/secure-aggregation.md)."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def variants(config):
        start = round_start(config)
        text = start.body["secagg"]["signature"]          # 64 bytes: 86 characters and "=="
        last = alphabet[alphabet.index(text[85]) | 1]      # the 4 unused bits of the 86th character set
        return {"canonical": start, "no padding": with_signature(start, text.rstrip("=")),
                "one = short": with_signature(start, text[:-1]),
                "unused bits set": with_signature(start, text[:85] + last + "=="),
                "a newline inside": with_signature(start, text[:40] + "\n" + text[40:]),
                "url-safe alphabet": with_signature(start, text.replace("+", "-").replace("/", "_")
                                                    if "+" in text or "/" in text else "-" + text[1:])}

    decisions = decide_round_starts(tmp_path, variants)
    assert {name: py.split()[0] for name, (py, _) in decisions.items()} == {
        "canonical": "accepted", "no padding": "refused", "one = short": "refused", "unused bits set": "refused",
        "a newline inside": "refused", "url-safe alphabet": "refused"}, decisions


def _short_ids(count: int) -> list[str]:
    """``count`` distinct device ids, the shortest there are (1 to 3 characters): as many members as
    a RoundStart's 64 KiB header can carry."""
    import itertools
    import string
    alphabet = string.ascii_letters + string.digits + "_.-"
    shortest = (("".join(p) for p in itertools.product(alphabet, repeat=k)) for k in (1, 2, 3))
    return list(itertools.islice(itertools.chain.from_iterable(shortest), count))


def test_python_and_java_refuse_a_group_beyond_the_protocols_largest_alike(tmp_path):
    """A review's finding: a signed round config naming any number of members was taken, and a
    group of 10,000 and more costs a device seconds of its agent thread over the round (a key
    directory of n identity keys, t consistency signatures to verify). MAX_GROUP_SIZE (10,000: no
    aggregator sends more, a secure job's clients_per_round is held to it) is the most either
    device takes; one more member is refused at once, with the same reason, before any key is made."""
    from protocols.secagg.config import MAX_GROUP_SIZE, max_scale_bits

    def starts(config):
        out = {}
        for name, n in (("largest", MAX_GROUP_SIZE), ("one more", MAX_GROUP_SIZE + 1)):
            members = sorted({*_short_ids(n - 1), JAVA})
            threshold = n * 2 // 3 + 1
            out[name] = round_start(config, members=members, threshold=threshold, degree=n - 1,
                                    share_threshold=threshold, scale_bits=max_scale_bits(n, config.bound))
        return out

    decisions = decide_round_starts(tmp_path, starts)
    assert decisions["largest"] == ("accepted", "accepted"), decisions
    python, java = decisions["one more"]
    reason = f"a group has at most {MAX_GROUP_SIZE} members, got {MAX_GROUP_SIZE + 1}"
    assert reason in python and reason in java, decisions


def test_python_and_java_refuse_a_round_past_the_mask_budget_alike(tmp_path):
    """A review's finding: nothing bounded the mask work a signed round config asks of a device, (its
    pairwise masks, one per neighbour, + its self mask) x vector_length words of AES-CTR keystream
    outside the task's deadline: 9,999 neighbours and a Fed3R-Sync vector kept a phone busy for
    hours. MAX_MASK_WORDS (2^29, protocols/secagg/config.py) is the most either device takes: a
    config at it is accepted, one neighbour more refused with the same words before any key is
    made; a SecAgg+ degree past the group counts the complete graph's n - 1 neighbours."""
    from protocols.secagg.config import MAX_MASK_WORDS, max_scale_bits
    words = 2 ** 16                             # 8,192 masks of it are the budget

    def starts(config):
        def start(n: int, graph: str, degree: int):
            members = sorted({*_short_ids(n - 1), JAVA})
            threshold, holders = n * 2 // 3 + 1, min(degree, n - 1) + 1
            return round_start(config, members=members, threshold=threshold, graph=graph, degree=degree,
                               share_threshold=threshold if graph == "complete" else holders // 2 + 1,
                               scale_bits=max_scale_bits(n, config.bound))
        return {"complete at the budget": start(8192, "complete", 8191),
                "complete, one member more": start(8193, "complete", 8192),
                "SecAgg+ at 8,190 neighbours": start(10_000, "regular", 8190),
                "SecAgg+ at 8,192 neighbours": start(10_000, "regular", 8192),
                "SecAgg+ degree past its group": start(8193, "regular", 9000)}

    decisions = decide_round_starts(tmp_path, starts, m=words)
    assert MAX_MASK_WORDS == 8192 * words
    for name in ("complete at the budget", "SecAgg+ at 8,190 neighbours"):
        assert decisions[name] == ("accepted", "accepted"), decisions
    reason = (f"the round asks each member to expand 8193 masks of {words} words ({8193 * words} words), "
              f"more than a device expands ({MAX_MASK_WORDS})")
    for name in ("complete, one member more", "SecAgg+ at 8,192 neighbours", "SecAgg+ degree past its group"):
        python, java = decisions[name]
        assert reason in python and reason in java, decisions
