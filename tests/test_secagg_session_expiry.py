"""A device's secure-aggregation session ends with its round (``edge_client/tasks/secure_update.py``).

SecAgg's security argument assumes a round's secrets are erased when the round ends. A device's
sessions used to end only when four newer rounds pushed them out, so a round whose aggregator
vanished kept the device's private keys, its neighbours' shares and its input in memory, on an
idle device for ever. Now a session ends at its task's deadline plus the clocks' grace (the moment
the agent runs the task until, ``edge_client/work_deadline.py``), through the client's own abort
path (a Timeout): its client is aborted, holds no secret, and a late message for it is refused. A
round still before its end is not touched. Real devices here (``SecureFed3R`` and their sessions
on an injected clock) and a real ``ServerSecAgg`` as the aggregator, over the wire envelopes."""

import time

import pytest

from edge_client.agent import AgentHooks, DeviceAgent
from edge_client.tasks.fed3r_stats import Fed3RStatsTask
from edge_client.tasks.secure_fed3r import SecureFed3R
from edge_client.tasks.secure_update import SecAggSessions
from edge_client.work_deadline import working_until
from protocols import messages as M
from protocols.device_session import DeviceState
from protocols.envelope import decode, encode
from protocols.identity import IdentityRegistry
from protocols.mqtt_link import BrokerConfig
from protocols.payloads.secagg import SECAGG_TYPE, SYNC_KIND, from_envelope, sync_vector_length, to_envelope, \
    unpack_sync_vector
from protocols.secagg import (AggregateReady, ClientState, ForwardedShares, Message, RoundConfig, ServerSecAgg,
                              Timeout, UnexpectedMessage)
from protocols.secagg.fixedpoint import fed3r_bound
from protocols.secagg.server import FINAL_STATES

from ops_fleet import Features
from test_secure_input_ledger import AGGREGATOR, C, D, IDENTITIES, N, P, PARAMS, data

MEMBERS = ["u", "v", "w", "y"]
START = 1_000_000.0             # the device's clock (unix s) when the tasks arrive
ENDS = START + 180.0            # their round is surely over: the deadline plus the grace


class Clock:
    def __init__(self):
        self.now = START

    def __call__(self) -> float:
        return self.now


def secrets_held(client) -> list[str]:
    """What of a round's secrets ``client`` still holds: its X25519 private keys, its self-mask
    seed, the pairwise keys, its own and its neighbours' Shamir shares, its input."""
    held = {"cipher key": client._cipher_key, "mask key": client._mask_key, "self-mask seed": client._self_mask_seed,
            "pairwise keys": client._share_keys, "own shares": client._own_shares,
            "neighbours' shares": client._held_shares, "encoded input": client._encoded_input,
            "input": client._raw_input}
    return [name for name, value in held.items()
            if value is not None and (not hasattr(value, "__len__") or len(value) > 0)]


def devices(clock):
    """The members, their tasks taken while the agent runs them until ``ENDS``."""
    fleet = {d: SecureFed3R(IDENTITIES[d], AGGREGATOR.public_key_bytes,
                            Fed3RStatsTask(*data(d), lambda b, s, w: Features(D)),
                            SecAggSessions(d, clock=clock)) for d in MEMBERS}
    with working_until(ENDS):
        for d in MEMBERS:
            assert fleet[d].on_task("job1", 1, PARAMS, {}) == []
    return fleet


def aggregator():
    config = RoundConfig.create(job_id="job1", round_id=1, group_id=PARAMS["group"], aggregator_id="aggregator",
                                members=MEMBERS, vector_length=sync_vector_length(P, C), bound=fed3r_bound(100, 3.0))
    return ServerSecAgg(config, AGGREGATOR, IdentityRegistry({d: IDENTITIES[d].public_key_bytes for d in MEMBERS}))


def deliver(fleet, server, outgoing):
    """The server's messages to the members, their answers back to the server: its next messages."""
    phase, replies = server.phase, []
    for message in outgoing:
        if isinstance(message, Message):
            for env in fleet[message.recipient].on_message(to_envelope(message)):
                replies.extend(server.handle(from_envelope(env)))
    if server.phase == phase and server.state not in FINAL_STATES:
        replies.extend(server.handle(Timeout(phase)))
    return replies


def client(fleet, device):
    return fleet[device].sessions.sessions[("job1", 1, PARAMS["group"])]


def test_a_round_past_its_deadline_holds_no_secret_and_refuses_late_messages():
    """The aggregator vanished after the key directory: the members hold their keys, their shares
    and their input. Past the round's end, u's tick and the others' next message end their
    sessions: aborted, nothing secret held, the late forwarded shares answered with nothing."""
    clock = Clock()
    fleet = devices(clock)
    server = aggregator()
    to_members = deliver(fleet, server, deliver(fleet, server, server.start()))     # the shares are out
    clients = {d: client(fleet, d) for d in MEMBERS}
    assert all(c.state is ClientState.SHARES_SENT and secrets_held(c) for c in clients.values())
    forwarded = [m for m in to_members if isinstance(m, ForwardedShares)]
    assert len(forwarded) == len(MEMBERS)

    clock.now = ENDS + 0.5
    fleet["u"].sessions.expire(clock.now)              # the agent's tick
    for message in forwarded:                           # u's, and the others' with no tick before them
        assert fleet[message.recipient].on_message(to_envelope(message)) == []
    for d, c in clients.items():
        assert c.state is ClientState.ABORTED, d
        assert secrets_held(c) == [], d
        assert fleet[d].sessions.sessions == {} and not fleet[d].sessions.expiring
        late = next(m for m in forwarded if m.recipient == d)
        with pytest.raises(UnexpectedMessage, match="already aborted"):     # as a round the aggregator aborted
            c.handle(late)


def test_a_round_before_its_end_is_unaffected():
    """The clock and the ticks run to just before the end: the round completes, every member's
    statistics in the sum, and then nothing is held."""
    clock = Clock()
    fleet = devices(clock)
    server = aggregator()
    outgoing = server.start()
    while server.state not in FINAL_STATES:
        clock.now += 30.0
        for device in fleet.values():
            device.sessions.expire()
        assert all(client(fleet, d).state is not ClientState.ABORTED for d in MEMBERS)
        outgoing = deliver(fleet, server, outgoing)
    assert clock.now <= ENDS
    assert isinstance(server.outcome, AggregateReady) and server.outcome.survivors == tuple(MEMBERS)
    assert unpack_sync_vector(server.outcome.decode(), P, C)[2] == N * len(MEMBERS)
    assert all(device.sessions.sessions == {} and not device.sessions.expiring for device in fleet.values())


def test_a_session_pushed_out_by_newer_rounds_is_erased_too():
    """``max_sessions`` newer rounds leave the oldest: its client aborted, nothing secret held."""
    fleet = devices(Clock())
    server = aggregator()
    deliver(fleet, server, deliver(fleet, server, server.start()))
    oldest = client(fleet, "u")
    assert secrets_held(oldest)
    with working_until(ENDS):
        for round_ in range(2, 2 + fleet["u"].sessions.max_sessions):
            fleet["u"].on_task(f"job{round_}", round_, PARAMS, {})
    assert ("job1", 1, PARAMS["group"]) not in fleet["u"].sessions.sessions
    assert oldest.state is ClientState.ABORTED and secrets_held(oldest) == []


class NoLink:
    def __init__(self, **kwargs):
        pass


def secure_agent():
    secure = SecureFed3R(IDENTITIES["u"], AGGREGATOR.public_key_bytes,
                         Fed3RStatsTask(*data("u"), lambda b, s, w: Features(D)), SecAggSessions("u"))
    agent = DeviceAgent("u", BrokerConfig(), {}, link_factory=NoLink, hooks=AgentHooks(always_available=True),
                        protocol_handlers={SYNC_KIND: secure, SECAGG_TYPE: secure.sessions})
    agent.online = True
    return agent, secure


def test_the_agent_ends_a_secure_session_at_its_tasks_deadline_on_its_tick(monkeypatch):
    """Through the agent: a secure task's session ends at the task's deadline plus the grace, and
    the agent's tick past that moment erases it (its clock: the device's wall clock)."""
    agent, secure = secure_agent()
    deadline = time.time() + 600
    task = M.task_message("aggregator", "job1", 1, SYNC_KIND, PARAMS, deadline=deadline, device="u")
    agent._handle(("inbox", encode(decode(encode(task)))))
    key = ("job1", 1, PARAMS["group"])
    opened = secure.sessions.sessions[key]
    assert secure.sessions.rounds[key].ends_at == deadline + agent.session.deadline_grace_s
    assert secrets_held(opened) == ["input"]                        # RoundStart not yet in: the input only
    agent._tick(time.monotonic())
    assert opened.state is ClientState.WAITING_CONFIG               # a tick before the end: kept
    monkeypatch.setattr(time, "time", lambda: deadline + agent.session.deadline_grace_s + 1)
    agent._tick(time.monotonic())
    assert opened.state is ClientState.ABORTED and secrets_held(opened) == []
    assert secure.sessions.sessions == {}


def test_an_idle_device_holding_a_session_with_an_end_is_ticked():
    """A host ticks only the devices a tick may change (DeviceAgent.wants_tick): an idle, always
    available one holding a session that ends on the clock is one (its other rounds acknowledged)."""
    agent, secure = secure_agent()
    assert not agent.wants_tick
    session = secure.sessions.sessions
    with working_until(time.time() + 600):
        secure.on_task("job1", 1, PARAMS, {})
    assert len(session) == 1 and agent.wants_tick
    secure.sessions.expire(time.time() + 601)
    assert session == {} and not agent.wants_tick


def test_a_device_whose_secure_round_is_over_is_not_ticked_for_ever():
    """A secure task's result goes out through its SecAgg session and expects no ack, so the device's
    session stays REPORTED (retry timer off) until its next task; the host ticked every such device
    every tick for ever after its first secure round. Once the SecAgg session is over, nothing a tick
    could do is left. A plain result awaiting its ack is still ticked (its resend)."""
    agent, secure = secure_agent()
    deadline = time.time() + 600
    task = M.task_message("aggregator", "job1", 1, SYNC_KIND, PARAMS, deadline=deadline, device="u")
    agent._handle(("inbox", encode(decode(encode(task)))))
    assert agent.session.state is DeviceState.REPORTED and not agent.session.resend_pending
    assert agent.wants_tick                                  # its SecAgg session ends on the clock
    secure.sessions.expire(deadline + agent.session.deadline_grace_s + 1)
    assert not agent.wants_tick
    agent.session.next_retry = time.monotonic() + 1.0        # as for a plain result awaiting its ack
    assert agent.session.resend_pending and agent.wants_tick
