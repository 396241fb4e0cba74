"""The Java device holds what waits unread in its inbox to the Python device's bound, in bytes per
topic and in all (a review's finding: its queue was bounded by count, 1,024 messages of up to
256 MiB each, so anyone who may publish to a busy device's inbox could fill its heap). The same
random offers and takes go through ``org.fedfleet.device.InboxQueue`` and through
``protocols.message_loop.MessageLoop``; every decision must agree, and the Java agent's default
bound, and the largest message it takes, must be the devices' one rule
(``protocols/device_inbox.py``, what the Python agent uses and the aggregator sizes tasks by)."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

import java_build
from protocols.device_inbox import DEVICE_INBOX_BOUND, LARGEST_DEVICE_MESSAGE_BYTES
from protocols.message_loop import MESSAGE_OVERHEAD_BYTES, MessageLoop, QueueBound

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))


def random_case(rng: np.random.Generator) -> dict:
    topic_bytes = int(rng.integers(1, 4 * MESSAGE_OVERHEAD_BYTES))       # each message costs its bytes + the overhead
    ops = []
    for _ in range(200):
        if rng.random() < 0.6:
            ops.append(["offer", f"fl/v1/in/{rng.integers(3)}", int(rng.integers(0, MESSAGE_OVERHEAD_BYTES))])
        else:
            ops.append(["take"])
    return {"topic_bytes": topic_bytes, "total_bytes": topic_bytes + int(rng.integers(0, 4 * MESSAGE_OVERHEAD_BYTES)),
            "ops": ops}


def python_decisions(case: dict) -> tuple[list, int]:
    taken: list = []
    loop = MessageLoop(taken.append, tick_s=0.0, bound=QueueBound(case["topic_bytes"], case["total_bytes"]))
    out = []
    for k, op in enumerate(case["ops"]):
        if op[0] == "offer":
            out.append(loop.post(k, op[1], op[2]))
        else:
            before = len(taken)
            loop.serve_one()
            out.append(taken[-1] if len(taken) > before else None)
    return out, loop.dropped


def test_the_java_inbox_keeps_and_drops_what_the_python_loop_does():
    rng = np.random.default_rng(7)
    cases = [random_case(rng) for _ in range(60)]
    proc = subprocess.run(java_build.java_command("-cp", java_build.built(), "InboxBound"),
                          input="\n".join(json.dumps(c) for c in cases) + "\n", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    first, waited, *lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert first == {"agent": [DEVICE_INBOX_BOUND.source_bytes, DEVICE_INBOX_BOUND.total_bytes],
                     "message": LARGEST_DEVICE_MESSAGE_BYTES, "overhead": MESSAGE_OVERHEAD_BYTES}
    assert waited["got"] == 1 and waited["left"] == 0 and 150 <= waited["waited_ms"] < 4000    # woken by the offer
    assert len(lines) == len(cases)
    drops = 0
    for case, java in zip(cases, lines):
        out, dropped = python_decisions(case)
        assert (java["out"], java["dropped"]) == (out, dropped), case
        drops += dropped
    assert drops > 100 and sum(java["out"].count(True) for java in lines) > 1000   # both ways, often
