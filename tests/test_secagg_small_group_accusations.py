"""Accusations in small groups: a pair of colluding members can name nobody a culprit.

A culprit is left out of its job's later rounds for good, on accusations the server cannot check
(a row's key would open every row its recipient holds). A bare majority of an honest member's
recipients was enough: in a group of 4, two colluders are 2 of its 3. Naming now also takes at
least three distinct accusers (both, in a group of three); a device whose rows really fail is still
named where three of its recipients say so, or both of its two. The reference is the accusers each test makes, counted here."""


import numpy as np

from protocols.identity import DeviceIdentity
from protocols.secagg import AggregateReady, MaskedInput, RoundConfig, RoundFailed, ShareAccusation
from protocols.secagg.driver import make_identities, plain_fixed_point_sum, run_round

from secagg_rounds import corrupting

AGGREGATOR = DeviceIdentity.generate("aggregator")


def _group(n):
    identities = {i.device_id: i for i in make_identities(n)}
    config = RoundConfig.create(job_id="j", round_id=1, group_id="g", aggregator_id="aggregator",
                                members=list(identities), vector_length=8, bound=10.0, graph="complete")
    return config, identities, {d: np.full(8, float(i)) for i, d in enumerate(config.members)}


def _liars_accuse(identities, liars, honest):
    """An intercept: each liar sends a signed ShareAccusation of ``honest`` (whose row it decrypted
    fine, so it goes on holding its shares) just before its masked input."""
    def lie(message):
        if isinstance(message, MaskedInput) and message.sender in liars:
            accusation = ShareAccusation(job_id=message.job_id, round_id=message.round_id, group_id=message.group_id,
                                         sender=message.sender, recipient="aggregator", accused=(honest,))
            return [accusation.signed(identities[message.sender]), message]
        return [message]
    return lie


def test_two_colluders_in_a_group_of_four_cannot_name_an_honest_member():
    """Two members of four accuse the third honest one (2 of its 3 recipients, a majority): it is not
    a culprit. The round itself fails (the liars hold, by their word, none of its shares, and could
    withhold them anyway), naming nobody."""
    config, identities, inputs = _group(4)
    honest, liars = config.members[0], config.members[1:3]
    run = run_round(config, AGGREGATOR, identities, inputs, intercept=_liars_accuse(identities, liars, honest))
    server = run.server
    assert run.errors == [] and len(server._accusations) == 2 and 2 * 2 > len(config.members) - 1
    assert server.culprits == set(), "two colluders named an honest member a culprit"
    assert isinstance(server.outcome, RoundFailed) and "could not decrypt" not in server.outcome.reason


def test_two_colluders_in_a_group_of_six_name_nobody_and_the_sum_is_exact():
    """Two accusers of five recipients were never a majority; the sum is everyone's, exactly."""
    config, identities, inputs = _group(6)
    honest, liars = config.members[0], config.members[1:3]
    run = run_round(config, AGGREGATOR, identities, inputs, intercept=_liars_accuse(identities, liars, honest))
    server = run.server
    assert run.errors == [] and server.culprits == set() and isinstance(server.outcome, AggregateReady)
    assert np.array_equal(server.outcome.sum_words, plain_fixed_point_sum(config, list(inputs.values())))


def test_a_member_whose_rows_all_fail_in_a_group_of_four_is_still_named():
    """All three recipients accuse it: three distinct accusers, a majority: a culprit."""
    config, identities, inputs = _group(4)
    attacker = config.members[0]
    run = run_round(config, AGGREGATOR, identities, inputs, intercept=corrupting(identities, attacker))
    assert all(run.clients[d].accused == (attacker,) for d in config.members[1:])
    assert run.server.culprits == {attacker} and isinstance(run.outcome, RoundFailed)
    assert f"could not decrypt: {attacker}" in run.outcome.reason


def test_in_a_group_of_three_both_recipients_accusing_name_the_sender():
    """Two accusers are all a member of a group of three has: both name it (three would leave a
    sender of bad rows unnamed, failing every round it is drawn into; two members of three learn
    the third's input from the sum anyway, so framing it costs it nothing the group protected)."""
    config, identities, inputs = _group(3)
    attacker = config.members[0]
    run = run_round(config, AGGREGATOR, identities, inputs, intercept=corrupting(identities, attacker))
    assert all(run.clients[d].accused == (attacker,) for d in config.members[1:])
    assert run.server.culprits == {attacker} and isinstance(run.outcome, RoundFailed)


def test_in_a_group_of_three_one_accuser_names_nobody():
    """One accusation of a group of three is no majority: nobody is named, and the liar's round
    goes on without the row it withholds."""
    config, identities, inputs = _group(3)
    liar, honest = config.members[1], config.members[0]
    run = run_round(config, AGGREGATOR, identities, inputs, intercept=_liars_accuse(identities, {liar}, honest))
    assert run.server.culprits == set()
