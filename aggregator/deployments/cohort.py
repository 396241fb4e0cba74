"""Who runs the candidate at each stage of a deployment.

The canary cohort is one of
* a seeded fraction (``5%``): a device is in the fraction f when the first 8 bytes of
  sha256("{seed}:{device}") read as an integer are below f * 2**64 — the same devices for the same
  seed on every aggregator, and a larger fraction always holds a smaller one (a widening stage
  never drops a device that already runs the candidate);
* devices carrying a tag (``tags:north,lab``), from the tags the operator gave them (never the
  ``tags`` a device announces: a device must not choose its canary);
* an explicit list (``devices:cam-1,cam-2``).
Each later stage holds the canary plus the seeded fraction the operator chose (25 %, then 100 %).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from protocols.topics import check_device_id


def in_fraction(device: str, fraction: float, seed: int) -> bool:
    point = int.from_bytes(hashlib.sha256(f"{seed}:{device}".encode()).digest()[:8], "big")
    return point < fraction * 2 ** 64


def parse_percent(text: str) -> float:
    """``25%`` or ``0.25`` -> 0.25, in (0, 1]."""
    s = str(text).strip()
    try:
        value = float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError:
        raise ValueError(f"{text!r} is not a fraction (write 5% or 0.05)") from None
    if not 0 < value <= 1:
        raise ValueError(f"{text!r}: a fraction must be above 0 % and at most 100 %")
    return value



def parse_stages(text: str) -> tuple[float, ...]:
    """``25%,100%`` -> (0.25, 1.0): a deployment's stages as requested, each wider than the last and
    the last 100 %. A stage no wider than the one before reaches no new device (``Deployment`` itself
    takes equal stages: one stored that way must still load)."""
    fractions = tuple(parse_percent(s) for s in str(text).split(",") if s.strip())
    if not fractions or fractions[-1] != 1.0 or any(a >= b for a, b in zip(fractions, fractions[1:])):
        raise ValueError(f"stages {text!r}: increasing fractions in (0, 1] ending at 1.0 (100 %), "
                         "each wider than the one before")
    return fractions

@dataclass(frozen=True)
class CohortRule:
    kind: str                      # fraction | tags | devices
    fraction: float = 0.0
    names: tuple[str, ...] = ()    # the tags, or the devices
    seed: int = 0

    @classmethod
    def parse(cls, text: str, seed: int = 0) -> "CohortRule":
        s = str(text).strip()
        for kind in ("tags", "devices"):
            if s.startswith(kind + ":"):
                names = tuple(sorted({n.strip() for n in s[len(kind) + 1:].split(",") if n.strip()}))
                if not names:
                    raise ValueError(f"cohort {text!r} names no {kind}")
                if kind == "devices":
                    names = tuple(check_device_id(n) for n in names)
                return cls(kind, names=names, seed=seed)
        return cls("fraction", fraction=parse_percent(s), seed=seed)

    def text(self) -> str:
        """What the deployment stores, and parses again when it is loaded: exactly this rule."""
        if self.kind != "fraction":
            return f"{self.kind}:{','.join(self.names)}"
        percent = f"{self.fraction * 100:g}%"
        return percent if parse_percent(percent) == self.fraction else repr(self.fraction)

    def canary(self, devices: dict[str, tuple[str, ...]]) -> set[str]:
        """devices: device -> its tags."""
        if self.kind == "fraction":
            return {d for d in devices if in_fraction(d, self.fraction, self.seed)}
        if self.kind == "tags":
            return {d for d, tags in devices.items() if set(tags) & set(self.names)}
        return set(self.names) & set(devices)

    def stage(self, fraction: float | None, devices: dict[str, tuple[str, ...]]) -> set[str]:
        """The devices of a stage: the canary (fraction None), or the canary plus a seeded fraction."""
        members = self.canary(devices)
        if fraction is not None:
            members |= {d for d in devices if in_fraction(d, fraction, self.seed)}
        return members
