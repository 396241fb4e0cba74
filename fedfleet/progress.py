"""A terminal progress bar fed by the aggregator's retained status topic."""

from __future__ import annotations

import math
import sys
import threading
import time
from typing import Callable

from protocols.envelope import EnvelopeError, decode
from protocols.mqtt_link import BrokerConfig, MqttLink
from protocols.topics import Topics


class StatusWatcher:
    def __init__(self, broker_url: str, topics: Topics, total: int, quiet: bool = False, width: int = 30,
                 job_id: str | None = None):
        self.total, self.quiet, self.width, self.job_id = total, quiet, width, job_id
        self._drawn = 0             # the length of the line last drawn
        self.last: dict = {}
        self.updates = threading.Event()
        self.link = MqttLink(f"watcher-{id(self):x}", BrokerConfig.from_url(broker_url), self._on_message,
                             subscriptions=[(topics.status, 1)], clean_start=True)
        self.link.start()

    def _on_message(self, topic: str, payload: bytes) -> None:
        try:
            body = decode(payload).body
        except EnvelopeError:
            return
        if self.job_id is not None and body.get("job") != self.job_id:
            return          # the retained status of an earlier job on the same broker
        self.last = body
        self.updates.set()
        if not self.quiet:
            self._draw()

    def _draw(self) -> None:
        s = self.last
        # numbers only: the status topic is the broker's, unsigned here, and a text in place of a
        # count went to the terminal raw (an escape sequence) or raised in the MQTT callback
        done, rnd, online = (_count(s.get(k)) for k in ("contributions", "round", "devices_online"))
        filled = int(self.width * min(done, self.total) / max(1, self.total))
        acc = s.get("accuracy") if _is_number(s.get("accuracy")) else None
        line = (f"  round {rnd:>3} [{'#' * filled}{'.' * (self.width - filled)}] "
                f"{done}/{self.total} devices  online {online:>3}"
                + (f"  acc {acc:.4f}" if acc is not None else ""))
        # padded to the line it overwrites: a shorter line (an accuracy no longer shown) would
        # leave the old one's tail on the terminal
        shown, self._drawn = line.ljust(self._drawn), len(line)
        end = "\n" if s.get("state") in ("done", "failed", "stopped") else ""
        sys.stdout.write("\r" + shown + end)
        sys.stdout.flush()

    def close(self) -> None:
        self.link.stop()


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value) -> int:
    """A status's count, or 0 for anything but a non-negative number."""
    return int(value) if _is_number(value) and value >= 0 else 0


class StepClock:
    """Wall time of each step of a run: a progress line as each ends, and the figures the report
    keeps (``timings_s``), so a slow run shows where its time went."""

    def __init__(self, say: Callable[[str], None]):
        self.say, self.started, self.steps = say, time.monotonic(), {}

    def done(self, step: str) -> None:
        now = time.monotonic()
        self.steps[step] = now - self.started - sum(self.steps.values())
        self.say(f"  {step}: {self.steps[step]:.0f} s (run so far {now - self.started:.0f} s)")
