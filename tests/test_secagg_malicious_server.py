"""A misbehaving SecAgg server, seen from the client: asked for both shares of one peer, declared
dropped itself, asked twice, asked to unmask a survivor set whose graph falls apart, a survivor set
changed behind the consistency check, a round of the wrong ring or one it is not invited to, too
few neighbours' shares forwarded to mask with. The client refuses (ProtocolViolation, ConfigError,
WrongContext), revealing nothing."""

import numpy as np
import pytest

from protocols.identity import DeviceIdentity
from protocols.secagg import (AggregateReady, ClientSecAgg, ClientState, Phase, ProtocolViolation, RoundConfig,
                              ServerState, UnexpectedMessage, WrongContext, shamir)
from protocols.secagg.crypto import apply_masks
from protocols.secagg.derivation import SECRET_BYTES
from protocols.secagg.driver import make_identities, plain_fixed_point_sum, run_round
from protocols.secagg.errors import ConfigError
from protocols.secagg.messages import ForwardedShares, MaskedInput, UnmaskShares

from secagg_rounds import AGGREGATOR, Round, resign


def _unmask_ready(n=6, **options):
    r = Round(n=n, consistency_check=False, **options)
    for _ in range(3):
        r.step()
    return r, r.pending[0]


def test_client_aborts_when_asked_for_both_shares_of_one_peer():
    r, request = _unmask_ready()
    client = r.clients[request.recipient]
    peer = next(d for d in r.config.members if d != request.recipient)
    with pytest.raises(ProtocolViolation):
        client.handle(resign(request, AGGREGATOR, dropped=r.config.to_bitmap([peer])))
    assert client.state is ClientState.ABORTED and client.revealed == {}
    with pytest.raises(UnexpectedMessage):
        client.handle(request)


def test_client_refuses_to_be_declared_dropped_or_to_answer_twice():
    r, request = _unmask_ready()
    client = r.clients[request.recipient]
    others = [d for d in r.config.from_bitmap(request.survivors) if d != request.recipient]
    with pytest.raises(ProtocolViolation):
        client.handle(resign(request, AGGREGATOR, survivors=r.config.to_bitmap(others),
                             dropped=r.config.to_bitmap([request.recipient])))
    r2, request2 = _unmask_ready()
    client2 = r2.clients[request2.recipient]
    assert client2.handle(request2)
    assert set(client2.revealed.values()) == {"self_mask"}
    with pytest.raises(UnexpectedMessage):
        client2.handle(request2)


def test_client_refuses_survivors_whose_graph_falls_apart():
    """SecAgg+: a server that claims chosen devices dropped (two runs of k/2 ring neighbours) would
    learn each remaining part's sum; a client asked to unmask such a survivor set aborts, revealing
    nothing. One run leaves a path, still connected: answered."""
    def request_without(runs):
        r, request = _unmask_ready(n=12, graph="regular", degree=4, threshold=7)
        members = r.config.members
        graph = r.config.neighbour_graph(members)
        ring = list(graph._ring)
        at = ring.index(request.recipient)
        removed = {ring[(at + offset) % len(ring)] for start in runs for offset in range(start, start + 2)}
        survivors = [m for m in members if m not in removed]
        return r, resign(request, AGGREGATOR, survivors=r.config.to_bitmap(survivors),
                         dropped=r.config.to_bitmap(sorted(removed))), graph, survivors

    r, split, graph, survivors = request_without([3, 8])          # runs of k/2 = 2 on both sides: two parts
    assert not graph.connects(survivors)
    client = r.clients[split.recipient]
    with pytest.raises(ProtocolViolation, match="falls apart"):
        client.handle(split)
    assert client.state is ClientState.ABORTED and client.revealed == {}
    r, one_run, graph, survivors = request_without([3])
    assert graph.connects(survivors)
    assert r.clients[one_run.recipient].handle(one_run)           # answered: only the whole sum is learnt


def test_consistency_check_catches_a_server_that_changes_the_survivor_set():
    r = Round(n=7, consistency_check=True)
    for _ in range(3):
        r.step()
    assert r.server.state is ServerState.WAIT_CONSISTENCY
    r.step()
    request = r.pending[0]
    client = r.clients[request.recipient]
    with pytest.raises(ProtocolViolation):
        survivors = r.config.from_bitmap(request.survivors)
        client.handle(resign(request, AGGREGATOR, survivors=r.config.to_bitmap(survivors[:-1]),
                             dropped=r.config.to_bitmap(survivors[-1:])))
    r2 = Round(n=7, consistency_check=True)
    for _ in range(4):
        r2.step()
    request2 = r2.pending[0]
    keep = r2.config.threshold - 1
    signers = r2.config.from_bitmap(request2.consistency_signers)[:keep]
    with pytest.raises(ProtocolViolation):
        r2.clients[request2.recipient].handle(
            resign(request2, AGGREGATOR, consistency_signers=r2.config.to_bitmap(signers),
                   consistency_signatures=request2.consistency_signatures[:keep]))
    other = r2.pending[1]  # the first client has aborted; ask another one
    forged = other.consistency_signatures.copy()
    forged[:, 5] ^= 1  # every signature broken
    with pytest.raises(ProtocolViolation):
        r2.clients[other.recipient].handle(resign(other, AGGREGATOR, consistency_signatures=forged))


def test_a_client_that_needs_the_64_bit_ring_refuses_a_32_bit_round():
    """A device whose input carries distributed-DP noise (scaled for the 64-bit ring) opens its
    session with ring_bits=64: a 32-bit RoundStart is refused, changing nothing, and the device
    still takes the round it can join."""
    narrow = Round(n=5, ring_bits=32)
    start = narrow.pending[0]
    identity = narrow.identities[start.recipient]
    client = ClientSecAgg(identity, "aggregator", AGGREGATOR.public_key_bytes, job_id="job", round_id=3,
                          group_id="g", input_vector=narrow.inputs[start.recipient], ring_bits=64)
    with pytest.raises(ConfigError, match="64-bit ring"):
        client.handle(start)
    assert client.state is ClientState.WAITING_CONFIG and client.config is None
    wide = Round(n=5)
    member = next(m for m in wide.pending if m.recipient == start.recipient)
    assert [type(m).__name__ for m in client.handle(member)] == ["AdvertiseKeys"]


def test_client_rejects_a_round_it_is_not_invited_to():
    r = Round(n=5)
    outsider = DeviceIdentity.generate("outsider")
    client = ClientSecAgg(outsider, "aggregator", AGGREGATOR.public_key_bytes, job_id="job", round_id=3, group_id="g")
    start = resign(r.pending[0], AGGREGATOR, recipient="outsider")
    with pytest.raises(WrongContext):
        client.handle(start)
    assert client.state is ClientState.WAITING_CONFIG


def _strip_forwarded_shares(victim, keep=0):
    """An intercept: the victim's ForwardedShares cut to its first ``keep`` senders (validly signed),
    while its other neighbours are still told the victim sent them its shares."""
    def strip(message):
        if isinstance(message, ForwardedShares) and message.recipient == victim:
            return [resign(message, AGGREGATOR, senders=message.senders[:keep], ciphertexts=message.ciphertexts[:keep])]
        return [message]
    return strip


def _unmasked_alone(run, config, victim):
    """What a server learns of ``victim``'s input from its masked input less its self mask, rebuilt
    from the shares of b_victim its neighbours revealed (None: no masked input, or too few shares)."""
    messages = [frame.to_message() for frame in run.server_view]
    masked = next((m.masked_input for m in messages if isinstance(m, MaskedInput) and m.sender == victim), None)
    shares = {config.holder_x(m.sender): m.self_mask_shares[m.self_mask_owners.index(victim)].tobytes()
              for m in messages if isinstance(m, UnmaskShares) and victim in m.self_mask_owners}
    if masked is None or len(shares) < config.share_threshold:
        return None
    unmasked = masked.copy()
    apply_masks(unmasked, [(shamir.reconstruct(shares, config.share_threshold, SECRET_BYTES), -1)])
    return unmasked


@pytest.mark.parametrize("graph, keep", [("complete", 0), ("complete", 2), ("regular", 0)])
def test_client_refuses_to_mask_with_fewer_neighbours_than_the_share_threshold(graph, keep):
    """A server that forwards a member too few (none) of its neighbours' shares, while telling those
    neighbours the member sent theirs, had the member mask its input with its self mask alone
    (y_u = x_u + PRG(b_u)): the neighbours then revealed their shares of b_u, and the server
    read x_u. The member now refuses (|senders| + 1 < t', as Bonawitz's |U2| >= t), sending no masked
    input; every honest round gives it at least t' - 1 senders (else b_u could not be rebuilt)."""
    identities = {i.device_id: i for i in make_identities(12 if graph == "regular" else 6)}
    config = RoundConfig.create(job_id="job", round_id=3, group_id="g", aggregator_id="aggregator",
                                members=list(identities), vector_length=16, bound=10.0, consistency_check=True,
                                graph=graph, degree=6 if graph == "regular" else None)
    rng = np.random.default_rng(7)
    inputs = {d: rng.uniform(-10, 10, 16) for d in identities}
    victim = config.members[0]
    run = run_round(config, AGGREGATOR, identities, inputs, intercept=_strip_forwarded_shares(victim, keep),
                    record_server_view=True)
    sent = {frame.to_message().TYPE for frame in run.server_view if frame.to_message().sender == victim}
    leaked = _unmasked_alone(run, config, victim)
    assert MaskedInput.TYPE not in sent, ("the victim sent its masked input; less its self mask it is its input: "
                                          f"{leaked is not None and np.array_equal(leaked, config.codec.encode(inputs[victim]))}")
    assert run.clients[victim].state is ClientState.ABORTED
    assert any(who == victim and isinstance(e, ProtocolViolation) and "share threshold" in str(e)
               for who, e in run.errors), run.errors


def test_client_masks_with_exactly_share_threshold_minus_one_senders():
    """The bound is not one too strict: two of six members drop after advertising (t = t' = 4), so
    each other member gets 3 senders, and the round still gives the survivors' exact sum."""
    identities = {i.device_id: i for i in make_identities(6)}
    config = RoundConfig.create(job_id="job", round_id=3, group_id="g", aggregator_id="aggregator",
                                members=list(identities), vector_length=16, bound=10.0)
    assert config.share_threshold == 4
    inputs = {d: np.full(16, float(i)) for i, d in enumerate(identities)}
    gone = config.members[:2]
    run = run_round(config, AGGREGATOR, identities, inputs, dropouts={d: Phase.SHARE_KEYS for d in gone})
    survivors = [d for d in config.members if d not in gone]
    assert isinstance(run.outcome, AggregateReady), run.outcome
    assert np.array_equal(run.outcome.sum_words, plain_fixed_point_sum(config, [inputs[d] for d in survivors]))
