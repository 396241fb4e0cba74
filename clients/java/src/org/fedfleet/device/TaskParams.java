// What every task kind's typed params share (protocols/payloads/task_params.py): the version a
// device speaks (params_version 1; absent means 1; another version declines the task), optional
// fields (absent or JSON null), required fields. Unknown keys are ignored. The model fields: ModelSpec.
package org.fedfleet.device;

import java.math.BigInteger;
import java.util.Map;

import org.fedfleet.wire.Json;

final class TaskParams {
    static final String VERSION_KEY = "params_version";
    static final BigInteger VERSION = BigInteger.ONE;

    private TaskParams() {}

    static void checkVersion(Map<String, Object> params, String kind) throws TaskDeclined {
        Object v = params.get(VERSION_KEY);
        if (params.containsKey(VERSION_KEY) && !VERSION.equals(v))
            throw new TaskDeclined("bad " + kind + " params: " + VERSION_KEY + " " + v
                    + " is not the one this device speaks (" + VERSION + ")");
    }

    /** Declines params without one of `keys` (fields a task must name even where their value may be null). */
    static void require(Map<String, Object> params, String kind, String... keys) throws TaskDeclined {
        for (String key : keys)
            if (!params.containsKey(key)) throw new TaskDeclined("bad " + kind + " params: missing field '" + key + "'");
    }

    /** Whether an optional field is there (present and not null). */
    static boolean present(Map<String, Object> params, String key) {
        return params.containsKey(key) && params.get(key) != Json.NULL && params.get(key) != null;
    }

    static boolean bool(Map<String, Object> params, String key, boolean dflt) throws TaskDeclined {
        Object v = params.getOrDefault(key, dflt);
        if (!(v instanceof Boolean)) throw new TaskDeclined("bad task params: " + key + " must be true or false, got " + v);
        return (Boolean) v;
    }

    static String choice(Map<String, Object> params, String key, String dflt, String... choices) throws TaskDeclined {
        String v = params.containsKey(key) ? Params.string(params, key) : dflt;
        for (String c : choices) if (c.equals(v)) return v;
        throw new TaskDeclined("bad task params: " + key + " must be one of " + String.join(", ", choices) + ", got " + v);
    }
}
