"""The Java device erases a secure round's secrets as soon as the round is over for it (a review's
two findings, each failing before):

* a round whose answer cannot be sent (the device's outbox refuses it before anything is published:
  over the envelope's limits, more chunks than a reassembler takes) ends at once, as the Python
  device's ``UnsendableMessage`` path (edge_client/tasks/secure_update.py): the client aborted, no
  secret held, the kind's round-end hook told "not finished" (secure Scaffold then puts its c_k
  back), and the aggregator sums the others without it. It used to be kept, secrets and all, until
  its task's deadline;
* MqttAgent's turn ends the rounds past their deadline whatever the message's handling did: a
  handler that threw skipped that turn's expiry (tests/java_device/AgentTurns.java).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import java_build
from java_agent_turns import AgentTurns
from java_secagg_bridge import AGGREGATOR, JAVA, setup_round
from protocols import messages as M
from protocols.payloads.secagg import to_envelope
from protocols.secagg import ClientState
from protocols.secagg.driver import plain_fixed_point_sum, run_round
from protocols.secagg.events import AggregateReady
from protocols.secagg.messages import RoundAborted

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))

# payloads of at most 16 bytes: a reassembler takes 4,096 chunks, 64 KiB, so the keys and the shares
# (a few KiB) can be sent and the masked input of 10,000 64-bit words cannot
CHUNK, LONG = 16, 10_000


def test_java_device_whose_masked_input_cannot_be_sent_leaves_the_round_at_once(tmp_path):
    """Its keys and shares go out in chunks; its masked input cannot: nothing of it is sent, the
    round ends on the device then and there, and the others' sum is exact."""
    config, identities, inputs, java = setup_round(tmp_path, "complete", m=LONG, chunk=CHUNK)
    try:
        run = run_round(config, AGGREGATOR, identities, inputs, record_server_view=True,
                        client_factory=lambda d, i: java if d == JAVA else None)
        after = java.tick(0.0)              # the bridge's clock before any end: what is still held
    finally:
        java.close()
    sent = [f.to_message().TYPE for f in run.server_view if f.to_message().sender == JAVA]
    assert sent == ["secagg.advertise_keys", "secagg.encrypted_shares"]      # sent in chunks; no masked input
    assert java.state is ClientState.ABORTED and after == (False, 0)
    assert java.round_ends == [False]
    survivors = tuple(d for d in config.members if d != JAVA)
    assert isinstance(run.outcome, AggregateReady) and run.outcome.survivors == survivors
    assert np.array_equal(run.outcome.sum_words, plain_fixed_point_sum(config, [inputs[d] for d in survivors]))


GRACE_S = 60.0          # DeviceSession's deadline grace in MqttAgent: a round ends at its deadline plus it


def test_java_agent_ends_rounds_past_their_deadline_in_a_turn_whose_handling_threw():
    """Two secure rounds past their end; a `secagg` message comes: its handling ends the first (the
    sessions check the clock first) and the kind's round-end hook throws out of it. The same turn's
    expiry still ends the second; it used to be skipped with the rest of the turn."""
    agent = AgentTurns()
    try:
        ends = time.time() + 3.0
        for job in ("job-a", "job-b"):     # received within the grace: each opens its round, to end at `ends`
            assert agent.turn(M.task_message("aggregator", job, 1, "test.secure", {"group": "g"}, ends - GRACE_S)).ended == 0
        time.sleep(max(0.0, ends - time.time()) + 0.5)
        late = RoundAborted(job_id="job-z", round_id=1, group_id="g", sender="aggregator", recipient=JAVA,
                            reason="any secagg message").signed(AGGREGATOR)
        assert agent.turn(to_envelope(late)).ended == 2
    finally:
        agent.close()
