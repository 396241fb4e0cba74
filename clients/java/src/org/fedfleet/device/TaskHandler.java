// What a device computes for one task kind (e.g. "fed3r.stats"): the task's params and tensors
// in, the result's kind-specific body fields and tensors out.
package org.fedfleet.device;

import java.util.List;
import java.util.Map;
import org.fedfleet.wire.Envelope;

public interface TaskHandler {
    final class Result {
        public final Map<String, Object> body;
        public final List<Envelope.Tensor> tensors;
        public Result(Map<String, Object> body, List<Envelope.Tensor> tensors) { this.body = body; this.tensors = tensors; }
    }

    Result run(Map<String, Object> params, List<Envelope.Tensor> tensors) throws TaskDeclined;

    /** Taken before run: what puts the task's job state back if the task then sends nothing (its
     *  handler or its result's encoding fails, it is stopped past its deadline). A handler that saves
     *  per-job state before its result goes out (StatefulHeadTask) overrides it; the others keep none.
     *  (Python: edge_client/agent.py KeepsState.) */
    default Runnable stateRestorer(Map<String, Object> params) throws TaskDeclined { return () -> { }; }
}
