// Task kind "ditto.head" (Ditto, Li et al. 2021, on the linear head; protocols/payloads/ditto.py,
// the Python device's edge_client/tasks/ditto_training.py). From the task's global head ψ:
// the global pass is fedavg.head's (HeadTrainer, the job's recipe and local rule), whose ψ_k is the
// upload; the personal pass trains the device's own head v_k (its DeviceStateStore's; first time,
// another run's or stale: ψ) for personal_epochs at personal_lr with FedProx's pull μ = λ towards
// ψ, in the batch order of seed + 1. v_k is stored (with the stored v_k it started from) before the
// result goes out and never sent: the result is fedavg.head's plus the held-out counts with v_k
// and with ψ (n_test, correct, correct_global) and restarted.
package org.fedfleet.device;

import java.util.List;
import java.util.Map;
import java.util.LinkedHashMap;
import org.fedfleet.wire.Envelope;

public final class DittoTask extends StatefulHeadTask {
    public static final String KIND = "ditto.head";
    private static final String[] HEAD = {"weight", "bias"};

    /** heldOut: the device's held-out samples for the personal report (null: none, n_test 0). */
    public DittoTask(LocalData data, LocalData heldOut, FeatureExtractor extractor, DeviceStateStore store) {
        super(data, heldOut, extractor, store);
    }

    @Override String kind() { return KIND; }

    @Override StatefulHeadParams parse(Map<String, Object> params) throws TaskDeclined {
        return DittoParams.fromParams(params);
    }

    @Override
    public Result run(Map<String, Object> params, List<Envelope.Tensor> tensors) throws TaskDeclined {
        Read t = read(params, tensors);
        DittoParams p = (DittoParams) t.params;
        admit(t, 4L * (t.weight.length + t.bias.length));
        Map<String, float[]> stored = startValue(t, HEAD), start = stored;
        if (start == null) {
            start = new LinkedHashMap<>();
            start.put("weight", t.weight);
            start.put("bias", t.bias);
        }
        LocalTraining recipe = p.head.recipe, personal = p.personalRecipe();
        withinBudget(t, "Ditto's global pass of " + recipe.epochs + " epochs and personal pass of " + personal.epochs
                + " epochs over " + t.labels.length + " samples in batches of " + recipe.batchSize, recipe, personal);
        HeadTrainer.Trained global = train(new HeadTrainer(t.numClasses, t.dim, recipe), t.weight, t.bias, t, recipe);
        HeadTrainer.Trained mine = train(new HeadTrainer(t.numClasses, t.dim, personal).pulledTo(t.weight, t.bias),
                start.get("weight"), start.get("bias"), t, personal);
        Result result = FedAvgHeadTask.encode(global.weight, global.bias, t.numClasses, t.dim, global.n, null);
        personalReport(t, mine.weight, mine.bias, stored == null, result.body);
        Map<String, float[]> now = new LinkedHashMap<>();
        now.put("weight", mine.weight);
        now.put("bias", mine.bias);
        keep(t, stored, now);
        return result;
    }
}
