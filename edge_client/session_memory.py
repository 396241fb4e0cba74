"""The device's replay guard on disk: what its round session remembers across restarts.

:class:`protocols.rounds.DeviceSession` skips a task created before the last task of its job the
device started (a captured task re-published) and declines an expired task once per job. That
memory is a few dozen small entries; kept only in the process, a restarted device would run a
captured task once more while its deadline lasts. A device with a state folder (``fedfleet device
--state-dir``) keeps it there, in ``session.json``:

* written atomically (``protocols.files.write_atomic``: synced temp file, rename, folder synced)
  each time it changes, *before* the task's work starts, so a device killed mid-task still skips
  that task's replay;
* read once when the agent starts, checked entry by entry: a torn, edited or foreign file is
  refused whole with one warning and the device starts with an empty memory (as one without a
  state folder does), never stops;
* bounded: at most ``MAX_MEMORY_BYTES`` are read, at most ``MAX_JOBS_REMEMBERED`` jobs kept;
* written through the store's temporary prefix (``.tmp-``), so the store's sweep removes a crash's leftover;
* not job state: ``--forget-state`` and the store's budget leave it alone (it holds job and task
  ids and the aggregator's timestamps, nothing learned from the device's data).

A write that fails (a full disk) is logged once per error; the session keeps its memory in the
process, as a device without a state folder does.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from protocols.files import write_atomic
from protocols.rounds import DeviceSession

log = logging.getLogger("fedfleet.device")

SESSION_FILE = "session.json"
MAX_MEMORY_BYTES = 256 * 1024     # 64 jobs x (a 256-character id, a task id, a ts) in JSON, with room


class SessionMemoryFile:
    """``path``: where the session's memory lives (``<state folder>/session.json``)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._saved = None                  # the session's memory_changes last written
        self._failed_writes: set[str] = set()

    def load_into(self, session: DeviceSession) -> bool:
        """Recall the file's memory into ``session``; whether there was a valid one."""
        try:
            with open(self.path, "rb") as f:
                data = f.read(MAX_MEMORY_BYTES + 1)
            if len(data) > MAX_MEMORY_BYTES:
                raise ValueError(f"larger than {MAX_MEMORY_BYTES} bytes")
            session.recall(json.loads(data))
        except FileNotFoundError:
            return False
        except (OSError, ValueError, RecursionError) as exc:   # json's errors, recall's, a deeply nested file
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
        try:
            # the store's temporary prefix: its sweep removes what a crash mid-write left
            write_atomic(self.path, json.dumps(session.memory(), separators=(",", ":")).encode(), temp_prefix=".tmp-")
        except OSError as exc:
            key = f"{type(exc).__name__}: {exc}"[:200]
            if key not in self._failed_writes and len(self._failed_writes) < 16:
                self._failed_writes.add(key)
                log.warning("writing the device's session memory %s failed (%s): it is kept in memory "
                            "until the next change", self.path, key)
            return
        self._saved = session.memory_changes
