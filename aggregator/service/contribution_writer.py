"""Accepted contributions written to the store on their own thread, while the service goes on.

Storing a 6.6 MB Fed3R result (its payload file written and fsynced, then its row committed) is
the largest serial cost of ingest, and it is waiting, not computing: write() and fsync() release
the GIL. So the service hands the write to this thread and goes on receiving, decoding and
summing the next results; what must wait for durability still does:

* the result's ``accepted`` ack is held until its write completed (an ack never promises what a
  crash could lose); the job runner holds it and sends it from :meth:`JobRunner.on_stored`;
* anything that reads the stored contributions or freezes state derived from them waits for
  every write first (:meth:`flush`): a round's close and its checkpoint (a checkpoint holding a
  contribution the table lacks would count it twice after a restart: once restored, once resent),
  an evaluation that is stored, the job's finish, forgetting a device, a rebuild from the store.

The job applies a result before it is durable; if its write fails the job is rebuilt from the
store (which lacks it), the device gets no ack and sends it again. Writes complete in submission
order (one thread), so the table's order is the order the job applied them in. Results that queued
while a write was under way are stored together, each file durable, their rows in one commit.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable

from aggregator.storage.store import Store


class ContributionWriter:
    MAX_BATCH = 16          # results per transaction when the writer is behind

    def __init__(self, store: Store, wake: Callable[[], None]):
        self.store, self.wake = store, wake      # wake(): the service thread should collect completions
        self._todo: queue.Queue = queue.Queue()
        self._done: deque[tuple[str, BaseException | None]] = deque()
        self.pending: set[str] = set()           # message ids submitted, completion not collected yet
        self._thread = threading.Thread(target=self._run, daemon=True, name="contribution-writer")
        self._thread.start()

    def submit(self, job_id: str, round_: int, device: str, message_id: str, payload: bytes) -> None:
        self.pending.add(message_id)
        self._todo.put((job_id, round_, device, message_id, payload))

    def completed(self) -> list[tuple[str, BaseException | None]]:
        """(message id, error or None) of the writes finished since the last call (service thread)."""
        out = []
        while self._done:
            out.append(self._done.popleft())
            self.pending.discard(out[-1][0])
        return out

    def wait(self) -> None:
        """Block until every submitted write has finished."""
        self._todo.join()

    def settle(self) -> None:
        """Wait for every write and forget their completions (the job is about to be rebuilt from
        the store, which then holds every one that succeeded)."""
        self.wait()
        self.completed()

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join(60)

    def _run(self) -> None:
        closing = False
        while not closing:
            batch = [self._todo.get()]
            while batch[-1] is not None and len(batch) < self.MAX_BATCH:   # what queued meanwhile: one commit
                try:
                    batch.append(self._todo.get_nowait())
                except queue.Empty:
                    break
            closing = batch[-1] is None
            results = [item for item in batch if item is not None]
            error = None
            try:
                if results:
                    self.store.add_contributions(results)
            except BaseException as exc:        # none of the batch stored: the service thread rebuilds the job
                error = exc
            for item in results:
                self._done.append((item[3], error))
            for _ in batch:
                self._todo.task_done()
            if results:
                self.wake()
