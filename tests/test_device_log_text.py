"""What the aggregator, the broker or a SecAgg peer sends a device, in the device's own log: one line
per record, every control, bidirectional override and invisible format character escaped, cut.

Over a real mosquitto (an attacker-minded review of what devices log):

* the Java device logged a rejection's reason raw (java.util.logging's formatter writes a message
  as it is): a newline in it wrote a record of the sender's choosing into the device's log, an ESC
  sequence reached the terminal tailing it, a U+202E showed the rest of the line reversed. Its
  loggers now pass every record through ``org.fedfleet.wire.LogText`` (the Python device's rules:
  both devices write the same line for the same reason, checked here on the real path);
* the Python device's log escaped a record's message but cut nothing: a handler's exception that
  quoted a task's parameter (60,000 characters here: a task header holds 64 KiB) wrote its whole traceback line;
* the emulated fleet's Ray device hosts logged with a plain ``logging.basicConfig``: their devices'
  records were raw, newlines and escapes included (a local worker process logs one line each).
"""

from __future__ import annotations

import io
import logging
import re
import sys
import threading
import time
from pathlib import Path

import pytest

import java_build
from edge_client.agent import DeviceAgent
from edge_client.tasks.fed3r_stats import Fed3RStatsTask
from log_capture import logging_restored, process_log
from ops_fleet import wait_for
from protocols import messages as M
from protocols.envelope import encode
from protocols.log_text import MAX_RECORD_CHARS, escaped_controls, log_to_stderr
from protocols.mqtt_link import BrokerConfig
from protocols.topics import AGGREGATOR_ID, Topics
from deployment_fleet import Sniffer
from test_device_hostile_tasks import Features, ask, fed3r_task, java_devices, local_data, online, write_features

T = Topics()
FORGED = "2026-01-01 00:00:00,000 fedfleet.device WARNING job ops: done, every device contributed"
# a forged record after a newline, a retitle and a screen clear, a right-to-left override and an
# isolate (a file name read backwards), a zero-width space, separators a terminal may break on
EVIL = f"no data\n{FORGED}\r\x1b]0;owned\x07\x1b[2J dev\u202egnp.exe\u2066x\u2069\u200b\u2028\x85"
RAW = "\x1b\r\u202e\u2066\u2069\u200b\u2028\x85"


def _no_raw_text(log: str) -> None:
    assert not any(c in log for c in RAW), repr([c for c in RAW if c in log])
    assert not any(line.startswith(FORGED[:23]) for line in log.splitlines()), log[-3000:]


@pytest.fixture
def device_log():
    """The process's logging as ``fedfleet device`` sets it up (``log_to_stderr``), read back."""
    with process_log() as read:
        yield read


def _python_device(broker, handlers) -> DeviceAgent:
    return DeviceAgent("py0", BrokerConfig(port=broker.port), handlers, tick_s=0.05).start()


@pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))
def test_a_rejection_reason_is_the_same_escaped_line_in_both_devices_logs(broker, tmp_path: Path, device_log):
    Z, y = local_data()
    sniffer = Sniffer(broker, [T.outbox("java0"), T.presence("java0"), T.outbox("py0"), T.presence("py0")])
    jvm = java_devices(broker, "--device", "java0", str(write_features(tmp_path / "java0.feat", Z, y)), "-")
    python = _python_device(broker, {"fed3r.stats": Fed3RStatsTask(Z, y, lambda b, s, w: Features())})
    try:
        wait_for(lambda: online(sniffer, "java0") and online(sniffer, "py0"), what="both devices online")
        for device in ("java0", "py0"):
            sniffer.publish(T.inbox(device), encode(M.ack_message(AGGREGATOR_ID, "f" * 32, "rejected", EVIL)))
            # an answer to a task sent after it: the ack was read and logged
            assert ask(sniffer, device, fed3r_task(3, round_=1)).type == M.RESULT
    finally:
        python.stop()
        out, java_log = jvm.communicate(timeout=60)
        sniffer.close()
    python_log = device_log()
    shown = escaped_controls(EVIL)
    assert [line.split(" rejected: ", 1)[1] for line in python_log.splitlines() if " rejected: " in line] == [shown]
    assert [line.split(" rejected: ", 1)[1] for line in java_log.splitlines() if " rejected: " in line] == [shown], \
        java_log[-3000:]
    _no_raw_text(python_log)
    _no_raw_text(java_log)


def test_a_handlers_exception_quoting_a_huge_parameter_is_cut_in_the_device_log(broker, device_log):
    """A handler bug that quotes what the task carried (a common one: ``unknown option {value}``)
    logs its traceback: each line at most MAX_RECORD_CHARS characters before escaping."""
    def handler(params, tensors=None):
        raise ValueError(f"unknown option {params['option']}")

    sniffer = Sniffer(broker, [T.outbox("py0"), T.presence("py0")])
    python = _python_device(broker, {"fed3r.stats": handler})
    try:
        wait_for(lambda: online(sniffer, "py0"), what="the device online")
        task = M.task_message(AGGREGATOR_ID, "hostile", 1, "fed3r.stats", {"option": EVIL + "A" * 60_000},
                              time.time() + 60)
        assert ask(sniffer, "py0", task).type == M.DECLINE
    finally:
        python.stop()
        sniffer.close()
    log = device_log()
    # the traceback's lines, the exception's own newline's too, indented: no record at column 0
    assert "\n    ValueError: unknown option no data\n    2026-01-01" in log, log[-3000:]
    assert max(map(len, log.splitlines())) <= MAX_RECORD_CHARS + len(escaped_controls(EVIL)), \
        max(map(len, log.splitlines()))
    assert "AAAA\u2026" in log
    _no_raw_text(log)


def test_a_ray_device_host_logs_one_line_per_record(monkeypatch):
    """The actor's logging set up in a worker with no handler yet (a fresh Ray worker), then a
    device's record quoting what the aggregator sent."""
    from fedfleet.emulation import ray_hosts, worker

    monkeypatch.setattr(worker, "host_devices", lambda spec: (None, []))
    with logging_restored() as root:
        root.handlers[:] = []
        ray_hosts.DeviceHostActor({})
        stream = io.StringIO()
        for handler in root.handlers:
            handler.setStream(stream)
        logging.getLogger("edge_client.agent").warning("%s: result %s rejected: %s", "dev01", "f" * 32, EVIL)
    log = stream.getvalue()
    assert log.count("\n") == 1 and log.rstrip("\n").endswith("rejected: " + escaped_controls(EVIL)), log
    _no_raw_text(log)


def test_the_one_line_formatter_cuts_a_huge_record_once_and_escapes_what_is_left():
    """The formatter itself: a record of a megabyte is MAX_RECORD_CHARS characters with … at the end."""
    stream = io.StringIO()
    with logging_restored() as root:
        log_to_stderr(fmt="%(message)s", force=True)
        root.handlers[0].setStream(stream)
        logging.getLogger("edge_client.agent").warning("%s", "\u202e" + "x" * 1_000_000)
    line = stream.getvalue().rstrip("\n")
    assert line == "\\u202e" + "x" * (MAX_RECORD_CHARS - 2) + "\u2026", len(line)


ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("aggregator", "edge_client", "export", "fedfleet", "protocols")


def test_every_process_and_every_java_logger_logs_through_the_one_line_rules():
    """No handler set up but by ``log_to_stderr`` (the Ray hosts' plain ``basicConfig`` was one);
    no Java logger but ``LogText.oneLineLogger``'s, no Java library code writing to stderr itself."""
    python = [f"{path.relative_to(ROOT)}:{n}" for package in PACKAGES for path in (ROOT / package).rglob("*.py")
              if path != ROOT / "protocols" / "log_text.py"
              for n, line in enumerate(path.read_text().splitlines(), 1)
              if re.search(r"logging\.(basicConfig|StreamHandler|FileHandler)\(|\bsetFormatter\(", line)]
    assert python == [], python
    library = ROOT / "clients" / "java" / "src"
    java = [f"{path.relative_to(ROOT)}:{n}" for path in library.rglob("*.java") if path.name != "LogText.java"
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if re.search(r"Logger\.getLogger\(|System\.err|printStackTrace\(", line)]
    assert java == [], java


def test_an_error_nobody_caught_in_a_thread_is_written_as_the_log_writes_a_traceback(capsys):
    """``log_to_stderr``'s threading hook: Python's own wrote the exception's message raw."""
    def work():
        raise RuntimeError(EVIL)

    with logging_restored():
        log_to_stderr()
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    err = capsys.readouterr().err
    assert err.startswith("uncaught RuntimeError:\n"), err
    assert all(line.startswith("    ") for line in err.splitlines()[1:]), err
    _no_raw_text(err)


def test_a_thread_that_exits_with_system_exit_writes_nothing(capsys):
    """A thread's SystemExit is how it ends, not an error: Python's own threading hook writes
    nothing for it (its documented rule), and ``log_to_stderr``'s wrote "uncaught SystemExit"
    with a traceback. The same hook still writes any other exception (the test above)."""
    with logging_restored():
        log_to_stderr()
        thread = threading.Thread(target=lambda: sys.exit(3))
        thread.start()
        thread.join()
    assert capsys.readouterr().err == ""
