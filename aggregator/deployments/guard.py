"""The guard a deployment's stage must pass before it widens: conditions on the metrics computed
from the counts devices report (never an image, never a per-sample value).

Metrics, over the devices of the current stage that reported on the candidate:

    reports        devices that evaluated the candidate
    refused        devices that could not load or verify it (they stay on their version)
    wma_candidate  weighted mean accuracy of the candidate, % (correct / held-out samples, pooled)
    wma_current    the same for the version it replaces
    wma_drop       wma_current - wma_candidate, percentage points (positive: the candidate is worse)

A guard is one or more ``METRIC OP NUMBER`` joined by ``,`` (``wma_drop<=1.0,refused<=0``); ops
``<= < >= > ==``. Too few reports (``min_reports``) fails the stage as well: a rollout nobody
judged is not promoted.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

METRICS = ("reports", "refused", "wma_candidate", "wma_current", "wma_drop")
OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt, "==": operator.eq}
_CONDITION = re.compile(r"^\s*([a-z_]+)\s*(<=|>=|==|<|>)\s*(-?[0-9]+(?:\.[0-9]+)?)\s*$")


@dataclass(frozen=True)
class DeviceReport:
    """What one device said about the candidate: counts on its held-out split, or why it refused."""
    n: int = 0
    correct_candidate: int = 0
    correct_current: int = 0
    refused: str = ""


@dataclass(frozen=True)
class Guard:
    conditions: tuple[tuple[str, str, float], ...]
    text: str

    @classmethod
    def parse(cls, text: str) -> "Guard":
        conditions = []
        for part in filter(None, (p.strip() for p in str(text).split(","))):
            m = _CONDITION.match(part)
            if m is None or m.group(1) not in METRICS:
                raise ValueError(f"guard {part!r}: write METRIC OP NUMBER with METRIC one of {', '.join(METRICS)} "
                                 f"and OP one of {' '.join(OPS)} (e.g. wma_drop<=1.0)")
            conditions.append((m.group(1), m.group(2), float(m.group(3))))
        if not conditions:
            raise ValueError("a guard needs at least one condition (e.g. wma_drop<=1.0)")
        return cls(tuple(conditions), ",".join(f"{m}{op}{v:g}" for m, op, v in conditions))

    def failures(self, metrics: dict[str, float]) -> list[str]:
        """The conditions the metrics break, as text (empty: the guard passes)."""
        return [f"{m} {'unknown (no held-out samples)' if metrics.get(m) is None else format(metrics[m], '.4g')} "
                f"is not {op} {v:g}" for m, op, v in self.conditions
                if metrics.get(m) is None or not OPS[op](metrics[m], v)]


def stage_metrics(reports: dict[str, DeviceReport]) -> dict[str, float | None]:
    """The guard's metrics over the reports of a stage's devices (accuracies None without samples)."""
    judged = [r for r in reports.values() if not r.refused]
    n = sum(r.n for r in judged)
    cand = 100.0 * sum(r.correct_candidate for r in judged) / n if n else None
    cur = 100.0 * sum(r.correct_current for r in judged) / n if n else None
    return {"reports": float(len(judged)), "refused": float(len(reports) - len(judged)), "wma_candidate": cand,
            "wma_current": cur, "wma_drop": (cur - cand) if n else None}
