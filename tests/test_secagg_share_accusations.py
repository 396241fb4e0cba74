"""Share rows that do not decrypt, and the accusations they cause: a victim accuses the member whose
row it cannot open and stays in the sum; a member whose rows all fail is named a culprit and fails
one round; false, repeated or malformed accusations name nobody and change nothing."""

import numpy as np
import pytest

from protocols.secagg import (AggregateReady, ClientState, EncryptedShares, MalformedMessage, Phase, ReplayedMessage,
                              RoundConfig, RoundFailed, ServerState, ShareAccusation, Timeout, UnexpectedMessage)
from protocols.secagg.driver import make_identities, plain_fixed_point_sum, run_round

from secagg_rounds import AGGREGATOR, BOUND, Round, corrupting, rejects, resign, wire


def _eight_members():
    identities = {i.device_id: i for i in make_identities(8)}
    config = RoundConfig.create(job_id="j", round_id=1, group_id="g", aggregator_id="aggregator",
                                members=list(identities), vector_length=100, bound=BOUND)
    return identities, config, {d: np.full(100, float(i)) for i, d in enumerate(config.members)}


def test_a_share_row_that_does_not_decrypt_is_accused_and_its_recipient_stays_in_the_sum():
    """The victim cannot decrypt the attacker's row: it accuses the attacker (ShareAccusation) and
    goes on without those shares; the other holders cover them at the unmasking, and the sum is
    everyone's, the victim's included. One accuser of seven names nobody."""
    identities, config, inputs = _eight_members()
    attacker, victim = config.members[0], config.members[1]
    run = run_round(config, AGGREGATOR, identities, inputs, intercept=corrupting(identities, attacker, [victim]))
    assert run.errors == [] and run.clients[victim].accused == (attacker,)
    assert run.clients[victim].state is ClientState.FINISHED and attacker not in run.clients[victim].revealed
    assert run.server.culprits == set()
    assert isinstance(run.outcome, AggregateReady) and run.outcome.survivors == tuple(config.members)
    assert np.array_equal(run.outcome.sum_words, plain_fixed_point_sum(config, list(inputs.values())))


def test_a_member_whose_rows_all_fail_fails_one_round_and_is_named():
    """Complete graph, every row of the attacker bad: all seven others accuse it, so it is a
    culprit (which the job leaves out of its next rounds); nobody else holds a share of its
    self-mask seed, so the round fails as the masked phase closes (no member is asked for shares
    it cannot use), its reason naming the attacker."""
    identities, config, inputs = _eight_members()
    attacker = config.members[0]
    run = run_round(config, AGGREGATOR, identities, inputs,
                    intercept=corrupting(identities, attacker, config.members[1:]))
    assert run.errors == [] and run.server.culprits == {attacker}
    assert all(run.clients[d].accused == (attacker,) for d in config.members[1:])
    assert isinstance(run.outcome, RoundFailed) and run.timeouts == 0
    assert run.outcome.phase is Phase.MASKED_INPUT and f"could not decrypt: {attacker}" in run.outcome.reason
    assert f"self-mask seed of {attacker!r} has 1 live share holders" in run.outcome.reason
    assert all(client.revealed == {} for client in run.clients.values())


def _accusation(r, accuser, *accused):
    from protocols.secagg import ShareAccusation
    return wire(ShareAccusation(job_id="job", round_id=3, group_id="g", sender=accuser, recipient="aggregator",
                                accused=accused).signed(r.identities[accuser]))


def test_a_minority_of_false_accusers_names_nobody_and_the_sum_is_exact():
    """Two members accuse an honest neighbour of five: no majority, no culprit, and the round's
    sum is everyone's (accusing costs the accusers nothing but changes nothing either)."""
    r = Round(n=6)
    r.step()
    r.step()                                        # the forwarded shares are out
    honest, liars = r.config.members[2], r.config.members[:2]
    for liar in liars:
        assert r.server.handle(_accusation(r, liar, honest)) == []
    outcome = r.finish()
    assert r.server.culprits == set()
    assert isinstance(outcome, AggregateReady) and outcome.survivors == tuple(r.config.members)
    assert np.array_equal(outcome.sum_words, r.expected_sum(r.config.members))


def test_accusations_count_when_the_callers_deadline_ends_the_masked_phase():
    """Every row of the attacker bad, the five others accuse it, and it withholds its masked input
    so that the phase waits: the job's deadline (``abort``) ends the round, and the attacker is
    named all the same (the accusations used to count only when the phase closed)."""
    r = Round(n=6)
    attacker = r.config.members[0]
    r.step()
    shares = [wire(resign(m, r.identities[attacker], ciphertexts=_flipped(m.ciphertexts)))
              if isinstance(m, EncryptedShares) and m.sender == attacker else m for m in r.to_clients()]
    r.to_server(shares)
    masked = r.to_clients([m for m in r.pending if m.recipient != attacker])     # the attacker stays silent
    assert sum(m.TYPE == "secagg.share_accusation" for m in masked) == 5
    r.to_server(masked)
    assert r.server.state is ServerState.WAIT_MASKED
    [failed] = [o for o in r.server.abort("deadline") if isinstance(o, RoundFailed)]
    assert r.server.culprits == {attacker} and attacker in failed.reason


def test_one_accuser_counts_once_however_often_it_names_a_device():
    """An accusation naming the same device five times (the wire refuses duplicates; the machine
    does not rely on that) counts once: one liar of five neighbours names nobody."""
    from protocols.secagg import ShareAccusation
    r = Round(n=6)
    r.step()
    r.step()
    liar, honest = r.config.members[:2]
    r.server.handle(ShareAccusation(job_id="job", round_id=3, group_id="g", sender=liar, recipient="aggregator",
                                    accused=(honest,) * 5).signed(r.identities[liar]))
    assert isinstance(r.finish(), AggregateReady) and r.server.culprits == set()


def _flipped(ciphertexts):
    flipped = ciphertexts.copy()
    flipped[:, 20] ^= 0xFF
    return flipped


def test_a_bad_accusation_is_refused_and_changes_nothing():
    r = Round(n=6)
    r.step()
    r.step()
    first, second = r.config.members[:2]
    rejects(r.server, _accusation(r, first, "stranger"), MalformedMessage)
    rejects(r.server, _accusation(r, first, first), MalformedMessage)           # its own rows
    rejects(r.server, _accusation(r, first), MalformedMessage)                  # nobody
    assert r.server.handle(_accusation(r, first, second)) == []
    rejects(r.server, _accusation(r, first, second), ReplayedMessage)
    masked = r.to_clients()
    r.to_server([m for m in masked if m.sender == second])
    rejects(r.server, _accusation(r, second, first), UnexpectedMessage)        # after its masked input
    assert r.server.culprits == set()


@pytest.mark.parametrize("graph", ["complete", "regular"])
def test_an_accusation_from_a_member_outside_the_key_directory_is_refused(graph):
    """A member that never advertised keys (so is in no neighbour graph) sends a validly signed
    ShareAccusation while the masked phase is open: refused, nothing changes, and the round sums
    the others. It used to look the member up in the graph first and raise KeyError, which the
    aggregator does not catch (a traceback per message, from any enrolled member)."""
    r = Round(n=8, graph=graph)
    absent, honest = r.config.members[-1], r.config.members[0]
    r.to_server([m for m in r.to_clients() if m.sender != absent])
    r.to_server([Timeout(Phase.ADVERTISE_KEYS)])            # U1 without the absent member
    r.step()                                                # the forwarded shares are out
    assert r.server.state is ServerState.WAIT_MASKED
    rejects(r.server, _accusation(r, absent, honest), UnexpectedMessage)
    outcome = r.finish()
    survivors = [d for d in r.config.members if d != absent]
    assert isinstance(outcome, AggregateReady) and list(outcome.survivors) == survivors
    assert np.array_equal(outcome.sum_words, r.expected_sum(survivors)) and r.server.culprits == set()


def test_the_job_refuses_an_accusation_from_outside_the_key_directory_as_one_envelope_error():
    """Through the aggregator's secure job (what the service calls for every secagg message): one
    EnvelopeError, which the service logs as a refusal, and the round goes on."""
    from protocols.envelope import EnvelopeError
    from protocols.payloads.secagg import from_envelope, to_envelope
    from test_secagg_upload_window import _answer, _group

    job, clients, _ = _group(upload_window_bytes=2**30, n=6)
    absent = sorted(clients)[-1]
    sends = [(d, env) for d, env in job.on_protocol_tick(0.0) if d != absent]
    directories = _answer(job, clients, sends)
    directories += job.on_protocol_tick(10**6)              # the keys phase times out without it
    forwarded = _answer(job, clients, [(d, e) for d, e in directories
                                       if from_envelope(e).TYPE == "secagg.key_directory"])
    assert job.secure.state is ServerState.WAIT_MASKED and forwarded
    accusation = ShareAccusation(job_id="paced", round_id=job.secure.config.round_id,
                                 group_id=job.secure.config.group_id, sender=absent, recipient="aggregator",
                                 accused=(sorted(clients)[0],)).signed(clients[absent].identity)
    with pytest.raises(EnvelopeError, match="UnexpectedMessage"):
        job.on_protocol(absent, to_envelope(accusation), 1.0)
    assert job.secure.state is ServerState.WAIT_MASKED
