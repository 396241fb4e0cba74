// A task kind answered under secure aggregation: the device computes one fixed-shape float
// vector, and the group's SecAgg round (SecAggSessions) sums it with its peers' vectors; the
// aggregator never sees it. Throw TaskDeclined to refuse (e.g. more samples than the round's bound).
package org.fedfleet.device;

import java.util.List;
import java.util.Map;
import org.fedfleet.wire.Envelope;

public interface SecureTask {
    double[] vector(Map<String, Object> params, List<Envelope.Tensor> tensors) throws TaskDeclined;
}
