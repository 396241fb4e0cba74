"""A round that can no longer unmask fails as soon as the phase that doomed it closes, with why.

SecAgg+ (the sparse ring graph): dropouts can split the survivors' graph (every honest member then
refuses to unmask, so the server used to wait out the next phase's timeout for answers that never
come), or leave some secret with fewer than t' live holders of its shares (the server used to ask
everyone for their shares and fail only at the reconstruction). The complete graph: share rows its
holders could not decrypt leave the owner's secret as short. Real rounds through the wire form with
members reported offline (``report_offline``), so a phase timeout is only ever fed when the server
waits for answers that cannot come; and through a job's adapter on a fake clock.

The references are independent of the server's new check: scipy's connected components for the
split, and the live share holders counted here from the graph's neighbour lists."""


import numpy as np
import pytest
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import connected_components

from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob
from protocols.identity import DeviceIdentity, IdentityRegistry
from protocols.payloads.secagg import from_envelope, to_envelope
from protocols.secagg import (AggregateReady, ClientSecAgg, Phase, RoundConfig,
                              RoundFailed)
from protocols.secagg.driver import make_identities, plain_fixed_point_sum, run_round

from secagg_rounds import corrupting

AGGREGATOR = DeviceIdentity.generate("aggregator")
BOUND = 10.0


def _regular_round(consistency_check, n=12, degree=4, threshold=7, job_id="job", round_id=1):
    identities = {i.device_id: i for i in make_identities(n)}
    config = RoundConfig.create(job_id=job_id, round_id=round_id, group_id=f"g{round_id}", aggregator_id="aggregator",
                                members=list(identities), vector_length=16, bound=BOUND, graph="regular",
                                degree=degree, threshold=threshold, consistency_check=consistency_check)
    assert config.share_threshold == 3                  # a strict majority of the 5 holders of a neighbourhood
    rng = np.random.default_rng(n)
    return config, identities, {d: rng.uniform(-BOUND, BOUND, 16) for d in identities}


def _ring_positions(config, offsets):
    """Members at ``offsets`` along the graph's ring from its first member."""
    ring = list(config.neighbour_graph(config.members)._ring)
    return [ring[offset % len(ring)] for offset in offsets]


def _parts(graph, alive):
    """Connected components of the survivors' induced subgraph (scipy, not the ring rule)."""
    alive = sorted(alive)
    index = {m: i for i, m in enumerate(alive)}
    edges = [(index[u], index[v]) for u in alive for v in graph.neighbours(u) if v in index]
    adjacency = csr_matrix((np.ones(len(edges)), ([e[0] for e in edges], [e[1] for e in edges])),
                           shape=(len(alive), len(alive)))
    return connected_components(adjacency, directed=False)[0]


def _live_holders(graph, survivors, dropped, responders):
    """Owner -> how many of ``responders`` hold a share of the secret the unmasking needs of it:
    b_u of each survivor (its neighbours and itself hold shares), s_v of each dropped member with a
    surviving neighbour (its neighbours hold them)."""
    counts = {u: len((graph.neighbours(u) | {u}) & set(responders)) for u in survivors}
    counts.update({v: len(graph.neighbours(v) & set(responders)) for v in dropped
                   if graph.neighbours(v) & set(survivors)})
    return counts


def _nothing_revealed(run):
    """No member was asked for (so revealed) a share of anyone's secrets."""
    return all(client.revealed == {} for client in run.clients.values())


@pytest.mark.parametrize("consistency_check", [True, False])
def test_a_split_survivor_graph_fails_the_round_when_the_masked_phase_closes(consistency_check):
    """Two runs of k/2 = 2 ring neighbours drop before their masked input: the survivors fall into two
    parts (every member would refuse to unmask them). The round fails as the masked phase closes,
    saying so, without a phase timeout; before, the server asked the survivors to sign or unmask,
    each refused, and the round failed only at the next phase's Timeout."""
    config, identities, inputs = _regular_round(consistency_check)
    gone = _ring_positions(config, [3, 4, 8, 9])
    dropouts = {d: Phase.MASKED_INPUT for d in gone}
    survivors = [d for d in config.members if d not in gone]
    graph = config.neighbour_graph(config.members)
    assert _parts(graph, survivors) == 2 and len(survivors) >= config.threshold
    assert min(_live_holders(graph, survivors, gone, survivors).values()) >= config.share_threshold   # only the split
    run = run_round(config, AGGREGATOR, identities, inputs, dropouts=dropouts, report_offline=True)
    assert isinstance(run.outcome, RoundFailed), run.outcome
    assert run.timeouts == 0, "the server waited out a phase timeout for a round that could not finish"
    assert run.outcome.phase is Phase.MASKED_INPUT
    assert "falls apart into 2 parts" in run.outcome.reason
    assert _nothing_revealed(run)


@pytest.mark.parametrize("consistency_check", [True, False])
def test_a_secret_with_fewer_live_holders_than_the_share_threshold_fails_the_round_at_once(consistency_check):
    """Three of one member's four neighbours drop before their masked input (one long run: the graph
    stays connected): its self-mask seed has 2 live holders, fewer than t' = 3. The round fails as
    the masked phase closes, naming the smallest count and t'; before, the survivors were asked for
    their shares and the round failed at the reconstruction."""
    config, identities, inputs = _regular_round(consistency_check)
    gone = _ring_positions(config, [-2, -1, 1])
    dropouts = {d: Phase.MASKED_INPUT for d in gone}
    survivors = [d for d in config.members if d not in gone]
    graph = config.neighbour_graph(config.members)
    assert _parts(graph, survivors) == 1
    counts = _live_holders(graph, survivors, gone, survivors)
    smallest = min(counts.values())
    assert smallest == 2 < config.share_threshold
    run = run_round(config, AGGREGATOR, identities, inputs, dropouts=dropouts, report_offline=True)
    assert isinstance(run.outcome, RoundFailed), run.outcome
    assert run.outcome.phase is Phase.MASKED_INPUT and run.timeouts == 0
    reason = run.outcome.reason
    assert f"{smallest} live share holders < share threshold {config.share_threshold}" in reason, reason
    assert any(f"{owner!r}" in reason for owner, count in counts.items() if count == smallest), reason
    assert _nothing_revealed(run)


def test_signers_too_few_for_a_neighbourhood_fail_the_round_when_the_consistency_phase_closes():
    """Everyone sends its masked input, then three of one member's neighbours do not sign U3: the
    unmasking would go to the signers only, 2 of the member's holders. The round fails as the
    consistency phase closes; before, the signers were asked for their shares."""
    config, identities, inputs = _regular_round(True)
    gone = _ring_positions(config, [-2, -1, 1])
    dropouts = {d: Phase.CONSISTENCY_CHECK for d in gone}
    graph = config.neighbour_graph(config.members)
    signers = [d for d in config.members if d not in gone]
    assert min(_live_holders(graph, config.members, (), signers).values()) == 2
    run = run_round(config, AGGREGATOR, identities, inputs, dropouts=dropouts, report_offline=True)
    assert isinstance(run.outcome, RoundFailed), run.outcome
    assert run.outcome.phase is Phase.CONSISTENCY_CHECK and run.timeouts == 0
    assert "2 live share holders < share threshold 3" in run.outcome.reason
    assert _nothing_revealed(run)


def test_dropouts_a_neighbourhood_can_spare_still_give_the_exact_sum():
    """One run of k/2 dropped: connected, every secret with t' live holders: the sum of the
    survivors, exactly (the check fails no round that can finish)."""
    config, identities, inputs = _regular_round(True)
    gone = _ring_positions(config, [3, 4])
    run = run_round(config, AGGREGATOR, identities, inputs, dropouts={d: Phase.MASKED_INPUT for d in gone},
                    report_offline=True)
    survivors = [d for d in config.members if d not in gone]
    assert isinstance(run.outcome, AggregateReady) and run.timeouts == 0 and run.errors == []
    assert np.array_equal(run.outcome.sum_words, plain_fixed_point_sum(config, [inputs[d] for d in survivors]))


def test_complete_graph_rows_its_holders_could_not_decrypt_fail_the_round_when_the_masked_phase_closes():
    """Complete graph of 5, t = t' = 4: one member's rows to two others do not decrypt (two accusers
    of four: no culprit). Its seed has 3 holders, fewer than 4: the round fails as the masked phase
    closes, naming it; before, everyone was asked for its shares and the reconstruction failed."""
    identities = {i.device_id: i for i in make_identities(5)}
    config = RoundConfig.create(job_id="j", round_id=1, group_id="g", aggregator_id="aggregator",
                                members=list(identities), vector_length=16, bound=BOUND, graph="complete")
    assert config.threshold == config.share_threshold == 4
    owner, victims = config.members[0], config.members[1:3]
    inputs = {d: np.full(16, 1.0) for d in identities}
    run = run_round(config, AGGREGATOR, identities, inputs, intercept=corrupting(identities, owner, victims),
                    report_offline=True)
    assert run.server.culprits == set()
    assert isinstance(run.outcome, RoundFailed), run.outcome
    assert run.outcome.phase is Phase.MASKED_INPUT and run.timeouts == 0
    assert f"{owner!r}" in run.outcome.reason and "3 live share holders < share threshold 4" in run.outcome.reason
    assert _nothing_revealed(run)


def test_the_job_fails_a_split_round_at_the_close_of_its_masked_phase_not_a_phase_timeout_later():
    """Through a job's adapter on a fake clock (phase_timeout_s = 10 s): the four members that split
    the graph go offline after sharing their keys; the round fails at t = 3 s, when the last masked
    input closes the phase, with the split as its reason; before, it failed only at t >= 13 s, when
    the consistency phase timed out."""
    ids = [f"dev{i:02d}" for i in range(12)]
    identities = {d: DeviceIdentity.generate(d) for d in ids}
    registry = IdentityRegistry({d: i.public_key_bytes for d, i in identities.items()})
    job = Fed3RSyncJob(Fed3RSyncConfig(job_id="split", num_classes=2, feature_dim=2, clients_per_round=12,
                                       max_samples=10, phase_timeout_s=10.0), identity=AGGREGATOR, registry=registry)
    config = RoundConfig.create(job_id="split", round_id=1, group_id="g1", aggregator_id="aggregator", members=ids,
                                vector_length=8, bound=BOUND, graph="regular", degree=4, threshold=7)
    job.host_group(config)
    gone = set(_ring_positions(config, [3, 4, 8, 9]))
    clients = {d: ClientSecAgg(identities[d], "aggregator", AGGREGATOR.public_key_bytes, job_id="split",
                               round_id=1, group_id="g1") for d in ids}
    for device, client in clients.items():
        client.provide_input(np.full(8, 1.0))
    outbox = job.on_protocol_tick(0.0)
    now = 0.0
    while outbox and not job.failed_rounds:
        now += 1.0
        replies = []
        for device, env in outbox:
            message = from_envelope(env)
            if device in gone and message.TYPE == "secagg.forwarded_shares":
                continue                               # shared its keys, then went away
            try:
                replies.extend((device, r) for r in clients[device].handle(message))
            except Exception:
                pass                                   # a member that refuses aborts: it sends nothing
        outbox = []
        for device in sorted(gone):
            outbox += job.member_offline(device, now) if now == 3.0 else []
        for device, reply in replies:
            outbox += job.on_protocol(device, to_envelope(reply), now)
        outbox += job.on_protocol_tick(now)
    for later in (5.0, 9.0, 12.0, 14.0):
        if job.failed_rounds:
            break
        job.on_protocol_tick(later)
        now = later
    [(round_id, reason)] = job.failed_rounds
    assert now == 3.0, f"the round failed at t = {now} s ({reason}), not when its masked phase closed"
    assert round_id == 1 and "falls apart into 2 parts" in reason, reason
