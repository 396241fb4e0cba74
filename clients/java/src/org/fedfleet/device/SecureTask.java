// A task kind answered under secure aggregation: the device computes one fixed-shape float
// vector, and the group's SecAgg round (SecAggSessions) sums it with its peers' vectors; the
// aggregator never sees it. The task's typed params name the round's group. Throw TaskDeclined to
// refuse (malformed params, more samples than the round's bound, ...). Which rounds the vector may
// leave in is the device's secure-input ledger's (SecureInputLedger), by the input's key: the
// task's (kind, params less group, tensors) unless the contribution names its own.
package org.fedfleet.device;

import java.util.List;
import java.util.Map;
import org.fedfleet.secagg.SecAggSessions;
import org.fedfleet.wire.Envelope;

public interface SecureTask {
    /** This device's input to the task's secure round: the round's group and the vector. */
    Contribution contribute(Map<String, Object> params, List<Envelope.Tensor> tensors) throws TaskDeclined;

    final class Contribution {
        public final String group;
        public final double[] vector;
        /** The vector carries this device's distributed-DP noise share (its SecAgg round must be 64-bit). */
        public final boolean distributedDp;
        /** The input's key (SecureInputLedger); null: the task's (SecureInputLedger.inputKey of its kind,
         *  params and tensors), for an update that differs each time it is computed. */
        public final String inputKey;

        public Contribution(String group, double[] vector) { this(group, vector, false); }

        public Contribution(String group, double[] vector, boolean distributedDp) { this(group, vector, distributedDp, null); }

        /** Told how the input's round ended (SecAggSessions.RoundEnd); null: the kind need not know. */
        public final SecAggSessions.RoundEnd roundEnd;

        public Contribution(String group, double[] vector, boolean distributedDp, String inputKey) {
            this(group, vector, distributedDp, inputKey, null);
        }

        public Contribution(String group, double[] vector, boolean distributedDp, String inputKey,
                            SecAggSessions.RoundEnd roundEnd) {
            this.group = group; this.vector = vector; this.distributedDp = distributedDp; this.inputKey = inputKey;
            this.roundEnd = roundEnd;
        }
    }
}
