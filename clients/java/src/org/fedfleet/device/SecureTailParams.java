// fedavg.tail.secure params (protocols/payloads/secure_tasks.py SecureTailParams): fedavg.tail's
// (TailTrainingParams) plus the secure round's (SecureUpdateRound). Not served by this library
// (no backbone to fine-tune); read exactly as the Python device does (golden params).
package org.fedfleet.device;

import java.util.Map;

public final class SecureTailParams {
    static final String KIND = "fedavg.tail.secure";
    final TailTrainingParams tail;
    final SecureUpdateRound round;

    private SecureTailParams(Map<String, Object> p) throws TaskDeclined {
        tail = new TailTrainingParams(p, KIND);
        round = new SecureUpdateRound(p, KIND);
    }

    public static SecureTailParams fromParams(Map<String, Object> params) throws TaskDeclined {
        return new SecureTailParams(params);
    }

    public Map<String, Object> toParams() {
        Map<String, Object> out = tail.toParams();
        round.toParams(out);
        return out;
    }
}
