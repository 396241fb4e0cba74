// Task kind "pp.head" (FedSim / FedAlt partial personalization of the head, Pillutla et al. 2022;
// protocols/payloads/partial.py, the Python device's edge_client/tasks/partial_training.py). The
// head is split: u = weight is shared (trained, sent back, averaged by the server), v_k = bias is
// the device's own, kept in its DeviceStateStore (first time, another run's or stale: the task's
// bias). FedSim: `epochs` epochs of plain SGD on (u, v_k) together; FedAlt: personal_epochs on v_k
// with u fixed (batch order of seed), then `epochs` on u with v_k fixed (seed + 1). v_k is stored,
// then the result: tensor weight (u) only, body n, num_classes, feature_dim and the held-out
// counts with (the task's u, v_k) and (the task's u, the global bias), restarted.
package org.fedfleet.device;

import java.math.BigInteger;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Tensors;

public final class PartialTask extends StatefulHeadTask {
    public static final String KIND = "pp.head";

    /** heldOut: the device's held-out samples for the personal report (null: none, n_test 0). */
    public PartialTask(LocalData data, LocalData heldOut, FeatureExtractor extractor, DeviceStateStore store) {
        super(data, heldOut, extractor, store);
    }

    @Override String kind() { return KIND; }

    @Override StatefulHeadParams parse(Map<String, Object> params) throws TaskDeclined {
        return PartialParams.fromParams(params);
    }

    @Override
    public Result run(Map<String, Object> params, List<Envelope.Tensor> tensors) throws TaskDeclined {
        Read t = read(params, tensors);
        PartialParams p = (PartialParams) t.params;
        admit(t, 4L * t.bias.length);
        Map<String, float[]> stored = startValue(t, "bias");
        float[] start = stored != null ? stored.get("bias") : t.bias;
        float[] u = t.weight, v = start;
        BigInteger seed = p.head.recipe.seed;
        if (p.algorithm.equals("fedsim")) {
            HeadTrainer.Trained both = pass(t, p.sgd(p.head.recipe.epochs, seed), u, v, true, true);
            u = both.weight; v = both.bias;
        } else {
            LocalTraining personal = p.sgd(p.personalEpochs, seed),
                    shared = p.sgd(p.head.recipe.epochs, seed.add(BigInteger.ONE).mod(BigInteger.ONE.shiftLeft(32)));
            withinBudget(t, "FedAlt's personal pass of " + personal.epochs + " epochs and shared pass of "
                    + shared.epochs + " epochs over " + t.labels.length + " samples in batches of " + shared.batchSize,
                    personal, shared);
            if (p.personalEpochs > 0) v = pass(t, personal, u, v, false, true).bias;
            u = pass(t, shared, u, v, true, false).weight;
        }
        Map<String, float[]> now = new LinkedHashMap<>();
        now.put("bias", v);
        keep(t, stored, now);
        Map<String, Object> body = new LinkedHashMap<>();
        body.put("n", BigInteger.valueOf(t.labels.length));
        body.put("num_classes", BigInteger.valueOf(t.numClasses));
        body.put("feature_dim", BigInteger.valueOf(t.dim));
        personalReport(t, t.weight, v, stored == null, body);
        List<Envelope.Tensor> out = new ArrayList<>();
        out.add(Tensors.floats("weight", "float32", t.shape("weight"), ScaffoldTask.widen(u)));
        return new Result(body, out);
    }

    private static HeadTrainer.Trained pass(Read t, LocalTraining recipe, float[] u, float[] v, boolean moveU, boolean moveV)
            throws TaskDeclined {
        return train(new HeadTrainer(t.numClasses, t.dim, recipe).moving(moveU, moveV), u, v, t, recipe);
    }
}
