"""A step-by-step in-memory SecAgg round that tests can interfere with between the steps, and what
the hostile-input SecAgg tests share with it: re-signing a changed message, a refusal that must
leave the server's state unchanged, an intercept that corrupts one member's share rows."""

import dataclasses

import numpy as np
import pytest

from protocols.identity import DeviceIdentity
from protocols.secagg import AggregateReady, EncryptedShares, Phase, RoundConfig, RoundFailed, ServerState, Timeout
from protocols.secagg.driver import WireFrame, build_round, make_identities, plain_fixed_point_sum

AGGREGATOR = DeviceIdentity.generate("aggregator")
BOUND = 10.0


def wire(message):
    return WireFrame.from_message(message).to_message()


def resign(message, identity, **changes):
    """The same message with some fields changed, validly signed by `identity`."""
    changed = dataclasses.replace(message, **changes, signature=b"")
    return dataclasses.replace(changed, signature=identity.sign(changed.canonical_bytes()))


class Round:
    """Step-by-step in-memory round, so tests can interfere between the steps."""

    def __init__(self, n=6, m=40, withhold=(), **config_options):
        self.identities = {i.device_id: i for i in make_identities(n)}
        self.config = RoundConfig.create(job_id="job", round_id=3, group_id="g", aggregator_id="aggregator",
                                         members=list(self.identities), vector_length=m, bound=BOUND,
                                         **config_options)
        self.server, self.clients = build_round(self.config, AGGREGATOR, self.identities)
        rng = np.random.default_rng(n * 1000 + m)
        self.inputs = {d: rng.uniform(-BOUND, BOUND, m) for d in self.identities}
        for device, client in self.clients.items():
            if device not in withhold:
                client.provide_input(self.inputs[device])
        self.pending = [wire(m) for m in self.server.start()]

    def to_clients(self, messages=None):
        replies = []
        for message in self.pending if messages is None else messages:
            replies.extend(wire(r) for r in self.clients[message.recipient].handle(message))
        return replies

    def to_server(self, messages):
        outputs = []
        for message in messages:
            outputs.extend(self.server.handle(message))
        self.pending = [wire(o) for o in outputs if not isinstance(o, (AggregateReady, RoundFailed))]
        return outputs

    def step(self):
        return self.to_server(self.to_clients())

    def finish(self):
        while self.server.state not in (ServerState.DONE, ServerState.FAILED):
            phase = self.server.phase
            self.step()
            if self.server.phase == phase and self.server.state not in (ServerState.DONE, ServerState.FAILED):
                self.to_server([Timeout(phase)])
        return self.server.outcome

    def expected_sum(self, survivors):
        return plain_fixed_point_sum(self.config, [self.inputs[d] for d in survivors])


def snapshot(server):
    accumulator = None if server._accumulator is None else server._accumulator.copy()
    return server.state, {p: server.participants(p) for p in Phase}, accumulator


def assert_same(before, after):
    assert before[0] == after[0] and before[1] == after[1]
    assert (before[2] is None and after[2] is None) or np.array_equal(before[2], after[2])


def rejects(server, message, error):
    before = snapshot(server)
    with pytest.raises(error):
        server.handle(message)
    assert_same(before, snapshot(server))


def corrupting(identities, attacker, victims=None):
    """An intercept: ``attacker``'s share rows for ``victims`` (None: every row it sends) flipped, its
    message validly re-signed."""
    def corrupt(message):
        if isinstance(message, EncryptedShares) and message.sender == attacker:
            ciphertexts = message.ciphertexts.copy()
            for victim in message.recipients if victims is None else victims:
                ciphertexts[message.recipients.index(victim), 20] ^= 0xFF
            return [resign(message, identities[attacker], ciphertexts=ciphertexts)]
        return [message]
    return corrupt
