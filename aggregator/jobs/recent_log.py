"""The latest entries of a log that grows with every round (a job's round log, its evaluations).

A FedBuff job opens a "round" at every dispatch and may run for days: kept whole in memory, its
round log grew ~0.65 KB a round for as long as the job ran. What the service and its reports
need in memory is the recent past; the whole log is in the store (rounds, evaluations) and in
``rounds.jsonl``. :class:`RecentLog` keeps the latest ``KEPT`` entries and counts those it let go
(``earlier``), so a report can say how many rounds came before the ones it shows.
"""

from __future__ import annotations

import collections
from typing import Iterable

KEPT = 1000


class RecentLog(collections.deque):
    """A deque of the latest ``maxlen`` entries; ``earlier``: how many were appended before them."""

    def __init__(self, entries: Iterable = (), maxlen: int | None = None):
        super().__init__((), KEPT if maxlen is None else maxlen)
        self.earlier = 0
        self.extend(entries)

    def append(self, entry) -> None:
        self.earlier += len(self) == self.maxlen
        super().append(entry)

    def extend(self, entries: Iterable) -> None:
        for entry in entries:
            self.append(entry)

    def __iadd__(self, entries: Iterable) -> "RecentLog":
        self.extend(entries)            # deque's own += bypasses append: the count would stop
        return self

    def __copy__(self) -> "RecentLog":
        copied = type(self)(self, self.maxlen)     # deque's copy rebuilds from the entries alone
        copied.earlier = self.earlier
        return copied

    copy = __copy__

    def __getitem__(self, index):
        """An index as a deque takes it, or a slice (a list of those entries)."""
        if isinstance(index, slice):
            return list(self)[index]
        return super().__getitem__(index)

    @property
    def total(self) -> int:
        """How many entries were ever appended (kept and let go)."""
        return self.earlier + len(self)
