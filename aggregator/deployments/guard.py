"""The guard a deployment's stage must pass before it widens: conditions on the metrics computed
from the counts devices report (never an image, never a per-sample value).

Metrics, over the devices of the current stage that reported on the candidate:

    reports        devices that evaluated the candidate (distinct devices: one report each)
    refused        devices that could not load or verify it (they stay on their version)
    median_drop    the median over devices of each device's accuracy drop (its current head's
                   accuracy minus the candidate's on its held-out split), percentage points
    wma_candidate  weighted mean accuracy of the candidate, % (correct / held-out samples, pooled)
    wma_current    the same for the version it replaces
    wma_drop       wma_current - wma_candidate, percentage points (positive: the candidate is worse)

A device's counts are its own claim. Its weight in the pooled ``wma_*`` is bounded by what it can
have (``bounded``: at most the held-out size it reported before, never above a cap, and never above
twice the stage's median claimed size, ``DeploymentController._weight_caps``), so a liar moves them
by at most its share of the capped weight, no more than two typical devices'; ``median_drop`` weighs every device alike,
so k liars among n judged devices keep it between the lowest and highest honest device's drop
while k < n / 2: a canary of n tolerates ceil(n / 2) - 1 liars (3: 1, 5: 2, 20: 9) whenever its
honest devices agree on which side of the threshold the candidate is. The default guard is
``median_drop<=1.0`` with at least 3 reports (``min_reports``); every decision records the
metrics and each device's evidence (claimed n, weight used, drop).

A guard is one or more ``METRIC OP NUMBER`` joined by ``,`` (``wma_drop<=1.0,refused<=0``); ops
``<= < >= > ==``. Too few reports (``min_reports``) fails the stage as well: a rollout nobody
judged is not promoted.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass

import numpy as np

METRICS = ("reports", "refused", "median_drop", "wma_candidate", "wma_current", "wma_drop")
DEFAULT_GUARD, DEFAULT_MIN_REPORTS = "median_drop<=1.0", 3
OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt, "==": operator.eq}
_CONDITION = re.compile(r"^\s*([a-z_]+)\s*(<=|>=|==|<|>)\s*(-?[0-9]+(?:\.[0-9]+)?)\s*$")


@dataclass(frozen=True)
class DeviceReport:
    """What one device said about the candidate: counts on its held-out split, or why it refused."""
    n: int = 0
    correct_candidate: int = 0
    correct_current: int = 0
    refused: str = ""

    def bounded(self, cap: int) -> "DeviceReport":
        """The same accuracies on at most ``cap`` samples: a device's weight is bounded by what it can
        have, whatever it claims (counts scaled down, rounded; a refusal unchanged)."""
        if self.refused or self.n <= cap:
            return self
        scale = cap / self.n
        return DeviceReport(cap, round(self.correct_candidate * scale), round(self.correct_current * scale))

    def drop(self) -> float | None:
        """This device's accuracy drop in percentage points (None without samples)."""
        return 100.0 * (self.correct_current - self.correct_candidate) / self.n if self.n else None


@dataclass(frozen=True)
class Guard:
    conditions: tuple[tuple[str, str, float], ...]
    text: str

    @classmethod
    def parse(cls, text: str) -> "Guard":
        conditions, parts = [], []
        for part in filter(None, (p.strip() for p in str(text).split(","))):
            m = _CONDITION.match(part)
            if m is None or m.group(1) not in METRICS:
                raise ValueError(f"guard {part!r}: write METRIC OP NUMBER with METRIC one of {', '.join(METRICS)} "
                                 f"and OP one of {' '.join(OPS)} (e.g. wma_drop<=1.0)")
            value = float(m.group(3))
            if not math.isfinite(value):
                raise ValueError(f"guard {part[:40]!r}…: too large a number")
            conditions.append((m.group(1), m.group(2), value))
            parts.append(f"{m.group(1)}{m.group(2)}{m.group(3)}")    # the number as written: it parses back
        if not conditions:
            raise ValueError("a guard needs at least one condition (e.g. wma_drop<=1.0)")
        return cls(tuple(conditions), ",".join(parts))

    def failures(self, metrics: dict[str, float]) -> list[str]:
        """The conditions the metrics break, as text (empty: the guard passes)."""
        return [f"{m} {'unknown (no held-out samples)' if metrics.get(m) is None else format(metrics[m], '.4g')} "
                f"is not {op} {v:g}" for m, op, v in self.conditions
                if metrics.get(m) is None or not OPS[op](metrics[m], v)]


def stage_metrics(reports: dict[str, DeviceReport], caps: dict[str, int] | None = None) -> dict:
    """The guard's metrics over the reports of a stage's devices, each bounded by its cap in
    ``caps`` (none: as claimed); accuracies None without samples. ``evidence``: per judged device
    its claimed n, the weight used and its drop."""
    judged = {d: r for d, r in reports.items() if not r.refused}
    used = {d: r.bounded(caps[d]) if caps and d in caps else r for d, r in judged.items()}
    n = sum(r.n for r in used.values())
    cand = 100.0 * sum(r.correct_candidate for r in used.values()) / n if n else None
    cur = 100.0 * sum(r.correct_current for r in used.values()) / n if n else None
    drops = [x for x in (r.drop() for r in used.values()) if x is not None]
    evidence = {d: {"n": judged[d].n, "weight": r.n, "drop": r.drop()} for d, r in sorted(used.items())}
    return {"reports": float(len(judged)), "refused": float(len(reports) - len(judged)),
            "median_drop": float(np.median(drops)) if drops else None, "wma_candidate": cand,
            "wma_current": cur, "wma_drop": (cur - cand) if n else None, "evidence": evidence}
