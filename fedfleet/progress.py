"""A terminal progress bar fed by the aggregator's retained status topic."""

from __future__ import annotations

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
        done = s.get("contributions") or 0
        filled = int(self.width * min(done, self.total) / max(1, self.total))
        acc = s.get("accuracy")
        line = (f"  round {s.get('round', 0):>3} [{'#' * filled}{'.' * (self.width - filled)}] "
                f"{done}/{self.total} devices  online {s.get('devices_online', 0):>3}"
                + (f"  acc {acc:.4f}" if acc is not None else ""))
        # padded to the line it overwrites: a shorter line (an accuracy no longer shown) would
        # leave the old one's tail on the terminal
        shown, self._drawn = line.ljust(self._drawn), len(line)
        end = "\n" if s.get("state") in ("done", "failed", "stopped") else ""
        sys.stdout.write("\r" + shown + end)
        sys.stdout.flush()

    def close(self) -> None:
        self.link.stop()


class StepClock:
    """Wall time of each step of a run: a progress line as each ends, and the figures the report
    keeps (``timings_s``), so a slow run shows where its time went."""

    def __init__(self, say: Callable[[str], None]):
        self.say, self.started, self.steps = say, time.monotonic(), {}

    def done(self, step: str) -> None:
        now = time.monotonic()
        self.steps[step] = now - self.started - sum(self.steps.values())
        self.say(f"  {step}: {self.steps[step]:.0f} s (run so far {now - self.started:.0f} s)")
