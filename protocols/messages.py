"""Message types of protocol v1 and the checks every receiver applies to them.

Generic round messages (any algorithm):

* ``task``     aggregator -> device inbox. body: job (1 to 64 characters), round, kind, params
               (kind-specific), deadline (unix s), optionally device (the addressee: a device
               skips a task naming another one, which someone re-published on its inbox)
* ``result``   device -> aggregator. body: job, round, task (id of the task message), kind, plus
               kind-specific fields; tensors: kind-specific (see the payload modules)
* ``decline``  device -> aggregator. body: job, round, task, reason (cannot do the task; at most
               1,000 characters)
* ``ack``      aggregator -> device inbox. body: ref (result message id), status, reason
* ``presence`` device -> retained presence topic. body: state ("online"/"offline"), info
* ``status``   aggregator -> retained status topic. body: free-form progress for dashboards

``kind`` names the work: ``fed3r.stats`` (protocols.payloads.fed3r), later ``fedavg.update`` etc.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .envelope import Envelope, EnvelopeError, body_field

TASK, RESULT, DECLINE, ACK, PRESENCE, STATUS = "task", "result", "decline", "ack", "presence", "status"
ACK_STATUSES = ("accepted", "duplicate", "late", "rejected")
MAX_JOB_ID_CHARS = 64       # a task's job id (the aggregator's job ids are 1 to 64 characters)
MAX_REASON_CHARS = 1000     # a decline's reason as sent


@dataclass(frozen=True, slots=True)
class TaskRef:
    """Identifies one unit of work: (job, round) plus the task message id. Slotted: a device's replay
    guard keeps one per job it remembers (bench/device_session_memory.py)."""

    job: str
    round: int
    task: str


def task_message(sender: str, job: str, round_: int, kind: str, params: dict[str, Any], deadline: float,
                 device: str | None = None) -> Envelope:
    return Envelope(type=TASK, sender=sender,
                    body={"job": job, "round": round_, "kind": kind, "params": params, "deadline": deadline,
                          **({} if device is None else {"device": device})})


def task_addressee(msg: Envelope) -> str | None:
    """The device a task names (signed with it), or None (a task of an aggregator that names none)."""
    if "device" not in msg.body:
        return None
    device = msg.body["device"]
    if not isinstance(device, str):
        raise EnvelopeError(f"task body field 'device' must be a string, got {type(device).__name__}")
    return device


def parse_task(msg: Envelope) -> tuple[TaskRef, str, dict[str, Any], float]:
    _expect(msg, TASK)
    job = body_field(msg, "job", str)
    if not 0 < len(job) <= MAX_JOB_ID_CHARS:     # every answer echoes it: a long one makes them unsendable
        raise EnvelopeError(f"task: job id of {len(job)} characters, not 1 to {MAX_JOB_ID_CHARS}")
    round_ = body_field(msg, "round", int)
    if not -(1 << 62) <= round_ < 1 << 62:        # what every device holds (the Java device's long, signed, with room)
        raise EnvelopeError(f"task: round {round_} outside -2^62 … 2^62 - 1")
    ref = TaskRef(job, round_, msg.id)
    return ref, body_field(msg, "kind", str), body_field(msg, "params", dict), float(body_field(msg, "deadline", (int, float)))


def result_message(sender: str, ref: TaskRef, kind: str, body: dict[str, Any], tensors) -> Envelope:
    return Envelope(type=RESULT, sender=sender,
                    body={**body, "job": ref.job, "round": ref.round, "task": ref.task, "kind": kind},
                    tensors=dict(tensors))


def parse_result_ref(msg: Envelope) -> tuple[TaskRef, str]:
    _expect(msg, RESULT, DECLINE)
    ref = TaskRef(body_field(msg, "job", str), body_field(msg, "round", int), body_field(msg, "task", str))
    kind = body_field(msg, "kind", str) if msg.type == RESULT else ""
    return ref, kind


def decline_message(sender: str, ref: TaskRef, reason: str) -> Envelope:
    """A decline; its reason cut to MAX_REASON_CHARS (a reason may quote what the task carried)."""
    return Envelope(type=DECLINE, sender=sender,
                    body={"job": ref.job, "round": ref.round, "task": ref.task, "reason": reason[:MAX_REASON_CHARS]})


def ack_message(sender: str, ref_id: str, status: str, reason: str = "") -> Envelope:
    if status not in ACK_STATUSES:
        raise ValueError(f"unknown ack status {status!r}")
    return Envelope(type=ACK, sender=sender, body={"ref": ref_id, "status": status, "reason": reason})


def parse_ack(msg: Envelope) -> tuple[str, str, str]:
    _expect(msg, ACK)
    status = body_field(msg, "status", str)
    if status not in ACK_STATUSES:
        raise EnvelopeError(f"ack: unknown status {status!r}")
    return body_field(msg, "ref", str), status, str(msg.body.get("reason", ""))


def presence_message(sender: str, state: str, info: dict[str, Any] | None = None) -> Envelope:
    if state not in ("online", "offline"):
        raise ValueError(f"presence state must be online/offline, not {state!r}")
    return Envelope(type=PRESENCE, sender=sender, body={"state": state, "info": info or {}})


def parse_presence(msg: Envelope) -> tuple[bool, dict[str, Any]]:
    """(online, info) of a presence message; EnvelopeError unless ``state`` is exactly online or
    offline and ``info`` (optional) is an object -- a garbled presence must not take a device offline."""
    _expect(msg, PRESENCE)
    state = body_field(msg, "state", str)
    if state not in ("online", "offline"):
        raise EnvelopeError(f"presence state must be online/offline, not {state!r}")
    info = msg.body.get("info", {})
    if not isinstance(info, dict):
        raise EnvelopeError(f"presence info must be an object, got {type(info).__name__}")
    if len(json.dumps(info)) > MAX_PROFILE_CHARS:    # stored with the device, shown on every device listing
        raise EnvelopeError(f"presence info is over {MAX_PROFILE_CHARS} characters as JSON")
    if "tags" in info:
        profile_tags(info)          # shown with the device: its shape checked (cohorts read the operator's tags)
    return state == "online", info


MAX_TAGS, MAX_TAG_CHARS = 32, 64
# a tag the operator gives a device (what a deployment's tags:a,b cohort names): no comma, no space
TAG_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"
MAX_PROFILE_CHARS = 16 * 1024       # a device's announced profile (kinds, runtime, tags): a few hundred


def profile_tags(info: dict[str, Any]) -> tuple[str, ...]:
    """The tags of a device's announced profile (``info["tags"]``: a comma-separated string or a
    list of strings; none: ()); EnvelopeError for any other type, more than MAX_TAGS tags or a tag
    longer than MAX_TAG_CHARS."""
    tags = info.get("tags", ())
    items = tags.split(",") if isinstance(tags, str) else tags
    if not isinstance(items, (list, tuple)) or not all(isinstance(t, str) for t in items):
        raise EnvelopeError("presence info tags must be a string or a list of strings")
    if len(items) > MAX_TAGS or any(len(t) > MAX_TAG_CHARS for t in items):
        raise EnvelopeError(f"presence info tags: at most {MAX_TAGS}, each at most {MAX_TAG_CHARS} characters")
    return tuple(items)


def _expect(msg: Envelope, *types: str) -> None:
    if msg.type not in types:
        raise EnvelopeError(f"expected a {'/'.join(types)} message, got {msg.type!r}")
