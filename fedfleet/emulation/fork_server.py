"""Where a simulation's processes come from: forks of one server that imported their code once.

Why. ``fedfleet simulate`` starts a process per device host and one per job's aggregator (three
to six jobs a pipeline). Each was ``python -m MODULE``: a fresh interpreter that spent ~2 CPU-s
importing torch, numpy and the job code before doing anything (``bench/sim_process_start.py``),
seconds of a short run's wall time on a small machine, and the same again at every job. Here
one server process, started with the children's environment (its malloc and BLAS settings are
read at interpreter start, so they must be the server's), imports the entry modules once, and
each start is a ``fork`` of it: milliseconds. What the children see is unchanged: each is a
separate process with its own pid, output file, environment, working folder and argv, running
``MODULE``'s ``main(argv)`` and exiting with its status as ``python -m MODULE`` would; SIGTERM,
SIGKILL and exit statuses (``-9`` for a SIGKILL) work as on a ``subprocess.Popen``.

Never a fork of the simulation's own process, whose threads (MQTT, progress) may hold locks a
child would inherit held: the server is single-threaded (it imports, selects, forks, reaps).
The same server runs the crash tests' aggregators (tests/aggregator_forkserver.py).

Why not ``multiprocessing``'s fork server (``aggregator/compute/fork_server.py``, which the
aggregator's own shard and ingest workers fork from): that server is an interpreter started in
the parent's environment, and what a child here must inherit is read at interpreter start
(glibc's ``MALLOC_ARENA_MAX``/``MALLOC_MMAP_THRESHOLD_``, torch's ``OMP_NUM_THREADS``); and its
children are ``Process`` targets, not ``python -m`` programs with their own output file, exit
status and Popen-like handle, which the fleet and the tests stop, signal and wait for.

Protocol (one JSON object a line, the client on the server's stdin/stdout): the client writes
``{"module", "argv", "env", "cwd", "log"}``, the server answers ``{"pid"}`` at once and
``{"exited": pid, "rc": status}`` when that child ends. The server exits when its stdin closes
(the client went away); its running children are left to finish, as a ``Popen``'s would be.

A process that runs several simulations (a pipeline's caller, the test suite's workers) keeps its
servers (:func:`shared_server`): a server's start is its imports, ~2 CPU-s, and two per simulation
were most of a small simulation's CPU beside its devices' work.
"""

from __future__ import annotations

import atexit
import importlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

# ``python -m`` module -> the module whose ``main(argv)`` it runs (its ``__main__`` calls that)
ENTRY_POINTS = {"aggregator": "aggregator.cli"}
# the entries whose every child imports torch on its way: the server imports it once. The job and device
# code imports torch where it computes (a command checking a config must not pay its import), so the
# entry's own modules leave it out, and each child would import it after its fork (~2 CPU-s each).
# Optional: a torch-free device install runs its hosts without it.
TORCH_ENTRIES = frozenset({"aggregator", "fedfleet.ladd.aggregator_process", "fedfleet.emulation.worker"})
# a child's /proc/<pid>/comm (its command line is the server's): what process tables show
PROCESS_NAMES = {"aggregator": "ff-aggregator", "fedfleet.emulation.worker": "ff-device-host",
                 "fedfleet.ladd.aggregator_process": "ff-aggregator"}


# ----------------------------------------------------------------------------- the server
def serve(preload: list[str]) -> None:
    """The server's loop (in the server process); a forked child never returns to it."""
    for module in preload:
        importlib.import_module(ENTRY_POINTS.get(module, module))
        if module in TORCH_ENTRIES:
            try:
                importlib.import_module("torch")
            except ImportError:
                pass
    children: set[int] = set()
    stdin = os.fdopen(0, "rb", buffering=0)     # unbuffered: select() then sees every line not read yet
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
            if not line:                       # the client went away: so do we
                return
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)     # as in a fresh interpreter
                os.close(woken)
                os.close(wake)
                _child(json.loads(line))       # ends in os._exit
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
    """In the forked child: become ``python -m MODULE ARGV`` with the request's environment."""
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    # the server's streams wrote to its pipe; these write through to the log (PYTHONUNBUFFERED)
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    module = request["module"]
    try:
        Path("/proc/self/comm").write_text(PROCESS_NAMES.get(module, module)[:15])
    except OSError:
        pass                                   # not Linux: the name is cosmetic
    sys.argv = [module, *request["argv"]]
    try:
        code = importlib.import_module(ENTRY_POINTS.get(module, module)).main(request["argv"])
    except SystemExit as stop:
        code = stop.code
    except BaseException:
        sys.excepthook(*sys.exc_info())       # log_to_stderr's, where the module's main set it up
        code = 1
    os._exit(_finish(code))


def _finish(code) -> int:
    """What interpreter exit does that a child's threads and output need (non-daemon threads
    joined, atexit handlers run, logging and the streams flushed; multiprocessing's children end
    the same way), without tearing down the modules inherited from the server: that touches, and
    so copies page by page, every object the server imported, ~0.5 CPU-s a child
    (``bench/sim_process_start.py``). The exit status as ``sys.exit(code)`` would set it."""
    threading._shutdown()
    atexit._run_exitfuncs()
    logging.shutdown()
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code & 0xFF


# ----------------------------------------------------------------------------- the client
class ForkedProcess:
    """One process started by the server, as much of ``subprocess.Popen`` as its users need:
    ``pid``, ``poll``/``wait``/``returncode`` (``-N`` for a signal N), ``send_signal``, ``kill``;
    its output (stdout and stderr, interleaved) is in ``log``."""

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
                raise subprocess.TimeoutExpired(f"forked process {self.pid}", timeout)
        if self.pid not in server.exits:
            raise RuntimeError(f"the fork server ended ({server.proc.wait()}) before its child {self.pid}")
        return server.exits[self.pid]

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class ForkServer:
    """The client side: the server process (``preload``: the ``python -m`` modules it will run,
    imported once; ``env``: the environment it starts in, the children's by default)."""

    def __init__(self, preload: list[str], env: dict | None = None, cwd: str | Path | None = None):
        self.env = dict(os.environ if env is None else env)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from fedfleet.emulation.fork_server import serve; serve({list(preload)!r})"],
            env=self.env, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.exits: dict[int, int] = {}
        self.gone = False
        self.started: list[int] = []
        self.changed = threading.Condition()
        self.lock = threading.Lock()            # one start request in flight at a time
        threading.Thread(target=self._read, daemon=True, name="fork-server-answers").start()

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

    def start(self, module: str, argv: list[str], log: Path, env: dict | None = None,
              cwd: str | Path | None = None, timeout: float = 120) -> ForkedProcess:
        """``python -m MODULE *argv`` (in ``env``, the server's by default, and ``cwd``), its output
        written to ``log`` (from its start). ``timeout``: for the server's first answer (its imports, the first time)."""
        request = json.dumps({"module": module, "argv": [str(a) for a in argv], "env": self.env if env is None else env,
                              "cwd": str(cwd or os.getcwd()), "log": str(log)})
        with self.lock, self.changed:
            known = len(self.started)
            try:
                self.proc.stdin.write(request + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError):     # the server is gone, or closed
                self.gone = True
            if not self.changed.wait_for(lambda: len(self.started) > known or self.gone, timeout):
                raise RuntimeError(f"the fork server did not answer in {timeout:.0f} s")
            if len(self.started) <= known:
                raise RuntimeError(f"the fork server ended (exit {self.proc.wait()}) before starting {module}")
            return ForkedProcess(self, self.started[known], log)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """The server exits (its children run on until they end or are stopped)."""
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# a process's kept servers: (preload, the environment they started in) -> server
_kept: dict[tuple, ForkServer] = {}
_kept_lock = threading.Lock()
# set anew for every test (pytest's name of it; the suite's per-test device state home, which only
# `fedfleet device` reads, when it runs); read by no server at its start (a child gets its caller's
# environment with each start)
PER_MOMENT_VARIABLES = frozenset({"PYTEST_CURRENT_TEST", "FEDFLEET_STATE_HOME"})


def shared_server(preload: list[str], env: dict) -> ForkServer:
    """This process's server for ``preload`` in ``env``, started on first use (and again if it died),
    then kept until the process exits. What a server's environment decides is read at its start
    (malloc, BLAS and torch settings), so callers share a server only when their environments are
    the same; a child's own environment is its caller's, given to each ``start``."""
    key = (tuple(preload), tuple(sorted((k, v) for k, v in env.items() if k not in PER_MOMENT_VARIABLES)))
    with _kept_lock:
        server = _kept.get(key)
        if server is None or not server.alive:
            if not _kept:
                atexit.register(_close_kept)
            server = _kept[key] = ForkServer(list(preload), env)
        return server


def _close_kept() -> None:
    with _kept_lock:
        servers = list(_kept.values())
        _kept.clear()
    for server in servers:
        server.close()
