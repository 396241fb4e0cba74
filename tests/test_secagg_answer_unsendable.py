"""A Python device's secure round whose answer its outbox cannot send ends at once
(``edge_client/agent.py`` ``DeviceAgent._answer``, ``SecAggSessions.unsendable``).

``to_envelope`` refuses a SecAgg answer over the envelope's own limits (``UnsendableMessage``), but an
answer that needs more chunks, at the agent's chunk size, than a reassembler takes
(``protocols/chunking.py`` ``MAX_CHUNKS``) failed only in the agent's publish, after the sessions had
answered: the agent logged it as a malformed message and the round kept its session (its private
keys, its neighbours' shares, its input) until its deadline. Every answer is now encoded before any
is published, and one that cannot be ends its round then and there, as on the Java device
(tests/test_java_secagg_leaving.py: the same round, 16-byte payloads).

A real ``DeviceAgent`` (its inbox verifying the aggregator's signature, its outbox signing and
chunking; the network replaced by a list) as one member of a round run by the Python server
(``protocols/secagg/driver.py``), the others the driver's own clients.
"""

from __future__ import annotations

import time

import numpy as np

from edge_client.agent import AgentHooks, DeviceAgent
from edge_client.tasks.secure_update import SecAggSessions
from protocols.chunking import MAX_CHUNKS, MessageAssembler
from protocols.envelope import encode
from protocols.identity import DeviceIdentity, sender_verifier
from protocols.mqtt_link import BrokerConfig, MqttLink
from protocols.payloads.secagg import SECAGG_TYPE, from_envelope, to_envelope
from protocols.secagg import ClientSecAgg, ClientState, RoundConfig
from protocols.secagg.driver import plain_fixed_point_sum, run_round
from protocols.secagg.events import AggregateReady

from test_secagg_session_expiry import secrets_held

AGGREGATOR = DeviceIdentity.generate("aggregator")
DEVICE = "dev-agent"
BOUND = 50.0
# payloads of at most 16 bytes: a reassembler takes 4,096 chunks, 64 KiB, so the keys and the shares
# (a few KiB) can be sent and the masked input of 10,000 64-bit words cannot
CHUNK, LONG = 16, 10_000


class WireLink:
    """The agent's link with the real link's encoding (``MqttLink.publish_envelope`` and
    ``publish_parts``) and no network: what it would publish is kept, and ``deliver`` hands a payload
    to the agent as its link's subscription would."""

    publish_envelope = MqttLink.publish_envelope
    publish_parts = MqttLink.publish_parts

    def __init__(self, on_message, **kwargs):
        self.on_message = on_message
        self.sent: list[bytes] = []

    def publish(self, topic, payload, qos=1, retain=False, wait=False) -> None:
        self.sent.append(payload)


class AgentMember:
    """The driver's client interface (``handle``, ``state``, ``provide_input``) over a DeviceAgent:
    each message goes to its inbox as the aggregator's signed envelope, and what its outbox published
    comes back reassembled (signature checked)."""

    def __init__(self, identity: DeviceIdentity, config: RoundConfig, vector: np.ndarray):
        self.sessions = SecAggSessions(identity.device_id)
        self.agent = DeviceAgent(identity.device_id, BrokerConfig(), {}, chunk_size=CHUNK, link_factory=WireLink,
                                 hooks=AgentHooks(always_available=True), signer=identity.sign,
                                 aggregator_key=AGGREGATOR.public_key_bytes,
                                 protocol_handlers={SECAGG_TYPE: self.sessions})
        self.agent.online = True
        self.client = ClientSecAgg(identity, config.aggregator_id, AGGREGATOR.public_key_bytes,
                                   job_id=config.job_id, round_id=config.round_id, group_id=config.group_id,
                                   input_vector=vector)
        self.round_ends: list[bool] = []        # what the round's RoundEnd was told
        # an end an hour away: the round is left at once or not at all during the test
        assert self.sessions.open((config.job_id, config.round_id, config.group_id), self.client,
                                  ends_at=time.time() + 3600, round_end=self.round_ends.append)
        self.replies = MessageAssembler(sender_verifier(identity.device_id, identity.public_key_bytes))
        self.sent_types: list[str] = []

    @property
    def state(self) -> ClientState:
        return self.client.state

    def provide_input(self, values) -> None:
        """The client has the same vector from its start, as a device's."""

    def handle(self, message):
        link = self.agent.link
        link.on_message("inbox", encode(to_envelope(message), signer=AGGREGATOR.sign))
        self.agent.loop.serve_pending()         # what the agent's own thread does: the message, then a tick
        replies = []
        for payload in link.sent:
            whole = self.replies.feed(payload)
            if whole is not None:
                replies.append(from_envelope(whole))
        link.sent.clear()
        self.sent_types += [reply.TYPE for reply in replies]
        return replies


def test_a_device_whose_masked_input_needs_too_many_chunks_leaves_the_round_at_once():
    """Its keys and shares go out in chunks; its masked input cannot: nothing of it is sent, the
    round ends on the device then and there (aborted, no secret held, its RoundEnd told it did not
    finish), and the others' sum is exact."""
    assert LONG * 8 > MAX_CHUNKS * CHUNK            # the masked input alone needs more chunks than are taken
    rng = np.random.default_rng(0)
    identities = {d: DeviceIdentity.generate(d) for d in [f"dev-py{i}" for i in range(5)] + [DEVICE]}
    config = RoundConfig.create(job_id="job", round_id=3, group_id="g3", aggregator_id="aggregator",
                                members=list(identities), vector_length=LONG, bound=BOUND)
    inputs = {d: rng.uniform(-BOUND, BOUND, LONG) for d in identities}
    member = AgentMember(identities[DEVICE], config, inputs[DEVICE])

    run = run_round(config, AGGREGATOR, identities, inputs,
                    client_factory=lambda d, i: member if d == DEVICE else None)

    assert member.sent_types == ["secagg.advertise_keys", "secagg.encrypted_shares"]    # no masked input
    assert member.state is ClientState.ABORTED and secrets_held(member.client) == []
    assert member.sessions.sessions == {} and not member.sessions.expiring
    assert member.round_ends == [False]
    survivors = tuple(d for d in config.members if d != DEVICE)
    assert isinstance(run.outcome, AggregateReady) and run.outcome.survivors == survivors
    assert np.array_equal(run.outcome.sum_words, plain_fixed_point_sum(config, [inputs[d] for d in survivors]))
