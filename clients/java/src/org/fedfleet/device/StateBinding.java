// The state binding of a stateful task's params (protocols/payloads/stateful.py StateBinding, the
// "state" object): the job's run (a new job under a reused id never continues an older job's
// state), the task's round, how many rounds old a state may be before the device restarts it,
// and how long the device keeps it (the job's horizon). Unknown fields are refused: a binding
// the device half understands could make it continue another run's state.
package org.fedfleet.device;

import java.math.BigInteger;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.TreeSet;
import java.util.regex.Pattern;

public final class StateBinding {
    private static final Pattern RUN = Pattern.compile("[0-9a-f]{8,64}");
    private static final List<String> FIELDS = Arrays.asList("run", "round", "max_staleness", "ttl_s");
    static final double MAX_TTL_S = 365 * 24 * 3600.0;

    public final String run;
    public final long round, maxStaleness;
    public final double ttlS;
    private final Object ttlWire;              // ttl_s as the task wrote it (an integer stays one)

    private StateBinding(String run, long round, long maxStaleness, Object ttlWire, double ttlS) {
        this.run = run; this.round = round; this.maxStaleness = maxStaleness; this.ttlWire = ttlWire; this.ttlS = ttlS;
    }

    static StateBinding fromParams(Object state, String kind) throws TaskDeclined {
        if (!(state instanceof Map)) throw new TaskDeclined("bad " + kind + " params: a stateful task needs a 'state' object in its params");
        @SuppressWarnings("unchecked") Map<String, Object> s = (Map<String, Object>) state;
        TreeSet<String> unknown = new TreeSet<>(s.keySet());
        unknown.removeAll(FIELDS);
        if (!unknown.isEmpty()) throw new TaskDeclined("bad " + kind + " params: unknown state fields " + unknown);
        for (String key : Arrays.asList("run", "round"))
            if (!s.containsKey(key)) throw new TaskDeclined("bad " + kind + " params: state: missing field '" + key + "'");
        Object run = s.get("run");
        if (!(run instanceof String) || !RUN.matcher((String) run).matches())
            throw new TaskDeclined("bad " + kind + " params: state run must be 8-64 lowercase hex digits, got " + run);
        Object ttl = s.getOrDefault("ttl_s", 7 * 24 * 3600.0);
        double ttlS = ttl instanceof BigInteger ? ((BigInteger) ttl).doubleValue() : ttl instanceof Double ? (Double) ttl : Double.NaN;
        if (!Double.isFinite(ttlS) || ttlS <= 0 || ttlS > MAX_TTL_S)
            throw new TaskDeclined("bad " + kind + " params: state ttl_s must be in (0, " + MAX_TTL_S + "] seconds, got " + ttl);
        return new StateBinding((String) run, count(s, "round", null, kind), count(s, "max_staleness", 50L, kind), ttl, ttlS);
    }

    private static long count(Map<String, Object> s, String key, Long dflt, String kind) throws TaskDeclined {
        Object v = s.containsKey(key) ? s.get(key) : BigInteger.valueOf(dflt);
        if (!(v instanceof BigInteger) || ((BigInteger) v).signum() < 0 || ((BigInteger) v).compareTo(BigInteger.TEN.pow(9)) > 0)
            throw new TaskDeclined("bad " + kind + " params: state " + key + " must be an integer in 0..1e9, got " + v);
        return ((BigInteger) v).longValue();
    }

    Map<String, Object> toParams() {
        Map<String, Object> out = new LinkedHashMap<>();
        out.put("run", run);
        out.put("round", BigInteger.valueOf(round));
        out.put("max_staleness", BigInteger.valueOf(maxStaleness));
        out.put("ttl_s", ttlWire);
        return out;
    }
}
