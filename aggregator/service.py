"""The aggregator process: MQTT in, round state machines and a job in the middle, MQTT out.

Threading: paho's network thread only enqueues ``(topic, payload)``; one service thread does
everything else (decode, validate, state machines, strategy math, publishing), so job state has
a single writer and needs no locks. Every inbound message is checked before it can touch state:
envelope structure and size, sender == the device named by the topic, device enrolled, job and
round ids, then the kind-specific payload checks (shapes, dtypes, NaN/Inf). Anything that fails
is logged and counted in ``rejections`` and, for results, acknowledged as ``rejected``.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from protocols import messages as M
from protocols.chunking import DEFAULT_CHUNK_SIZE, MessageAssembler
from protocols.envelope import Envelope, EnvelopeError, encode
from protocols.mqtt_link import BrokerConfig, MqttLink
from protocols.rounds import (ApplyResult, Declined, DeviceLost, ResultArrived, ResultInvalid, RoundClosed, RoundCoordinator,
                              SendAck, Tick)
from protocols.topics import AGGREGATOR_ID, Topics

from .jobs import Job

log = logging.getLogger("fedfleet.aggregator")


@dataclass
class ServiceStats:
    bytes_in: int = 0
    results_accepted: int = 0
    rejections: Counter = field(default_factory=Counter)
    late: int = 0
    duplicates: int = 0


class AggregatorService:
    def __init__(self, job: Job, broker: BrokerConfig, out_dir: Path, topics: Topics = Topics(),
                 enrolled: set[str] | None = None, eval_set: tuple[np.ndarray, np.ndarray] | None = None,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, max_message_bytes: int = 256 * 1024 * 1024,
                 tick_s: float = 0.2, evaluate_every_contribution: bool = True):
        self.job = job
        self.topics = topics
        self.enrolled = enrolled
        self.eval_set = eval_set
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.chunk_size = chunk_size
        self.tick_s = tick_s
        self.evaluate_every_contribution = evaluate_every_contribution
        self.assembler = MessageAssembler(max_message_bytes=max_message_bytes)
        self.stats = ServiceStats()
        self.online: set[str] = set()
        self.seen_devices: set[str] = set()
        self.rounds: dict[int, RoundCoordinator] = {}
        self.current: RoundCoordinator | None = None
        self.history: list[dict] = []
        self.round_log: list[dict] = []
        self._q: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._started = False
        self._done = False
        self.link = MqttLink(AGGREGATOR_ID, broker, on_message=lambda t, p: self._q.put((t, p)),
                             subscriptions=[(topics.all_outboxes, 1), (topics.all_presence, 1)],
                             on_connect=lambda: None)

    # ------------------------------------------------------------------ lifecycle
    def run(self, timeout_s: float | None = None) -> dict:
        self.link.start()
        self._t0 = time.monotonic()
        try:
            while not self._stop.is_set() and not self._done:
                if timeout_s is not None and time.monotonic() - self._t0 > timeout_s:
                    log.error("job timed out after %.0fs", timeout_s)
                    break
                try:
                    topic, payload = self._q.get(timeout=self.tick_s)
                    self._on_payload(topic, payload)
                except queue.Empty:
                    pass
                self._tick(time.monotonic())
        finally:
            summary = self._finish()
            self.link.stop()
        return summary

    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------ inbound
    def _on_payload(self, topic: str, payload: bytes) -> None:
        self.stats.bytes_in += len(payload)
        device = self.topics.device_of(topic)
        if device is None:
            self.stats.rejections["bad topic"] += 1
            return
        try:
            env = self.assembler.feed(payload)
        except EnvelopeError as exc:
            self._reject(device, None, f"malformed: {exc}")
            return
        if env is None:
            return
        if env.sender != device:
            self._reject(device, None, f"sender {env.sender!r} does not own topic {topic}")
            return
        if topic.endswith("/out") and self.enrolled is not None and device not in self.enrolled:
            self._reject(device, None, "unknown device (not enrolled)")
            return
        if env.type == M.PRESENCE:
            self._on_presence(device, env)
        elif env.type in (M.RESULT, M.DECLINE):
            self._on_result(device, env)
        else:
            self._reject(device, env.id, f"unexpected message type {env.type!r}")

    def _on_presence(self, device: str, env: Envelope) -> None:
        if self.enrolled is not None and device not in self.enrolled:
            return
        if env.body.get("state") == "online":
            self.online.add(device)
            self.seen_devices.add(device)
        else:
            self.online.discard(device)
            if self.current is not None:
                self._execute(self.current.handle(DeviceLost(device)))

    def _on_result(self, device: str, env: Envelope) -> None:
        try:
            ref, kind = M.parse_result_ref(env)
        except EnvelopeError as exc:
            self._reject(device, env.id, str(exc))
            return
        if ref.job != self.job.config.job_id:
            self._reject(device, env.id, f"unknown job {ref.job!r}")
            return
        coord = self.rounds.get(ref.round)
        if coord is None:
            self._reject(device, env.id, f"no round {ref.round} in job {ref.job}")
            return
        if env.type == M.DECLINE:
            self._execute(coord.handle(Declined(device, str(env.body.get("reason", "")))))
            return
        try:
            if kind != self.job.kind:
                raise EnvelopeError(f"result kind {kind!r} does not match the job's {self.job.kind!r}")
            payload = self.job.parse_result(env)
        except EnvelopeError as exc:
            self.stats.rejections["invalid payload"] += 1
            log.warning("rejected result from %s: %s", device, exc)
            self._execute(coord.handle(ResultInvalid(device, env.id, str(exc))))
            return
        self._execute(coord.handle(ResultArrived(device, env.id, payload)))

    def _reject(self, device: str, message_id: str | None, reason: str) -> None:
        self.stats.rejections[reason.split(":")[0]] += 1
        log.warning("rejected message from %s: %s", device, reason)

    # ------------------------------------------------------------------ actions
    def _execute(self, actions: list) -> None:
        for act in actions:
            if isinstance(act, ApplyResult):
                self.job.apply(act.device, act.result)
                self.stats.results_accepted += 1
                if self.evaluate_every_contribution:
                    self._record_eval()
            elif isinstance(act, SendAck):
                if act.status == "late":
                    self.stats.late += 1
                elif act.status == "duplicate":
                    self.stats.duplicates += 1
                self._send(act.device, M.ack_message(AGGREGATOR_ID, act.ref, act.status, act.reason))
            elif isinstance(act, RoundClosed):
                self.round_log.append({"round": act.round, "accepted": list(act.accepted),
                                       "dropped": list(act.dropped), "declined": list(act.declined),
                                       "rejected": list(act.rejected), "t": time.monotonic() - self._t0})
                log.info("round %d closed: %d accepted, %d dropped, %d declined", act.round,
                         len(act.accepted), len(act.dropped), len(act.declined))
                self.job.close_round(act)
                if not self.evaluate_every_contribution:
                    self._record_eval()
                self.current = None
                self._publish_status("running")

    def _send(self, device: str, env: Envelope) -> None:
        self.link.publish_envelope(self.topics.inbox(device), env, chunk_size=self.chunk_size)

    def _record_eval(self) -> None:
        Z, y = self.eval_set if self.eval_set is not None else (None, None)
        entry = self.job.evaluate(Z, y)
        entry["t"] = time.monotonic() - self._t0
        entry["bytes_in"] = self.stats.bytes_in
        self.history.append(entry)
        self._publish_status("running")

    # ------------------------------------------------------------------ scheduling
    def _tick(self, now: float) -> None:
        if self.current is not None:
            self._execute(self.current.handle(Tick(now)))
            return
        if not self._started:
            enough = len(self.online) >= max(1, self.job.config.expected_devices)
            if not enough and not (self.online and now - self._t0 > self.job.config.start_timeout_s):
                return
            self._started = True
        participants = self.job.next_participants(self.online)
        if not participants:
            if self.job.finished(self.online, self.seen_devices):
                self._done = True
            return
        deadline_wall = time.time() + self.job.config.round_timeout_s
        coord = RoundCoordinator(self.job.round, frozenset(participants), now + self.job.config.round_timeout_s)
        self.rounds[self.job.round] = self.current = coord
        for dev in participants:
            params, tensors = self.job.task_for(dev)
            msg = M.task_message(AGGREGATOR_ID, self.job.config.job_id, self.job.round, self.job.kind,
                                 params, deadline_wall)
            msg.tensors.update(tensors)
            self._send(dev, msg)
        self._publish_status("running")

    # ------------------------------------------------------------------ output
    def _publish_status(self, state: str) -> None:
        last = self.history[-1] if self.history else {}
        body = {"state": state, "job": self.job.config.job_id, "round": self.job.round,
                "contributions": self.job.contributions, "devices_online": len(self.online),
                "devices_known": len(self.seen_devices), "accuracy": last.get("accuracy"),
                "bytes_in": self.stats.bytes_in}
        env = Envelope(type=M.STATUS, sender=AGGREGATOR_ID, body=body)
        self.link.publish(self.topics.status, encode(env), retain=True)

    def _finish(self) -> dict:
        if not self.history or self.history[-1]["contributions"] != self.job.contributions:
            self._record_eval()
        np.savez(self.out_dir / "model.npz", **self.job.model_arrays())
        np.savez(self.out_dir / "statistics.npz", **self.job.state_dict())
        summary = {
            "state": "done" if self._done else "stopped",
            "config": self.job.config.to_dict(),
            "contributed": self.job.contributed,
            "rounds": self.round_log,
            "history": self.history,
            "final": self.history[-1] if self.history else {},
            "bytes_in": self.stats.bytes_in,
            "bytes_out": self.link.bytes_sent,
            "results_accepted": self.stats.results_accepted,
            "rejections": dict(self.stats.rejections),
            "late": self.stats.late,
            "duplicates": self.stats.duplicates,
            "wall_s": time.monotonic() - self._t0,
        }
        (self.out_dir / "results.json").write_text(json.dumps(summary, indent=1))
        self._publish_status(summary["state"])
        return summary
