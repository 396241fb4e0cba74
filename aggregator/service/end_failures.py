"""What becomes of a job whose end (``JobRunner.finish``: its re-sum, finalize, final evaluation or
model) raises: tried again later, or ended now saying why; and what that end reports (``JobEnd``).

A later try can get past the environment's failures (``TRANSIENT_END_ERRORS``); the job then stays
running in the store and the service takes it up again after a growing wait (``service/backoff.py``,
``AggregatorService._finish_job``). Not every one of them is worth a wait, and none for ever:

* an OSError naming a path that is gone, of the wrong kind or refused to this process (a blob file
  deleted, a folder where a file was, no permission) fails the same way on every try: the job ends
  now, as on a deterministic exception. A disk that is full (ENOSPC, EDQUOT), failing (EIO), read-only
  or busy, and an OSError without an errno (what the retry tests inject) may mend: tried again;
* an SQLite error of the statement itself (SQLITE_ERROR: no such table or column) is the store's
  schema, not its state: permanent. Locked, busy, full or failing (every other code) may mend;
* a transient failure ends the job once it has failed ``end_attempts`` times in a row
  (``ServiceSettings.end_attempts``), saying so and naming the last error: before, a disk that never
  mended had the service rebuild and end the job once a minute for ever. The count is the job's row's
  (``jobs.end_failures``, ``JobRunner._tried_again``), so a service restarted within every wait
  counts on (it counted from 0 in each process, and tried for ever); the service's own count
  stands in where the store could not count one.

The commit of the job's final state (``Store.finish_job``) is part of its end: a store failing there
is sorted the same way (a failing store used to raise out of the service's loop). What follows that
commit (``after_commit``: the job's files, its round log's line, its devices' job-end notice, its
status) is not: the end is durable, so each of those fails on its own, logged, the others still
done, and the service goes on. A full disk writing results.json, or a store failing to keep the
job-end notice, used to raise out of ``finish`` and stop the service, the devices never told.
"""

from __future__ import annotations

import errno
import logging
import sqlite3
from dataclasses import dataclass
from typing import Callable, Iterable

from aggregator.jobs.base import Job

log = logging.getLogger("fedfleet.aggregator")


@dataclass(frozen=True)
class JobEnd:
    """What a finished job reports: the job whose model it is (None: its end failed, nothing made
    from its state is published), its last evaluation, and the model to commit (None: none)."""
    job: Job | None
    evaluation: dict
    model: dict | None


TRANSIENT_END_ERRORS = (OSError, MemoryError, sqlite3.OperationalError)

# The path itself is what fails: gone, not a folder where one is needed, a folder where a file is,
# refused to this process, too long, a loop of links. Python raises the subclasses for these errnos,
# but code may raise a plain OSError carrying one (or a subclass carrying none): both are asked.
PERMANENT_OS_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)
PERMANENT_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM,
                              errno.ENAMETOOLONG, errno.ELOOP})
SQLITE_ERROR = 1        # SQLite's primary result code of a statement it cannot run (its extended codes add high bits)


def is_transient(exc: BaseException) -> bool:
    """Whether a later try of the job's end may get past ``exc``."""
    if isinstance(exc, PERMANENT_OS_ERRORS) or (isinstance(exc, OSError) and exc.errno in PERMANENT_ERRNOS):
        return False
    # sqlite3 sets the code on the exceptions it raises; one raised by hand has none: taken as the store's state
    code = vars(exc).get("sqlite_errorcode") if isinstance(exc, sqlite3.OperationalError) else None
    if code is not None and code & 0xFF == SQLITE_ERROR:
        return False
    return isinstance(exc, TRANSIENT_END_ERRORS)


def end_failure(exc: BaseException, *, retried: bool, failed_before: int, attempts: int) -> str | None:
    """Why the job's end fails for good, or None when it is tried again. ``retried``: something takes
    the job up again (it is stored, and not cancelled); ``failed_before``: its end's failures in a row
    before this one; ``attempts``: how many tries a transient failure gets."""
    why = f"{type(exc).__name__}: {exc}"
    if not retried or not is_transient(exc):
        return f"the job cannot end: {why}"
    if failed_before + 1 >= attempts:
        return f"the job could not end after {failed_before + 1} attempts: {why}"
    return None


def after_commit(job_id: str, steps: Iterable[tuple[str, Callable[[], object]]]) -> None:
    """Do each of ``steps`` ((what, action)) of a job whose final state is committed: one that raises
    is logged and the next still done (the store holds the end: nothing of it is tried again)."""
    for what, action in steps:
        try:
            action()
        except Exception:
            log.exception("job %s: its end is committed, but %s failed", job_id, what)
