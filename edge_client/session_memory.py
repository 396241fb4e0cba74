"""The device's replay guard on disk: what its round session remembers across restarts.

:class:`protocols.device_session.DeviceSession` skips a task created before the last task of its job the
device started (a captured task re-published), and that last task too once it was answered, and
declines an expired task once per job. That
memory is a few dozen small entries; kept only in the process, a restarted device would run a
captured task once more while its deadline lasts. A device with a state folder (``fedfleet device``'s by
default, or ``--state-dir``) keeps it there, in ``session.json``:

* written atomically (``protocols.files.write_atomic``: synced temp file, rename, folder synced)
  each time it changes, *before* the task's work starts, so a device killed mid-task still skips
  that task's replay, and before its answer is sent, so a restarted device (which keeps no
  answers) skips the answered task's replay instead of running it again;
* read once when the agent starts: a regular file of at most ``MAX_MEMORY_BYTES``, strict JSON as
  the envelope's header is read (``parse_strict_json``: no NaN, no duplicate keys, integers within
  the wire's range, nesting bounded), every entry checked; a torn or malformed file is refused
  whole with one warning and the device starts with an empty memory (as one without a state
  folder does), never stops or blocks (a FIFO in its place is not opened);
* a job's last start created later than the device's clock plus the grace is forgotten when read
  (written while the aggregator's clock ran ahead, it would have had the job's every later task
  skipped, across restarts);
* bounded: at most ``MAX_JOBS_REMEMBERED`` jobs kept, the newest;
* written through the store's temporary prefix (``TEMP_PREFIX``), so the store's sweep removes a crash's leftover;
* not job state: ``--forget-state`` and the store's budget leave it alone (it holds job and task
  ids and the aggregator's timestamps, nothing learned from the device's data).

A write that fails (a full disk) is logged once per kind of error and not retried until the
memory changes again; the session keeps its memory in the process meanwhile, as a device without
a state folder does. The Java device's ``SessionMemoryFile.java`` reads and writes the same file by
the same rules (``tests/test_device_session_traces.py`` feeds both the same files).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from protocols.envelope import parse_strict_json
from protocols.files import write_atomic
from protocols.regular_file import read_small_file
from protocols.device_session import DeviceSession

from edge_client.state import TEMP_PREFIX

log = logging.getLogger("fedfleet.device")

SESSION_FILE = "session.json"
# 64 jobs x (a 256-character id, a task id, a ts, the id again declined and again answered) in JSON,
# with room: 4-byte characters make that 264 KB
MAX_MEMORY_BYTES = 320 * 1024


class SessionMemoryFile:
    """``path``: where the session's memory lives (``<state folder>/session.json``)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._saved = None                  # the session's memory_changes last written
        self._failed_writes: set[str] = set()

    def load_into(self, session: DeviceSession, now: float | None = None) -> bool:
        """Recall the file's memory into ``session`` (``now``: the device's clock, by default
        time.time()); whether there was a valid one."""
        try:
            data = read_small_file(self.path, MAX_MEMORY_BYTES)
            session.recall(parse_strict_json(data), time.time() if now is None else now)
        except FileNotFoundError:
            return False
        except (OSError, ValueError, RecursionError) as exc:   # the parser's errors (UTF-8 too), recall's
            log.warning("the device's session memory %s is unreadable (%s): starting without it, so a "
                        "replayed task within its deadline may run once more", self.path, str(exc)[:200])
            return False
        finally:
            self._saved = session.memory_changes
        return True

    def save_if_changed(self, session: DeviceSession) -> None:
        """Write the session's memory if it changed since the last write (or load)."""
        if session.memory_changes == self._saved:
            return
        self._saved = session.memory_changes       # written, or failed: tried again at the next change
        text = json.dumps(session.memory(), separators=(",", ":"), ensure_ascii=False)    # as read: UTF-8
        try:
            # the store's temporary prefix: its sweep removes what a crash mid-write left
            write_atomic(self.path, text.encode("utf-8"), temp_prefix=TEMP_PREFIX)
        except OSError as exc:
            key = f"{type(exc).__name__} (errno {exc.errno})"     # not its text: that names a random temp file
            if key not in self._failed_writes and len(self._failed_writes) < 16:
                self._failed_writes.add(key)
                log.warning("writing the device's session memory %s failed (%s: %s): it is kept in memory "
                            "and written at its next change", self.path, key, str(exc)[:200])
