// ditto.head.secure params (protocols/payloads/secure_tasks.py SecureDittoParams): ditto.head's
// (DittoParams) plus the secure round's (SecureUpdateRound).
package org.fedfleet.device;

import java.util.Map;

public final class SecureDittoParams {
    static final String KIND = "ditto.head.secure";
    final DittoParams ditto;
    final SecureUpdateRound round;

    private SecureDittoParams(Map<String, Object> p) throws TaskDeclined {
        ditto = DittoParams.fromParams(p);
        round = new SecureUpdateRound(p, KIND);
    }

    public static SecureDittoParams fromParams(Map<String, Object> params) throws TaskDeclined {
        return new SecureDittoParams(params);
    }

    public Map<String, Object> toParams() {
        Map<String, Object> out = ditto.toParams();
        round.toParams(out);
        return out;
    }
}
