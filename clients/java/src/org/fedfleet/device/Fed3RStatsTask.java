// Task kind "fed3r.stats" (docs/protocol.md): the local samples through the feature extractor,
// their Fed3R statistics, and the result body {n, p, num_classes, format} with tensors A_upper,
// class_ids (sparse only) and b. The exact factor form is optional for a device and not sent here;
// random-feature tasks (Fed3R-RF) are declined. A streaming task's from_sample is echoed.
package org.fedfleet.device;

import java.math.BigInteger;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Tensors;

public final class Fed3RStatsTask implements TaskHandler {
    public static final String KIND = "fed3r.stats";
    private final LocalData data;
    private final FeatureExtractor extractor;

    public Fed3RStatsTask(LocalData data, FeatureExtractor extractor) { this.data = data; this.extractor = extractor; }

    /** The task's statistics without encoding them (what the secure variant masks): over the
     *  samples after the first from_sample (streaming: the aggregator holds those already), the
     *  first max_samples of them when the task caps samples (DP), rows clipped to
     *  feature_clip_norm when it is > 0. */
    public Fed3RAccumulator accumulate(Map<String, Object> params) throws TaskDeclined {
        if (data.size() == 0) throw new TaskDeclined("no local training data");
        int numClasses = (int) Params.integer(params, "num_classes", 1, 1 << 20);
        Object fit = params.getOrDefault("fit_intercept", Boolean.TRUE);
        if (!(fit instanceof Boolean)) throw new TaskDeclined("bad fed3r.stats params: fit_intercept must be a boolean");
        Object rf = params.get("random_features");
        if (rf != null && rf != org.fedfleet.wire.Json.NULL)
            throw new TaskDeclined("random features (Fed3R-RF) are not supported by this device");
        int start = (int) Params.integer(params, "from_sample", 0, 0, Integer.MAX_VALUE);
        if (start > data.size()) throw new TaskDeclined("the aggregator holds " + start + " samples of this device, it has " + data.size());
        if (start == data.size()) throw new TaskDeclined("no new samples");
        double clipNorm = Params.number(params, "feature_clip_norm", 0.0, true);
        int end = data.size();
        Object cap = params.getOrDefault("cap_samples", Boolean.FALSE);
        if (!(cap instanceof Boolean)) throw new TaskDeclined("bad fed3r.stats params: cap_samples must be a boolean");
        if ((Boolean) cap)     // DP caps the samples per device: the first max_samples, a choice blind to the data
            end = (int) Math.min(end, start + Params.integer(params, "max_samples", 1, Integer.MAX_VALUE));
        for (int i = start; i < data.size(); i++)
            if (data.label(i) < 0 || data.label(i) >= numClasses)
                throw new TaskDeclined("local label " + data.label(i) + " outside the job's " + numClasses + " classes");
        extractor.checkModel(params);
        Fed3RAccumulator acc;
        try {
            acc = new Fed3RAccumulator(numClasses, extractor.featureDim(), (Boolean) fit, clipNorm);
        } catch (IllegalArgumentException e) {
            throw new TaskDeclined(e.getMessage());
        }
        for (int first = start; first < end; first += LocalFeatures.BATCH) {
            int last = Math.min(first + LocalFeatures.BATCH, end);
            float[][] inputs = new float[last - first][];
            for (int i = first; i < last; i++) inputs[i - first] = data.input(i);
            float[][] feats = extractor.extract(inputs);
            for (int i = first; i < last; i++) {
                try {
                    acc.add(feats[i - first], data.label(i));
                } catch (IllegalArgumentException e) {
                    throw new TaskDeclined(e.getMessage());
                }
            }
        }
        return acc;
    }

    @Override
    public Result run(Map<String, Object> params, List<Envelope.Tensor> tensors) throws TaskDeclined {
        Object format = params.getOrDefault("format", "sparse"), dtype = params.getOrDefault("dtype", "float64");
        if (!"sparse".equals(format) && !"dense".equals(format)) throw new TaskDeclined("bad fed3r.stats params: format " + format);
        if (!"float64".equals(dtype) && !"float32".equals(dtype)) throw new TaskDeclined("bad fed3r.stats params: dtype " + dtype);
        Result r = encode(accumulate(params), "dense".equals(format), (String) dtype);
        if (params.containsKey("from_sample")) r.body.put("from_sample", params.get("from_sample"));
        return r;
    }

    /** Body and tensors of the packed form (protocols/payloads/fed3r.py encode_stats). */
    public static Result encode(Fed3RAccumulator acc, boolean dense, String dtype) {
        int p = acc.p;
        Map<String, Object> body = new LinkedHashMap<>();
        body.put("n", BigInteger.valueOf(acc.n()));
        body.put("p", BigInteger.valueOf(p));
        body.put("num_classes", BigInteger.valueOf(acc.numClasses));
        body.put("format", dense ? "dense" : "sparse");
        List<Envelope.Tensor> out = new ArrayList<>();
        out.add(Tensors.floats("A_upper", dtype, new long[] {(long) p * (p + 1) / 2}, acc.aUpper()));
        long[] classes;
        if (dense) {
            classes = new long[acc.numClasses];
            for (int c = 0; c < classes.length; c++) classes[c] = c;
        } else {
            classes = acc.presentClasses();
            out.add(Tensors.int64("class_ids", new long[] {classes.length}, classes));
        }
        out.add(Tensors.floats("b", dtype, new long[] {classes.length, p}, acc.bRows(classes)));
        return new Result(body, out);
    }
}
