// scaffold.head.secure params (protocols/payloads/secure_tasks.py SecureScaffoldParams): scaffold.head's
// (a stateful head task's, StatefulHeadParams) plus the secure round's (SecureUpdateRound) and
// control_clip_norm (required, > 0): the L2 norm the device clips its Δc to before it enters the
// sum. No distributed DP (Scaffold's controls are outside its accounting): a task with dp is declined.
package org.fedfleet.device;

import java.util.Map;

public final class SecureScaffoldParams {
    static final String KIND = "scaffold.head.secure";
    final StatefulHeadParams scaffold;
    final SecureUpdateRound round;
    final double controlClipNorm;

    private SecureScaffoldParams(Map<String, Object> p) throws TaskDeclined {
        scaffold = new StatefulHeadParams(p, KIND);
        round = new SecureUpdateRound(p, KIND);
        TaskParams.require(p, KIND, "control_clip_norm");
        controlClipNorm = Params.number(p, "control_clip_norm", Double.NaN, false);
        if (round.dp != null)
            throw new TaskDeclined("bad " + KIND + " params: dp: Scaffold's control variates are outside distributed DP's accounting");
    }

    public static SecureScaffoldParams fromParams(Map<String, Object> params) throws TaskDeclined {
        return new SecureScaffoldParams(params);
    }

    public Map<String, Object> toParams() {
        Map<String, Object> out = scaffold.toParams();
        round.toParams(out);
        out.put("control_clip_norm", controlClipNorm);
        return out;
    }
}
