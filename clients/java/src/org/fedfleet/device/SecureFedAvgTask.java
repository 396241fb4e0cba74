// Task kind "fedavg.secure" (secure FedAvg(ψ), edge_client/tasks/secure_fedavg_training.py): the
// head trained as for fedavg.head, contributed as [n·t_1 | n·t_2 | n] over the task's
// vector_order (default weight, bias; protocols/payloads/secagg.py pack_weighted), so the group
// sum gives Σ n_k θ_k and Σ n_k and no θ_k is seen. With the task's update_clip_norm C the
// update θ_k − θ_t is first clipped to norm C (bounded influence: the aggregator checks the
// group's sum against Σ n_k·C). A head with an entry beyond the round's max_abs_param, or more
// samples than max_samples, is declined before SecAgg's fixed-point range would overflow. Under
// distributed DP (a task with "dp") the device sends [clip(θ_k − θ_t) | 1] instead, unweighted
// (n_k would make the sensitivity data-dependent), with its share of Skellam noise on the update
// (SkellamNoise). Params: SecureFedAvgParams.
package org.fedfleet.device;

import java.util.List;
import java.util.Map;
import org.fedfleet.wire.Envelope;

public final class SecureFedAvgTask implements SecureTask {
    public static final String KIND = "fedavg.secure";
    private final FedAvgHeadTask training;
    private final SkellamNoise noise;

    public SecureFedAvgTask(FedAvgHeadTask training) { this(training, new SkellamNoise()); }

    public SecureFedAvgTask(FedAvgHeadTask training, SkellamNoise noise) { this.training = training; this.noise = noise; }

    @Override
    public Contribution contribute(Map<String, Object> params, List<Envelope.Tensor> tensors) throws TaskDeclined {
        SecureFedAvgParams task = SecureFedAvgParams.fromParams(params);
        SecureUpdateRound round = task.round;
        List<String> order = round.vectorOrder;
        if (order.size() != 2 || !order.containsAll(SecureUpdateRound.HEAD_ORDER))
            throw new TaskDeclined("vector_order " + order + " does not name exactly the trained tensors [bias, weight]");
        HeadTrainer.Trained t = training.train(task.head, tensors);
        double[] trained = inOrder(order, t.weight, t.bias);
        if (round.dp != null) {         // distributed DP-FedAvg: [clip(θ_k − θ_t) | 1] plus this device's noise share
            double[] v = withCount(clippedDelta(round.dp.clipNorm, trained, start(order, t, tensors)), 1.0);
            return new Contribution(round.group, noise.add(v, round.dp, trained.length));
        }
        if (t.n > round.maxSamples)
            throw new TaskDeclined(t.n + " local samples exceed the round's bound of " + round.maxSamples);
        if (round.updateClipNorm != null && round.updateClipNorm > 0) {       // bounded influence: θ_t + clip(θ_k − θ_t)
            double[] start = start(order, t, tensors), delta = clippedDelta(round.updateClipNorm, trained, start);
            for (int i = 0; i < trained.length; i++) trained[i] = start[i] + delta[i];
        }
        double largest = 0;
        for (double v : trained) largest = Math.max(largest, Math.abs(v));
        if (largest > round.maxAbsParam)
            throw new TaskDeclined(String.format("trained model has |θ| = %.3g > the round's bound %s", largest, round.maxAbsParam));
        for (int i = 0; i < trained.length; i++) trained[i] *= (double) t.n;
        return new Contribution(round.group, withCount(trained, t.n));
    }

    /** The head's two tensors as one vector, in the round's vector order. */
    private static double[] inOrder(List<String> order, float[] weight, float[] bias) {
        double[] v = new double[weight.length + bias.length];
        int k = 0;
        for (String name : order)
            for (float x : name.equals("weight") ? weight : bias) v[k++] = x;
        return v;
    }

    /** The head the task sent (θ_t), in the round's vector order. */
    private static double[] start(List<String> order, HeadTrainer.Trained t, List<Envelope.Tensor> tensors) throws TaskDeclined {
        long[] weightShape = {t.bias.length, t.weight.length / t.bias.length};
        return inOrder(order, FedAvgHeadTask.headTensor(tensors, "weight", weightShape),
                FedAvgHeadTask.headTensor(tensors, "bias", new long[] {t.bias.length}));
    }

    /** θ_k − θ_t clipped to clipNorm as one vector over both tensors (protocols/clipping.py clip_update). */
    private static double[] clippedDelta(double clipNorm, double[] trained, double[] start) {
        double[] delta = new double[trained.length];
        double sq = 0;
        for (int i = 0; i < delta.length; i++) {
            delta[i] = trained[i] - start[i];
            sq += delta[i] * delta[i];
        }
        double norm = Math.sqrt(sq), factor = norm > 0 ? Math.min(1.0, clipNorm / norm) : 1.0;
        for (int i = 0; i < delta.length; i++) delta[i] *= factor;
        return delta;
    }

    private static double[] withCount(double[] v, double count) {
        double[] out = java.util.Arrays.copyOf(v, v.length + 1);
        out[v.length] = count;
        return out;
    }
}
