// ditto.head params (protocols/payloads/ditto.py DittoParams): a stateful head task's plus the
// personal pass, every field required (a device never guesses the job's λ): ditto_lambda in
// (0, 1e4] (FedProx's μ bound), personal_epochs in 1..10000, personal_lr in (0, 100].
package org.fedfleet.device;

import java.math.BigInteger;
import java.util.Map;

public final class DittoParams extends StatefulHeadParams {
    public final double lambda, personalLr;
    public final int personalEpochs;
    private final Object lambdaWire, lrWire;          // as the task wrote them (an integer stays one)

    private DittoParams(Map<String, Object> p) throws TaskDeclined {
        super(p, DittoTask.KIND);
        TaskParams.require(p, DittoTask.KIND, "ditto_lambda", "personal_epochs", "personal_lr");
        Object e = p.get("personal_epochs");
        if (!(e instanceof BigInteger) || ((BigInteger) e).compareTo(BigInteger.ONE) < 0
                || ((BigInteger) e).compareTo(BigInteger.valueOf(10_000)) > 0)
            throw new TaskDeclined("bad ditto.head params: personal_epochs must be an integer in 1..10000, got " + e);
        personalEpochs = ((BigInteger) e).intValue();
        lambdaWire = p.get("ditto_lambda");
        lrWire = p.get("personal_lr");
        lambda = positive("ditto_lambda", lambdaWire, 1e4);
        personalLr = positive("personal_lr", lrWire, 100.0);
    }

    public static DittoParams fromParams(Map<String, Object> params) throws TaskDeclined {
        return new DittoParams(params);
    }

    private static double positive(String key, Object v, double max) throws TaskDeclined {
        double x = v instanceof BigInteger ? ((BigInteger) v).doubleValue() : v instanceof Double ? (Double) v : Double.NaN;
        if (!Double.isFinite(x) || x <= 0 || x > max)
            throw new TaskDeclined("bad ditto.head params: " + key + " must be a finite number in (0, " + max + "], got " + v);
        return x;
    }

    /** The personal pass's recipe: the job's, with Ditto's epochs and rate, its own batch order
     *  (seed + 1 mod 2^32) and FedProx's pull μ = λ (edge_client/tasks/ditto_training.py personal_recipe). */
    LocalTraining personalRecipe() {
        LocalTraining r = head.recipe;
        return new LocalTraining(personalEpochs, r.batchSize, personalLr, r.weightDecay, r.temperature,
                r.seed.add(BigInteger.ONE).mod(BigInteger.ONE.shiftLeft(32)), r.localRule, r.samRho, r.asamEta, lambda);
    }

    @Override
    public Map<String, Object> toParams() {
        Map<String, Object> out = super.toParams();
        out.put("ditto_lambda", lambdaWire);
        out.put("personal_epochs", BigInteger.valueOf(personalEpochs));
        out.put("personal_lr", lrWire);
        return out;
    }
}
