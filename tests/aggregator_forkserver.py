"""The aggregator processes of the crash tests, forked from one process that imported the
aggregator once (a fork server), instead of each started by ``python -m aggregator``.

A crash test starts the aggregator tens of times (killed at a crash point, restarted on the same
state file), and every fresh interpreter spent ~2.5 s of CPU importing torch, numpy and the
aggregator before doing anything: most of such a test's time on CI's 2 cores. Here one server
process per test process imports ``aggregator.cli`` (in the environment the aggregator processes
get: this checkout, one BLAS thread) and forks a child per start; the child sets its environment,
working folder, argv and output file, then runs ``aggregator.cli.main`` and exits as
``python -m aggregator`` would (``sys.exit(main())``). What the tests check is unchanged: each
child is a separate process with nothing but the imported modules in common with the next one
(the server never runs ``main``), restarts from its state file alone, is SIGKILLed by its own
crash point, and the test sees its exit status (-9) and output.

The server is started with ``python -c`` so that the aggregator's ``spawn``-ed shard and ingest
processes do not re-import a ``__main__`` file, exactly as under ``python -m aggregator``.
Protocol (one JSON object a line): the client writes ``{"argv", "env", "cwd", "log"}``, the server
answers ``{"pid"}`` at once and ``{"exited": pid, "rc": status}`` when that child ends.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- the server
def serve() -> None:
    """The server's loop (in the server process). A forked child leaves it by raising SystemExit."""
    import aggregator.cli  # noqa: F401  what every child would import first
    import aggregator.api.server  # noqa: F401  and what ``serve`` imports on its way
    import aggregator.service.loop  # noqa: F401
    import aggregator.storage.store  # noqa: F401

    children: set[int] = set()
    stdin = os.fdopen(0, "rb", buffering=0)     # unbuffered: select() then sees every line that is not read yet
    # a child's exit wakes select() (a byte on this pipe), so the server sleeps until there is work
    woken, wake = os.pipe()
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        ready, _, _ = select.select([stdin, woken], [], [])
        if woken in ready:
            os.read(woken, 512)
        if stdin in ready:
            line = stdin.readline()
            if not line:                       # the test process went away: so do we
                return
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)     # as in a fresh interpreter
                os.close(woken)
                os.close(wake)
                _child(json.loads(line))       # never returns
            children.add(pid)
            _answer({"pid": pid})
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                _answer({"exited": pid, "rc": os.waitstatus_to_exitcode(status)})


def _answer(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _child(request: dict) -> None:
    """In the forked child: become ``python -m aggregator <argv>`` with the request's environment."""
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = [str(REPO / "aggregator" / "__main__.py"), *request["argv"]]
    from aggregator.cli import main

    sys.exit(main(request["argv"]))


# ----------------------------------------------------------------------------- the client
class ForkedAggregator:
    """One aggregator process started by the server: ``pid``, its exit status as Popen gives it
    (``-9`` for a SIGKILL), its output (stdout and stderr, interleaved) in ``log``."""

    def __init__(self, server: "ForkServer", pid: int, log: Path):
        self.server, self.pid, self.log = server, pid, log

    @property
    def returncode(self) -> int | None:
        return self.server.exits.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        server = self.server
        with server.changed:
            if not server.changed.wait_for(lambda: self.pid in server.exits or server.gone, timeout):
                raise subprocess.TimeoutExpired(f"aggregator {self.pid}", timeout)
        assert self.pid in server.exits, f"the aggregator fork server ended ({server.proc.wait()}) before its child"
        return server.exits[self.pid]

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class ForkServer:
    """The client side: starts the server process on first use (one per test process)."""

    _instance: "ForkServer | None" = None
    _instance_lock = threading.Lock()

    @classmethod
    def shared(cls) -> "ForkServer":
        with cls._instance_lock:
            if cls._instance is None or cls._instance.proc.poll() is not None:
                cls._instance = cls()
            return cls._instance

    def __init__(self):
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
        env.pop("FEDFLEET_CRASH_AT", None)
        self.proc = subprocess.Popen([sys.executable, "-c", "from aggregator_forkserver import serve; serve()"],
                                     env=env, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.exits: dict[int, int] = {}
        self.gone = False
        self.started: list[int] = []
        self.changed = threading.Condition()
        self.lock = threading.Lock()            # one start request in flight at a time
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            message = json.loads(line)
            with self.changed:
                if "pid" in message:
                    self.started.append(message["pid"])
                else:
                    self.exits[message["exited"]] = message["rc"]
                self.changed.notify_all()
        with self.changed:
            self.gone = True                    # every answer read: no exit is reported any more
            self.changed.notify_all()

    def start(self, argv: list[str], env: dict, cwd: Path, log: Path, timeout: float = 60) -> ForkedAggregator:
        """``python -m aggregator *argv`` in ``env`` and ``cwd``, its output appended to ``log``."""
        request = json.dumps({"argv": [str(a) for a in argv], "env": env, "cwd": str(cwd), "log": str(log)})
        with self.lock, self.changed:
            known = len(self.started)
            self.proc.stdin.write(request + "\n")
            self.proc.stdin.flush()
            if not self.changed.wait_for(lambda: len(self.started) > known or self.gone, timeout):
                raise AssertionError("the aggregator fork server did not answer")
            assert len(self.started) > known, f"the aggregator fork server ended ({self.proc.wait()})"
            return ForkedAggregator(self, self.started[known], log)


def start_aggregator(argv: list[str], env: dict, cwd: Path, log: Path) -> ForkedAggregator:
    """``argv`` as ``[sys.executable, "-m", "aggregator", *args]`` (what ``aggregator_cmd`` builds)."""
    assert argv[1:3] == ["-m", "aggregator"], argv
    return ForkServer.shared().start(argv[3:], env, cwd, log)


def run_aggregator_process(argv: list[str], env: dict, cwd: Path, log: Path, timeout: float) -> tuple[int, str]:
    """Run to its end (killed after ``timeout`` s, then TimeoutExpired as subprocess.run raises);
    (exit status, output)."""
    t0 = time.monotonic()
    proc = start_aggregator(argv, env, cwd, log)
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        raise
    return rc, proc.output() + f"\n[{time.monotonic() - t0:.1f}s]"
