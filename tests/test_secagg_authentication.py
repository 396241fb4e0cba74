"""Hostile messages to the SecAgg state machines that fail authentication: forged, missing and
impersonated signatures, unknown senders, the wrong job / round / group / recipient, replayed,
reordered and late messages. Each must raise a specific SecAggError with nothing applied: the
state is unchanged and the final sum, when there is one, is still exact."""

import dataclasses

import numpy as np
import pytest

from protocols.identity import DeviceIdentity, IdentityRegistry, InvalidSignature
from protocols.secagg import (AggregateReady, BadSignature, ClientState, ConsistencySignature, Phase, ReplayedMessage,
                              SecAggError, ServerState, Timeout, UnexpectedMessage, UnknownSender, UnmaskRequest,
                              WrongContext, decode)
from protocols.secagg.errors import ConfigError, LateMessage
from protocols.secagg.server import ServerSecAgg

from secagg_rounds import AGGREGATOR, Round, rejects, resign, wire


def test_forged_missing_and_impersonated_signatures_are_rejected():
    r = Round()
    adverts = r.to_clients()
    first = adverts[0]
    flipped = dataclasses.replace(first, signature=bytes([first.signature[0] ^ 1]) + first.signature[1:])
    rejects(r.server, flipped, BadSignature)
    rejects(r.server, dataclasses.replace(first, signature=b""), BadSignature)
    impostor = r.identities[adverts[1].sender]
    rejects(r.server, resign(first, impostor), BadSignature)
    header, arrays = first.to_wire()
    header["signature"] = ""
    rejects(r.server, decode(header, arrays), BadSignature)
    assert issubclass(BadSignature, InvalidSignature) and issubclass(BadSignature, SecAggError)
    r.to_server(adverts)  # the genuine messages still work
    assert r.server.state is ServerState.WAIT_SHARES


def test_unknown_and_unenrolled_senders():
    r = Round()
    adverts = r.to_clients()
    outsider = DeviceIdentity.generate("outsider")
    rejects(r.server, resign(adverts[0], outsider, sender="outsider"), UnknownSender)
    registry = IdentityRegistry({d: i.public_key_bytes for d, i in list(r.identities.items())[1:]})
    with pytest.raises(ConfigError):
        ServerSecAgg(r.config, AGGREGATOR, registry)


@pytest.mark.parametrize("field,value", [("job_id", "other-job"), ("round_id", 2), ("group_id", "g2"),
                                         ("recipient", "someone-else")])
def test_wrong_context_is_rejected_even_when_properly_signed(field, value):
    r = Round()
    first = r.to_clients()[0]
    rejects(r.server, resign(first, r.identities[first.sender], **{field: value}), WrongContext)


def test_client_rejects_server_messages_with_wrong_context_or_signature():
    r = Round()
    start = r.pending[0]
    client = r.clients[start.recipient]
    other_server = DeviceIdentity.generate("aggregator")
    for bad, error in [(resign(start, AGGREGATOR, round_id=4), WrongContext),
                       (resign(start, AGGREGATOR, recipient=r.pending[1].recipient), WrongContext),
                       (resign(start, other_server), BadSignature),
                       (dataclasses.replace(start, sender="evil"), UnknownSender)]:
        with pytest.raises(error):
            client.handle(bad)
        assert client.state is ClientState.WAITING_CONFIG


def test_replayed_messages_are_rejected():
    r = Round()
    adverts = r.to_clients()
    r.to_server(adverts[:1])
    rejects(r.server, adverts[0], ReplayedMessage)
    r.to_server(adverts[1:])
    shares = r.to_clients()
    rejects(r.server, adverts[2], ReplayedMessage)  # an advertise from the closed phase
    r.to_server(shares)
    # the same device's messages from an earlier round of the same job are stale
    stale = resign(shares[0], r.identities[shares[0].sender], round_id=2)
    rejects(r.server, stale, WrongContext)
    # client side: the same server message twice
    forwarded = r.pending[0]
    client = r.clients[forwarded.recipient]
    client.handle(forwarded)
    with pytest.raises(ReplayedMessage):
        client.handle(forwarded)
    assert client.state is ClientState.INPUT_SENT


def test_reordered_messages_are_rejected_and_the_round_still_completes_exactly():
    r = Round(n=7, consistency_check=True)
    r.step()  # advertise
    key_directories = r.pending
    late_device = key_directories[0].recipient
    replies = r.to_clients(key_directories[1:])
    r.to_server(replies)  # server waits for the late device's shares
    assert r.server.state is ServerState.WAIT_SHARES
    everyone, nobody = r.config.to_bitmap(r.config.members), r.config.to_bitmap(())
    forwarded_elsewhere = UnmaskRequest(job_id="job", round_id=3, group_id="g", sender="aggregator",
                                        recipient=late_device, survivors=everyone, dropped=nobody,
                                        consistency_signers=nobody, consistency_signatures=np.zeros((0, 64), np.uint8))
    client = r.clients[late_device]
    with pytest.raises(UnexpectedMessage):
        client.handle(wire(forwarded_elsewhere.signed(AGGREGATOR)))
    assert client.state is ClientState.ADVERTISED
    # a later-phase message type reaching the server early
    early = ConsistencySignature(job_id="job", round_id=3, group_id="g", sender=late_device,
                                 recipient="aggregator", survivors_signature=bytes(64))
    rejects(r.server, early.signed(r.identities[late_device]), UnexpectedMessage)
    with pytest.raises(UnexpectedMessage) as early_error:     # early is a violation, never "late"
        r.server.handle(early.signed(r.identities[late_device]))
    assert not isinstance(early_error.value, LateMessage)
    r.to_server(r.to_clients(key_directories[:1]))  # the late shares arrive; the round goes on
    outcome = r.finish()
    assert isinstance(outcome, AggregateReady)
    assert np.array_equal(outcome.sum_words, r.expected_sum(r.config.members))


def test_late_message_after_timeout_is_rejected():
    r = Round(n=6)
    adverts = r.to_clients()
    r.to_server(adverts[:-1])
    r.to_server([Timeout(Phase.ADVERTISE_KEYS)])
    assert r.server.state is ServerState.WAIT_SHARES
    rejects(r.server, adverts[-1], LateMessage)     # late, not a violation: the service counts it as late
    r.to_server([Timeout(Phase.ADVERTISE_KEYS)])  # stale timeout: ignored
    assert r.server.state is ServerState.WAIT_SHARES
