// fedavg.secure params (protocols/payloads/secure_tasks.py SecureFedAvgParams): fedavg.head's
// (HeadTrainingParams: the head trained as for the plain kind) plus the secure round's
// (SecureUpdateRound). toParams() is their canonical form (golden vectors: protocols/golden/task_params/).
package org.fedfleet.device;

import java.util.Map;

public final class SecureFedAvgParams {
    static final String KIND = "fedavg.secure";
    final HeadTrainingParams head;
    final SecureUpdateRound round;

    private SecureFedAvgParams(Map<String, Object> p) throws TaskDeclined {
        TaskParams.checkVersion(p, KIND);
        head = HeadTrainingParams.fromParams(p);
        round = new SecureUpdateRound(p, KIND);
    }

    public static SecureFedAvgParams fromParams(Map<String, Object> params) throws TaskDeclined {
        return new SecureFedAvgParams(params);
    }

    public Map<String, Object> toParams() {
        Map<String, Object> out = head.toParams();
        round.toParams(out);
        return out;
    }
}
