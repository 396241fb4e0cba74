// fedgloss.head params (protocols/payloads/fedgloss.py FedGlossParams): a stateful head task's
// plus FedGloSS's ADMM weight admm_beta in (0, 1e6], required (a device never guesses the
// server's β). This library does not serve fedgloss.head; it reads the params exactly as the
// Python device does (golden params).
package org.fedfleet.device;

import java.math.BigInteger;
import java.util.Map;

public final class FedGlossParams extends StatefulHeadParams {
    static final String KIND = "fedgloss.head";
    static final double MAX_ADMM_BETA = 1e6;
    private final Object beta;              // as the task wrote it (an integer stays one)

    private FedGlossParams(Map<String, Object> p) throws TaskDeclined {
        super(p, KIND);
        TaskParams.require(p, KIND, "admm_beta");
        beta = p.get("admm_beta");
        double x = beta instanceof BigInteger ? ((BigInteger) beta).doubleValue() : beta instanceof Double ? (Double) beta : Double.NaN;
        if (!Double.isFinite(x) || x <= 0 || x > MAX_ADMM_BETA)
            throw new TaskDeclined("bad " + KIND + " params: admm_beta must be a finite number in (0, " + MAX_ADMM_BETA + "], got " + beta);
    }

    public static FedGlossParams fromParams(Map<String, Object> params) throws TaskDeclined {
        return new FedGlossParams(params);
    }

    @Override
    public Map<String, Object> toParams() {
        Map<String, Object> out = super.toParams();
        out.put("admm_beta", beta);
        return out;
    }
}
