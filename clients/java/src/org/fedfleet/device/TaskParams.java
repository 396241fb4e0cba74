// What every task kind's typed params share (protocols/payloads/task_params.py): the version a
// device speaks (params_version 1; absent means 1; another version declines the task), optional
// fields (absent or JSON null), and the model fields. Unknown keys are ignored.
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

    /** The model a classification task runs (protocols/payloads/task_params.py ModelSpec). */
    static final class Model {
        final int numClasses, imageSize;
        final String backbone, weightsSha256, bundleSha256;

        private Model(int numClasses, String backbone, int imageSize, String weightsSha256, String bundleSha256) {
            this.numClasses = numClasses; this.backbone = backbone; this.imageSize = imageSize;
            this.weightsSha256 = weightsSha256; this.bundleSha256 = bundleSha256;
        }

        static Model fromParams(Map<String, Object> params) throws TaskDeclined {
            return new Model((int) Params.integer(params, "num_classes", 1, 1_000_000), Params.string(params, "backbone"),
                    (int) Params.integer(params, "image_size", 1, 16_384), sha(params, "weights_sha256"), sha(params, "bundle_sha256"));
        }

        private static String sha(Map<String, Object> params, String key) throws TaskDeclined {
            String v = params.containsKey(key) ? Params.string(params, key) : "";
            if (!v.isEmpty() && !v.matches("[0-9a-f]{64}"))
                throw new TaskDeclined("bad task params: " + key + " must be empty or 64 lowercase hex digits, got " + v);
            return v;
        }

        void toParams(Map<String, Object> out) {
            out.put("num_classes", BigInteger.valueOf(numClasses));
            out.put("backbone", backbone);
            out.put("image_size", BigInteger.valueOf(imageSize));
            out.put("weights_sha256", weightsSha256);
            out.put("bundle_sha256", bundleSha256);
        }
    }
}
