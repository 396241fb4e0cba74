"""The device's sample-window ledger: no two Fed3R answers differenced down to a few samples.

A ``fed3r.stats`` answer (and Fed3R-Sync's, which masks the same statistics) covers a **window**
[s, e) of the device's training samples, chosen by the aggregator: s = ``from_sample`` (streaming;
0 without it) and e = the device's sample count, or s + ``max_samples`` when the task caps samples
(``cap_samples``). A = Σ z zᵀ and B = Σ z yᵀ are sums over the window, so two answers over windows
one sample apart differ by exactly that sample's z zᵀ and z yᵀ: its features and its label (a
review's finding, ``tests/test_sample_windows.py``). Sums and differences of several answers
isolate more: [0, 10), [10, 20) and [0, 21) differ pairwise by 11 samples, yet the third less the
first two is sample 20 alone. So the rule is on every answer the device gave, not on pairs:

**The boundary rule.** The device keeps the boundaries (both ends) of every window it answered,
0 among them from the start. A window is answered only when each of its two ends either is a
boundary already kept or lies at least ``min_difference`` samples (default 8) from every kept
boundary and from the window's other end. Then every answered window is a union of the
intervals between neighbouring kept boundaries, each of at least ``min_difference`` samples, and
so is anything added up or subtracted from the answers: no combination of answers isolates fewer
than ``min_difference`` samples. One exception: a device's first answer, when it starts at its
first sample ([0, e): all its data, or its first e under a cap), is answered whatever e: what a
Fed3R job shows of a device by design (a device of 3 samples; a DP job capping each device at
``max_samples`` = 1, whose centrally noised release trusts the aggregator with each device's
statistics). Nothing answered can be subtracted from it; after it the rule holds.

So a re-run over the same window (a redelivered task, the next round of a Fed3R-Sync job, the
centre round and the rounds after it) is answered, and so are honest streaming increments of at
least ``min_difference`` new samples ([c, n), c a kept boundary); a smaller increment, or a window
that moves an end by fewer samples, is declined with the reason, and asked again later the device
answers once enough new samples have gathered.

Samples are identified by their index: the device's data only appends (``Fed3RStatsTask.add_samples``;
the Java device's is fixed), so an index names the same sample at every task. A device whose data is
replaced in place (another data folder, another held-out split) keeps the boundaries, which
still bound its windows, but two answers over the same window of different data differ by what
changed: that is not a windowing choice of the aggregator's and this ledger does not see it.

**Kept.** In the device's state folder (``sample_windows.json``, ``{"boundaries": [0, ...]}``
ascending) and in memory: a window is written (``protocols.files.write_atomic``, the store's
temporary prefix) *before* its answer leaves the handler, and an answer whose window could not be
written is declined (the boundaries it would have added are taken back), so a restarted device
never forgets a window it answered. Bounded: at most ``MAX_BOUNDARIES``; a window that would add
one past that is declined (the ledger never forgets a boundary: a forgotten one could be approached
again one sample off). Not job state: ``--forget-state`` leaves it (it guards the device's data, it
holds no data). The Java device (``SampleWindows.java``) keeps the same file by the same rule, and
fails closed in the same two cases, with the same words:

**Lost** (fails closed). The file is read when the handlers are built: a regular file of at most
``MAX_FILE_BYTES``, strict JSON, ascending integers from 0. A missing file is a fresh device. Any
other file (damaged, not strict JSON, not ascending, too large, a directory, unreadable...) means
the device no longer knows which windows it answered: starting from {0} would exempt a first
answer again ([0, n) before, [0, n - 1) after: sample n - 1). So the ledger is *lost*: a warning
naming the file and why, then every window is declined with ``LOST_REASON`` and nothing is written
(the bad file stays for the operator). Recovery is the operator's, then a restart: repair the file,
or move it aside to start a fresh ledger, accepting that the device forgets every window it
answered (docs/deployment.md, "systemd unit for the device agent").

**Unkept** (no state folder, ``path`` None; fails closed). Nothing outlives the process, so the
device answers only a window of all its samples from the first, [0, n) (re-runs, a job capping at
``max_samples`` >= n, a plain Fed3R job): two such answers over the same data are the same answer,
whatever restarts between them. A capped window of fewer, or a streaming increment, is declined
(``unkept_reason``: it names the missing state folder). Data that grows between restarts of such a
device ([0, n), restart, [0, n + 1)) is not seen: a device whose data grows keeps a state folder.
In-process the boundary rule still applies (``add_samples`` between two answers).
"""

from __future__ import annotations

import bisect
import json
import logging
import threading
from pathlib import Path

from protocols.envelope import parse_strict_json
from protocols.files import write_atomic
from protocols.regular_file import read_small_file

from edge_client.state import TEMP_PREFIX

log = logging.getLogger("fedfleet.device")

WINDOWS_FILE = "sample_windows.json"
MIN_DIFFERENCE = 8
MAX_BOUNDARIES = 4096
# 4,096 integers below 2^63 (19 digits and a comma each) and the key: 80 KB, with room
MAX_FILE_BYTES = 96 * 1024
# the decline of every window once the kept file could not be read (SampleWindows.LOST_REASON: the same words)
LOST_REASON = (f"this device's sample-window ledger ({WINDOWS_FILE} in its state folder) could not be read: it "
               "answers no Fed3R window until an operator repairs that file or moves it aside (a fresh ledger "
               "forgets every window this device answered)")


def unkept_reason(start: int, end: int, samples: int) -> str:
    """The decline of a window that is not all of a device's samples, on a device without a state folder."""
    return (f"samples [{start}, {end}) of {samples}: this device has no state folder (--state-dir) to keep the "
            "windows it answered across a restart, so it answers only a window of all its samples from the first")


class SampleWindowLedger:
    """The boundaries of the windows a device answered; ``path``: where they are kept (None: no
    state folder, only windows of all the device's samples are answered). ``lost``: why the kept
    file could not be read (then no window is answered), or None. Thread-safe: two tasks of one
    device never both pass on the same boundary."""

    def __init__(self, path: str | Path | None = None, min_difference: int = MIN_DIFFERENCE):
        if isinstance(min_difference, bool) or not isinstance(min_difference, int) or min_difference < 1:
            raise ValueError(f"min_difference must be an integer >= 1, got {min_difference!r}")
        self.path = None if path is None else Path(path)
        self.min_difference = min_difference
        self._lock = threading.Lock()
        self._boundaries = [0]               # ascending
        self.lost: str | None = None
        if self.path is not None:
            self._load()

    @property
    def boundaries(self) -> list[int]:
        with self._lock:
            return list(self._boundaries)

    def refusal(self, start: int, end: int, samples: int) -> str | None:
        """Why the window [start, end) of the device's ``samples`` samples may not be answered, or None."""
        with self._lock:
            return self._refusal(start, end, samples)

    def record(self, start: int, end: int, samples: int) -> str | None:
        """Keep [start, end) as answered (checked again: another task may have answered meanwhile)
        and write it down; why the answer may not go out, or None."""
        with self._lock:
            reason = self._refusal(start, end, samples)
            if reason is not None:
                return reason
            new = [b for b in (start, end) if b not in self._boundaries]
            if not new:
                return None
            before = self._boundaries
            self._boundaries = sorted(set(before) | set(new))
            if self.path is None:
                return None
            try:
                write_atomic(self.path, json.dumps({"boundaries": self._boundaries}, separators=(",", ":")).encode(),
                             temp_prefix=TEMP_PREFIX)
            except OSError as exc:
                self._boundaries = before        # not remembered across a restart: not answered
                log.warning("writing the device's sample windows %s failed (%s)", self.path, str(exc)[:200])
                return (f"this device could not write down the sample window [{start}, {end}) "
                        f"({type(exc).__name__}): a window it could forget is not answered")
            return None

    def _refusal(self, start: int, end: int, samples: int) -> str | None:
        if self.lost is not None and self._load() is not None:      # read again: repaired or moved aside meanwhile?
            return LOST_REASON
        if self.path is None and (start, end) != (0, samples):
            return unkept_reason(start, end, samples)
        kept = self._boundaries
        new = [b for b in (start, end) if b not in kept]
        if not new or (kept == [0] and start == 0):
            return None                      # a re-run, or the first answer from the first sample
        if len(kept) + len(new) > MAX_BOUNDARIES:
            return (f"this device keeps {len(kept)} sample-window boundaries, its most: it answers only "
                    f"windows whose ends are among them")
        for b in new:
            near, gap = nearest(kept, b)
            if b == end and start not in kept and end - start < gap:   # the window's other end, new too
                near, gap = start, end - start
            if gap < self.min_difference:
                return (f"samples [{start}, {end}): a window boundary at {b} lies {gap} sample(s) from the "
                        f"boundary {near} of a window answered (or this one): answers could be differenced "
                        f"down to fewer than {self.min_difference} samples")
        return None

    def _load(self) -> str | None:
        """Read the kept file: its boundaries, or [0] where there is none (a fresh device, or one whose
        lost file the operator moved aside); ``lost`` and returned: why it cannot be read. A lost
        ledger is read again at every window asked of it, so a repaired file (or one moved aside)
        serves the next task without a restart; the warning is logged once per reason."""
        try:
            self._boundaries = checked_boundaries(parse_strict_json(read_small_file(self.path, MAX_FILE_BYTES)))
        except FileNotFoundError:
            self._boundaries = [0]
        except (OSError, ValueError, RecursionError) as exc:
            why = str(exc)[:200]
            if why != self.lost:                 # the file is kept as it is, for the operator: never written over
                log.warning("the device's sample windows %s are unreadable (%s): no Fed3R window is answered until "
                            "the file is repaired or moved aside", self.path, why)
            self.lost = why
            return why
        if self.lost is not None:
            log.warning("the device's sample windows %s are readable again: Fed3R windows are answered by them",
                        self.path)
        self.lost = None
        return None


def nearest(kept: list[int], b: int) -> tuple[int, int]:
    """The kept boundary nearest ``b`` (the lower one on a tie) and its distance."""
    i = bisect.bisect_left(kept, b)
    near = min(kept[max(i - 1, 0):i + 1], key=lambda k: (abs(k - b), k))
    return near, abs(near - b)


def checked_boundaries(doc) -> list[int]:
    """The file's boundaries: strictly ascending integers from 0, at most MAX_BOUNDARIES."""
    if not isinstance(doc, dict) or set(doc) != {"boundaries"} or not isinstance(doc["boundaries"], list):
        raise ValueError('not {"boundaries": [...]}')
    values = doc["boundaries"]
    if not values or len(values) > MAX_BOUNDARIES:
        raise ValueError(f"{len(values)} boundaries (1 to {MAX_BOUNDARIES})")
    if any(isinstance(v, bool) or not isinstance(v, int) or v >= 2**63 for v in values):
        raise ValueError("a boundary that is not an integer")
    if values[0] != 0 or any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError("boundaries not strictly ascending from 0")
    return values


__all__ = ["LOST_REASON", "MAX_BOUNDARIES", "MIN_DIFFERENCE", "SampleWindowLedger", "WINDOWS_FILE"]
