// A device run secure-only (HeadlessDevices --secure-only; the Python device's `fedfleet device
// --secure-only`, protocols/payloads/task_kinds.py UPDATES_IN_THE_CLEAR): every task kind whose
// result is the device's own update or statistics in the clear is declined, whoever asks, so its
// updates reach the aggregator only through secure aggregation. Without it an aggregator that
// turned against its fleet could ask a device of a secure job for the same training in the clear.
package org.fedfleet.device;

import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import org.fedfleet.wire.Envelope;

public final class SecureOnly implements TaskHandler {
    /** The plain kinds that send an update or statistics in the clear (the Python device's list). */
    public static final Set<String> UPDATES_IN_THE_CLEAR = Set.of("fed3r.stats", "fedavg.head", "fedavg.tail",
            "ladd.train", "pp.head", "scaffold.head", "scaffold.tail", "fedgloss.head", "ditto.head");
    private final String kind;

    private SecureOnly(String kind) { this.kind = kind; }

    /** `handlers` with each of UPDATES_IN_THE_CLEAR declining (build the secure tasks from the handlers first). */
    public static Map<String, TaskHandler> apply(Map<String, TaskHandler> handlers) {
        Map<String, TaskHandler> out = new LinkedHashMap<>();
        for (Map.Entry<String, TaskHandler> e : handlers.entrySet())
            out.put(e.getKey(), UPDATES_IN_THE_CLEAR.contains(e.getKey()) ? new SecureOnly(e.getKey()) : e.getValue());
        return out;
    }

    @Override
    public Result run(Map<String, Object> params, List<Envelope.Tensor> tensors) throws TaskDeclined {
        throw new TaskDeclined(kind + " would send this device's update in the clear, and it runs secure-only: its updates "
                + "go only through secure aggregation");
    }
}
