"""What a device's replay guard costs in memory (protocols/rounds.py ``DeviceSession.last_started``
and ``expired_declined``): the bytes a session holds per job it remembers, measured with
tracemalloc over many sessions (as a host of emulated devices holds them), for 1, 4 and
``MAX_JOBS_REMEMBERED`` jobs, each job's last task a real message id (32 hex digits) and a signed
ts; and the same with every job also declined once as expired (the guard's worst case).

Compare with a whole idle emulated device's footprint (``bench/fleet_scale.py``: 0.03 MB a device
at 100,000 devices, stop 49): the printed ratio is the guard's bytes over that figure.

    .venv/bin/python bench/device_session_memory.py [--sessions 5000]
"""

from __future__ import annotations

import argparse
import gc
import tracemalloc
import uuid

from protocols.messages import TaskRef
from protocols.device_session import MAX_JOBS_REMEMBERED, DeviceSession, TaskArrived, WorkFailed

IDLE_DEVICE_BYTES = 0.03 * 2**20        # bench/fleet_scale.py's figure for a whole idle emulated device


def bytes_per_session(sessions: int, jobs: int, expired: bool) -> float:
    """Bytes the sessions' guards grew by, per session, after remembering ``jobs`` jobs each."""
    held = [DeviceSession() for _ in range(sessions)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for i, session in enumerate(held):
        for j in range(jobs):
            ref = TaskRef(f"job-{j:04d}", 1, uuid.uuid4().hex)
            session.handle(TaskArrived(ref, "fed3r.stats", {}, 1e12, sent_at=1.7e9 + i))
            session.handle(WorkFailed(ref, "bench"))
            if expired:     # a task of the job received past its deadline: declined once, remembered
                late = TaskRef(f"job-{j:04d}", 2, uuid.uuid4().hex)
                session.handle(TaskArrived(late, "fed3r.stats", {}, 0.0, received_at=1e9, sent_at=1.8e9 + i))
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    return grown / sessions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=5000)
    args = parser.parse_args()
    print(f"{args.sessions} device sessions; ratio = bytes / a whole idle emulated device ({IDLE_DEVICE_BYTES:.0f} B)")
    for jobs in (1, 4, MAX_JOBS_REMEMBERED):
        for expired in (False, True):
            held = bytes_per_session(args.sessions, jobs, expired)
            print(f"  {jobs:3d} job(s){', each declined once' if expired else '':22s}: {held:9.0f} B a device, "
                  f"{held / jobs:5.0f} B a job, ratio {held / IDLE_DEVICE_BYTES:.3f}")


if __name__ == "__main__":
    main()
