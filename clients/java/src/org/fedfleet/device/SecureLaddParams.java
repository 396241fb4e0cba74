// ladd.train.secure params (protocols/payloads/secure_tasks.py SecureLaddParams): ladd.train's
// plus the round's slot layout (slots: {"global": layout or [], "slot": layout or [], "enabled":
// [1..64 booleans]}, names disjoint and not all empty), whose group id ("ladd-slots-" + sha256 of
// its compact ASCII JSON) the task's group must be, max_samples, max_abs_param and optional DP.
// This library does not serve it; it reads the params exactly as the Python device does.
package org.fedfleet.device;

import java.math.BigInteger;
import java.util.ArrayList;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;

public final class SecureLaddParams extends LaddTrainParams {
    static final String KIND = "ladd.train.secure";
    static final long MAX_SLOT_VECTOR = 1L << 27;
    private final String group;
    private final Map<String, Object> slots;
    private final long maxSamples;
    private final double maxAbsParam;
    private final DpRound dp;

    private SecureLaddParams(Map<String, Object> p) throws TaskDeclined {
        super(p, KIND);
        TaskParams.require(p, KIND, "group", "slots", "max_samples", "max_abs_param");
        group = SecureUpdateRound.group(p);
        slots = slots(p.get("slots"));
        if (!group.equals("ladd-slots-" + digest(slots)))
            throw bad(KIND, "the task's group is not the group of its slot layout");
        maxSamples = Params.integer(p, "max_samples", 1, 1_000_000_000);
        maxAbsParam = Params.number(p, "max_abs_param", Double.NaN, false);
        dp = TaskParams.present(p, "dp") ? DpRound.fromParams(p.get("dp")) : null;
    }

    public static SecureLaddParams fromParams(Map<String, Object> params) throws TaskDeclined {
        return new SecureLaddParams(params);
    }

    /** ClusterSlotLayout.from_json's checks; the layout as written. */
    private static Map<String, Object> slots(Object value) throws TaskDeclined {
        if (!(value instanceof Map) || !((Map<?, ?>) value).keySet().equals(new HashSet<>(java.util.Arrays.asList("global", "slot", "enabled"))))
            throw bad(KIND, "slots must be an object with exactly 'global', 'slot' and 'enabled'");
        @SuppressWarnings("unchecked") Map<String, Object> s = (Map<String, Object>) value;
        Object enabled = s.get("enabled");
        if (!(enabled instanceof List) || !((List<?>) enabled).stream().allMatch(e -> e instanceof Boolean))
            throw bad(KIND, "slots: enabled must be a list of booleans");
        List<String> names = new ArrayList<>();
        long[] sizes = new long[2];                          // values of the global layout, of one slot
        for (int k = 0; k < 2; k++) {
            String part = k == 0 ? "global" : "slot";
            Object layout = s.get(part);
            if (layout instanceof List && ((List<?>) layout).isEmpty()) continue;
            for (Object item : layout(layout, KIND, "slots: bad " + part + " layout")) {
                names.add((String) ((List<?>) item).get(0));
                long size = 1;
                for (Object dim : (List<?>) ((List<?>) item).get(1)) size *= ((BigInteger) dim).longValue();
                sizes[k] += size;
            }
        }
        int clusters = ((List<?>) enabled).size();
        if (clusters < 1 || clusters > 64) throw bad(KIND, "slots: 1 to 64 clusters, got " + clusters);
        Set<String> distinct = new HashSet<>(names);
        if (distinct.size() != names.size()) throw bad(KIND, "slots: a tensor name appears twice (global and slot names must be disjoint)");
        if (names.isEmpty()) throw bad(KIND, "slots: no tensors");
        long vector = sizes[0] + clusters * sizes[1] + 1 + 2L * clusters;       // RoundConfig's largest vector_length
        if (vector > MAX_SLOT_VECTOR) throw bad(KIND, "slots: vector of " + vector + " values, more than " + MAX_SLOT_VECTOR);
        return s;
    }

    @Override
    public Map<String, Object> toParams() {
        Map<String, Object> out = super.toParams();
        out.put("group", group);
        out.put("slots", new LinkedHashMap<>(slots));
        out.put("max_samples", BigInteger.valueOf(maxSamples));
        out.put("max_abs_param", maxAbsParam);
        if (dp != null) out.put("dp", dp.toParams());
        return out;
    }
}
