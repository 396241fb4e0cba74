"""A job's round log: ``rounds.jsonl`` in the job's output directory, one JSON object per line,
written as things happen (round opened, contribution applied, declined, rejected, late,
quarantined, evaluation, round closed, job ended) — what ``fedfleet admin logs JOB --follow``
streams through the admin API, as ``flwr log`` does.

It is a log for people, not a record the service recovers from (that is the store): a line is
flushed as it is written so a reader sees it at once, a failing disk loses lines but never stops
the job, and a restarted service appends to the same file. Only a regular file of that name is
written or read: a symbolic link or a FIFO planted there is neither followed nor waited on (the job
runs without its log, which says so once).

Readers page through it by byte offset (:func:`read_from`): only whole lines, at most
``max_bytes`` per call, so an API request's answer stays bounded however long the job ran.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from protocols.regular_file import not_regular, open_regular, open_regular_fd

log = logging.getLogger("fedfleet.aggregator")

FILE_NAME = "rounds.jsonl"
SETTING_PREFIX = "round_log/"        # store setting naming each job's log file, for the admin API
MAX_READ_BYTES = 256 * 1024
_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT


class RoundLog:
    """Appends one JSON line per event to ``path``; every line carries the time, job and event."""

    def __init__(self, path: Path, job_id: str):
        self.path, self.job_id = Path(path), job_id
        self._file = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # never through a link planted under its name (the aggregator appended to any file it
            # could write), never waiting on a FIFO there (the job's start hung)
            fd = open_regular_fd(self.path, _APPEND, follow_links=False, mode=0o666)
        except OSError as exc:
            log.warning("round log %s not written: %s", self.path, not_regular(exc) or exc)
            return
        self._file = open(fd, "a", encoding="utf-8")

    def write(self, event: str, round_: int | None = None, **fields) -> None:
        if self._file is None:
            return
        line = {"t": round(time.time(), 3), "job_id": self.job_id, "event": event,
                **({"round": round_} if round_ is not None else {}), **fields}
        try:
            self._file.write(json.dumps(line, default=str) + "\n")
            self._file.flush()
        except (OSError, ValueError) as exc:      # full disk, closed file: the job goes on without it
            log.warning("round log %s: %s", self.path, exc)

    def evaluation(self, round_: int, entry: dict) -> None:
        """An evaluation's scalar metrics (accuracy, contributions, ...); arrays stay in the store."""
        scalars = {k: v for k, v in entry.items() if isinstance(v, (int, float, str, bool)) and k not in ("round", "t")}
        self.write("evaluation", round_, elapsed_s=entry.get("t"), **scalars)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_from(path: Path, offset: int, max_bytes: int = MAX_READ_BYTES) -> tuple[list[dict], int]:
    """The whole lines of ``path`` from byte ``offset`` (at most ``max_bytes`` of them) and the
    offset to ask for next; a line not yet finished is left for the next call. A line that is not
    JSON (a torn write) comes back as ``{"event": "unreadable"}`` instead of failing the read. A
    name that is no regular file (none yet, a link, a FIFO) has no lines."""
    try:        # only the regular file it wrote: never a link's target, never waiting on a FIFO
        f = open_regular(path, follow_links=False)
    except OSError:
        return [], offset
    with f:
        f.seek(min(offset, os.fstat(f.fileno()).st_size))     # past the end (seek refuses a huge one): nothing yet
        chunk = f.read(max_bytes)
    end = chunk.rfind(b"\n") + 1
    if end == 0 and len(chunk) == max_bytes:      # one line longer than a page: skip it, say so
        return [{"event": "unreadable", "reason": f"line longer than {max_bytes} bytes"}], offset + len(chunk)
    lines = []
    for raw in chunk[:end].splitlines():
        try:
            lines.append(json.loads(raw))
        except ValueError:
            lines.append({"event": "unreadable"})
    return lines, offset + end
