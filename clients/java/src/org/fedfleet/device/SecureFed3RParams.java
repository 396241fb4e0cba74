// fed3r.secure params (protocols/payloads/secure_tasks.py SecureFed3RParams): fed3r.stats's
// (Fed3RStatsParams; the device sends dense float64 statistics whatever format and dtype say: a
// sum needs fixed shapes) with max_samples required, plus the round's group and, under
// distributed DP, its noise (dp) and how the vector's blocks are scaled first (block_scales), and
// whether this is the private feature center's round (center_round: the device contributes
// (Σ z, n) of its clipped rows only, every entry noised).
// toParams() is their canonical form (golden vectors).
package org.fedfleet.device;

import java.util.Map;

public final class SecureFed3RParams {
    static final String KIND = "fed3r.secure";
    final Fed3RStatsParams stats;
    final String group;
    final long maxSamples;
    final DpRound dp;                       // null: absent (no distributed DP)
    final SyncBlockScales blockScales;      // null: absent (the vector's blocks as they are)
    final Boolean centerRound;              // null: absent (false)

    private SecureFed3RParams(Map<String, Object> p) throws TaskDeclined {
        TaskParams.checkVersion(p, KIND);
        TaskParams.require(p, KIND, "max_samples", "group");
        stats = Fed3RStatsParams.fromParams(p);
        group = SecureUpdateRound.group(p);
        if (stats.maxSamples == null) throw new TaskDeclined("bad " + KIND + " params: a secure Fed3R task needs max_samples");
        maxSamples = stats.maxSamples;
        dp = TaskParams.present(p, "dp") ? DpRound.fromParams(p.get("dp")) : null;
        blockScales = TaskParams.present(p, "block_scales") ? SyncBlockScales.fromParams(p.get("block_scales")) : null;
        if (blockScales != null && dp == null)
            throw new TaskDeclined("bad " + KIND + " params: block_scales shape distributed-DP noise: a task without dp has none");
        centerRound = TaskParams.present(p, "center_round") ? TaskParams.bool(p, "center_round", false) : null;
        if (Boolean.TRUE.equals(centerRound) && (dp == null || blockScales != null || Boolean.TRUE.equals(stats.centered)
                || !stats.fitIntercept || stats.featureClipNorm == null || stats.featureClipNorm == 0.0))
            throw new TaskDeclined("bad " + KIND + " params: center_round needs dp, feature_clip_norm and fit_intercept, "
                    + "and neither block_scales nor centered (it releases the mean the later rounds centre on)");
    }

    public static SecureFed3RParams fromParams(Map<String, Object> params) throws TaskDeclined {
        return new SecureFed3RParams(params);
    }

    public Map<String, Object> toParams() {
        Map<String, Object> out = stats.toParams();
        out.put("group", group);
        if (dp != null) out.put("dp", dp.toParams());
        if (blockScales != null) out.put("block_scales", blockScales.toParams());
        if (centerRound != null) out.put("center_round", centerRound);
        return out;
    }
}
