"""Text a device controls (its decline reasons, presence profile, refusals; anyone on the broker: the
retained status) shown to a person: the aggregator's log, the admin CLI's terminal output, the
simulator's progress line, the dashboard. A newline in it must not write a line of its own (a forged
log record, a forged table row or device), an escape sequence must not reach the terminal raw, and
the dashboard must show markup as text."""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import threading
import time
from pathlib import Path

import pytest

from edge_client.agent import TaskDeclined
from fedfleet import admin_deployments, admin_rendering
from fedfleet.terminal_text import terminal_safe
from protocols.envelope import Envelope, encode
from protocols.log_text import OneLineFormatter, escaped_controls

from ops_fleet import Fleet, prepare, run_aggregator

FORGED = "2026-01-01 00:00:00,000 fedfleet.aggregator WARNING job ops: done, every device contributed"
# a newline then a whole record of the attacker's, then a terminal escape (retitle, clear the screen)
EVIL = f"no data\n{FORGED}\r\x1b]0;owned\x07\x1b[2J\u2028\x85"


def _no_raw_controls(text: str) -> None:
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]", text), repr(text)


def _declines(reason: str):
    def handler(params, tensors=None):
        raise TaskDeclined(reason)
    return handler


# --------------------------------------------------------------------------- the aggregator's log
def test_a_devices_decline_reason_writes_no_record_of_its_own_in_the_aggregators_log(broker, tmp_path):
    """The only device declines with a reason holding a whole log record after a newline: the job
    fails, and the aggregator's WARNING ``job ops failed: ... declined: <reason>`` quoted it raw, so
    the log showed a second record of the device's choosing (and its escapes reached the terminal)."""
    prepare(tmp_path, ["dev01"], max_attempts=1, expected_devices=1, clients_per_round=1)
    with Fleet(broker.url, ["dev01"], handlers=lambda d: ({"fed3r.stats": _declines(EVIL)}, {})):
        rc, log = run_aggregator(tmp_path, broker.url, tmp_path / "state.db", timeout=60)
    assert rc == 1, log
    failed = [line for line in log.splitlines() if "job ops failed" in line]
    assert len(failed) == 1 and "no data\\n2026-01-01" in failed[0], log
    assert not any(line.startswith(FORGED[:23]) for line in log.splitlines()), log
    _no_raw_controls(log.replace("\n", ""))


def test_a_traceback_quoting_a_device_starts_no_line_at_column_zero():
    formatter = OneLineFormatter("%(levelname)s %(message)s")
    try:
        raise ValueError(EVIL)
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "refused: %s", (EVIL,), sys.exc_info())
    lines = formatter.format(record).splitlines()
    assert lines[0].startswith("ERROR refused: no data\\n2026") and len(lines) > 2
    assert all(line.startswith("    ") for line in lines[1:]), lines
    _no_raw_controls("".join(lines))


# --------------------------------------------------------------------------- the admin CLI
def _no_line_added(text: str, baseline: str) -> None:
    """``text`` has the lines of the same rendering with harmless values, none forged, no raw control."""
    assert text.count("\n") == baseline.count("\n"), text
    assert FORGED not in text.splitlines(), text
    _no_raw_controls(text.replace("\n", ""))


def test_admin_logs_prints_a_decline_reason_on_its_own_line():
    event = {"t": time.time(), "job_id": "ops", "event": "declined", "round": 1, "device": "dev01"}
    line = admin_rendering.log_line({**event, "reason": EVIL})
    assert "\n" not in line and "no data\\n2026-01-01" in line, line
    _no_raw_controls(line)


def test_admin_devices_table_keeps_one_row_per_device_whatever_its_profile():
    devices = [{"device_id": d, "status": "enrolled", "last_seen": None, "online": True, "cluster": None,
                "profile": {"model": p}} for d, p in (("dev01", "\nrogue   enrolled  online"), ("dev02", EVIL))]
    columns = [("DEVICE", "device_id"), ("PROFILE", "profile_")]
    text = admin_rendering.table(admin_rendering.devices_rows(devices), columns)
    plain = admin_rendering.table(admin_rendering.devices_rows([{**d, "profile": {"model": "m"}} for d in devices]), columns)
    _no_line_added(text, plain)
    assert not any(line.startswith("rogue") for line in text.splitlines()), text


def test_admin_job_show_prints_the_failure_and_the_rejection_counts_on_their_lines():
    job = {"job_id": "ops", "kind": "fed3r", "state": "failed", "rounds": 1, "contributions": 0,
           "summary": {"error": f"no device contributed in 1 round(s); declined: {EVIL} (dev01)"},
           "counters": {"rejections": {"presence": 1}}, "config": {"job_id": "ops"}}
    text = admin_rendering.job_text(job)
    _no_line_added(text, admin_rendering.job_text({**job, "summary": {"error": "x"}}))


def test_admin_deployment_show_keeps_one_line_per_device_whatever_it_refused():
    d = {"deployment_id": "m1-1", "model_id": 1, "model_sha256": "ab" * 32, "state": "canary", "replaces": None,
         "cohort": "5%", "stages": [1.0], "stage": 0, "guard": "median_drop<=1", "bake_s": 1.0, "min_reports": 1,
         "patience_s": 1.0, "reason": EVIL, "history": [{"t": time.time(), "from": "canary", "to": "halted",
                                                         "why": EVIL}],
         "devices": {"cam1": {"sent": "run", "report": {"refused": f"bad head\n  cam9{' ' * 17}sent run  held-out 9/9"}}}}
    text = admin_deployments.deployment_text(d)
    plain = admin_deployments.deployment_text({**d, "reason": "r", "history": [{**d["history"][0], "why": "w"}],
                                               "devices": {"cam1": {"sent": "run", "report": {"refused": "r"}}}})
    _no_line_added(text, plain)
    assert "cam9" not in [line.split()[0] for line in text.splitlines()], text


# --------------------------------------------------------------------------- simulate's progress line
def test_the_progress_line_draws_only_numbers_from_a_retained_status_anyone_may_publish(capsys):
    """``fedfleet simulate``'s bar reads the broker's retained status topic, unsigned: a status whose
    round was an escape sequence went to the terminal raw, and one whose counts were text raised in
    the MQTT callback."""
    from fedfleet.progress import StatusWatcher

    watcher = StatusWatcher.__new__(StatusWatcher)
    watcher.total, watcher.quiet, watcher.width, watcher.job_id, watcher._drawn = 4, False, 10, None, 0
    watcher.last, watcher.updates = {}, threading.Event()
    body = {"round": "\x1b]0;owned\x07\x1b[2J", "contributions": "3", "devices_online": "\x1b[31m", "accuracy": "x",
            "state": "running"}
    watcher._on_message("fedfleet/status", encode(Envelope(type="status", sender="aggregator", body=body)))
    watcher._on_message("fedfleet/status", encode(Envelope(type="status", sender="aggregator",
                                                           body={"round": 2, "contributions": 3, "devices_online": 4,
                                                                 "accuracy": 0.5})))
    out = capsys.readouterr().out
    _no_raw_controls(out.replace("\r", ""))
    assert "round   2" in out and "3/4 devices" in out and "acc 0.5000" in out, repr(out)


# --------------------------------------------------------------------------- the dashboard
MARKUP = '<img src=x onerror="window.__injected=1"><script>window.__injected=2</script>'


def _wait_until(page, condition: str, timeout_s: float = 20.0) -> None:
    """Poll ``condition`` from here: Playwright's wait_for_function evaluates it in the page, which the
    dashboard's policy refuses."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(condition):
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {condition}"
        time.sleep(0.05)


@contextlib.contextmanager
def _dashboard(tmp_path, profile: dict, error: str):
    """The dashboard signed in, over a store whose one device announced ``profile`` and whose one
    job failed with ``error``, both rows shown."""
    sync_api = pytest.importorskip("playwright.sync_api")
    from test_dashboard import CHROMIUM, CHROMIUM_ARGS, TOKEN
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not installed (Debian package chromium)")
    import shutil
    import tempfile

    from aggregator.api.app import create_app
    from aggregator.api.server import ApiServer
    from aggregator.storage.store import Store

    store = Store(tmp_path / "state.db")
    store.enroll_device("dev01", None, None)
    store.device_seen("dev01", online=True, profile=profile)
    store.create_job("ops", "fed3r", {})
    store.set_job_state("ops", "failed", {"error": error})
    api = ApiServer(create_app(store, TOKEN)).start()
    profile_dir = tempfile.mkdtemp(prefix="fedfleet-chromium-")
    try:
        with sync_api.sync_playwright() as pw:
            ctx = pw.chromium.launch_persistent_context(profile_dir, executable_path=CHROMIUM, headless=True,
                                                        args=CHROMIUM_ARGS)
            page = ctx.new_page()
            page.goto(f"{api.url}/dashboard/")
            page.fill("#token", TOKEN)
            page.click("#login button[type=submit]")
            _wait_until(page, "document.querySelectorAll('#fleet-table tbody tr').length === 1 && "
                              "document.querySelectorAll('#jobs-table tbody tr').length === 1")
            yield page
            ctx.close()
    finally:
        api.stop()
        shutil.rmtree(profile_dir, ignore_errors=True)


def test_the_dashboard_shows_a_devices_markup_as_text_and_runs_no_inline_script(tmp_path):
    """A device's presence profile (key and value) and its decline reason in a failed job's summary
    hold markup whose handlers would set ``window.__injected``: the page shows it as text, makes no
    element of it, and its Content-Security-Policy refuses inline scripts even where a future
    change writes markup (checked by writing some: its handler never runs)."""
    from test_dashboard import cells

    with _dashboard(tmp_path, {"model": MARKUP, MARKUP[:20]: "v"},
                    f"no device contributed in 1 round(s); declined: {MARKUP} (dev01)") as page:
        assert MARKUP in cells(page, "jobs-table")[0][-1]
        assert MARKUP[:20] in cells(page, "fleet-table")[0][-1]
        assert page.evaluate("document.querySelectorAll('main img, main script').length") == 0
        page.evaluate("document.getElementById('conn').insertAdjacentHTML('beforeend', "
                      "'<img src=\"data:,x\" onerror=\"window.__injected=3\" onload=\"window.__injected=3\">')")
        page.wait_for_timeout(500)
        assert page.evaluate("window.__injected === undefined"), page.evaluate("window.__injected")


# a right-to-left override and an isolate make "dev01 declined: exe.png" read as another file and
# device; zero-width and other format characters hide in a value; the escapes are the log's
BIDI = "cat\u202egnp.exe \u2066(dev02)\u2069 \u200b\ufeff\u00ad\u061c\u2028\x1b[2J"
# what a forged escape looks like: printable backslashes spelling an escaped newline and record, an
# override and an ESC, beside the real ones (shown alike before a backslash was escaped too)
FORGED_ESCAPES = f"no data\\n{FORGED} \\u202egnp.exe\u202e \\x1b\x1b \\\\n \\"


def test_the_dashboard_shows_a_devices_bidi_and_invisible_characters_escaped_as_the_log_does(tmp_path):
    """A device's profile and decline reason holding bidirectional controls and invisible format
    characters: the dashboard wrote them into the cell as they came (textContent: no markup, but a
    U+202E still reverses what follows), now as their escapes, the same as the admin CLI and the
    logs write them (``protocols/log_text.escaped_controls``), a backslash too."""
    from test_dashboard import cells
    from test_log_text_java import unescaped as read_back

    with _dashboard(tmp_path, {"model": BIDI}, f"declined: {BIDI} (dev01)") as page:
        jobs, fleet = cells(page, "jobs-table")[0][-1], cells(page, "fleet-table")[0][-1]
        # the page's escape on every form (\\n, \\x, \\u, \\U, \\\\), the printable left alone
        samples = [EVIL, BIDI, "tab\there \U000f0000 \xa0\u3000 \U000e0041 ok \U0001f600 \u00e9\u4e2d",
                   FORGED_ESCAPES, "\\", "\\n", "\n", "\\\\x1b", "\\\x1b"]
        on_page = page.evaluate("(texts) => texts.map(shown)", samples)
        assert on_page == [escaped_controls(t) for t in samples]
        # and each reads back as the text sent (a forged escape apart from a real one)
        assert [read_back(t) for t in on_page] == samples, on_page
    assert jobs == escaped_controls(f"declined: {BIDI} (dev01)"), repr(jobs)
    assert fleet == escaped_controls(f"model={BIDI}"), repr(fleet)
    for shown in (jobs, fleet):
        assert not re.search(r"[\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff\u00ad\u061c\u2028\x1b]", shown), repr(shown)


def test_the_admin_cli_writes_bidi_and_invisible_characters_as_the_log_does():
    """``one_line`` escapes what Python's str.isprintable refuses, the bidirectional controls and
    format characters among them (so it did before this review: pinned here, as the dashboard's)."""
    event = {"t": time.time(), "job_id": "ops", "event": "declined", "round": 1, "device": "dev01"}
    line = admin_rendering.log_line({**event, "reason": BIDI})
    assert escaped_controls(BIDI) in line and "cat\\u202egnp.exe \\u2066(dev02)\\u2069" in line, line
    assert not re.search(r"[\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff\u00ad\u061c\u2028\x1b]", line), repr(line)


def test_a_devices_printable_backslashes_read_apart_from_the_escapes_in_the_log_and_the_admin_cli():
    """A device's reason spelling escapes in printable text (``\\n`` then a forged record, ``\\u202e``)
    was shown exactly as a real newline or override is shown escaped: a reader of the log or of
    ``admin logs`` could not tell which was sent. Now a backslash is shown ``\\\\``: what the log
    and the CLI show, read back as Python reads escapes, is what the device sent -- in the CLI
    once escaped, not twice (``terminal_safe`` over a line of ``one_line`` values)."""
    from test_log_text_java import unescaped as read_back

    real = "no data\n" + FORGED + " \u202egnp.exe \x1b"
    forged = real.replace("\n", "\\n").replace("\u202e", "\\u202e").replace("\x1b", "\\x1b")
    formatter = OneLineFormatter("%(message)s")
    event = {"t": time.time(), "job_id": "ops", "event": "declined", "round": 1, "device": "dev01"}
    shown = {}
    for name, reason in (("real", real), ("forged", forged), ("both", FORGED_ESCAPES)):
        record = formatter.format(logging.LogRecord("x", logging.WARNING, __file__, 1, "declined: %s", (reason,), None))
        line = terminal_safe(admin_rendering.log_line({**event, "reason": reason}))
        assert read_back(record) == f"declined: {reason}", record
        assert read_back(line.split(" reason=", 1)[1]) == reason, line
        _no_raw_controls(record + line)
        shown[name] = record
    assert shown["real"] != shown["forged"], shown
    assert shown["forged"] == "declined: no data\\\\n" + FORGED + " \\\\u202egnp.exe \\\\x1b", shown["forged"]
