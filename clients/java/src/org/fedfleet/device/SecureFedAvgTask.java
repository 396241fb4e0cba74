// Task kind "fedavg.secure" (secure FedAvg(ψ), edge_client/tasks/secure_fedavg_training.py): the
// head trained as for fedavg.head, contributed as [n·t_1 | n·t_2 | n] over the task's
// vector_order (default weight, bias; protocols/payloads/secagg.py pack_weighted), so the group
// sum gives Σ n_k θ_k and Σ n_k and no θ_k is seen. A head with an entry beyond the round's
// max_abs_param, or more samples than max_samples, is declined before SecAgg's fixed-point range
// would overflow. Under distributed DP (a task with "dp") the device sends [clip(θ_k − θ_t) | 1]
// instead, unweighted (n_k would make the sensitivity data-dependent), with its share of Skellam
// noise on the update (SkellamNoise).
package org.fedfleet.device;

import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.Map;
import org.fedfleet.wire.Envelope;

public final class SecureFedAvgTask implements SecureTask {
    public static final String KIND = "fedavg.secure";
    private static final List<Object> HEAD_ORDER = Arrays.<Object>asList("weight", "bias");
    private final FedAvgHeadTask training;
    private final SkellamNoise noise;

    public SecureFedAvgTask(FedAvgHeadTask training) { this(training, new SkellamNoise()); }

    public SecureFedAvgTask(FedAvgHeadTask training, SkellamNoise noise) { this.training = training; this.noise = noise; }

    @Override
    public double[] vector(Map<String, Object> params, List<Envelope.Tensor> tensors) throws TaskDeclined {
        Object order = params.getOrDefault("vector_order", new ArrayList<Object>(HEAD_ORDER));
        if (!(order instanceof List) || ((List<?>) order).size() != 2 || !((List<?>) order).containsAll(HEAD_ORDER))
            throw new TaskDeclined("vector_order " + order + " does not name exactly the trained tensors [bias, weight]");
        if (params.containsKey("dp")) return dpVector(params, tensors, (List<?>) order);
        long maxSamples = Params.integer(params, "max_samples", 1, Long.MAX_VALUE);
        double limit = Params.number(params, "max_abs_param", Double.NaN, false);
        if (Double.isNaN(limit)) throw new TaskDeclined("bad task params: max_abs_param is missing");
        HeadTrainer.Trained t = training.train(params, tensors);
        if (t.n > maxSamples) throw new TaskDeclined(t.n + " local samples exceed the round's bound of " + maxSamples);
        double largest = 0;
        for (float v : t.weight) largest = Math.max(largest, Math.abs(v));
        for (float v : t.bias) largest = Math.max(largest, Math.abs(v));
        if (largest > limit) throw new TaskDeclined(String.format("trained model has |θ| = %.3g > the round's bound %s", largest, limit));
        double[] v = new double[t.weight.length + t.bias.length + 1];
        int k = 0;
        for (Object name : (List<?>) order)
            for (float x : name.equals("weight") ? t.weight : t.bias) v[k++] = (double) t.n * x;
        v[k] = t.n;
        return v;
    }

    /** Distributed DP-FedAvg: [clip(θ_k − θ_t) | 1] plus this device's noise share; the update is
     *  clipped as one vector over both tensors (protocols/clipping.py clip_update). */
    private double[] dpVector(Map<String, Object> params, List<Envelope.Tensor> tensors, List<?> order) throws TaskDeclined {
        Object dp = params.get("dp");
        if (!(dp instanceof Map)) throw new TaskDeclined("bad dp params " + dp);
        @SuppressWarnings("unchecked") double clipNorm = Params.number((Map<String, Object>) dp, "clip_norm", Double.NaN, false);
        if (Double.isNaN(clipNorm)) throw new TaskDeclined("bad dp params " + dp + ": clip_norm is missing");
        HeadTrainer.Trained t = training.train(params, tensors);
        long[] weightShape = {t.bias.length, t.weight.length / t.bias.length};
        float[] startW = FedAvgHeadTask.headTensor(tensors, "weight", weightShape);
        float[] startB = FedAvgHeadTask.headTensor(tensors, "bias", new long[] {t.bias.length});
        double[] v = new double[t.weight.length + t.bias.length + 1];
        int k = 0;
        double sq = 0;
        for (Object name : order) {
            boolean w = name.equals("weight");
            float[] after = w ? t.weight : t.bias, before = w ? startW : startB;
            for (int i = 0; i < after.length; i++) {
                v[k] = (double) after[i] - before[i];
                sq += v[k] * v[k];
                k++;
            }
        }
        double norm = Math.sqrt(sq), factor = norm > 0 ? Math.min(1.0, clipNorm / norm) : 1.0;
        for (int i = 0; i < k; i++) v[i] *= factor;
        v[k] = 1.0;
        return noise.add(v, dp, k);
    }
}
