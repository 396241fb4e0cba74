// block_scales of a fed3r.secure task under distributed DP (protocols/payloads/secure_tasks.py
// SyncBlockScales): the device multiplies its vector's packed-A off-diagonal entries by
// a_off_diagonal and its b by b before adding its Skellam share, and puts 1 in the count slot
// (protocols/payloads/secagg.py scale_sync_blocks): one noise stddev becomes per-block noise once
// the aggregator scales the sum back, and the sum's count says how many members scaled.
package org.fedfleet.device;

import java.util.LinkedHashMap;
import java.util.Map;

public final class SyncBlockScales {
    static final double MAX_SCALE = 1048576.0;          // 2^20, MAX_BLOCK_SCALE
    final double aOffDiagonal;
    final double b;

    private SyncBlockScales(Map<String, Object> p) throws TaskDeclined {
        TaskParams.require(p, "block_scales", "a_off_diagonal", "b");
        aOffDiagonal = scale(p, "a_off_diagonal");
        b = scale(p, "b");
    }

    private static double scale(Map<String, Object> p, String key) throws TaskDeclined {
        double x = Params.number(p, key, Double.NaN, false);
        if (x > MAX_SCALE) throw new TaskDeclined("bad task params: " + key + " must be at most 2^20, got " + p.get(key));
        return x;
    }

    /** The block_scales field's value (a JSON object); each refusal names the field as block_scales.<key>. */
    @SuppressWarnings("unchecked")
    public static SyncBlockScales fromParams(Object scales) throws TaskDeclined {
        if (!(scales instanceof Map))
            throw new TaskDeclined("bad task params: block_scales must be a JSON object, got " + scales);
        try {
            return new SyncBlockScales((Map<String, Object>) scales);
        } catch (TaskDeclined e) {
            throw new TaskDeclined(e.getMessage().replaceFirst("^bad task params: ", "bad task params: block_scales."));
        }
    }

    /** v (the sync vector [A_upper (p(p+1)/2) | b (C·p) | n]) with its blocks scaled, in place;
     * the count slot set to 1. */
    void apply(double[] v, int p) {
        int at = 0;
        for (int i = 0; i < p; i++) {                   // row i of the packed upper triangle: A_ii, then A_ij (j > i)
            at++;                                       // the diagonal entry stays
            for (int j = i + 1; j < p; j++, at++) v[at] *= aOffDiagonal;
        }
        for (; at < v.length - 1; at++) v[at] *= b;     // then b, up to the count
        v[v.length - 1] = 1.0;
    }

    Map<String, Object> toParams() {
        Map<String, Object> out = new LinkedHashMap<>();
        out.put("a_off_diagonal", aOffDiagonal);
        out.put("b", b);
        return out;
    }
}
