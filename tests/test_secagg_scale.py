"""Secure aggregation in large groups (issue #38): with the default graph ("auto") a group of 2,000
builds messages that fit the envelope, a round above the auto threshold is exact, the degree meets
its stated failure bounds, and a message that cannot be built fails its round once, with its reason.

References are independent of the code under test: scipy's binomial tail for the correctness bound,
scipy's connected components for the split rule, the plain fixed-point sum for exactness, and the
envelope's own encoder for the limits."""

import math
import random
import struct

import numpy as np
import pytest
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components
from scipy.stats import binom

from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob
from aggregator.service.active_job import ActiveJob
from protocols.envelope import MAX_HEADER_BYTES, Envelope, EnvelopeError, encode
from protocols.identity import DeviceIdentity, IdentityRegistry
from protocols.payloads.secagg import SECAGG_TYPE, UnsendableMessage, from_envelope, to_envelope
from protocols.rounds import RoundClosed
from protocols.secagg import (AggregateReady, ClientSecAgg, GRAPH_COMPLETE, GRAPH_REGULAR, Message, Phase, RoundConfig,
                              ServerSecAgg)
from protocols.secagg.config import AUTO_COMPLETE_MAX_MEMBERS, resolve_graph
from protocols.secagg.driver import make_identities, plain_fixed_point_sum, run_round
from protocols.secagg.graph import CORRECTNESS_LOG2, SECURITY_LOG2, NeighbourGraph, regular_degree
from protocols.secagg.messages import ForwardedShares, UnmaskRequest, UnmaskShares

AGGREGATOR = DeviceIdentity.generate("aggregator")


def _create(members, **over):
    return RoundConfig.create(job_id="job", round_id=1, group_id="g1", aggregator_id="aggregator",
                              members=list(members), vector_length=over.pop("vector_length", 8),
                              bound=over.pop("bound", 1.0), **over)


# ---------------------------------------------------------------- the auto graph and its degree
def test_auto_picks_the_complete_graph_up_to_the_threshold_and_secagg_plus_above():
    small = [f"dev{i:04d}" for i in range(AUTO_COMPLETE_MAX_MEMBERS)]
    large = small + ["dev9999"]
    assert _create(small).graph == GRAPH_COMPLETE and _create(small).degree == len(small) - 1
    config = _create(large)
    assert config.graph == GRAPH_REGULAR and config.degree == regular_degree(len(large)) < len(large) // 2
    assert resolve_graph("complete", 5000) == GRAPH_COMPLETE and resolve_graph("regular", 10) == GRAPH_REGULAR
    assert Fed3RSyncConfig(job_id="s", num_classes=2, feature_dim=2).graph == "auto"      # every job's default


@pytest.mark.parametrize("n", [129, 500, 2000, 10_000])
@pytest.mark.parametrize("dropout", [0.1, 0.2])
def test_the_default_degree_meets_the_correctness_and_security_targets(n, dropout):
    """Correctness: n · P[fewer than t' of the k+1 holders answer] <= 2^-20 (scipy's binomial
    tail); security: C(n,2) · δ^k <= 2^-40 (two dropped runs of k/2 split the ring, next test);
    and k is the smallest even degree meeting both, floored at 2⌈log2 n⌉."""
    k = regular_degree(n, dropout)
    assert k % 2 == 0 and k < n - 1
    t_share = (k + 1) // 2 + 1

    def fails_log2(degree):
        holders = degree + 1
        short = binom.cdf((degree + 1) // 2, holders, 1 - dropout)      # fewer than t' = ⌊h/2⌋+1 answer
        return max(math.log2(n) + math.log2(max(short, 1e-300)),
                   math.log2(math.comb(n, 2)) + degree * math.log2(dropout))

    assert t_share == (k + 1) // 2 + 1 and fails_log2(k) <= CORRECTNESS_LOG2 and SECURITY_LOG2 <= CORRECTNESS_LOG2
    assert math.log2(math.comb(n, 2)) + k * math.log2(dropout) <= SECURITY_LOG2
    floor = 2 * math.ceil(math.log2(n))
    assert k == floor or fails_log2(k - 2) > CORRECTNESS_LOG2



@pytest.mark.parametrize("n,dropout", [(2000, 0.45), (10_000, 0.45), (10_000, 0.49), (2000, 0.4)])
def test_high_dropouts_give_a_degree_past_a_thousand_holders_not_an_overflow(n, dropout):
    """Past 1,029 holders C(h, s) overflows a float: regular_degree raised OverflowError ("int too
    large to convert to float") for these rates, which jobs allow (expected_dropout up to 0.49), so
    such a job could not be built. Its correctness bound against scipy's binomial tail, as above:
    the degree meets it, and the next smaller one does not (or the degree is the complete graph's)."""
    from protocols.secagg.graph import EXACT_HOLDERS, binomial_below, degree_for

    k = degree_for(n, dropout)
    short = lambda degree: binom.cdf((degree + 1) // 2, degree + 1, 1 - dropout)    # noqa: E731
    assert k == n - 1 or math.log2(n) + math.log2(max(short(k), 1e-300)) <= CORRECTNESS_LOG2
    assert k - 2 < 2 or math.log2(n) + math.log2(short(k - 2)) > CORRECTNESS_LOG2
    assert regular_degree(n, dropout) >= min(k, n - 1) - 1 and regular_degree(n, dropout) % 2 == 0
    for holders in (EXACT_HOLDERS + 1, 1500, 4037):        # the logarithmic terms against scipy's tail
        t = holders // 2 + 1
        assert binomial_below(holders, t, 1 - dropout) == pytest.approx(binom.cdf(t - 1, holders, 1 - dropout),
                                                                         rel=1e-9)
    holders = EXACT_HOLDERS                                 # up to it, the terms as they always were
    assert binomial_below(holders, holders // 2 + 1, 0.6) == sum(
        math.comb(holders, s) * 0.6 ** s * 0.4 ** (holders - s) for s in range(holders // 2 + 1))

def test_the_exact_binomial_tail_is_the_sum_of_math_comb_terms_bit_for_bit():
    """Up to EXACT_HOLDERS the tail is summed term by term, C(h, s) an exact integer carried from
    one term to the next: every (h, t, keep) gives the bits of the sum of math.comb(h, s) · keep^s ·
    (1 − keep)^(h − s) for s < t, the degrees jobs draw depend on it."""
    from protocols.secagg.graph import EXACT_HOLDERS, binomial_below

    for holders in (1, 2, 3, 16, 129, 700, EXACT_HOLDERS):
        for keep in (0.0, 0.5, 0.51, 0.55, 0.9, 1.0):
            for t in {0, 1, holders // 2 + 1, holders, holders + 1}:
                want = sum(math.comb(holders, s) * keep ** s * (1.0 - keep) ** (holders - s) for s in range(t))
                assert binomial_below(holders, t, keep) == want, (holders, t, keep)


def test_the_ring_graph_splits_only_when_two_runs_of_half_the_degree_drop():
    """The premise of the security bound, checked by brute force on small rings: the survivors of
    a SecAgg+ graph are disconnected exactly when two disjoint runs of >= k/2 consecutive ring
    positions are all gone (scipy's connected components as the reference)."""
    rng = random.Random(7)
    for n, k in [(16, 4), (21, 6), (30, 8)]:
        members = [f"d{i:02d}" for i in range(n)]
        graph = NeighbourGraph.random_regular(members, k, bytes(32))
        ring = list(graph._ring)
        for _ in range(300):
            gone = set(rng.sample(ring, rng.randint(1, n - 3)))
            alive = [m for m in ring if m not in gone]
            index = {m: i for i, m in enumerate(alive)}
            edges = [(index[u], index[v]) for u in alive for v in graph.neighbours(u) if v in index]
            rows, cols = [e[0] for e in edges], [e[1] for e in edges]
            adjacency = csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(alive), len(alive)))
            components = connected_components(adjacency, directed=False)[0]
            positions = [i for i, m in enumerate(ring) if m not in gone]
            gaps = [(positions[(j + 1) % len(positions)] - positions[j] - 1) % n for j in range(len(positions))]
            assert (components > 1) == (sum(g >= k // 2 for g in gaps) >= 2), (n, k, sorted(gone))
            assert graph.parts(alive) == components, (n, k, sorted(gone))       # the count a failure names


# ---------------------------------------------------------------- 2,000 members: every message fits
def test_a_2000_member_group_with_the_default_graph_sends_only_messages_the_envelope_carries():
    """Real server and clients through RoundStart, AdvertiseKeys and KeyDirectory for all 2,000 (the
    complete graph's key directory would be about 500 KB of header), a device's EncryptedShares, and the later
    messages at their largest (every peer's share, every member a survivor and a signer), each
    encoded by the envelope's encoder."""
    n = 2000
    identities = {i.device_id: i for i in make_identities(n, prefix="dev")}
    config = _create(identities, vector_length=1000)
    assert config.graph == GRAPH_REGULAR and config.degree == regular_degree(n) and config.consistency_check
    server = ServerSecAgg(config, AGGREGATOR,
                          IdentityRegistry({d: i.public_key_bytes for d, i in identities.items()}))
    clients = {d: ClientSecAgg(i, "aggregator", AGGREGATOR.public_key_bytes, job_id="job", round_id=1,
                               group_id="g1") for d, i in identities.items()}
    largest: dict[str, int] = {}

    def sent(messages, every=1):
        """The messages, each ``every``-th encoded by the envelope's encoder (it raises past the
        limits; every member's message of one type is built by the same code from same-sized
        ids, keys and k, so a sample stands for all); the largest header of each type is kept."""
        messages = [m for m in messages if isinstance(m, Message)]
        for m in messages[::every]:
            wire = encode(to_envelope(m))
            largest[m.TYPE] = max(largest.get(m.TYPE, 0), struct.unpack_from("<I", wire, 4)[0])
        return messages

    advertised = [reply for start in sent(server.start(), 50) for reply in clients[start.recipient].handle(start)]
    directories = sent([out for up in sent(advertised, 50) for out in server.handle(up)], 10)
    assert len(directories) == n and all(len(d.neighbour_keys) == config.degree for d in directories)
    sent([r for d in directories[:3] for r in clients[d.recipient].handle(d)])
    # the later phases at their largest: a device's k shares forwarded and returned, every member a
    # survivor and a consistency signer
    me, k = config.members[0], config.degree
    peers = config.members[1: k + 1]
    everyone = config.to_bitmap(config.members)
    big = [ForwardedShares(job_id="job", round_id=1, group_id="g1", sender="aggregator", recipient=me,
                           senders=tuple(peers), ciphertexts=np.zeros((k, 100), np.uint8)).signed(AGGREGATOR),
           UnmaskRequest(job_id="job", round_id=1, group_id="g1", sender="aggregator", recipient=me,
                         survivors=everyone, dropped=np.zeros_like(everyone), consistency_signers=everyone,
                         consistency_signatures=np.zeros((n, 64), np.uint8)).signed(AGGREGATOR),
           UnmaskShares(job_id="job", round_id=1, group_id="g1", sender=me, recipient="aggregator",
                        self_mask_owners=tuple(peers[: k // 2 + 1]), key_owners=tuple(peers[k // 2 + 1:]),
                        self_mask_shares=np.zeros((k // 2 + 1, 36), np.uint8),
                        key_shares=np.zeros((k - k // 2 - 1, 36), np.uint8)).signed(identities[me])]
    sent(big)
    assert max(largest.values()) < MAX_HEADER_BYTES // 2, largest
    assert set(largest) >= {"secagg.round_start", "secagg.advertise_keys", "secagg.key_directory",
                            "secagg.encrypted_shares", "secagg.forwarded_shares", "secagg.unmask_request",
                            "secagg.unmask_shares"}


# ---------------------------------------------------------------- above the threshold: exact
def test_a_round_with_the_default_graph_above_the_auto_threshold_is_exact_with_dropouts():
    n, m = AUTO_COMPLETE_MAX_MEMBERS + 1, 6
    identities = {i.device_id: i for i in make_identities(n, prefix="dev")}
    config = _create(identities, vector_length=m, bound=50.0, consistency_check=False)
    assert config.graph == GRAPH_REGULAR
    rng = np.random.default_rng(1)
    inputs = {d: rng.uniform(-50, 50, m) for d in identities}
    dropped = random.Random(1).sample(sorted(identities), n // 10)           # the declared 10 %
    dropouts = {d: (Phase.MASKED_INPUT if i % 2 else Phase.SHARE_KEYS) for i, d in enumerate(dropped)}
    run = run_round(config, AGGREGATOR, identities, inputs, dropouts=dropouts, report_offline=True)
    assert isinstance(run.outcome, AggregateReady), run.outcome
    survivors = sorted(set(identities) - set(dropped))
    assert sorted(run.outcome.survivors) == survivors
    expected = plain_fixed_point_sum(config, [inputs[d] for d in survivors])
    np.testing.assert_array_equal(run.outcome.sum_words, expected)


# ---------------------------------------------------------------- a message that cannot be built
def test_a_key_directory_too_large_for_the_envelope_fails_the_round_once_with_its_reason(caplog):
    """The complete graph forced on 300 members: each key directory's header (about 240 bytes per
    member) exceeds 64 KiB. The job fails the round at once with that reason, tells the members to
    erase their secrets, raises nothing, and the round log entry says why."""
    n = 300
    identities = {i.device_id: i for i in make_identities(n, prefix="dev")}
    registry = IdentityRegistry({d: i.public_key_bytes for d, i in identities.items()})
    job = Fed3RSyncJob(Fed3RSyncConfig(job_id="big", num_classes=2, feature_dim=2, clients_per_round=n,
                                       max_samples=10, graph="complete"), identity=AGGREGATOR, registry=registry)
    chosen = job.next_participants(set(identities))
    round_id = job.secure.config.round_id
    clients = {d: ClientSecAgg(identities[d], "aggregator", AGGREGATOR.public_key_bytes, job_id="big",
                               round_id=round_id, group_id=f"g{round_id}") for d in chosen}
    starts = job.on_protocol_tick(0.0)
    assert len(starts) == n
    sends = []
    for device, env in starts:
        for reply in clients[device].handle(from_envelope(env)):
            sends += job.on_protocol(device, to_envelope(reply), 1.0)      # never raises
    assert job.secure is None and job.settled(round_id) == ()
    [(failed_round, reason)] = job.failed_rounds
    assert failed_round == round_id and "secagg.key_directory" in reason and str(MAX_HEADER_BYTES) in reason
    assert len(sends) == n and all(from_envelope(env).TYPE == "secagg.round_aborted" for _, env in sends)
    assert sum(r.levelname == "ERROR" for r in caplog.records) == 1             # one error, no traceback
    assert not any(r.exc_info for r in caplog.records)
    for device, env in sends:                                              # devices erase their secrets
        clients[device].handle(from_envelope(env))
    assert all(c.abort_reason is not None for c in clients.values())
    active = ActiveJob(job=job, kind="fed3r-sync", out_dir=None)
    entry = active.round_entry(RoundClosed(round_id, (), tuple(chosen), (), ()), 0.0, 1.0)
    assert entry["secure_failure"] == reason


def test_the_size_check_refuses_what_the_envelope_encoder_refuses():
    """to_envelope refuses (UnsendableMessage, an EnvelopeError) a message whose header encode()
    would refuse, and passes one well inside the limit."""
    for n_ids, fits in [(100, True), (200, True), (300, False), (1000, False)]:
        ids = tuple(f"{'peer' * 60}{i:05d}" for i in range(n_ids))            # 245-byte ids
        message = ForwardedShares(job_id="job", round_id=1, group_id="g1", sender="aggregator", recipient="dev0",
                                  senders=ids, ciphertexts=np.zeros((n_ids, 100), np.uint8)).signed(AGGREGATOR)
        header, arrays = message.to_wire()
        raw = Envelope(type=SECAGG_TYPE, sender="aggregator", body={"secagg": header}, tensors=dict(arrays))
        if fits:
            assert len(encode(raw)) > 0 and to_envelope(message).body == raw.body
        else:
            with pytest.raises(EnvelopeError, match="header too large"):
                encode(raw)
            with pytest.raises(UnsendableMessage, match="secagg.forwarded_shares to dev0"):
                to_envelope(message)


# ---------------------------------------------------------------- phase timer: no progress, not age
def group_in_the_shares_phase(phase_timeout_s: float, members: int = 5):
    """A Fed3R-Sync group of ``members`` whose keys phase closed at t = 1 (every key in): the job,
    the members' key directories (the shares phase's requests), and ``answer(device, request, now)``
    (the member's reply fed to the job; what the job sends back)."""
    ids = [f"dev{i}" for i in range(members)]
    identities = {d: DeviceIdentity.generate(d) for d in ids}
    registry = IdentityRegistry({d: i.public_key_bytes for d, i in identities.items()})
    job = Fed3RSyncJob(Fed3RSyncConfig(job_id="slow", num_classes=2, feature_dim=2, clients_per_round=members,
                                       max_samples=10, phase_timeout_s=phase_timeout_s),
                       identity=AGGREGATOR, registry=registry)
    job.next_participants(set(ids))
    round_id = job.secure.config.round_id
    clients = {d: ClientSecAgg(identities[d], "aggregator", AGGREGATOR.public_key_bytes, job_id="slow",
                               round_id=round_id, group_id=f"g{round_id}") for d in ids}

    def answer(device, request, now):
        [reply] = clients[device].handle(from_envelope(request))
        return job.on_protocol(device, to_envelope(reply), now)

    starts = dict(job.on_protocol_tick(0.0))
    directories = dict(sent for device in ids for sent in answer(device, starts[device], 1.0))
    assert job.secure.phase is Phase.SHARE_KEYS and sorted(directories) == ids
    return job, ids, directories, answer


def test_a_phase_times_out_after_phase_timeout_without_an_answer_not_after_it_opened():
    """A large group's answers keep arriving for longer than phase_timeout_s (each device computes
    and uploads in turn): the phase stays open while they come, and times out only once none has
    come for phase_timeout_s. A fixed timer would have closed it at t = 11 and made the later
    answers late. (The shares phase: the first, which holds the members' local work, has no idle
    limit: tests/test_secagg_slow_member.py.)"""
    job, ids, directories, answer = group_in_the_shares_phase(10.0)
    for i, device in enumerate(ids[:3]):                  # one answer every 6 s: 7 → 19 s
        assert answer(device, directories[device], 1.0 + 6.0 * (i + 1)) == []
        assert job.on_protocol_tick(6.0 * (i + 1) + 6.0) == []       # 12, 18, 24 s: still open
    assert job.secure.phase is Phase.SHARE_KEYS
    assert answer(ids[3], directories[ids[3]], 28.0) == []     # 27 s after it opened, 9 s after the last
    assert job.on_protocol_tick(37.0) == []                # 9 s without an answer: still waiting for dev4
    forwarded = job.on_protocol_tick(38.5)                 # 10.5 s without: it closes with the four
    assert sorted(device for device, _ in forwarded) == ids[:4]
    assert job.secure.phase is Phase.MASKED_INPUT


def test_a_member_flapping_its_presence_does_not_hold_a_phase_open():
    """A review's suspicion, confirmed: every MemberOffline restarted the phase timer, so a device
    going offline again and again kept the phase open up to the round's deadline. Only progress
    (an accepted answer, a closed phase) restarts it now."""
    job, ids, directories, answer = group_in_the_shares_phase(5.0, members=7)
    for device in ids[1:6]:                                # five of seven answer (t = 5); ids[6] stays silent
        assert answer(device, directories[device], 2.0) == []
    closed_at = None
    for t in range(3, 15):                                 # ids[0] flaps every second, never answering
        sent = job.member_offline(ids[0], float(t)) + job.on_protocol_tick(float(t))
        if sent and closed_at is None:
            closed_at, forwarded = t, sent
    assert closed_at == 8                                  # more than 5 s after the last progress (t = 2)
    assert sorted(device for device, _ in forwarded) == ids[1:6]


# ---------------------------------------------------------------- consistency signatures checked once per process
def test_a_cached_consistency_check_refuses_what_ed25519_refuses():
    """The cached check answers as verify_signature does, for the valid triple and for each byte
    changed, whichever was asked first."""
    from protocols.identity import InvalidSignature, verify_signature
    from protocols.secagg.client import consistency_signature_valid

    signer, other = DeviceIdentity.generate("s"), DeviceIdentity.generate("o")
    statement = b"fedfleet/secagg/consistency" + bytes(range(40))
    signature = signer.sign(statement)
    forged = bytes([signature[0] ^ 1]) + signature[1:]
    cases = [(signer.public_key_bytes, statement, signature), (signer.public_key_bytes, statement, forged),
             (signer.public_key_bytes, statement + b"\x00", signature), (other.public_key_bytes, statement, signature)]
    for _ in range(2):                                            # uncached, then cached
        for key, data, sig in cases:
            try:
                verify_signature(key, data, sig)
                expected = True
            except InvalidSignature:
                expected = False
            assert consistency_signature_valid(key, data, sig) is expected
    assert [consistency_signature_valid(*c) for c in cases] == [True, False, False, False]


def test_a_group_in_one_process_verifies_each_consistency_signature_once():
    """20 clients in one process each check t of the same signatures: 20 verifications, not 20·t;
    the round's sum is exact."""
    from protocols.secagg.client import consistency_signature_valid

    n, m = 20, 4
    identities = {i.device_id: i for i in make_identities(n, prefix="cc")}
    config = _create(identities, vector_length=m, bound=10.0, consistency_check=True)
    inputs = {d: np.random.default_rng(i).uniform(-10, 10, m) for i, d in enumerate(identities)}
    consistency_signature_valid.cache_clear()
    run = run_round(config, AGGREGATOR, identities, inputs)
    assert isinstance(run.outcome, AggregateReady), run.outcome
    np.testing.assert_array_equal(run.outcome.sum_words, plain_fixed_point_sum(config, list(inputs.values())))
    info = consistency_signature_valid.cache_info()
    assert info.misses <= n and info.hits + info.misses >= n * config.threshold


# ---------------------------------------------------------------- what a process hosting many members does once
def test_a_group_in_one_process_checks_each_advertisement_and_builds_its_graph_once():
    """24 members of a SecAgg+ group (degree 6) in one process: each member's signed key
    advertisement is verified once, not once per neighbour, and the graph is built once; the sum
    is exact. The cached check refuses keys or a signer other than the advertisement's
    (a client refusing such a directory entry: test_secagg_advertised_keys.py)."""
    from protocols.secagg.client import advertisement_valid
    from protocols.secagg.derivation import RoundContext
    from protocols.secagg.graph import _random_regular
    from protocols.secagg.messages import AdvertiseKeys

    n, m = 24, 4
    identities = {i.device_id: i for i in make_identities(n, prefix="ad")}
    config = _create(identities, vector_length=m, bound=10.0, graph=GRAPH_REGULAR, degree=6)
    inputs = {d: np.random.default_rng(i).uniform(-10, 10, m) for i, d in enumerate(identities)}
    advertisement_valid.cache_clear()
    _random_regular.cache_clear()
    run = run_round(config, AGGREGATOR, identities, inputs)
    assert isinstance(run.outcome, AggregateReady), run.outcome
    np.testing.assert_array_equal(run.outcome.sum_words, plain_fixed_point_sum(config, list(inputs.values())))
    checks = advertisement_valid.cache_info()
    assert checks.misses == n and checks.hits == n * config.degree - n
    assert _random_regular.cache_info().misses == 1

    signer = identities[config.members[0]]
    cipher, mask = bytes(range(32)), bytes(range(1, 33))
    context = RoundContext("job", 1, "g1")
    signature = AdvertiseKeys(job_id="job", round_id=1, group_id="g1", sender=signer.device_id,
                              recipient="aggregator", cipher_public_key=cipher,
                              mask_public_key=mask).signed(signer).signature
    args = (context, signer.device_id, "aggregator", cipher, mask, signature, signer.public_key_bytes)
    assert advertisement_valid(*args) and advertisement_valid(*args)         # uncached, then cached
    assert not advertisement_valid(context, signer.device_id, "aggregator", mask, cipher, signature,
                                   signer.public_key_bytes)
    assert not advertisement_valid(context, signer.device_id, "aggregator", cipher, mask, signature,
                                   identities[config.members[1]].public_key_bytes)
