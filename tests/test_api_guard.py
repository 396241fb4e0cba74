"""The admin API refuses before it reads: no token -> 401 with a 300 MB body left unread; a body
over the cap -> 413 (declared length) or refused as it streams (chunked), all against a real
uvicorn server over a socket, with the process's memory checked."""

import resource
import select
import socket
import time

import pytest

from aggregator.api import connections, guard
from aggregator.api.app import create_app
from aggregator.api.guard import MAX_BODY_BYTES
from aggregator.api.server import ApiServer
from aggregator.storage.store import Store

TOKEN = "guard-token-0123456789abcdef"


@pytest.fixture
def api(tmp_path):
    server = ApiServer(create_app(Store(tmp_path / "state.db"), TOKEN)).start()
    yield server
    server.stop()


def raw_request(port: int, head: str, body_bytes: int = 0, chunk: bytes = b"x" * 65536) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head.encode())
        sent = 0
        try:
            while sent < body_bytes:
                s.sendall(chunk)
                sent += len(chunk)
        except OSError:              # the server answered and closed: it did not read the rest
            pass
        s.settimeout(10)
        reply = b""
        try:
            while b"\r\n\r\n" not in reply:
                part = s.recv(4096)
                if not part:
                    break
                reply += part
        except OSError:
            pass
    return reply


def test_a_huge_body_without_the_token_is_refused_unread(api):
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    head = ("POST /api/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 300000000\r\n\r\n")
    reply = raw_request(api.port, head, body_bytes=8 * 1024 * 1024)
    assert reply.startswith(b"HTTP/1.1 401"), reply[:80]
    assert time.monotonic() - t0 < 10
    grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert grown_kb < 100 * 1024, grown_kb                      # far from the 300 MB it announced


def test_an_oversized_declared_body_with_the_token_is_refused_unread(api):
    head = (f"POST /api/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {MAX_BODY_BYTES + 1}\r\n\r\n")
    assert raw_request(api.port, head, body_bytes=2 * 1024 * 1024).startswith(b"HTTP/1.1 413")


def test_an_oversized_chunked_body_is_cut_off_without_a_server_error(api):
    head = (f"POST /api/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    block = b"10000\r\n" + b" " * 0x10000 + b"\r\n"
    reply = raw_request(api.port, head, body_bytes=4 * 1024 * 1024, chunk=block)
    assert reply.startswith((b"HTTP/1.1 413", b"HTTP/1.1 400")), reply[:80]
    assert not reply.startswith(b"HTTP/1.1 5")


def test_connections_that_send_no_request_are_closed_and_the_api_keeps_answering(tmp_path):
    """A review's finding: uvicorn waited for ever for a connection's first request, and for headers
    sent a byte at a time, so idle sockets opened without a token took every file descriptor and the
    API stopped answering. Each request's head must now be in within the server's deadline (1 s
    here): idle and trickling connections are closed, and the API answers throughout."""
    server = ApiServer(create_app(Store(tmp_path / "state.db"), TOKEN), head_timeout_s=1.0).start()
    try:
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(50)]
        trickle = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        started = time.monotonic()
        for byte in b"GET /api/health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40:
            if time.monotonic() - started > 4:
                break
            try:
                trickle.sendall(bytes([byte]))
            except OSError:                 # closed by the server: what should happen
                break
            time.sleep(0.2)
        assert raw_request(server.port, "GET /api/health HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 ")
        for s in [*idle, trickle]:
            s.settimeout(5)
            try:
                assert s.recv(1) == b"", "an idle connection was kept open"
            except ConnectionResetError:
                pass
            s.close()
        assert time.monotonic() - started < 15
        # a keep-alive connection that answered one request is held to the same deadline for the next
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"GET /api/health HTTP/1.1\r\nHost: x\r\n\r\n")
            s.settimeout(5)
            reply, asked = b"", time.monotonic()
            while chunk := s.recv(4096):        # the answer (401: no token), then the close
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 ") and time.monotonic() - asked < 5
    finally:
        server.stop()


def test_sign_ins_whose_form_never_arrives_are_answered_and_the_api_stays_reachable(tmp_path, monkeypatch):
    """A review's finding: the sign-in POST is the one request read without the token, and the guard
    waited for ever for its body, so connections that sent the head of a sign-in and then nothing
    (no token needed) held uvicorn's concurrency slots for good, and the operator got 503s. Each
    sign-in's form must now be in within the guard's deadline (1 s here): past it the guard answers
    408 and closes, and the API answers again."""
    monkeypatch.setattr(guard, "LOGIN_BODY_TIMEOUT_S", 1.0)
    monkeypatch.setattr(connections, "MAX_REQUESTS", 16)      # the guard's request slots ...
    monkeypatch.setattr(connections, "OPERATOR_SLOTS", 1)        # ... 15 open to requests without the token
    server = ApiServer(create_app(Store(tmp_path / "state.db"), TOKEN), head_timeout_s=1.0).start()
    health = f"GET /api/health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n"
    try:
        stalled = []
        for _ in range(15):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            s.sendall(b"POST /dashboard/login HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 100\r\n\r\ntoken=")
            stalled.append(s)
        started = time.monotonic()
        for s in stalled:
            s.settimeout(max(0.1, started + 5 - time.monotonic()))
            reply = b""
            try:
                while chunk := s.recv(4096):        # the answer, then the close
                    reply += chunk
            except TimeoutError:
                pass
            assert reply.startswith(b"HTTP/1.1 408"), reply[:80]
            s.close()
        assert time.monotonic() - started < 5
        assert raw_request(server.port, health).startswith(b"HTTP/1.1 200"), "the API is still unreachable"
    finally:
        server.stop()


def _replies(sockets: list[socket.socket], quiet_s: float = 0.5) -> tuple[dict[socket.socket, bytes], set[socket.socket]]:
    """What each socket received until none has more for ``quiet_s``, and the sockets the server closed."""
    replies, closed = {s: b"" for s in sockets}, set()
    while waiting := [s for s in sockets if s not in closed]:
        readable, _, _ = select.select(waiting, [], [], quiet_s)
        if not readable:
            break
        for s in readable:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                chunk = b""
            replies[s] += chunk
            if not chunk:
                closed.add(s)
    return replies, closed


def test_a_flood_without_the_token_leaves_the_operator_a_slot(tmp_path, monkeypatch):
    """A review's finding: uvicorn's one limit (its limit_concurrency) counted every open connection,
    token or not, so a client without the token that held them (a keep-alive connection after its
    401, a connection that has sent nothing yet, a sign-in whose form never comes) took every slot
    and the operator's request with the token was answered 503. Now an answer to a request without
    the token closes its connection, and a share of the slots (4 of 16 here) is only for requests
    that present the token, decided once the request's head is read."""
    monkeypatch.setattr(connections, "MAX_REQUESTS", 16)
    monkeypatch.setattr(connections, "OPERATOR_SLOTS", 4)
    server = ApiServer(create_app(Store(tmp_path / "state.db"), TOKEN)).start()
    connect = lambda: socket.create_connection(("127.0.0.1", server.port), timeout=10)   # noqa: E731
    flood: list[socket.socket] = []
    try:
        asked = [connect() for _ in range(16)]
        for s in asked:
            s.sendall(b"GET /api/health HTTP/1.1\r\nHost: x\r\n\r\n")
        answers, asked_closed = _replies(asked)                     # answered (and closed) before the sign-ins start
        silent = [connect() for _ in range(16)]
        stalled = [connect() for _ in range(16)]
        for s in stalled:
            s.sendall(b"POST /dashboard/login HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Type: application/x-www-form-urlencoded\r\nContent-Length: 100\r\n\r\ntoken=")
        flood = [*asked, *silent, *stalled]
        sign_ins, stalled_closed = _replies(stalled)
        operator = raw_request(server.port, f"GET /api/health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n")
        assert operator.startswith(b"HTTP/1.1 200"), operator[:80]
        assert b"\r\nconnection: close\r\n" not in operator.lower()       # the operator's stays alive
        for s in asked:                               # each 401 closed its connection: no slot kept alive
            assert answers[s].startswith(b"HTTP/1.1 401") and b"\r\nconnection: close\r\n" in answers[s].lower()
            assert s in asked_closed, "the connection stayed open after its 401"
        # the sign-ins without the token had the 12 slots open to them; the rest were refused at once
        refused = [s for s in stalled if sign_ins[s]]
        assert len(refused) == 4 and all(sign_ins[s].startswith(b"HTTP/1.1 503") for s in refused)
        assert all(s in stalled_closed for s in refused)
    finally:
        for s in flood:
            s.close()
        server.stop()


def test_request_slots_keep_the_operators_share():
    """4 slots, 1 only for requests with the token: 3 without it run at once, the 4th waits for a
    request with the token, and every slot counts against the total whoever holds it."""
    slots = connections.RequestSlots(total=4, operator_only=1)
    assert [slots.take(with_token=False) for _ in range(4)] == [True, True, True, False]
    assert slots.take(with_token=True) and not slots.take(with_token=True)       # 4 running: none left
    slots.give_back(with_token=False)                  # 3 running, 2 of them without the token
    assert slots.take(with_token=True)                 # the freed slot, taken by the operator
    assert not slots.take(with_token=False)            # 4 running
    slots.give_back(with_token=True)
    slots.give_back(with_token=True)                   # 2 running, both without the token
    assert slots.take(with_token=False) and not slots.take(with_token=False)    # 3 without it at most
    assert slots.take(with_token=True) and (slots.running, slots.running_without_token) == (4, 3)
