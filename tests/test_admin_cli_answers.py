"""What ``fedfleet admin`` reads of the API's answers: an error's ``detail`` shown in one line with
its controls escaped (the server's words quote devices' words: a decline reason, a profile), and
answers past their bounds refused unread, so a server that is not the admin API (a mistyped
``--url``, a proxy) neither drives the operator's terminal nor fills the CLI's memory.

A real HTTP server on loopback (``http.server``) answers as such a server would."""

from __future__ import annotations

import ast
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from fedfleet import admin_client
from fedfleet.admin import main
from fedfleet.admin_client import MAX_ANSWER_BYTES, MAX_ERROR_BYTES

FORGED = "\n2026-12-06 23:59:59 fedfleet.aggregator INFO job ops done\x1b]52;c;cm0gLXJmIC8=\x07 \u202egnp.exe"


class Answers(BaseHTTPRequestHandler):
    """Answers each GET with what the test put in ``self.server.answer``: (status, body bytes)."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        status, body = self.server.answer
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass                        # the CLI stopped reading: what it should do

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def admin_status(server, capsys) -> tuple[int, str]:
    rc = main(["status", "--url", f"http://127.0.0.1:{server.server_port}", "--token", "t"])
    return rc, capsys.readouterr().err


def admin_status_from_raw_server(serve_one, capsys) -> tuple[int, str]:
    """``admin status`` against a loopback socket whose one connection ``serve_one(conn)`` answers
    byte by byte (what no HTTP server library would send)."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))

    def accept_one():
        conn, _ = listener.accept()
        with conn:
            serve_one(conn)

    thread = threading.Thread(target=accept_one, daemon=True)
    thread.start()
    try:
        rc = main(["status", "--url", f"http://127.0.0.1:{listener.getsockname()[1]}", "--token", "t"])
    finally:
        thread.join(5)
        listener.close()
    return rc, capsys.readouterr().err


def raw_controls(text: str) -> list[str]:
    return [c for c in text if not c.isprintable() and c != "\n"]


@pytest.mark.parametrize("detail", [f"device dev01 declined: {FORGED}",
                                    [{"loc": ["body", "x"], "msg": FORGED, "type": "value_error"}]],
                         ids=["text", "validation-list"])
def test_an_error_detail_quoting_a_device_is_one_line_without_controls(server, capsys, detail):
    server.answer = (400, json.dumps({"detail": detail}).encode())
    rc, err = admin_status(server, capsys)
    assert rc == 1
    assert err.count("\n") == 1 and err.startswith("fedfleet admin: GET /api/status: HTTP 400: "), err
    assert raw_controls(err) == [], err
    if isinstance(detail, str):                         # shown, escaped once
        assert "\\x1b]52" in err and "\\u202e" in err and "\\n2026-12-06" in err
    else:                                               # the list as its Python literal: escaped once
        assert ast.literal_eval(err.split("HTTP 400: ", 1)[1]) == detail


def test_a_validation_errors_strings_are_shown_escaped_once(server, capsys):
    """FastAPI's 422: ``detail`` a list of objects that quote what was sent. Shown as its JSON text
    put through the one-line escaping, each escape came twice: the sent backslash as four, the
    newline as ``\\\\n``, the ``é`` as ``\\\\u00e9``. Each string now reads as log_text shows
    text: its backslash two, its newline ``\\n``, its ``é`` as it is."""
    detail = [{"type": "string_pattern_mismatch", "loc": ["body", "tags", 0],
               "msg": "String should match pattern '^[a-z]+$'", "input": "C:\\fleet\nnext caf\u00e9"}]
    server.answer = (422, json.dumps({"detail": detail}).encode())
    rc, err = admin_status(server, capsys)
    assert rc == 1 and err.count("\n") == 1, err
    shown = err.split("HTTP 422: ", 1)[1].rstrip("\n")
    # written out by hand: each string quoted, its one backslash and its newline escaped once
    assert shown == ("[{'type': 'string_pattern_mismatch', 'loc': ['body', 'tags', 0], "
                     "'msg': \"String should match pattern '^[a-z]+$'\", "
                     r"'input': 'C:\\fleet\nnext café'}]"), shown
    assert ast.literal_eval(shown) == detail            # and it reads back as what was sent


# one unit of repr's text: an escape (\\ \' \n \xhh \uhhhh \Uhhhhhhhh) or one character
REPR_UNIT = re.compile(r"\\(?:x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8}|.)|.", re.S)


def test_a_validation_list_cut_short_never_splits_an_escape(server, capsys):
    """repr escapes first, then the list is cut at 500 characters: a cut inside an escape showed
    its half ("\\u20…"), or a backslash of a pair alone before the cut mark. At every length the
    shown text is whole units of repr's (REPR_UNIT), at most one escape short of the bound."""
    from fedfleet.terminal_text import literal_line

    detail = [{"msg": "C:\\fleet\u202e\x1b\U000e0041'\n", "input": ["\\" * 7, "\u2066\x85" * 5]}]
    text = repr(detail)
    ends = {0}
    for unit in REPR_UNIT.finditer(text):
        ends.add(unit.end())
    for max_chars in range(2, len(text)):
        shown = literal_line(detail, max_chars)
        assert shown.endswith("\u2026") and text.startswith(shown[:-1]), (max_chars, shown)
        assert len(shown) - 1 in ends and len(shown) > max_chars - 10, (max_chars, shown)
    # through the CLI: the 422's list past 500 characters
    server.answer = (422, json.dumps({"detail": [{"msg": "x" * 480 + "\u202e" * 9}]}).encode())
    rc, err = admin_status(server, capsys)
    assert rc == 1 and err.rstrip("\n").endswith("x\\u202e\u2026"), err          # not "\\u202e\\u2…"


def test_an_error_body_past_its_bound_is_cut_and_a_plain_text_body_is_shown_as_text(server, capsys, monkeypatch):
    read = []
    real_error_detail = admin_client.error_detail
    monkeypatch.setattr(admin_client, "error_detail", lambda body: read.append(len(body)) or real_error_detail(body))
    server.answer = (502, b"x" * (8 * 1024 * 1024))
    rc, err = admin_status(server, capsys)
    assert rc == 1 and err.count("\n") == 1 and len(err) < 1000, len(err)
    assert read == [MAX_ERROR_BYTES + 1]                # read no further than the bound (and one byte)
    assert "HTTP 502: xxx" in err and err.rstrip().endswith("\u2026")


def test_an_answer_past_its_bound_is_refused_unread(server, capsys):
    server.answer = (200, b'{"x": "' + b"y" * MAX_ANSWER_BYTES + b'"}')
    rc, err = admin_status(server, capsys)
    assert rc == 1
    assert err == f"fedfleet admin: GET /api/status: the answer is larger than {MAX_ANSWER_BYTES} bytes: not read\n"


def test_a_good_answer_within_the_bound_is_read_whole(server, capsys):
    """The bound is no cap on what the API answers: the status it sends is shown."""
    status = {"job": None, "devices_online": ["dev01", "dev02"]}
    server.answer = (200, json.dumps(status).encode())
    rc = main(["status", "--json", "--url", f"http://127.0.0.1:{server.server_port}", "--token", "t"])
    out = capsys.readouterr().out
    assert rc == 0 and json.loads(out) == status


ROUND_COUNTS = {"participants": 4, "accepted": 2, "declined": 1, "rejected": 0, "lost": 0, "pending": 1}


@pytest.mark.parametrize("listed", [False, True], ids=["counts", "lists-of-an-earlier-aggregator"])
def test_the_status_line_reads_counts_of_devices_or_an_earlier_aggregators_lists(server, capsys, listed):
    """/api/status counts the devices online and the open round's (it listed them: 4 MB at 100,000
    online); the CLI reads both."""
    as_sent = (lambda n: [f"dev{i:02d}" for i in range(n)]) if listed else (lambda n: n)
    current = {"round": 2, **{k: as_sent(n) for k, n in ROUND_COUNTS.items()}}
    job = {"job_id": "ops", "state": "running", "round": 2, "contributions": 5, "accuracy": None, "waiting": None,
           "current_round": current}
    for status, line in (({"job": None, "devices_online": as_sent(3)}, "no active job; 3 devices online"),
                         ({"job": job, "devices_online": as_sent(3)},
                          "ops [running] round   2 [###############.....] 3/4  contributions 5  online 3")):
        server.answer = (200, json.dumps(status).encode())
        rc = main(["status", "--url", f"http://127.0.0.1:{server.server_port}", "--token", "t"])
        assert (rc, capsys.readouterr().out) == (0, line + "\n")


@pytest.mark.parametrize("answer", [{"job": None, "devices_online": "3"}, {"job": None, "devices_online": True}, [1, 2],
                                    {"job": {"rounds": "x"}}],
                         ids=["count-as-text", "count-as-bool", "list", "job-of-another-shape"])
def test_an_answer_of_another_shape_is_one_line_not_a_traceback(server, capsys, answer):
    server.answer = (200, json.dumps(answer).encode())
    rc, err = admin_status(server, capsys)
    assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "answered in a shape this fedfleet does not read" in err


def test_an_answer_nested_past_what_json_reads_is_one_line_not_a_traceback(server, capsys):
    """json.loads raises RecursionError (no ValueError) on an answer nested thousands deep."""
    server.answer = (200, b"[" * 5000 + b"]" * 5000)
    rc, err = admin_status(server, capsys)
    assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("fedfleet admin: GET /api/status: "), err


@pytest.mark.parametrize("when", [1e300, -1e300], ids=["far-future", "far-past"])
def test_a_time_past_what_the_clock_shows_is_one_line_not_a_traceback(server, capsys, when):
    """time.localtime raises OverflowError (no ValueError) on a time of 1e300 s: a job's dates, a log line's."""
    server.answer = (200, json.dumps({"job_id": "j1", "kind": "fed3r", "state": "done", "rounds": 1,
                                      "contributions": 1, "created_at": when}).encode())
    rc = main(["job", "show", "j1", "--url", f"http://127.0.0.1:{server.server_port}", "--token", "t"])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "answered in a shape this fedfleet does not read" in err, err


def test_a_url_that_is_no_http_server_is_one_line_not_a_traceback(capsys):
    """A mistyped --url naming another service (an SSH port's banner): http.client's BadStatusLine
    is no OSError, so urllib passed it through."""
    def banner(conn):
        conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
        conn.recv(65536)

    rc, err = admin_status_from_raw_server(banner, capsys)
    assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "did not answer as an HTTP server" in err and "SSH-2.0" in err, err


@pytest.mark.parametrize("status", [200, 500], ids=["answer", "error-body"])
def test_a_chunked_answer_cut_short_is_one_line_not_a_traceback(capsys, status):
    """A connection closed inside a chunk: http.client's IncompleteRead, in the answer or in an
    error's body (read in the HTTPError handler, where the handler beside it does not catch it)."""
    def cut(conn):
        conn.recv(65536)
        conn.sendall(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n40\r\n{\"detail\": \"cut".encode())

    rc, err = admin_status_from_raw_server(cut, capsys)
    assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "IncompleteRead" in err, err


def test_a_job_named_with_a_newline_by_the_server_is_one_line_of_status(server, capsys):
    """The API checks job ids; a server that is not ours need not: its job id and state are values
    like any other on the status line (one_line), not layout (terminal_safe keeps newlines)."""
    job = {"job_id": "ops\nfedfleet admin: forged", "state": "running\x1b[2J", "round": 1, "current_round": None,
           "contributions": 0, "waiting": None}
    server.answer = (200, json.dumps({"job": job, "devices_online": []}).encode())
    rc = main(["status", "--url", f"http://127.0.0.1:{server.server_port}", "--token", "t"])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("\n") == 1 and raw_controls(out) == [], out
    assert out.startswith("ops\\nfedfleet admin: forged [running\\x1b[2J] round   1"), out


def test_a_rounds_device_lists_from_the_server_stay_on_their_lines(server, capsys):
    round_ = {"round": 2, "state": "closed", "participants": ["dev01", "dev02\ndropped      dev07"],
              "accepted": ["dev01"], "dropped": [], "declined": [], "rejected": [], "pending": [],
              "duration_s": 1.5, "bytes_in": 10, "result_latency_s": {"dev01": 0.5}}
    server.answer = (200, json.dumps(round_).encode())
    rc = main(["round", "ops", "2", "--url", f"http://127.0.0.1:{server.server_port}", "--token", "t"])
    out = capsys.readouterr().out
    assert rc == 0 and raw_controls(out) == [], out
    assert [line for line in out.splitlines() if line.startswith("dropped")] == ["dropped      -"], out
    assert "participants dev01, dev02\\ndropped      dev07" in out and "accepted     dev01" in out
