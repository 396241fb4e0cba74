"""A member that advertises a public key another member of the round advertised first.

The key directory would hand the copy to the owner's neighbours, and the owner (whose own cipher
key comes back to it as a neighbour's) aborts the round and erases its secrets: one enrolled
member could stop any honest peer's round. The server refuses the copy instead: the copier is a
dropout of the round, with its reason kept (``ServerSecAgg.refused``, the round log's
``secure_refused``), and the round sums everyone else exactly."""

from __future__ import annotations

import numpy as np
import pytest

from protocols.secagg import AggregateReady, ClientState, Phase, ReplayedMessage, ServerState, UnexpectedMessage
from secagg_rounds import Round, resign, wire


def _copying(r: Round, copier: str, owner: str, which: str):
    """The round's adverts, ``copier``'s carrying ``owner``'s ``which`` key (validly signed by the copier)."""
    adverts = {m.sender: m for m in r.to_clients()}
    field = f"{which}_public_key"
    adverts[copier] = wire(resign(adverts[copier], r.identities[copier], **{field: getattr(adverts[owner], field)}))
    return adverts


@pytest.mark.parametrize("which", ["cipher", "mask"])
def test_a_copied_key_is_refused_and_the_round_sums_the_others_exactly(which):
    r = Round(n=6)
    owner, copier = sorted(r.identities)[1], sorted(r.identities)[4]
    adverts = _copying(r, copier, owner, which)
    r.to_server([adverts[d] for d in sorted(adverts)])          # the owner's first, the copy after it
    assert r.server.state is ServerState.WAIT_SHARES            # not held for the copier: it is out
    assert copier not in r.server.participants(Phase.ADVERTISE_KEYS)
    outcome = r.finish()                # before the fix: the owner's client aborts (ProtocolViolation)
    assert isinstance(outcome, AggregateReady), outcome
    survivors = sorted(set(r.identities) - {copier})
    assert sorted(outcome.survivors) == survivors
    np.testing.assert_array_equal(outcome.sum_words, r.expected_sum(survivors))
    assert r.clients[owner].state is ClientState.FINISHED      # the owner's secrets served the round
    assert copier in r.server.refused and owner in r.server.refused[copier]
    assert which in r.server.refused[copier]


def test_a_refused_member_stays_out_even_with_fresh_keys():
    r = Round(n=6)
    owner, copier = sorted(r.identities)[0], sorted(r.identities)[2]
    adverts = _copying(r, copier, owner, "cipher")
    r.to_server([adverts[owner], adverts[copier]])
    retry = wire(resign(adverts[copier], r.identities[copier], cipher_public_key=bytes(range(1, 33))))
    with pytest.raises(UnexpectedMessage, match="refused"):
        r.server.handle(retry)
    assert copier not in r.server.participants(Phase.ADVERTISE_KEYS)


def test_a_replayed_advert_is_still_a_replay_not_a_copy():
    """A member's own advert sent twice names keys it owns: refused as a replay, nothing recorded."""
    r = Round(n=5)
    adverts = r.to_clients()
    r.to_server(adverts[:1])
    with pytest.raises(ReplayedMessage):
        r.server.handle(adverts[0])
    assert r.server.refused == {}


def test_the_round_log_names_the_refused_member_and_why():
    """Through the aggregator's secure job: the copier is out of the sum and the round's log entry
    says why (``secure_refused``)."""
    from aggregator.service.active_job import ActiveJob
    from protocols.payloads.secagg import from_envelope, to_envelope
    from protocols.rounds import RoundClosed
    from test_secagg_upload_window import _answer, _group

    job, clients, stats = _group(upload_window_bytes=2**30, n=8)
    devices = sorted(clients)
    owner, copier = devices[2], devices[5]
    adverts = {}
    for device, env in job.on_protocol_tick(0.0):
        [advert] = clients[device].handle(from_envelope(env))
        adverts[device] = advert
    copy = resign(adverts[copier], clients[copier].identity, cipher_public_key=adverts[owner].cipher_public_key)
    sends = []
    for device in devices:
        sends += job.on_protocol(device, to_envelope(copy if device == copier else adverts[device]), 1.0)
    assert sends, "the key directories go out without waiting for the copier"
    while sends:
        sends = _answer(job, {d: c for d, c in clients.items() if d != copier}, sends, 2.0)
    survivors = sorted(set(devices) - {copier})
    assert sorted(job.settled(1)) == survivors
    np.testing.assert_allclose(job.strategy.packed_upper(), sum(stats[d][0] for d in survivors), atol=1e-6)
    entry = ActiveJob(job=job, kind="fed3r-sync", out_dir=None).round_entry(
        RoundClosed(1, tuple(survivors), (copier,), (), ()), 0.0, 3.0)
    assert set(entry["secure_refused"]) == {copier}
    assert owner in entry["secure_refused"][copier]
