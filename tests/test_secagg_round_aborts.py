"""How a SecAgg round ends early: a client's timeout aborts it and erases its secrets, messages after
the round are refused, a failed round tells every member (a notice only the aggregator can sign),
the caller can abort a running round, and malformed abort notices are refused."""

import pytest

from protocols.secagg import (AggregateReady, BadSignature, ClientState, MalformedMessage, Phase, RoundFailed,
                              ServerState, Timeout, UnexpectedMessage, decode)

from secagg_rounds import Round, resign, wire


def test_client_timeout_aborts_and_erases_secrets():
    r = Round(n=5)
    r.step()
    client = r.clients[r.pending[0].recipient]
    assert client.handle(Timeout(Phase.SHARE_KEYS)) == []
    assert client.state is ClientState.ABORTED and client._mask_key is None
    with pytest.raises(UnexpectedMessage):
        client.handle(r.pending[0])


def test_messages_after_the_round_ended_are_rejected():
    r = Round(n=5)
    adverts = r.to_clients()
    r.to_server(adverts)
    outcome = r.finish()
    assert isinstance(outcome, AggregateReady)
    with pytest.raises(UnexpectedMessage):
        r.server.handle(resign(adverts[0], r.identities[adverts[0].sender]))


def test_a_failed_round_tells_every_member_and_the_clients_erase_their_secrets():
    r = Round(n=6)
    advertised = r.to_clients()                          # RoundStart -> AdvertiseKeys
    outputs = r.to_server(advertised[:3])                # 3 of 6 advertise: below t = 4 at the timeout
    assert not [o for o in outputs if isinstance(o, RoundFailed)]
    outputs = r.server.handle(Timeout(Phase.ADVERTISE_KEYS))
    failed = [o for o in outputs if isinstance(o, RoundFailed)]
    notices = [wire(o) for o in outputs if not isinstance(o, (RoundFailed, AggregateReady))]
    assert len(failed) == 1 and sorted(n.recipient for n in notices) == sorted(r.clients)
    assert all(type(n).__name__ == "RoundAborted" and "threshold" in n.reason for n in notices)
    # a notice signed by someone else than the aggregator changes nothing
    victim = notices[0].recipient
    forged = resign(notices[0], r.identities[victim])
    with pytest.raises(BadSignature):
        r.clients[victim].handle(forged)
    assert r.clients[victim].state is ClientState.ADVERTISED and r.clients[victim]._mask_key is not None
    for notice in notices:
        client = r.clients[notice.recipient]
        assert client.handle(notice) == []
        assert client.state is ClientState.ABORTED and client.abort_reason == notice.reason
        assert client._mask_key is None and client._self_mask_seed is None and client._encoded_input is None
    assert r.server.abort("late") == []                  # already over: nothing more to say


def test_the_caller_can_abort_a_running_round():
    r = Round(n=5)
    r.to_server(r.to_clients())                          # everyone advertised; shares phase running
    outputs = r.server.abort("deadline")
    assert r.server.state is ServerState.FAILED
    assert [o for o in outputs if isinstance(o, RoundFailed)][0].reason == "aborted: deadline"
    notices = [wire(o) for o in outputs if not isinstance(o, RoundFailed)]
    for notice in notices:
        r.clients[notice.recipient].handle(notice)
    assert all(c.state is ClientState.ABORTED for c in r.clients.values())


def test_malformed_abort_notices_are_refused():
    r = Round(n=5)
    r.to_server(r.to_clients())
    notice = [o for o in r.server.abort("deadline") if not isinstance(o, RoundFailed)][0]
    header, arrays = notice.to_wire()
    for bad in ("x" * 1001, 42, None):
        with pytest.raises(MalformedMessage):
            decode({**header, "reason": bad}, arrays)
    with pytest.raises(MalformedMessage):
        decode({**header, "extra": 1}, arrays)
