"""The Java device's MqttAgent turn by turn, behind tests/java_device/AgentTurns.java: ``AgentTurns``
sends the bridge payloads signed by the aggregator (one a turn) and reads what each turn left.
tests/test_java_secagg_leaving.py, tests/test_java_agent_errors.py and tests/test_java_stateful.py use it."""

from __future__ import annotations

import base64
import os
import subprocess
from dataclasses import dataclass

import java_build
from java_secagg_bridge import AGGREGATOR, JAVA
from protocols.envelope import Envelope, encode


@dataclass(frozen=True)
class AfterTurn:
    ended: int              # the secure kind's round-end calls so far
    done: int               # tasks done (MqttAgent.tasksDone)
    declined: int           # declines sent (MqttAgent.tasksDeclined)
    stopped_by: str | None  # the class of what stopped the agent (MqttAgent.stoppedBy), None: running


class AgentTurns:
    def __init__(self, *stateful: str):
        """``stateful``: (features file, state folder): the device also answers scaffold.head and ditto.head."""
        self.proc = subprocess.Popen(java_build.java_command("-cp", java_build.built(), "org.fedfleet.device.AgentTurns",
                                                             JAVA, os.urandom(32).hex(), AGGREGATOR.public_key_bytes.hex(),
                                                             *map(str, stateful)),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert self.proc.stdout.readline().strip() == "READY", self.proc.stderr.read()[-3000:]
        except BaseException:
            self.close()
            raise

    def turn(self, env: Envelope) -> AfterTurn:
        self.proc.stdin.write(base64.b64encode(encode(env, signer=AGGREGATOR.sign)).decode() + "\n")
        self.proc.stdin.flush()
        fields = self.proc.stdout.readline().split()
        assert fields[0::2] == ["ENDED", "DONE", "DECLINED", "STOPPED"], self.proc.stderr.read()[-3000:]
        ended, done, declined, stopped = fields[1::2]
        return AfterTurn(int(ended), int(done), int(declined), None if stopped == "-" else stopped)

    def fail(self, how: str) -> None:
        """The stateful kinds' results from now on: "oversize", "throw" or "none" (AgentTurns.failing)."""
        self.proc.stdin.write(f"FAIL {how}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "OK", self.proc.stderr.read()[-3000:]

    def close(self) -> str:
        """Ends the bridge; returns what it logged (standard error)."""
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        return self.proc.stderr.read()
