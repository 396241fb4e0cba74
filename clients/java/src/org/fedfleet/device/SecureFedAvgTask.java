// Task kind "fedavg.secure" (secure FedAvg(ψ), edge_client/tasks/secure_fedavg_training.py): the
// head trained as for fedavg.head, contributed as [n·t_1 | n·t_2 | n] over the task's
// vector_order (default weight, bias; protocols/payloads/secagg.py pack_weighted), so the group
// sum gives Σ n_k θ_k and Σ n_k and no θ_k is seen. With the task's update_clip_norm C the
// update θ_k − θ_t is first clipped to norm C (bounded influence: the aggregator checks the
// group's sum against Σ n_k·C). A head with an entry beyond the round's max_abs_param, or more
// samples than max_samples, is declined before SecAgg's fixed-point range would overflow. Under
// distributed DP (a task with "dp") the device sends [clip(θ_k − θ_t) | 1] instead, unweighted
// (n_k would make the sensitivity data-dependent), with its share of Skellam noise on the update
// (SkellamNoise); with the round's dp.clip_bit_scale s (adaptive clipping) [clip(θ_k − θ_t) |
// (b_k − ½)·s | 1], b_k = 1[‖θ_k − θ_t‖ ≤ C], the bit noised as the update. Params: SecureFedAvgParams.
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
        return new Contribution(round.group, vector(round, t.n, inOrder(order, t.weight, t.bias), start(order, t.bias.length, t.weight.length / t.bias.length, tensors), noise), round.dp != null);
    }

    /** The vector a FedAvg-family device masks (secure_fedavg_training.py SecureFedAvgTraining.vector):
     *  [n·θ | n] of its trained tensors (in the round's order; θ_t + the clipped update under
     *  update_clip_norm), declined beyond the round's bounds; under distributed DP [clip(θ − θ_t) | 1]
     *  with this device's noise share. Also used by the stateful heads' secure kinds (SecureStatefulHeadTask). */
    static double[] vector(SecureUpdateRound round, long n, double[] trained, double[] start, SkellamNoise noise) throws TaskDeclined {
        if (round.dp != null) {         // distributed DP-FedAvg: [clip(θ_k − θ_t) | 1] plus this device's noise share
            double[] v = clippedDelta(round.dp.clipNorm, trained, start);
            if (round.dp.clipBitScale != null)      // adaptive clipping: [clip(θ_k − θ_t) | (b_k − ½)·s | 1]
                v = withCount(v, clipBit(norm(trained, start), round.dp.clipNorm, round.dp.clipBitScale));
            return noise.add(withCount(v, 1.0), round.dp, v.length);
        }
        if (n > round.maxSamples)
            throw new TaskDeclined(n + " local samples exceed the round's bound of " + round.maxSamples);
        if (round.updateClipNorm != null && round.updateClipNorm > 0) {       // bounded influence: θ_t + clip(θ_k − θ_t)
            double[] delta = clippedDelta(round.updateClipNorm, trained, start);
            for (int i = 0; i < trained.length; i++) trained[i] = start[i] + delta[i];
        }
        double largest = 0;
        for (double v : trained) largest = Math.max(largest, Math.abs(v));
        if (largest > round.maxAbsParam)
            throw new TaskDeclined(String.format("trained model has |θ| = %.3g > the round's bound %s", largest, round.maxAbsParam));
        for (int i = 0; i < trained.length; i++) trained[i] *= (double) n;
        return withCount(trained, n);
    }

    /** The head's two tensors as one vector, in the round's vector order. */
    static double[] inOrder(List<String> order, float[] weight, float[] bias) {
        double[] v = new double[weight.length + bias.length];
        int k = 0;
        for (String name : order)
            for (float x : name.equals("weight") ? weight : bias) v[k++] = x;
        return v;
    }

    /** The head the task sent (θ_t, `classes` × `dim`), in the round's vector order. */
    static double[] start(List<String> order, int classes, int dim, List<Envelope.Tensor> tensors) throws TaskDeclined {
        return inOrder(order, FedAvgHeadTask.headTensor(FedAvgHeadTask.KIND, tensors, "weight", new long[] {classes, dim}),
                FedAvgHeadTask.headTensor(FedAvgHeadTask.KIND, tensors, "bias", new long[] {classes}));
    }

    /** θ_k − θ_t clipped to clipNorm as one vector over both tensors (protocols/clipping.py clip_update). */
    static double[] clippedDelta(double clipNorm, double[] trained, double[] start) {
        double[] delta = new double[trained.length];
        for (int i = 0; i < delta.length; i++) delta[i] = trained[i] - start[i];
        double norm = norm(trained, start), factor = norm > 0 ? Math.min(1.0, clipNorm / norm) : 1.0;
        for (int i = 0; i < delta.length; i++) delta[i] *= factor;
        return delta;
    }

    /** ‖θ_k − θ_t‖₂ before any clip (protocols/clipping.py global_norm). */
    static double norm(double[] trained, double[] start) {
        double sq = 0;
        for (int i = 0; i < trained.length; i++) sq += (trained[i] - start[i]) * (trained[i] - start[i]);
        return Math.sqrt(sq);
    }

    /** The centred clipped-indicator bit (1[norm ≤ C] − ½)·s (protocols/secagg/distributed_dp.py clip_bit). */
    static double clipBit(double norm, double clipNorm, double scale) {
        return (norm <= clipNorm ? 0.5 : -0.5) * scale;
    }

    static double[] withCount(double[] v, double count) {
        double[] out = java.util.Arrays.copyOf(v, v.length + 1);
        out[v.length] = count;
        return out;
    }
}
