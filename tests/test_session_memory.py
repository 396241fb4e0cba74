"""The device's replay guard on disk (edge_client/session_memory.py), the file's own rules: read
only from a regular file, strict JSON as an envelope header is read, a job's start created in the
device's future forgotten, written as UTF-8 (what is written is read back within the bound), a
failed write said once per kind and tried again only at the next change. Both devices on the same
files: tests/test_device_session_traces.py; across a restart over a broker: test_task_deadlines.py."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest

from edge_client.session_memory import MAX_MEMORY_BYTES, SESSION_FILE, SessionMemoryFile
from edge_client.work_deadline import PastDeadline, sleep_within, working_until
from protocols.messages import TaskRef
from protocols.device_session import DeviceSession, TaskArrived

NOW = 1.8e9


def memory(*started, declined=()) -> dict:
    return {"version": 1, "started": [list(s) for s in started], "expired_declined": list(declined)}


def loaded(path, caplog) -> tuple[bool, DeviceSession, str]:
    session = DeviceSession()
    caplog.clear()
    ok = SessionMemoryFile(path).load_into(session, now=NOW)
    return ok, session, caplog.text


@pytest.mark.parametrize("text, why", [
    ('{"version": 1, "started": [["j", 1, "t", NaN]], "expired_declined": []}', "NaN"),
    ('{"version": 1, "version": 1, "started": [], "expired_declined": []}', "duplicate key"),
    ('\ufeff{"version": 1, "started": [], "expired_declined": []}', "a byte order mark"),
    ('{"version": 1, "started": [], "expired_declined": [], "x": 1e400}', "a float past binary64"),
    ('{"version": 1, "started": [], "expired_declined": [], "x": 18446744073709551616}', "an integer past 2^64 - 1"),
    ('{"version": 1, "started": [], "expired_declined": ["\\ud800"]}', "a lone surrogate"),
    ('{"version": 1, "started": [["j", 1, "t", 1.0]' + ', ["k", 1, "t", "x"]' + ', ["j", 2, "t", 2.0]' * 70
     + '], "expired_declined": []}', "a bad entry older than the newest 64"),
])
def test_a_file_json_module_would_take_is_refused_whole_as_the_wire_refuses_it(tmp_path, caplog, text, why):
    (tmp_path / SESSION_FILE).write_bytes(text.encode("utf-8"))
    ok, session, log = loaded(tmp_path / SESSION_FILE, caplog)
    assert not ok and session.last_started == {} and "is unreadable" in log, why


def test_a_fifo_in_its_place_is_not_opened(tmp_path, caplog):
    os.mkfifo(tmp_path / SESSION_FILE)         # opened for reading, it would block until a writer came
    started = time.monotonic()
    ok, _, log = loaded(tmp_path / SESSION_FILE, caplog)
    assert not ok and "not a regular file" in log and time.monotonic() - started < 5


def test_a_start_created_in_the_devices_future_is_forgotten_and_the_rest_kept(tmp_path, caplog):
    """Written while the aggregator's clock ran an hour ahead: kept, every later task of job f
    (created by the corrected clock) would be skipped as a replay, restart after restart."""
    (tmp_path / SESSION_FILE).write_text(json.dumps(memory(("f", 9, "t9", NOW + 3600), ("g", 2, "t2", NOW - 5),
                                                           ("h", 1, "t1", NOW + 30), declined=("f",))))
    ok, session, _ = loaded(tmp_path / SESSION_FILE, caplog)
    assert ok and sorted(session.last_started) == ["g", "h"] and list(session.expired_declined) == ["f"]
    assert session.handle(TaskArrived(TaskRef("f", 10, "t10"), "k", {}, NOW + 60, received_at=NOW,
                                      sent_at=NOW))[0].__class__.__name__ == "StartWork"


def test_what_is_written_reads_back_within_the_bound(tmp_path, caplog):
    """64 jobs of 256-character non-ASCII ids, each declined once expired and its last start
    answered: written as UTF-8 (as escapes it was 3 x larger, and a file the device wrote could be
    refused at its next start)."""
    session = DeviceSession()
    ids = [chr(0x1F600 + i) * 256 for i in range(64)]
    session.recall({**memory(*((job, 1, job, NOW) for job in ids), declined=ids), "answered": ids})
    assert all(last.answered for last in session.last_started.values())
    session.memory_changes += 1
    SessionMemoryFile(tmp_path / SESSION_FILE).save_if_changed(session)
    assert (tmp_path / SESSION_FILE).stat().st_size <= MAX_MEMORY_BYTES
    ok, back, _ = loaded(tmp_path / SESSION_FILE, caplog)
    assert ok and back.memory() == session.memory()


def test_a_failed_write_is_said_once_and_tried_again_only_at_the_next_change(tmp_path, caplog):
    (tmp_path / SESSION_FILE).mkdir()           # the rename over it fails, after the temp file is written
    caplog.set_level(logging.WARNING)
    session, memory_file = DeviceSession(), SessionMemoryFile(tmp_path / SESSION_FILE)
    for change in range(3):
        session.memory_changes += 1
        for _ in range(3):                      # the agent calls it before every batch of actions
            memory_file.save_if_changed(session)
    assert caplog.text.count("writing the device's session memory") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [SESSION_FILE]     # no temp file left


def test_an_emulated_slower_devices_extra_time_stops_with_its_round():
    started = time.monotonic()
    with working_until(time.time() + 0.3), pytest.raises(PastDeadline):
        sleep_within(30.0)
    assert time.monotonic() - started < 5
    sleep_within(0.01)                          # outside any task: simply sleeps
