// dp of a secure task (protocols/payloads/task_params.py DpRound): the round's distributed-DP
// noise, as a JSON object under "dp": each member's Skellam stddev, the fixed-point scale_bits,
// the threshold the noise was sized for (the device does not need it) and, for the update-based
// kinds, the clip norm and (adaptive clipping) clip_bit_scale s: the device puts its centred
// clipped-indicator bit (1[‖θ_k − θ_t‖ ≤ clip_norm] − ½)·s before its vector's count entry
// (protocols/secagg/distributed_dp.py clip_bit). SkellamNoise adds the device's share from it.
package org.fedfleet.device;

import java.math.BigInteger;
import java.util.LinkedHashMap;
import java.util.Map;

public final class DpRound {
    final double stddev;
    final int scaleBits;
    final Long threshold;                   // null: absent
    final Double clipNorm;                  // null: absent
    final Double clipBitScale;              // null: absent (no clipped-indicator bit)

    private DpRound(Map<String, Object> p) throws TaskDeclined {
        TaskParams.require(p, "dp", "stddev", "scale_bits");
        stddev = Params.number(p, "stddev", Double.NaN, true);
        scaleBits = (int) Params.integer(p, "scale_bits", 0, 62);
        threshold = TaskParams.present(p, "threshold") ? Params.integer(p, "threshold", 1, 1_000_000_000) : null;
        clipNorm = TaskParams.present(p, "clip_norm") ? Params.number(p, "clip_norm", Double.NaN, false) : null;
        clipBitScale = TaskParams.present(p, "clip_bit_scale") ? Params.number(p, "clip_bit_scale", Double.NaN, false) : null;
        if (clipBitScale != null && clipNorm == null)
            throw new TaskDeclined("bad task params: clip_bit_scale: the clipped-indicator bit needs the round's clip_norm");
    }

    /** The dp field's value (a JSON object); each refusal names the field as dp.<key>. */
    @SuppressWarnings("unchecked")
    public static DpRound fromParams(Object dp) throws TaskDeclined {
        if (!(dp instanceof Map)) throw new TaskDeclined("bad task params: dp must be a JSON object, got " + dp);
        try {
            return new DpRound((Map<String, Object>) dp);
        } catch (TaskDeclined e) {          // Params names the key inside dp; the task's field is dp.<key>
            throw new TaskDeclined(e.getMessage().replaceFirst("^bad task params: ", "bad task params: dp."));
        }
    }

    /** A round of the given noise stddev and scale (what a device's own noise draw needs). */
    public static DpRound of(double stddev, int scaleBits) throws TaskDeclined {
        Map<String, Object> p = new LinkedHashMap<>();
        p.put("stddev", stddev);
        p.put("scale_bits", BigInteger.valueOf(scaleBits));
        return fromParams(p);
    }

    Map<String, Object> toParams() {
        Map<String, Object> out = new LinkedHashMap<>();
        out.put("stddev", stddev);
        out.put("scale_bits", BigInteger.valueOf(scaleBits));
        if (threshold != null) out.put("threshold", BigInteger.valueOf(threshold));
        if (clipNorm != null) out.put("clip_norm", clipNorm);
        if (clipBitScale != null) out.put("clip_bit_scale", clipBitScale);
        return out;
    }

    @Override public String toString() { return toParams().toString(); }
}
