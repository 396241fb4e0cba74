// fed3r.stats params (protocols/payloads/fed3r.py Fed3RStatsParams): the one place this device
// reads them; toParams() is their canonical form (golden vectors: protocols/golden/task_params/).
package org.fedfleet.device;

import java.math.BigInteger;
import java.util.LinkedHashMap;
import java.util.Map;

import org.fedfleet.wire.Json;

public final class Fed3RStatsParams {
    static final String KIND = "fed3r.stats";
    final ModelSpec model;
    final boolean fitIntercept, factor;
    final Object randomFeatures;            // a JSON object, or null (this device declines random features)
    final String format, dtype;
    final Double featureClipNorm;           // null: absent
    final Long maxSamples, fromSample;
    final Boolean capSamples;
    final Boolean capByWeight;              // true (with capSamples): every sample weighed to max_samples in all
    final Boolean centered;                 // true: rows shifted by the task's feature_center tensor before the clip

    private Fed3RStatsParams(Map<String, Object> p) throws TaskDeclined {
        TaskParams.checkVersion(p, KIND);
        model = ModelSpec.fromParams(p);
        fitIntercept = TaskParams.bool(p, "fit_intercept", true);
        Object rf = p.get("random_features");
        if (TaskParams.present(p, "random_features") && !(rf instanceof Map))
            throw new TaskDeclined("bad " + KIND + " params: random_features must be a JSON object or null, got " + rf);
        randomFeatures = TaskParams.present(p, "random_features") ? rf : null;
        format = TaskParams.choice(p, "format", "sparse", "sparse", "dense");
        dtype = TaskParams.choice(p, "dtype", "float64", "float64", "float32");
        factor = TaskParams.bool(p, "factor", false);
        featureClipNorm = TaskParams.present(p, "feature_clip_norm") ? Params.number(p, "feature_clip_norm", 0.0, true) : null;
        maxSamples = TaskParams.present(p, "max_samples") ? Params.integer(p, "max_samples", 1, 1_000_000_000) : null;
        capSamples = TaskParams.present(p, "cap_samples") ? TaskParams.bool(p, "cap_samples", false) : null;
        if (Boolean.TRUE.equals(capSamples) && maxSamples == null)
            throw new TaskDeclined("bad " + KIND + " params: cap_samples needs max_samples");
        capByWeight = TaskParams.present(p, "cap_by_weight") ? TaskParams.bool(p, "cap_by_weight", false) : null;
        if (Boolean.TRUE.equals(capByWeight) && !Boolean.TRUE.equals(capSamples))
            throw new TaskDeclined("bad " + KIND + " params: cap_by_weight needs cap_samples");
        fromSample = TaskParams.present(p, "from_sample") ? Params.integer(p, "from_sample", 0, 1_000_000_000) : null;
        centered = TaskParams.present(p, "centered") ? TaskParams.bool(p, "centered", false) : null;
        if (Boolean.TRUE.equals(centered) && (featureClipNorm == null || featureClipNorm == 0.0 || randomFeatures != null))
            throw new TaskDeclined("bad " + KIND + " params: centered needs feature_clip_norm and no random_features");
    }

    public static Fed3RStatsParams fromParams(Map<String, Object> params) throws TaskDeclined {
        return new Fed3RStatsParams(params);
    }

    /** The samples a DP task caps the device to, or null. */
    Long sampleCap() { return Boolean.TRUE.equals(capSamples) ? maxSamples : null; }

    /** Whether the cap weighs every sample (cap_by_weight) rather than keeping the first ones. */
    boolean weighsSamples() { return Boolean.TRUE.equals(capSamples) && Boolean.TRUE.equals(capByWeight); }

    public Map<String, Object> toParams() {
        Map<String, Object> out = new LinkedHashMap<>();
        model.toParams(out);
        out.put("fit_intercept", fitIntercept);
        out.put("random_features", randomFeatures == null ? Json.NULL : randomFeatures);
        out.put("format", format);
        out.put("dtype", dtype);
        out.put("factor", factor);
        if (featureClipNorm != null) out.put("feature_clip_norm", featureClipNorm);
        if (maxSamples != null) out.put("max_samples", BigInteger.valueOf(maxSamples));
        if (capSamples != null) out.put("cap_samples", capSamples);
        if (capByWeight != null) out.put("cap_by_weight", capByWeight);
        if (fromSample != null) out.put("from_sample", BigInteger.valueOf(fromSample));
        if (centered != null) out.put("centered", centered);
        out.put(TaskParams.VERSION_KEY, TaskParams.VERSION);
        return out;
    }
}
