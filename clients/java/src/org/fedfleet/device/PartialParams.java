// pp.head params (protocols/payloads/partial.py PartialParams): a stateful head task's plus
// FedSim/FedAlt's choice (algorithm fedsim | fedalt) and personal_epochs (0..10000); the pass
// takes plain SGD steps (PartialRecipe: epochs and batch_size within 1..10000, the local rule unused).
package org.fedfleet.device;

import java.math.BigInteger;
import java.util.Map;

public final class PartialParams extends StatefulHeadParams {
    public final String algorithm;
    public final int personalEpochs;

    private PartialParams(Map<String, Object> p, String kind) throws TaskDeclined {
        super(p, kind);
        algorithm = TaskParams.choice(p, "algorithm", "fedalt", "fedsim", "fedalt");
        personalEpochs = (int) count(p, "personal_epochs", 1, 0, kind);
        count(p, "epochs", 1, 1, kind);
        count(p, "batch_size", 50, 1, kind);
    }

    public static PartialParams fromParams(Map<String, Object> params) throws TaskDeclined {
        return new PartialParams(params, PartialTask.KIND);
    }

    /** pp.head's fields of another kind's params (pp.head.secure), declining in its name. */
    static PartialParams fromParams(Map<String, Object> params, String kind) throws TaskDeclined {
        return new PartialParams(params, kind);
    }

    private static long count(Map<String, Object> p, String key, long dflt, long min, String kind) throws TaskDeclined {
        Object v = p.containsKey(key) ? p.get(key) : BigInteger.valueOf(dflt);
        if (!(v instanceof BigInteger) || ((BigInteger) v).compareTo(BigInteger.valueOf(min)) < 0
                || ((BigInteger) v).compareTo(BigInteger.valueOf(10_000)) > 0)
            throw new TaskDeclined("bad " + kind + " params: " + key + " must be an integer in " + min + "..10000, got " + v);
        return ((BigInteger) v).longValue();
    }

    /** The plain SGD recipe of `epochs` epochs in the order of `seed` (partial_training.py sgd_epochs). */
    LocalTraining sgd(int epochs, BigInteger seed) {
        LocalTraining r = head.recipe;
        return new LocalTraining(epochs, r.batchSize, r.lr, r.weightDecay, r.temperature, seed);
    }

    @Override
    public Map<String, Object> toParams() {
        Map<String, Object> out = super.toParams();
        out.put("algorithm", algorithm);
        out.put("personal_epochs", BigInteger.valueOf(personalEpochs));
        return out;
    }
}
