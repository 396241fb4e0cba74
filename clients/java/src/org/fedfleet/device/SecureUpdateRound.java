// The FedAvg family's secure round fields (protocols/payloads/secure_tasks.py SecureUpdateRound),
// read beside the plain kind's params: the round's group, the largest sample count and |value|
// a member may put in the sum, the trained tensors' order in the vector, the bounded-influence
// clip (update_clip_norm) and, under distributed DP, the round's noise (dp, with its clip_norm).
package org.fedfleet.device;

import java.math.BigInteger;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import org.fedfleet.wire.Json;

final class SecureUpdateRound {
    static final int MAX_GROUP_ID = 128;
    static final List<String> HEAD_ORDER = Collections.unmodifiableList(Arrays.asList("weight", "bias"));
    final String group;
    final long maxSamples;
    final double maxAbsParam;
    final List<String> vectorOrder;
    final Double updateClipNorm;            // null: absent
    final DpRound dp;                       // null: absent (no distributed DP)

    SecureUpdateRound(Map<String, Object> p, String kind) throws TaskDeclined {
        TaskParams.require(p, kind, "group", "max_samples", "max_abs_param");
        group = group(p);
        maxSamples = Params.integer(p, "max_samples", 1, 1_000_000_000);
        maxAbsParam = Params.number(p, "max_abs_param", Double.NaN, false);
        vectorOrder = p.containsKey("vector_order") ? vectorOrder(p.get("vector_order"), kind) : HEAD_ORDER;
        updateClipNorm = TaskParams.present(p, "update_clip_norm") ? Params.number(p, "update_clip_norm", Double.NaN, true) : null;
        dp = TaskParams.present(p, "dp") ? DpRound.fromParams(p.get("dp")) : null;
        if (dp != null && dp.clipNorm == null)
            throw new TaskDeclined("bad " + kind + " params: dp of a secure update round needs its clip_norm");
    }

    /** A secure task's group: a non-empty string of at most MAX_GROUP_ID characters. */
    static String group(Map<String, Object> p) throws TaskDeclined {
        String group = Params.string(p, "group");
        if (group.isEmpty() || Json.characters(group) > MAX_GROUP_ID)
            throw new TaskDeclined("bad task params: group must be a non-empty string of at most " + MAX_GROUP_ID
                    + " characters (a secure task needs its group)");
        return group;
    }

    /** The group a task names as sent, or null where it names none (a live round is only ever opened
     *  under a well-formed group, so a malformed one matches none and is declined by the kind's check). */
    static String namedGroup(Map<String, Object> p) {
        Object group = p.get("group");
        return group instanceof String ? (String) group : null;
    }

    private static List<String> vectorOrder(Object v, String kind) throws TaskDeclined {
        String bad = "bad " + kind + " params: vector_order must name distinct tensors, got " + v;
        if (!(v instanceof List) || ((List<?>) v).isEmpty()) throw new TaskDeclined(bad);
        List<String> names = new ArrayList<>();
        for (Object name : (List<?>) v) {
            if (!(name instanceof String) || Json.characters((String) name) > 256) throw new TaskDeclined(bad);
            names.add((String) name);
        }
        if (new HashSet<>(names).size() != names.size()) throw new TaskDeclined(bad);
        return Collections.unmodifiableList(names);
    }

    void toParams(Map<String, Object> out) {
        out.put("group", group);
        out.put("max_samples", BigInteger.valueOf(maxSamples));
        out.put("max_abs_param", maxAbsParam);
        out.put("vector_order", new ArrayList<Object>(vectorOrder));
        if (updateClipNorm != null) out.put("update_clip_norm", updateClipNorm);
        if (dp != null) out.put("dp", dp.toParams());
    }
}
