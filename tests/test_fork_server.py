"""fedfleet/emulation/fork_server.py: a forked child is ``python -m MODULE`` — the same exit status,
output, argv, environment and working folder as a fresh interpreter running the same module
(the reference here), its non-daemon threads and atexit handlers still run, and signals end it
as they end a ``Popen``'s process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedfleet.emulation.fork_server import ForkServer

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]), PROBE="server's")


@pytest.fixture(scope="module")
def server():
    s = ForkServer(["fork_child_probe"], ENV, cwd=REPO)
    yield s
    s.close()


def fresh(argv: list[str], cwd: Path, env: dict, log: Path) -> int:
    with open(log, "w") as out:
        return subprocess.run([sys.executable, "-m", "fork_child_probe", *argv], cwd=cwd, env=env, stdout=out,
                              stderr=subprocess.STDOUT, timeout=60).returncode


def lines(log: Path) -> list[str]:
    return sorted(log.read_text().splitlines())


@pytest.mark.parametrize("argv,status", [(["exit", "0"], 0), (["exit", "3"], 3), (["sys-exit-message"], 1),
                                         (["raise"], 1), (["late-thread"], 0)])
def test_a_forked_child_ends_as_a_fresh_interpreter_running_the_module_does(server, tmp_path, argv, status):
    env = dict(ENV, PROBE="the child's")
    runs = {}
    for how in ("fresh", "forked"):
        work = tmp_path / how
        work.mkdir()
        full = [argv[0], str(work / "report.json"), *argv[1:]]
        if how == "fresh":
            rc = fresh(full, work, env, work / "log")
        else:
            rc = server.start("fork_child_probe", full, work / "log", env=env, cwd=work).wait(60)
        report = json.loads((work / "report.json").read_text())
        runs[how] = (rc, report, lines(work / "log"))
    (rc_fresh, seen_fresh, out_fresh), (rc_forked, seen_forked, out_forked) = runs["fresh"], runs["forked"]
    assert rc_forked == rc_fresh == status
    assert seen_forked["probe"] == seen_fresh["probe"] == "the child's"
    assert seen_forked["cwd"] == str(tmp_path / "forked") and seen_forked["sys_argv_tail"] == seen_forked["argv"][:]
    assert seen_forked["pid"] not in (os.getpid(), server.proc.pid)
    # the same lines (a traceback's frames differ: runpy's against the server's); the thread's and atexit's too
    if argv == ["raise"]:
        for out in (out_fresh, out_forked):
            assert {"Traceback (most recent call last):", "RuntimeError: probe failure"} <= set(out)
        out_fresh, out_forked = ([line for line in out if line.startswith("probe")] for out in (out_fresh, out_forked))
    assert [line.replace(str(tmp_path / "fresh"), "W") for line in out_fresh] == \
        [line.replace(str(tmp_path / "forked"), "W") for line in out_forked]
    if argv == ["late-thread"]:
        assert {"thread finished", "atexit ran"} <= set(out_forked)


def test_an_uncaught_error_quoting_a_device_is_written_as_the_log_writes_a_traceback(server, tmp_path):
    """An entry module whose main raised an error quoting a device's text (a forged record after a
    newline, a terminal escape, a right-to-left override): Python's hook, and the fork server's
    ``traceback.print_exc``, wrote it raw; ``log_to_stderr``'s hook, which the fork server calls
    too, indents, escapes and cuts it, forked or not."""
    evil = "no data\n2026-01-01 00:00:00,000 aggregator WARNING job ops: done\x1b]0;owned\x07 dev\u202egnp.exe"
    for how in ("fresh", "forked"):
        work = tmp_path / how
        work.mkdir()
        argv = ["raise-quoting", str(work / "report.json"), evil]
        rc = fresh(argv, work, ENV, work / "log") if how == "fresh" else \
            server.start("fork_child_probe", argv, work / "log", env=ENV, cwd=work).wait(60)
        log = (work / "log").read_text()
        assert rc == 1, log
        assert "\x1b" not in log and "\u202e" not in log and "dev\\u202egnp.exe" in log, log
        at_column_zero = [line for line in log.splitlines() if not line.startswith("    ")]
        assert sorted(at_column_zero) == ["probe raise-quoting on stderr", "probe raise-quoting on stdout",
                                          "uncaught RuntimeError:"], log


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_signal_ends_a_forked_child_with_the_status_popen_reports(server, tmp_path, sig):
    child = server.start("fork_child_probe", ["wait", str(tmp_path / "report.json")], tmp_path / "log")
    deadline = time.monotonic() + 30
    while not (tmp_path / "report.json").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert child.poll() is None
    child.send_signal(sig)
    assert child.wait(30) == -sig == child.returncode
    waiting = server.start("fork_child_probe", ["wait", str(tmp_path / "r2.json")], tmp_path / "log2")
    with pytest.raises(subprocess.TimeoutExpired):
        waiting.wait(0.2)
    waiting.kill()
    assert waiting.wait(30) == -signal.SIGKILL


def test_a_client_that_goes_away_ends_the_server(tmp_path):
    s = ForkServer(["fork_child_probe"], ENV, cwd=REPO)
    assert s.start("fork_child_probe", ["exit", str(tmp_path / "r.json"), "0"], tmp_path / "log").wait(60) == 0
    s.close()
    assert s.proc.returncode == 0 and not s.alive
    with pytest.raises(RuntimeError, match="ended"):
        s.start("fork_child_probe", ["exit", str(tmp_path / "r.json"), "0"], tmp_path / "log", timeout=5)


def test_a_child_that_cannot_open_its_log_fails_alone_and_the_server_goes_on(server, tmp_path):
    """A request the child cannot carry out (its log's folder does not exist) ends that child with
    status 1; the server keeps serving the next request."""
    assert server.start("fork_child_probe", ["exit", str(tmp_path / "r.json"), "0"],
                        tmp_path / "missing" / "log").wait(60) == 1
    assert server.alive
    assert server.start("fork_child_probe", ["exit", str(tmp_path / "r.json"), "5"], tmp_path / "log").wait(60) == 5


def test_the_server_imports_torch_for_the_entries_whose_code_imports_it_where_it_computes(tmp_path):
    """The job and device code imports torch only where it computes (a command checking a config
    must not pay for it: tests/test_cli_errors.py), so a server for the aggregator's entry imports
    torch itself: else every forked aggregator would import it after its fork (~2 CPU-s each). The
    probe imports no torch of its own; a server for it alone does not have it."""
    seen = {}
    for preload in (["aggregator", "fork_child_probe"], ["fork_child_probe"]):
        s = ForkServer(preload, ENV, cwd=REPO)
        try:
            report = tmp_path / f"{len(preload)}.json"
            assert s.start("fork_child_probe", ["exit", str(report), "0"], tmp_path / "log", env=ENV).wait(60) == 0
        finally:
            s.close()
        seen[preload[0]] = json.loads(report.read_text())["torch_imported"]
    assert seen == {"aggregator": True, "fork_child_probe": False}


def test_a_process_keeps_one_server_per_preload_and_environment_and_a_childs_environment_is_its_callers(
        tmp_path, monkeypatch):
    """``shared_server``: the same preload in the same environment (pytest's per-test variable
    aside) is one server, another environment another; a dead server is started again; a child
    started with its caller's environment sees that, not the server's."""
    from fedfleet.emulation import fork_server

    monkeypatch.setattr(fork_server, "_kept", {})          # this test's servers only
    try:
        first = fork_server.shared_server(["fork_child_probe"], ENV)
        assert fork_server.shared_server(["fork_child_probe"], dict(ENV, PYTEST_CURRENT_TEST="another test")) is first
        other = fork_server.shared_server(["fork_child_probe"], dict(ENV, MALLOC_ARENA_MAX="3"))
        assert other is not first and other.proc.pid != first.proc.pid
        report = tmp_path / "r.json"
        assert first.start("fork_child_probe", ["exit", str(report), "0"], tmp_path / "log",
                           env=dict(ENV, PROBE="the child's")).wait(60) == 0
        assert json.loads(report.read_text())["probe"] == "the child's"
        first.proc.kill()
        first.proc.wait()
        again = fork_server.shared_server(["fork_child_probe"], ENV)
        assert again is not first and again.alive
    finally:
        for s in fork_server._kept.values():
            s.close()


def test_a_processs_later_fleets_start_no_fork_server(tmp_path, monkeypatch):
    """``fedfleet simulate``'s fleets (EmulatedFleet) take the process's kept servers: a second
    fleet starts no server (a start is ~2 CPU-s of imports), and each host and aggregator is
    started with its own fleet's environment."""
    from fedfleet.emulation import fork_server
    from fedfleet.emulation.profiles import sample_profiles
    from fedfleet.sim_config import SimConfig
    from fedfleet.simulate import EmulatedFleet

    started, requests = [], []

    class Child:
        pid = 0

        def poll(self):
            return 0

        def wait(self, timeout=None):
            return 0

        def send_signal(self, sig):
            pass

    class Server:                       # a server that starts nothing: what matters is how many are made
        alive = True

        def __init__(self, preload, env):
            started.append(tuple(preload))

        def start(self, module, argv, log, env=None, cwd=None, timeout=120):
            requests.append((module, env))
            return Child()

    monkeypatch.setattr(fork_server, "_kept", {})
    monkeypatch.setattr(fork_server, "ForkServer", Server)
    for run in ("one", "two"):
        out = tmp_path / run
        out.mkdir()
        # what differs between a test process's simulations: none of a server's business, but the child's own
        monkeypatch.setenv("PYTEST_CURRENT_TEST", run)
        monkeypatch.setenv("FEDFLEET_STATE_HOME", str(tmp_path / run / "state"))     # the suite's, per test
        with EmulatedFleet(SimConfig(devices=1), out, sample_profiles(1, 0), None, quiet=True) as fleet:
            fleet.run_aggregator(["aggregator", "serve"], out / "aggregator.log", "probe", 10)
    assert sorted(started) == [("aggregator", "fedfleet.ladd.aggregator_process"), ("fedfleet.emulation.worker",)]
    assert [(m, e["PYTEST_CURRENT_TEST"]) for m, e in requests] == [("fedfleet.emulation.worker", "one"), ("aggregator", "one"),
                                                           ("fedfleet.emulation.worker", "two"), ("aggregator", "two")]
    assert [e["FEDFLEET_STATE_HOME"] for _, e in requests] == [str(tmp_path / r / "state") for r in ("one", "one", "two", "two")]
