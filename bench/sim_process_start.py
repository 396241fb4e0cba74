"""What starting one of ``fedfleet simulate``'s processes costs (a job's aggregator, a device
host): ``python -m MODULE`` as a fresh interpreter, against a fork of the simulation's fork
server (``fedfleet/emulation/fork_server.py``), which imported the modules once.

Measured per start, for ``python -m aggregator --help`` (imports the aggregator and torch, parses,
exits 0): the wall time until the process has exited, and its CPU-seconds (a ``Popen``'s from
this process's reaped children, a fork's from the server's, read from /proc when it reaped it).
The server's own start (its imports, once a simulation) is printed apart; then what a child's
end costs, by the interpreter's teardown of the inherited modules against the server's
``_finish`` (forks of this process, which imported the aggregator). Ratios are of medians in
this one run.

    .venv/bin/python bench/sim_process_start.py [--starts 5]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from fedfleet.emulation.fork_server import ForkServer  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def reaped_cpu(pid: int) -> float:
    """CPU-seconds of the children ``pid`` has reaped (/proc/<pid>/stat cutime + cstime)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / TICK


def fresh_interpreter(starts: int) -> list[tuple[float, float]]:
    out = []
    for _ in range(starts):
        cpu, t0 = children_cpu(), time.perf_counter()
        subprocess.run([sys.executable, "-m", "aggregator", "--help"], stdout=subprocess.DEVNULL, check=True)
        out.append((time.perf_counter() - t0, children_cpu() - cpu))
    return out


def forked(server: ForkServer, starts: int, log: pathlib.Path) -> list[tuple[float, float]]:
    out = []
    for _ in range(starts):
        cpu, t0 = reaped_cpu(server.proc.pid), time.perf_counter()
        if server.start("aggregator", ["--help"], log).wait(60) != 0:
            raise SystemExit(f"the forked aggregator failed:\n{log.read_text()[-2000:]}")
        out.append((time.perf_counter() - t0, reaped_cpu(server.proc.pid) - cpu))
    return out


def child_end_cpu(ends: int) -> tuple[float, float]:
    """(median CPU-s of a fork of this process, which imported the aggregator, that ends by the
    interpreter's teardown; that ends as the fork server's children do, ``_finish``)."""
    import aggregator.cli  # noqa: F401  what the server's children inherit
    from fedfleet.emulation.fork_server import _finish

    def cpu_of_a_child(end) -> float:
        before = children_cpu()
        pid = os.fork()
        if pid == 0:
            end()
        os.waitpid(pid, 0)
        return children_cpu() - before

    teardown = statistics.median(cpu_of_a_child(lambda: sys.exit(0)) for _ in range(ends))
    finish = statistics.median(cpu_of_a_child(lambda: os._exit(_finish(0))) for _ in range(ends))
    return teardown, finish


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--starts", type=int, default=5)
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        log = pathlib.Path(tmp) / "child.log"
        t0 = time.perf_counter()
        server = ForkServer(["aggregator", "fedfleet.emulation.worker"], env)
        server.start("aggregator", ["--help"], log).wait(120)          # answers once its imports are done
        server_start = time.perf_counter() - t0
        try:
            fresh = fresh_interpreter(args.starts)
            forks = forked(server, args.starts, log)
        finally:
            server.close()
    wall = [statistics.median(w for w, _ in runs) for runs in (fresh, forks)]
    cpu = [statistics.median(c for _, c in runs) for runs in (fresh, forks)]
    print(f"python -m aggregator --help, {args.starts} starts each (medians):")
    print(f"  fresh interpreter   {wall[0]:.3f} s wall, {cpu[0]:.2f} CPU-s")
    print(f"  fork of the server  {wall[1]:.3f} s wall, {cpu[1]:.2f} CPU-s   "
          f"(the server's own start, once a simulation: {server_start:.2f} s)")
    print(f"fork / fresh: wall {wall[1] / wall[0]:.3f}x, CPU {cpu[1] / max(cpu[0], 1e-9):.3f}x")
    teardown, finish = child_end_cpu(args.starts)
    print(f"a child's end: interpreter teardown {teardown:.3f} CPU-s, _finish then os._exit {finish:.3f} CPU-s "
          f"({finish / max(teardown, 1e-9):.3f}x)")


if __name__ == "__main__":
    main()
