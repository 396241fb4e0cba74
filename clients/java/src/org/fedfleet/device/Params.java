// Reading a task's params (JSON as org.fedfleet.wire.Json parses it: BigInteger for integers,
// Double for other numbers): each malformed field declines the task with one clear reason.
package org.fedfleet.device;

import java.math.BigInteger;
import java.util.Map;
import org.fedfleet.wire.Json;

final class Params {
    private Params() {}

    static long integer(Map<String, Object> params, String key, long min, long max) throws TaskDeclined {
        Object v = params.get(key);
        if (!(v instanceof BigInteger) || ((BigInteger) v).compareTo(BigInteger.valueOf(min)) < 0
                || ((BigInteger) v).compareTo(BigInteger.valueOf(max)) > 0)
            throw new TaskDeclined("bad task params: " + key + " must be an integer in [" + min + ", " + max + "], got " + v);
        return ((BigInteger) v).longValue();
    }

    /** An optional integer field: dflt when absent. */
    static long integer(Map<String, Object> params, String key, long dflt, long min, long max) throws TaskDeclined {
        return params.containsKey(key) ? integer(params, key, min, max) : dflt;
    }

    /** A finite number > 0 (>= 0 with zeroOk); an integer counts; dflt when absent. */
    static double number(Map<String, Object> params, String key, double dflt, boolean zeroOk) throws TaskDeclined {
        Object v = params.get(key);
        if (v == null) return dflt;
        double x;
        if (v instanceof Double) x = (Double) v;
        else if (v instanceof BigInteger) x = ((BigInteger) v).doubleValue();
        else throw new TaskDeclined("bad task params: " + key + " must be a number, got " + v);
        if (!Double.isFinite(x) || x < 0 || (x == 0 && !zeroOk))
            throw new TaskDeclined("bad task params: " + key + " must be a finite number " + (zeroOk ? ">=" : ">") + " 0, got " + v);
        return x;
    }

    static String string(Map<String, Object> params, String key) throws TaskDeclined {
        Object v = params.get(key);
        if (!(v instanceof String)) throw new TaskDeclined("bad task params: " + key + " must be a string, got " + v);
        return (String) v;
    }

    /** A string of at most maxChars characters (code points, as protocols/payloads/task_params.py check_str). */
    static String string(Map<String, Object> params, String key, int maxChars) throws TaskDeclined {
        String v = string(params, key);
        if (Json.characters(v) > maxChars)
            throw new TaskDeclined("bad task params: " + key + " must be a string of at most " + maxChars + " characters");
        return v;
    }
}
