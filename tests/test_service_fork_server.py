"""aggregator/compute/fork_server.py's start_fork_server_here: the service's fork server as a fork
of the service (started before its first thread), against multiprocessing's own server as the
reference. Each case runs in a fresh interpreter: a process has one fork server for its life."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# What the workers report: whether they see a value the parent set at run time (a fork of the
# parent inherits it; a fresh interpreter cannot), their parent (the server), and their answers.
PROGRAM = textwrap.dedent("""
    import json, multiprocessing, os, sys, threading, time
    import aggregator.compute.fork_server as fs

    def probe(_):
        return [getattr(fs, "MARK", None), os.getppid()]

    if __name__ == "__main__":
        fs.MARK = "set in the parent"
        if sys.argv[1] == "thread":           # a service that already runs a thread
            threading.Thread(target=time.sleep, args=(3,), daemon=True).start()
        here = fs.start_fork_server_here(("aggregator.compute.fork_server",))
        ctx = fs.fork_server_context("aggregator.compute.fork_server")
        with ctx.Pool(2) as pool:
            answers = pool.map(probe, range(4))
        proc = ctx.Process(target=sys.exit, args=(7,))
        proc.start()
        proc.join()
        server = multiprocessing.forkserver._forkserver._forkserver_pid
        cmdline = open(f"/proc/{server}/cmdline", "rb").read().split(b"\\0")
        print(json.dumps({"here": here, "server": server, "answers": answers, "exitcode": proc.exitcode,
                          "server_is_fresh_interpreter": b"-c" in cmdline}), flush=True)
""")


def run(case: str, tmp_path: Path) -> dict:
    script = tmp_path / "service.py"
    script.write_text(PROGRAM)
    proc = subprocess.run([sys.executable, str(script), case], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":                      # ended, not yet reaped by its init
            return True
        time.sleep(0.05)
    return False


def test_a_single_threaded_service_forks_its_own_server_and_its_workers_inherit_its_state(tmp_path):
    report = run("single", tmp_path)
    assert report["here"] == report["server"] and not report["server_is_fresh_interpreter"]
    assert report["answers"] == [["set in the parent", report["server"]]] * 4
    assert report["exitcode"] == 7                  # a worker's exit status comes back as with the reference
    assert gone(report["server"])                   # the server ends with its service


def test_a_service_with_threads_keeps_multiprocessing_s_own_server(tmp_path):
    report = run("thread", tmp_path)
    assert report["here"] is None and report["server_is_fresh_interpreter"]
    assert report["answers"] == [[None, report["server"]]] * 4      # the reference: nothing inherited
    assert report["exitcode"] == 7
    assert gone(report["server"])


def test_a_killed_service_leaves_no_server_behind(tmp_path):
    """SIGKILL: no atexit, no cleanup; the server sees its pipe's last writer gone and ends."""
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys
        import aggregator.compute.fork_server as fs
        print(fs.start_fork_server_here(("aggregator.compute.fork_server",)), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """))
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9
    server = int(proc.stdout.strip())
    assert gone(server)


def test_a_server_that_died_is_replaced_by_multiprocessing_s_own(tmp_path):
    """The service's server killed: the next worker's start notices (multiprocessing checks its
    server before each start) and starts a fresh server; the worker runs."""
    script = tmp_path / "replaced.py"
    script.write_text(textwrap.dedent("""
        import json, multiprocessing, os, signal, sys
        import aggregator.compute.fork_server as fs

        if __name__ == "__main__":
            first = fs.start_fork_server_here(("aggregator.compute.fork_server",))
            os.kill(first, signal.SIGKILL)
            while open(f"/proc/{first}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
                pass                                   # dead, left for multiprocessing to reap
            proc = fs.fork_server_context().Process(target=sys.exit, args=(3,))
            proc.start()
            proc.join()
            second = multiprocessing.forkserver._forkserver._forkserver_pid
            print(json.dumps([first, second, proc.exitcode]), flush=True)
    """))
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first, second, exitcode = json.loads(proc.stdout.splitlines()[-1])
    assert second != first and exitcode == 3


def test_a_service_that_cannot_fork_its_server_keeps_multiprocessing_s_own(tmp_path):
    """No process to spare at the service's start (the fork fails): a warning, nothing left open,
    and the first worker starts multiprocessing's own server."""
    script = tmp_path / "no_fork.py"
    script.write_text(textwrap.dedent("""
        import json, multiprocessing, os, sys
        import aggregator.compute.fork_server as fs

        def no_fork():
            raise BlockingIOError(11, "Resource temporarily unavailable")

        if __name__ == "__main__":
            fds = sorted(os.listdir("/proc/self/fd"))
            real_fork, os.fork = os.fork, no_fork
            here = fs.start_fork_server_here(("aggregator.compute.fork_server",))
            os.fork = real_fork
            left_open = sorted(set(os.listdir("/proc/self/fd")) - set(fds))
            proc = fs.fork_server_context().Process(target=sys.exit, args=(5,))
            proc.start()
            proc.join()
            server = multiprocessing.forkserver._forkserver._forkserver_pid
            fresh = b"-c" in open(f"/proc/{server}/cmdline", "rb").read().split(b"\\0")
            print(json.dumps([here, left_open, proc.exitcode, fresh]), flush=True)
    """))
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    here, left_open, exitcode, fresh = json.loads(proc.stdout.splitlines()[-1])
    assert here is None and exitcode == 5 and fresh
    assert "cannot start one here" in proc.stderr and "Resource temporarily unavailable" in proc.stderr
    assert len(left_open) <= 1          # at most the resource tracker's pipe, which multiprocessing keeps


def test_a_service_whose_cuda_is_initialised_keeps_multiprocessing_s_own(tmp_path):
    """A fork of a process that initialised CUDA cannot use CUDA, and a worker's job may run on the
    GPU: such a service never forks its server. (No GPU here: torch is told CUDA is initialised.)"""
    script = tmp_path / "cuda.py"
    script.write_text(textwrap.dedent("""
        import json, multiprocessing, sys
        import torch
        import aggregator.compute.fork_server as fs

        if __name__ == "__main__":
            torch.cuda.is_initialized = lambda: True
            here = fs.start_fork_server_here(("aggregator.compute.fork_server",))
            proc = fs.fork_server_context().Process(target=sys.exit, args=(4,))
            proc.start()
            proc.join()
            server = multiprocessing.forkserver._forkserver._forkserver_pid
            fresh = b"-c" in open(f"/proc/{server}/cmdline", "rb").read().split(b"\\0")
            print(json.dumps([here, proc.exitcode, fresh]), flush=True)
    """))
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == [None, 4, True]


def test_aggregator_serve_forks_its_server_only_when_it_will_have_workers():
    from aggregator.cli import build_parser, forks_workers, service_settings
    from aggregator.compute.mask_expansion import cpu_mask_expansion_plan

    def forks(*options: str) -> bool:
        args = build_parser().parse_args(["serve", "--out", "out", *options])
        return forks_workers(args, service_settings(args))

    many_cores = cpu_mask_expansion_plan()[0] == "processes"      # the secure mask applier's processes
    assert forks() is many_cores
    assert forks("--shards", "2") and forks("--ingest-workers", "2")
    assert forks("--shards", "2", "--ray", "auto") is many_cores    # the shards are Ray actors
