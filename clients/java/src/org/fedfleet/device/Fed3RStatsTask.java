// Task kind "fed3r.stats" (docs/protocol.md): the local samples through the feature extractor,
// their Fed3R statistics, and the result body {n, p, num_classes, format} with tensors A_upper,
// class_ids (sparse only) and b; when the task allows the exact factor form ("factor": true, sparse)
// and the device has fewer samples than features, the canonical factor (R, QtY, class_ids and
// zero_columns) instead when it is smaller. Random-feature tasks (Fed3R-RF) are declined. A
// streaming task's from_sample is echoed. A task whose numbers size more memory than the device's
// budget is declined before anything is allocated, by the Python device's rule and words
// (edge_client/tasks/fed3r_stats.py _check_memory): num_classes is the aggregator's to choose, up
// to 1,000,000, and a task of that many classes threw OutOfMemoryError, which ended the agent's thread.
// Which samples a task covers (from_sample; max_samples with cap_samples) is the aggregator's choice:
// the device answers only windows the boundary rule allows (SampleWindows, edge_client/sample_windows.py).
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
    /** The bytes a device gives a task's statistics unless told otherwise (the Python device's DEFAULT_MEMORY_BUDGET). */
    public static final long DEFAULT_MEMORY_BUDGET = 256L * 1024 * 1024;
    private final LocalData data;
    private final FeatureExtractor extractor;
    private final long memoryBudget;
    /** The windows of samples this device answered (kept in its state folder when it has one). */
    public final SampleWindows windows;

    public Fed3RStatsTask(LocalData data, FeatureExtractor extractor) { this(data, extractor, DEFAULT_MEMORY_BUDGET); }

    public Fed3RStatsTask(LocalData data, FeatureExtractor extractor, long memoryBudget) {
        this(data, extractor, memoryBudget, new SampleWindows());
    }

    public Fed3RStatsTask(LocalData data, FeatureExtractor extractor, long memoryBudget, SampleWindows windows) {
        this.data = data; this.extractor = extractor; this.memoryBudget = memoryBudget; this.windows = windows;
    }

    /** TaskDeclined when the statistics of `rows` samples need more than the memory budget: 8 bytes
     *  for each of the p x p Gram matrix, the C x p class sums and each row's C one-hot labels, as the
     *  Python device counts them (random features, which it also counts, this device declines). */
    private void checkMemory(int numClasses, int featureDim, boolean fitIntercept, long rows) throws TaskDeclined {
        double p = featureDim + (fitIntercept ? 1 : 0);
        double needed = 8 * (p * p + (double) numClasses * p + (double) rows * numClasses);
        if (needed > memoryBudget)
            throw new TaskDeclined(String.format(java.util.Locale.ROOT, "statistics of %d features need %.0f MiB, over this device's %.0f MiB",
                    (long) p, needed / (1 << 20), memoryBudget / (double) (1 << 20)));
    }

    /** The task's statistics without encoding them (what the secure variant masks): over the
     *  samples after the first from_sample (streaming: the aggregator holds those already), the
     *  first max_samples of them when the task caps samples (DP; all of them weighed to max_samples
     *  with cap_by_weight), rows clipped to
     *  feature_clip_norm when it is > 0. */
    public Fed3RAccumulator accumulate(Fed3RStatsParams task) throws TaskDeclined {
        if (Boolean.TRUE.equals(task.centered)) throw new TaskDeclined("a centered " + KIND + " task needs its feature_center tensor");
        return accumulate(task, List.of());
    }

    /** The same, a centered task's rows shifted by the feature_center among the task's tensors first. */
    public Fed3RAccumulator accumulate(Fed3RStatsParams task, List<Envelope.Tensor> tensors) throws TaskDeclined {
        if (data.size() == 0) throw new TaskDeclined("no local training data");
        return accumulate(task, false, tensors);
    }

    /** A centered task's feature_center: the feature dimension's finite values (else a decline). */
    static double[] featureCenter(Fed3RStatsParams task, List<Envelope.Tensor> tensors, int featureDim) throws TaskDeclined {
        if (!Boolean.TRUE.equals(task.centered)) return null;
        for (Envelope.Tensor t : tensors) {
            if (!t.name.equals("feature_center")) continue;
            double[] center;
            try {
                center = Tensors.doubles(t);
            } catch (Envelope.EnvelopeError e) {
                throw new TaskDeclined(e.getMessage());
            }
            if (t.shape.length != 1 || center.length != featureDim)
                throw new TaskDeclined("feature_center must be " + featureDim + " finite values, got shape " + java.util.Arrays.toString(t.shape));
            for (double c : center)
                if (!Double.isFinite(c)) throw new TaskDeclined("feature_center must be " + featureDim + " finite values");
            return center;
        }
        throw new TaskDeclined("a centered " + KIND + " task without its 'feature_center' tensor");
    }

    private Fed3RAccumulator accumulate(Fed3RStatsParams task, boolean keepRows, List<Envelope.Tensor> tensors) throws TaskDeclined {
        int numClasses = task.model.numClasses;
        if (task.randomFeatures != null)
            throw new TaskDeclined("random features (Fed3R-RF) are not supported by this device");
        int start = task.fromSample == null ? 0 : (int) Math.min(task.fromSample, Integer.MAX_VALUE);
        if (start > data.size()) throw new TaskDeclined("the aggregator holds " + start + " samples of this device, it has " + data.size());
        if (start == data.size()) throw new TaskDeclined("no new samples");
        double clipNorm = task.featureClipNorm == null ? 0.0 : task.featureClipNorm;
        int end = data.size();
        // DP caps the samples per device: the first max_samples, a choice blind to the data (or, with
        // cap_by_weight, every sample weighed after the loop: the same bound, none of the data left out)
        if (task.sampleCap() != null && !task.weighsSamples())
            end = (int) Math.min(end, start + task.sampleCap());
        for (int i = start; i < data.size(); i++)
            if (data.label(i) < 0 || data.label(i) >= numClasses)
                throw new TaskDeclined("local label " + data.label(i) + " outside the job's " + numClasses + " classes");
        extractor.checkModel(task.model);
        checkMemory(numClasses, extractor.featureDim(), task.fitIntercept, end - start);
        String refused = windows.refusal(start, end, data.size());
        if (refused != null) throw new TaskDeclined(refused);
        Fed3RAccumulator acc;
        try {
            acc = new Fed3RAccumulator(numClasses, extractor.featureDim(), task.fitIntercept, clipNorm);
            if (keepRows) acc.keepRows();
            if (tensors != null) acc.center(featureCenter(task, tensors, extractor.featureDim()));
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
        if (task.weighsSamples()) acc.weigh(task.sampleCap());
        refused = windows.record(start, end, data.size());      // written down before the answer goes out
        if (refused != null) throw new TaskDeclined(refused);
        return acc;
    }

    @Override
    public Result run(Map<String, Object> params, List<Envelope.Tensor> tensors) throws TaskDeclined {
        if (data.size() == 0) throw new TaskDeclined("no local training data");
        Fed3RStatsParams task = Fed3RStatsParams.fromParams(params);
        String format = task.format, dtype = task.dtype;
        boolean factorOk = task.factor && "sparse".equals(format);
        Fed3RAccumulator acc = accumulate(task, factorOk, tensors);
        CanonicalFactor f = factorOk ? acc.factor() : null;
        long[] classes = acc.presentClasses();
        Result r = f != null && factorValues(f, classes.length) < (long) acc.p * (acc.p + 1) / 2 + (long) classes.length * acc.p
                && f.canonicalAs(dtype)
                ? encodeFactor(acc, f, dtype) : encode(acc, "dense".equals(format), dtype);
        if (task.fromSample != null) r.body.put("from_sample", BigInteger.valueOf(task.fromSample));
        return r;
    }

    private static long factorValues(CanonicalFactor f, int classes) {
        long rank = f.r.length;
        return rank * f.columns + rank * classes + f.zeroColumns.length;
    }

    /** Body and tensors of the factor form (protocols/payloads/fed3r.py encode_factor). */
    public static Result encodeFactor(Fed3RAccumulator acc, CanonicalFactor f, String dtype) {
        Map<String, Object> body = new LinkedHashMap<>();
        body.put("n", BigInteger.valueOf(acc.n()));
        body.put("p", BigInteger.valueOf(acc.p));
        body.put("num_classes", BigInteger.valueOf(acc.numClasses));
        body.put("format", "sparse");
        body.put("a_format", "factor");
        long[] classes = acc.presentClasses();
        List<Envelope.Tensor> out = new ArrayList<>();
        out.add(Tensors.floats("R", dtype, new long[] {f.r.length, f.columns}, flat(f.r, dtype)));
        out.add(Tensors.floats("QtY", dtype, new long[] {f.qty.length, classes.length}, flat(f.qty, dtype)));
        out.add(Tensors.int64("class_ids", new long[] {classes.length}, classes));
        if (f.zeroColumns.length > 0) out.add(Tensors.int64("zero_columns", new long[] {f.zeroColumns.length}, f.zeroColumns));
        return new Result(body, out);
    }

    /** Row-major, with -0.0 (what a pivot's sign flip leaves of a zero) sent as 0.0. */
    private static double[] flat(double[][] m, String dtype) {
        int cols = m.length == 0 ? 0 : m[0].length;
        double[] out = new double[m.length * cols];
        for (int i = 0; i < m.length; i++)
            for (int k = 0; k < cols; k++) out[i * cols + k] = m[i][k];
        return positiveZeros(out, dtype);
    }

    /** The values rounded to the wire dtype, every -0.0 as +0.0 (x + 0.0 is x for every other x),
     *  in place: the statistics are canonical payloads, equal values must be equal bytes on every
     *  device (protocols/payloads/fed3r.py positive_zeros). Rounded first: a tiny negative double
     *  becomes -0.0 in float32. */
    static double[] positiveZeros(double[] values, String dtype) {
        boolean single = "float32".equals(dtype);
        for (int k = 0; k < values.length; k++) values[k] = (single ? (double) (float) values[k] : values[k]) + 0.0;
        return values;
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
        out.add(Tensors.floats("A_upper", dtype, new long[] {(long) p * (p + 1) / 2}, positiveZeros(acc.aUpper(), dtype)));
        long[] classes;
        if (dense) {
            classes = new long[acc.numClasses];
            for (int c = 0; c < classes.length; c++) classes[c] = c;
        } else {
            classes = acc.presentClasses();
            out.add(Tensors.int64("class_ids", new long[] {classes.length}, classes));
        }
        out.add(Tensors.floats("b", dtype, new long[] {classes.length, p}, positiveZeros(acc.bRows(classes), dtype)));
        return new Result(body, out);
    }
}
