"""Every row of the SecAgg client's and server's transition tables fires in every state it names
(issue 36), as tests/test_deployment_machine.py does for deployments: seeded random rounds, in
memory (no broker), with devices that go silent, replies that are replayed, members reported
offline, stale and early timeouts, the caller's abort at any moment, share rows that do not decrypt
(their recipients accuse the senders), and events after the end."""

import dataclasses

import numpy as np
import pytest

from protocols.identity import DeviceIdentity
from protocols.secagg import MemberOffline, Phase, RoundConfig, SecAggError, Timeout
from protocols.secagg.client import CLIENT_TABLE, ClientState
from protocols.secagg.driver import build_round, make_identities
from protocols.secagg.messages import AdvertiseKeys, ConsistencyCheckRequest, EncryptedShares, Message, UnmaskRequest
from protocols.secagg.server import FINAL_STATES, SERVER_TABLE, ServerState

AGGREGATOR = DeviceIdentity.generate("aggregator")
IDENTITIES = {i.device_id: i for i in make_identities(5)}


@pytest.fixture
def fired(monkeypatch):
    """(table, state, row) of every firing of either table while the test runs."""
    seen = set()
    for name, table in (("client", CLIENT_TABLE), ("server", SERVER_TABLE)):
        def fire(machine, event, table=table, name=name, real=table.fire):
            try:
                seen.add((name, machine.state.name, table.describe(table.select(machine, event))))
            except Exception:
                pass                    # no row: the real fire refuses it
            return real(machine, event)
        monkeypatch.setattr(table, "fire", fire)
    return seen


def _quietly(call, *args) -> list:
    try:
        return call(*args)
    except SecAggError:
        return []


def _out_of_turn(config: RoundConfig, device: str) -> Message:
    """A correctly signed request the client's state does not allow: a consistency check in a round
    without one, an unmask request before U3 is signed in a round with one."""
    context = dict(job_id=config.job_id, round_id=config.round_id, group_id=config.group_id,
                   sender=config.aggregator_id, recipient=device)
    members = config.to_bitmap(config.members)
    if not config.consistency_check:
        return ConsistencyCheckRequest(**context, survivors=members).signed(AGGREGATOR)
    return UnmaskRequest(**context, survivors=members, dropped=config.to_bitmap(()),
                         consistency_signers=config.to_bitmap(()),
                         consistency_signatures=np.zeros((0, 64), np.uint8)).signed(AGGREGATOR)


def _stray_events(server, rng, abort_in) -> None:
    """What a caller may feed at any moment: a timeout of another phase (stale or early), a member
    or a stranger reported offline, and its own deadline (once the round is in `abort_in`)."""
    members = server.config.members
    if rng.random() < 0.2:
        _quietly(server.handle, Timeout(rng.choice([p for p in Phase if p is not server.phase])))
    if rng.random() < 0.2:
        _quietly(server.handle, MemberOffline(str(rng.choice([*members, "stranger"]))))
    if server.state is abort_in and rng.random() < 0.5:
        server.abort("deadline")


def _bad_row(shares: EncryptedShares, rng) -> EncryptedShares:
    """``shares`` with one row flipped, validly re-signed by its sender."""
    ciphertexts = shares.ciphertexts.copy()
    ciphertexts[rng.integers(len(shares.recipients)), 20] ^= 0xFF
    changed = dataclasses.replace(shares, ciphertexts=ciphertexts, signature=b"")
    return changed.signed(IDENTITIES[shares.sender])


def _copied_key(advert: AdvertiseKeys, seen: list[AdvertiseKeys], rng) -> AdvertiseKeys:
    """``advert`` carrying a key another member advertised (``seen``), validly signed by its sender."""
    other = seen[rng.integers(len(seen))]
    which = "cipher_public_key" if rng.random() < 0.5 else "mask_public_key"
    changed = dataclasses.replace(advert, **{which: getattr(other, which)}, signature=b"")
    return changed.signed(IDENTITIES[advert.sender])


def run_random_round(seed: int) -> None:
    rng = np.random.default_rng(seed)
    bad_rows = np.random.default_rng(seed + 10_000)       # its own stream: the other draws stay as they were
    copies, seen = np.random.default_rng(seed + 20_000), []   # adverts with another member's key: refused
    config = RoundConfig.create(job_id="job", round_id=seed, group_id="g", aggregator_id="aggregator",
                                members=list(IDENTITIES), vector_length=8, bound=10.0,
                                consistency_check=bool(rng.random() < 0.5), threshold=3)
    server, clients = build_round(config, AGGREGATOR, IDENTITIES)
    abort_in = rng.choice([None, None, *ServerState])
    for client in clients.values():
        client.provide_input(rng.uniform(-10, 10, 8))
    # devices whose replies are lost from here on (some messages still reach them); some never show up
    silent = {d for d in config.members if rng.random() < 0.1}
    _stray_events(server, rng, abort_in)
    to_clients = [m for m in _quietly(server.start) if isinstance(m, Message)]
    while to_clients or server.state not in FINAL_STATES:
        phase, outputs = server.phase, []
        for message in to_clients:
            client = clients[message.recipient]
            if client.device_id in silent and rng.random() < 0.3:
                continue                                                       # gone: not delivered either
            if rng.random() < 0.05:
                _quietly(client.handle, Timeout(phase or Phase.UNMASK))     # the device's own clock
            if client.state is ClientState.INPUT_SENT and rng.random() < 0.3:
                _quietly(client.handle, _out_of_turn(config, client.device_id))
            for reply in _quietly(client.handle, message):
                if isinstance(reply, EncryptedShares) and len(reply.recipients) and bad_rows.random() < 0.15:
                    reply = _bad_row(reply, bad_rows)                        # a recipient will accuse it
                if isinstance(reply, AdvertiseKeys):
                    if seen and copies.random() < 0.1:
                        reply = _copied_key(reply, seen, copies)
                    else:
                        seen.append(reply)
                if client.device_id in silent or rng.random() < 0.07:
                    silent.add(client.device_id)
                    if rng.random() < 0.5:
                        outputs += _quietly(server.handle, MemberOffline(client.device_id))
                    continue
                outputs += _quietly(server.handle, reply)
                if rng.random() < 0.1:
                    outputs += _quietly(server.handle, reply)                # a redelivery
            if server.state not in FINAL_STATES:
                _stray_events(server, rng, abort_in)
        if server.state not in FINAL_STATES and server.phase == phase:
            outputs += _quietly(server.handle, Timeout(phase))
        to_clients = [m for m in outputs if isinstance(m, Message)]
    for late in (Timeout(Phase.UNMASK), MemberOffline(config.members[0]), MemberOffline("stranger")):
        server.handle(late)                                                  # after the end: ignored
    server.abort("after the end")
    for client in clients.values():
        _quietly(client.handle, Timeout(Phase.UNMASK))


def test_every_table_row_fires_in_every_state_it_names(fired):
    for seed in range(60):           # every row is reached by seed 45
        run_random_round(seed)
    for name, table in (("client", CLIENT_TABLE), ("server", SERVER_TABLE)):
        expected = {(name, state.name, table.describe(row)) for state, row in table.entries()}
        assert expected - fired == set(), f"{name} rows never fired"
