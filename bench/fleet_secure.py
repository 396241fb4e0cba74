"""Secure aggregation at fleet scale: the same `fedfleet simulate` run plain and with --secure,
back to back, and the secure/plain ratios measured in this one run (issue #38, item 3).

    .venv/bin/python bench/fleet_secure.py --devices 2000                       # Fed3R vs Fed3R-Sync
    .venv/bin/python bench/fleet_secure.py --devices 2000 --pipeline fed3r-ft-oll --ft-rounds 3
    .venv/bin/python bench/fleet_secure.py --config runs/fleet-10k-ft.json --devices 2000 \
        --pipeline fed3r-ft-oll --ft-rounds 3 --fp-epochs 0    # secure FedAvg(ψ) at κ = 1,000
    .venv/bin/python bench/fleet_secure.py --devices 10000 --only secure        # one side only

Per run: wall time, the aggregator's job time, bytes uploaded per device, late results, and, sampled
from /proc every second, the CPU seconds and peak resident memory of the aggregator process
("server") and of the device hosts; the machine's load average before and after (the figures
are only comparable on an equally loaded machine). For a pipeline, each training phase's job
time (Fed3R, FedAvg(ψ) fine-tuning) and its time per round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLOCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _role(cmdline: str, comm: str, out: str) -> str | None:
    # simulate's processes are forks of its fork server (fedfleet/emulation/fork_server.py), named
    # by their /proc comm; a process started as ``python -m ...`` is known by its command line
    if comm in ("ff-aggregator", "ff-device-host"):
        return "server" if comm == "ff-aggregator" else "hosts"
    if out not in cmdline:
        return None
    if "aggregator" in cmdline and " serve" in cmdline:
        return "server"
    if "emulation.worker" in cmdline:
        return "hosts"
    return None


def _parent(pid: str) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return None


def _descends_from(pid: str, root: str) -> bool:
    """Whether ``pid`` is a descendant of ``root`` (its parent's parent's ... is ``root``)."""
    seen = set()
    while pid not in (None, "0", "1") and pid not in seen:
        if pid == root:
            return True
        seen.add(pid)
        pid = _parent(pid)
    return False


class ProcessSampler(threading.Thread):
    """Every second: CPU seconds (last seen) and peak RSS of each of this bench's descendant
    processes whose command line names ``out`` (or a fork of simulate's, by its name), summed per
    role. Only descendants: another session's ``fedfleet simulate`` forks have the same names, and
    counting them reported a 20.8 GB server peak. A process's CPU is read until it exits, so the
    last sample before its exit is kept: up to a second of CPU may be missed per process."""

    def __init__(self, out: str):
        super().__init__(daemon=True)
        self.out, self.stop, self.seen = out, threading.Event(), {}
        self.root, self.strangers = str(os.getpid()), set()

    def run(self):
        while not self.stop.is_set():
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                    role = _role(cmd, Path(f"/proc/{pid}/comm").read_text().strip(), self.out)
                    if role is None or pid in self.strangers:
                        continue
                    if pid not in self.seen and not _descends_from(pid, self.root):
                        self.strangers.add(pid)
                        continue
                    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                except (OSError, IndexError, UnicodeDecodeError):
                    continue
                cpu, rss = (int(stat[11]) + int(stat[12])) / CLOCK, int(stat[21]) * PAGE
                _, old_cpu, old_rss = self.seen.get(pid, (role, 0.0, 0))
                self.seen[pid] = (role, max(cpu, old_cpu), max(rss, old_rss))
            self.stop.wait(1.0)

    def figures(self) -> dict:
        roles: dict = {}
        for role, cpu, rss in self.seen.values():
            r = roles.setdefault(role, {"cpu_s": 0.0, "peak_rss_mb": 0.0})
            r["cpu_s"] += cpu
            r["peak_rss_mb"] += rss / 2**20
        return roles


def simulate(args, secure: bool) -> dict:
    out = f"{args.out}/{'secure' if secure else 'plain'}"
    cmd = [sys.executable, "-m", "fedfleet.cli", "simulate", "--config", args.config, "--devices", str(args.devices),
           "--pipeline", args.pipeline, "--out", out] + (["--secure"] if secure else [])
    if args.pipeline != "fed3r":
        cmd += ["--ft-rounds", str(args.ft_rounds)]
    if args.fp_epochs is not None:
        cmd += ["--fp-epochs", str(args.fp_epochs)]
    load_before = os.getloadavg()[0]
    sampler = ProcessSampler(out)
    sampler.start()
    started = time.monotonic()
    log = ROOT / f"{out}.log"            # the run's own output, to follow it while it runs
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as sink:
        proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=sink,
                              stderr=subprocess.STDOUT)
    wall = time.monotonic() - started
    sampler.stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): see {log}")
    report = json.loads((ROOT / out / "report.json").read_text())
    return {"cmd": " ".join(cmd[2:]), "wall_s": wall, "load": (load_before, os.getloadavg()[0]),
            "report": report, **sampler.figures()}


def phase_figures(report: dict) -> dict:
    """Per training phase: job time, rounds, bytes up per device, late results."""
    phases = report.get("phases") or {"fed3r": report}
    out = {}
    for name, p in phases.items():
        if not p.get("job_s"):
            continue
        devices = max(1, p.get("contributed") or report.get("devices", 1))
        out[name] = {"job_s": p["job_s"], "rounds": p.get("rounds"), "late": p.get("late"),
                     "mb_up_per_device": p.get("bytes_up", 0) / devices / 1e6}
    return out


def show(name: str, run: dict) -> None:
    r = run["report"]
    print(f"{name}: {run['cmd']}")
    print(f"  wall {run['wall_s']:.1f} s, load {run['load'][0]:.1f} → {run['load'][1]:.1f}; "
          f"server CPU {run.get('server', {}).get('cpu_s', 0):.1f} s, peak RSS "
          f"{run.get('server', {}).get('peak_rss_mb', 0):.0f} MB; hosts CPU {run.get('hosts', {}).get('cpu_s', 0):.1f} s, "
          f"peak RSS {run.get('hosts', {}).get('peak_rss_mb', 0):.0f} MB")
    for phase, f in phase_figures(r).items():
        print(f"  {phase}: job {f['job_s']:.1f} s over {f['rounds']} rounds, {f['mb_up_per_device']:.3f} MB up "
              f"per device, {f['late']} late")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="fleet-10k")
    ap.add_argument("--devices", type=int, default=2000)
    ap.add_argument("--pipeline", default="fed3r")
    ap.add_argument("--ft-rounds", type=int, default=3)
    ap.add_argument("--fp-epochs", type=int, help="the pipeline's OLL+FP epochs (0: OLL only; default: the config's)")
    ap.add_argument("--only", choices=("plain", "secure"))
    ap.add_argument("--out", default="runs/bench/fleet_secure")
    args = ap.parse_args()
    runs = {}
    for side in ("plain", "secure"):
        if args.only in (None, side):
            runs[side] = simulate(args, secure=side == "secure")
            show(side, runs[side])
    if len(runs) == 2:
        plain, secure = (phase_figures(runs[s]["report"]) for s in ("plain", "secure"))
        print(f"secure/plain wall time: {runs['secure']['wall_s'] / runs['plain']['wall_s']:.2f}x; server CPU: "
              f"{runs['secure']['server']['cpu_s'] / max(runs['plain']['server']['cpu_s'], 1e-9):.2f}x")
        for phase in plain.keys() & secure.keys():
            per_round = [f["job_s"] / max(1, f["rounds"] or 1) for f in (plain[phase], secure[phase])]
            print(f"  {phase}: job time {secure[phase]['job_s'] / plain[phase]['job_s']:.2f}x, per round "
                  f"{per_round[1] / per_round[0]:.2f}x, bytes up per device "
                  f"{secure[phase]['mb_up_per_device'] / max(plain[phase]['mb_up_per_device'], 1e-12):.1f}x")


if __name__ == "__main__":
    main()
