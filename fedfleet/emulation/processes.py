"""Child processes of a simulation (aggregator, device workers, brokers): stop them all, politely
first; their memory."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path


def stop_all(procs: list, first_is_done: bool = True, grace_s: float = 30.0) -> None:
    """SIGTERM every still-running process (all but the first, which is waited for, when
    ``first_is_done``), then wait for each and SIGKILL whatever is still there after ``grace_s``.
    ``procs``: ``subprocess.Popen``s or ``fork_server.ForkedProcess``es (the same methods)."""
    for p in procs[1:] if first_is_done else procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
        except (RuntimeError, OSError):     # its fork server is gone: the next processes still go
            try:
                p.kill()
            except (RuntimeError, OSError):
                pass


def process_rss_mb(pid: int | str) -> float:
    """A process's resident memory (Linux /proc; ``"self"``: this one), 0 where unknown."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0
