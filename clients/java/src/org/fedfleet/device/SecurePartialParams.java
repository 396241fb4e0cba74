// pp.head.secure params (protocols/payloads/secure_tasks.py SecurePartialParams): pp.head's
// (PartialParams) plus the secure round's (SecureUpdateRound). Read exactly as the Python device
// does (golden params); this library serves pp.head in the clear only.
package org.fedfleet.device;

import java.util.Map;

public final class SecurePartialParams {
    static final String KIND = "pp.head.secure";
    final PartialParams partial;
    final SecureUpdateRound round;

    private SecurePartialParams(Map<String, Object> p) throws TaskDeclined {
        partial = PartialParams.fromParams(p, KIND);
        round = new SecureUpdateRound(p, KIND);
    }

    public static SecurePartialParams fromParams(Map<String, Object> params) throws TaskDeclined {
        return new SecurePartialParams(params);
    }

    public Map<String, Object> toParams() {
        Map<String, Object> out = partial.toParams();
        round.toParams(out);
        return out;
    }
}
