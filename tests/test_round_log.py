"""A job's round log (aggregator/storage/round_log.py): ``rounds.jsonl`` written live by a real Fed3R job
over mosquitto, and ``fedfleet admin logs JOB --follow`` streaming it through the admin API while
the job runs; what the log says is checked against the store's own records of the same job."""

from __future__ import annotations

import copy
import json
import logging
import os
import pickle
import stat
import subprocess
import sys
import threading

import pytest

from aggregator.api.app import create_app
from aggregator.api.server import ApiServer
from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.storage.round_log import FILE_NAME, RoundLog, read_from
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from aggregator.storage.store import Store
from protocols.mqtt_link import BrokerConfig

from ops_fleet import REPO, Fleet, data_for, job_config

TOKEN = "round-log-token-0123456789"
DEVICES = ["dev01", "dev02", "dev03"]


def test_read_from_pages_whole_lines_and_survives_a_torn_line(tmp_path):
    path = tmp_path / "rounds.jsonl"
    events = [{"event": "contribution", "round": i, "device": f"dev{i:02d}"} for i in range(40)]
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + '{"event": "half')   # a line being written
    got, offset = [], 0
    while True:
        lines, nxt = read_from(path, offset, max_bytes=150)
        if nxt == offset:
            break
        got += lines
        offset = nxt
    assert got == events and offset == path.stat().st_size - len('{"event": "half')
    with open(path, "a") as f:
        f.write('"}\nnot json\n')
    lines, _ = read_from(path, offset)
    assert lines == [{"event": "half"}, {"event": "unreadable"}]
    assert read_from(tmp_path / "missing.jsonl", 7) == ([], 7)


def done_within(make, seconds: float = 10):
    """``make()``'s result, made in a thread; None if it still waits after ``seconds`` (opening a
    FIFO waits for its other end: the job's start hung)."""
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(make()), daemon=True)
    worker.start()
    worker.join(seconds)
    return outcome[0] if outcome else None


def test_the_round_log_never_writes_through_a_link_nor_waits_on_a_fifo_under_its_name(tmp_path, caplog):
    """A review's findings: ``open(path, "a")`` followed a symbolic link planted as ``rounds.jsonl``
    (the aggregator appended to any file it could write) and waited for ever on a FIFO there (the
    job's start hung). Neither is written; the job goes on without its log, which says why."""
    precious = tmp_path / "precious.txt"
    precious.write_text("an operator's file\n")
    linked, piped, plain = (tmp_path / name for name in ("linked", "piped", "plain"))
    for out in (linked, piped, plain):
        out.mkdir()
    (linked / FILE_NAME).symlink_to(precious)
    os.mkfifo(piped / FILE_NAME)
    with caplog.at_level(logging.WARNING, logger="fedfleet.aggregator"):
        for out in (linked, piped, plain):
            events = done_within(lambda: RoundLog(out / FILE_NAME, "j"))
            if events is None:              # waiting on the FIFO: give it a reader, then fail
                os.close(os.open(out / FILE_NAME, os.O_RDONLY | os.O_NONBLOCK))
                pytest.fail(f"{out.name}: opening the round log blocked")
            events.write("round_opened", 1)
            events.close()
    assert precious.read_text() == "an operator's file\n"
    assert stat.S_ISFIFO(os.lstat(piped / FILE_NAME).st_mode) and (linked / FILE_NAME).is_symlink()
    assert [json.loads(line)["event"] for line in (plain / FILE_NAME).read_text().splitlines()] == ["round_opened"]
    refused = [r.getMessage() for r in caplog.records if "not written" in r.getMessage()]
    assert len(refused) == 2 and "symbolic link" in refused[0] and "not a regular file" in refused[1], refused


def test_the_log_route_serves_only_the_regular_file_the_aggregator_wrote(tmp_path):
    """A review's finding: ``read_from`` checked ``is_file()``, which follows a link, so a
    ``rounds.jsonl`` link made ``GET /api/jobs/{id}/log`` serve whatever file it pointed at."""
    secret = tmp_path / "secret.jsonl"
    secret.write_text(json.dumps({"event": "secret", "key": "s3cr3t"}) + "\n")
    link = tmp_path / FILE_NAME
    link.symlink_to(secret)
    assert read_from(link, 0) == ([], 0)
    link.unlink()
    os.mkfifo(link)
    assert done_within(lambda: read_from(link, 0)) == ([], 0)


def test_a_recent_log_keeps_the_latest_entries_and_counts_the_rest():
    from aggregator.jobs.recent_log import RecentLog

    log = RecentLog(({"round": r} for r in range(1, 2501)), maxlen=1000)
    assert len(log) == 1000 and log.earlier == 1500 and log.total == 2500
    assert log[0] == {"round": 1501} and log[-1] == {"round": 2500} and log[-2:] == [{"round": 2499}, {"round": 2500}]
    log.append({"round": 2501})
    assert log[0] == {"round": 1502} and log.earlier == 1501
    assert json.loads(json.dumps(list(log)))[-1] == {"round": 2501}
    short = RecentLog([1, 2], maxlen=5)
    assert list(short) == [1, 2] and short.earlier == 0
    short += [3, 4, 5, 6, 7]
    assert list(short) == [3, 4, 5, 6, 7] and short.earlier == 2
    for copied in (copy.copy(short), short.copy(), copy.deepcopy(short), pickle.loads(pickle.dumps(short))):
        assert type(copied) is RecentLog and list(copied) == list(short) and copied.earlier == 2
        assert copied.maxlen == 5


def test_admin_logs_follow_streams_the_round_log_live_and_it_matches_the_store(broker, tmp_path, monkeypatch):
    """Also: the service keeps only the latest rounds and evaluations in memory (here 2:
    jobs/recent_log.py), results.json says how many came before them, the log file and the store
    keep every one."""
    monkeypatch.setattr("aggregator.jobs.recent_log.KEPT", 2)
    gates = {d: threading.Event() for d in DEVICES}
    store = Store(tmp_path / "state.db")
    svc = AggregatorService(Fed3RJob(Fed3RConfig(**job_config(DEVICES, clients_per_round=1))),
                            BrokerConfig.from_url(broker.url), tmp_path / "out", ServiceSettings(tick_s=0.05),
                            enrolled=set(DEVICES), eval_set=data_for("dev99"), store=store)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=90)), daemon=True)
    thread.start()
    api = ApiServer(create_app(store, TOKEN, svc)).start()
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    follow = subprocess.Popen([sys.executable, "-m", "fedfleet.cli", "admin", "logs", "ops", "--follow", "--json",
                               "--interval", "0.2", "--timeout", "80", "--url", api.url, "--token", TOKEN],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    streamed: list[dict] = []
    try:
        with Fleet(broker.url, DEVICES, gates=gates):
            # the first round opens while its device is held: the line must reach the follower now,
            # while the job is still running
            while True:
                line = follow.stdout.readline()
                assert line, follow.stderr.read()
                streamed.append(json.loads(line))
                if streamed[-1]["event"] == "round_open":
                    break
            assert not result and (svc.live.get("job") or {}).get("state") == "running"
            for g in gates.values():
                g.set()
            out, err = follow.communicate(timeout=60)
            streamed += [json.loads(x) for x in out.splitlines()]
            thread.join(60)
    finally:
        follow.kill()
        api.stop()
        svc.stop()
    assert follow.returncode == 0, err
    assert result["state"] == "done"

    written = [json.loads(x) for x in (tmp_path / "out" / "rounds.jsonl").read_text().splitlines()]
    assert streamed == written                    # the follower saw every line, once, in order
    assert written[-1]["event"] == "job_end" and written[-1]["state"] == "done"
    by_event = lambda name: [e for e in written if e["event"] == name]  # noqa: E731
    rounds = store.rounds("ops")
    assert [(e["round"], e["participants"]) for e in by_event("round_open")] == \
        [(r.round, sorted(r.participants)) for r in rounds]
    assert [(e["round"], e["accepted"]) for e in by_event("round_close")] == \
        [(r.round, r.outcome["accepted"]) for r in rounds]
    assert sorted((e["round"], e["device"], e["message_id"]) for e in by_event("contribution")) == \
        sorted((c.round, c.device, c.message_id) for c in store.contributions("ops", with_payload=False))
    evaluations = store.evaluations("ops")
    assert [e["accuracy"] for e in by_event("evaluation")] == [e["accuracy"] for e in evaluations]
    assert len(evaluations) >= len(DEVICES)
    summary = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["round"] for r in summary["rounds"]] == [r.round for r in rounds][-2:]
    assert summary["rounds_earlier"] == len(rounds) - 2 > 0
    assert [h["accuracy"] for h in summary["history"]] == [e["accuracy"] for e in evaluations][-2:]
    assert summary["history_earlier"] == len(evaluations) - 2
    assert all(a["t"] <= b["t"] for a, b in zip(written, written[1:]))
