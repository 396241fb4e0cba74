// A secure task's start on the device (edge_client/tasks/secure_update.py SecureUpdate.on_task):
// a task re-sent for a (job, round, group) whose SecAgg round is live is a duplicate, found BEFORE
// the task's contribution is computed: computing it runs the local training, and the stateful
// secure kinds (SecureStatefulHeadTask: Scaffold's c_k, Ditto's v_k) commit their state as they
// train, so a duplicate computed first advanced the kept state a second round while the live round
// (and the aggregator) went on with the first. Otherwise the vector becomes this device's input to
// a new round, under the secure-input ledger's release guard for the input's key; an unreadable
// ledger declines the task, also found before the contribution is computed (for the same reason).
// The round's session ends with the task's round (MqttAgent runs the task until that moment), and
// names the task: declined if the device leaves the round at its start (SecAggSessions.Leaving).
package org.fedfleet.device;

import java.util.List;
import java.util.Map;
import java.util.logging.Logger;
import org.fedfleet.secagg.ClientSecAgg;
import org.fedfleet.secagg.SecAggSessions;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Json;
import org.fedfleet.wire.LogText;

public final class SecureRounds {
    private static final Logger LOG = LogText.oneLineLogger("fedfleet.device.secagg");
    private final String deviceId;
    private final Identity identity;
    private final byte[] aggregatorKey;
    private final SecAggSessions sessions;
    private final SecureInputLedger inputs;

    public SecureRounds(String deviceId, Identity identity, byte[] aggregatorKey, SecAggSessions sessions,
                        SecureInputLedger inputs) {
        this.deviceId = deviceId; this.identity = identity; this.aggregatorKey = aggregatorKey.clone();
        this.sessions = sessions; this.inputs = inputs;
    }

    /** Opens the round of a secure task (ref) of kind (params, tensors) with secure's contribution;
     *  false where the task is a duplicate of a live round (nothing computed). */
    public boolean start(TaskRef ref, String kind, Map<String, Object> params, List<Envelope.Tensor> tensors,
                         SecureTask secure) throws TaskDeclined {
        String job = ref.job;
        long round = ref.round;
        String group = SecureUpdateRound.namedGroup(params);
        sessions.expire();                  // a round over by now is no live one to keep
        if (group != null && sessions.live(job, round, group)) {
            LOG.info(deviceId + ": task for the live secure round " + job + "/" + round + "/" + group + " again: a duplicate");
            return false;
        }
        // before training: an earlier round of the job still open here ends first, so a kind whose state
        // follows the sum (Scaffold's c_k) has put back a step that round never summed
        sessions.leaveEarlierRounds(job, round);
        // before the contribution: computing it trains, and the stateful kinds keep their new state as
        // they train (a task declined afterwards would leave it advanced for a round never joined)
        if (inputs.lost() != null && inputs.reload() != null) throw new TaskDeclined(SecureInputLedger.LOST_REASON);
        SecureTask.Contribution mine = secure.contribute(params, tensors);
        return sessions.open(job, round, mine.group, ref.task, new ClientSecAgg(deviceId, identity, identity.publicKey(),
                Topics.AGGREGATOR_ID, aggregatorKey, job, round, mine.group, mine.vector, mine.distributedDp,
                inputs.release(inputKey(kind, params, tensors, mine))), WorkDeadline.roundOverAt(), mine.roundEnd);
    }

    /** The key naming a secure task's input (SecureInputLedger): the contribution's, else the task's. */
    private static String inputKey(String kind, Map<String, Object> params, List<Envelope.Tensor> tensors,
                                   SecureTask.Contribution mine) throws TaskDeclined {
        if (mine.inputKey != null) return mine.inputKey;
        try {
            return SecureInputLedger.inputKey(kind, params, tensors);
        } catch (Json.JsonError e) {       // params read from JSON are JSON: never here
            throw new TaskDeclined("the task's params cannot name its input: " + e.getMessage());
        }
    }
}
