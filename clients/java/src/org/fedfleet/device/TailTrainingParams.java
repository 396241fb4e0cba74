// fedavg.tail params (protocols/payloads/fedavg.py TailTrainingParams): fedavg.head's plus the
// tail's stages (1..64) and what trains ("tail": FT(φ), "tail+head": FT(M)), both required (a
// device never guesses the split). This library does not serve fedavg.tail (it has no backbone
// to fine-tune); it reads the params exactly as the Python device does (golden params).
package org.fedfleet.device;

import java.math.BigInteger;
import java.util.Map;

public final class TailTrainingParams {
    static final String KIND = "fedavg.tail";
    final HeadTrainingParams head;
    final int tailStages;
    final String train;

    TailTrainingParams(Map<String, Object> p, String kind) throws TaskDeclined {
        TaskParams.checkVersion(p, kind);
        TaskParams.require(p, kind, "tail_stages", "train");
        head = HeadTrainingParams.fromParams(p, kind);
        tailStages = (int) Params.integer(p, "tail_stages", 1, 64);
        train = TaskParams.choice(p, "train", "tail", "tail", "tail+head");
    }

    public static TailTrainingParams fromParams(Map<String, Object> params) throws TaskDeclined {
        return new TailTrainingParams(params, KIND);
    }

    public Map<String, Object> toParams() {
        Map<String, Object> out = head.toParams();
        out.put("tail_stages", BigInteger.valueOf(tailStages));
        out.put("train", train);
        return out;
    }
}
