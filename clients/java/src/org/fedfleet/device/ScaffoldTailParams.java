// scaffold.tail params (protocols/payloads/scaffold.py ScaffoldTailParams): fedavg.tail's
// (TailTrainingParams: the split and what trains) plus a stateful task's job_id and state binding
// (StatefulHeadParams). This library does not serve scaffold.tail (it has no backbone to
// fine-tune); it reads the params exactly as the Python device does (golden params).
package org.fedfleet.device;

import java.util.Map;

public final class ScaffoldTailParams {
    static final String KIND = "scaffold.tail";
    final TailTrainingParams tail;
    final StatefulHeadParams stateful;

    private ScaffoldTailParams(Map<String, Object> p) throws TaskDeclined {
        tail = new TailTrainingParams(p, KIND);
        stateful = new StatefulHeadParams(p, KIND);
    }

    public static ScaffoldTailParams fromParams(Map<String, Object> params) throws TaskDeclined {
        return new ScaffoldTailParams(params);
    }

    public Map<String, Object> toParams() {
        Map<String, Object> out = tail.toParams();
        stateful.putBinding(out);
        return out;
    }
}
