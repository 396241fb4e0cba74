"""The Java device erases a secure round's secrets as soon as the round is over for it (a review's
finding, failing before):

* MqttAgent's turn ends the rounds past their deadline whatever the message's handling did: a
  handler that threw skipped that turn's expiry (tests/java_device/AgentTurns.java).
"""

from __future__ import annotations

import base64
import os
import subprocess
import time

import pytest

import java_build
from java_secagg_bridge import AGGREGATOR, JAVA
from protocols import messages as M
from protocols.envelope import encode
from protocols.payloads.secagg import to_envelope
from protocols.secagg.messages import RoundAborted

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))

GRACE_S = 60.0          # DeviceSession's deadline grace in MqttAgent: a round ends at its deadline plus it


def test_java_agent_ends_rounds_past_their_deadline_in_a_turn_whose_handling_threw():
    """Two secure rounds past their end; a `secagg` message comes: its handling ends the first (the
    sessions check the clock first) and the kind's round-end hook throws out of it. The same turn's
    expiry still ends the second; it used to be skipped with the rest of the turn."""
    seed = os.urandom(32)
    proc = subprocess.Popen(java_build.java_command("-cp", java_build.built(), "org.fedfleet.device.AgentTurns", JAVA,
                                                    seed.hex(), AGGREGATOR.public_key_bytes.hex()),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def turn(env) -> int:
        proc.stdin.write(base64.b64encode(encode(env, signer=AGGREGATOR.sign)).decode() + "\n")
        proc.stdin.flush()
        kind, _, count = proc.stdout.readline().strip().partition(" ")
        assert kind == "ENDED", proc.stderr.read()[-3000:]
        return int(count)

    try:
        assert proc.stdout.readline().strip() == "READY", proc.stderr.read()[-3000:]
        ends = time.time() + 3.0
        for job in ("job-a", "job-b"):     # received within the grace: each opens its round, to end at `ends`
            assert turn(M.task_message("aggregator", job, 1, "test.secure", {"group": "g"}, ends - GRACE_S)) == 0
        time.sleep(max(0.0, ends - time.time()) + 0.5)
        late = RoundAborted(job_id="job-z", round_id=1, group_id="g", sender="aggregator", recipient=JAVA,
                            reason="any secagg message").signed(AGGREGATOR)
        assert turn(to_envelope(late)) == 2
    finally:
        proc.stdin.close()
        proc.wait(10)
