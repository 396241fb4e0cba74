// fedavg.head params (protocols/payloads/fedavg.py HeadTrainingParams): the model, the head's
// feature dimension, the local recipe (LocalTraining) and, for asynchronous jobs, the model version.
package org.fedfleet.device;

import java.math.BigInteger;
import java.util.LinkedHashMap;
import java.util.Map;

public final class HeadTrainingParams {
    static final String KIND = "fedavg.head";
    final ModelSpec model;
    final int featureDim;
    final LocalTraining recipe;
    final Long modelVersion;                // null: absent

    private HeadTrainingParams(Map<String, Object> p, String kind) throws TaskDeclined {
        TaskParams.checkVersion(p, kind);
        model = ModelSpec.fromParams(p);
        featureDim = (int) Params.integer(p, "feature_dim", 1280, 1, 1_000_000);
        recipe = LocalTraining.fromParams(p);
        modelVersion = TaskParams.present(p, "model_version") ? Params.integer(p, "model_version", 0, 1_000_000_000) : null;
    }

    public static HeadTrainingParams fromParams(Map<String, Object> params) throws TaskDeclined {
        return new HeadTrainingParams(params, KIND);
    }

    /** The head fields of another kind's params (a stateful head task's), declining in its name. */
    static HeadTrainingParams fromParams(Map<String, Object> params, String kind) throws TaskDeclined {
        return new HeadTrainingParams(params, kind);
    }

    public Map<String, Object> toParams() {
        Map<String, Object> out = new LinkedHashMap<>();
        model.toParams(out);
        out.put("feature_dim", BigInteger.valueOf(featureDim));
        recipe.toParams(out);
        if (modelVersion != null) out.put("model_version", BigInteger.valueOf(modelVersion));
        out.put(TaskParams.VERSION_KEY, TaskParams.VERSION);
        return out;
    }
}
