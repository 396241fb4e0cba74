// oll.personalize params (protocols/payloads/personalize.py PersonalizeParams): the model, OLL's
// fallback and FP(ψ)'s recipe (recipe(): LocalTraining with max(fp_epochs, 1) epochs; its learning
// rate is chosen among fp_lrs).
package org.fedfleet.device;

import java.math.BigInteger;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

public final class PersonalizeParams {
    static final String KIND = "oll.personalize";
    final ModelSpec model;
    final int featureDim, fpEpochs, fpFolds, tailStages;
    final String fallback, personalJob;     // personalJob null: absent
    final String fpPart;                    // psi | phi | M: what FP fine-tunes (this library: psi only)
    final double[] fpLrs;
    final LocalTraining recipe;

    private PersonalizeParams(Map<String, Object> p) throws TaskDeclined {
        TaskParams.checkVersion(p, KIND);
        model = ModelSpec.fromParams(p);
        featureDim = (int) Params.integer(p, "feature_dim", 1280, 1, 1_000_000);
        fallback = TaskParams.choice(p, "fallback", "error", "error", "global");
        fpEpochs = (int) Params.integer(p, "fp_epochs", 0, 0, 10_000);
        fpLrs = learningRates(p.getOrDefault("fp_lrs", new ArrayList<Object>()));
        if (fpEpochs > 0 && fpLrs.length == 0) throw new TaskDeclined("bad " + KIND + " params: FP needs at least one learning rate in fp_lrs");
        fpFolds = (int) Params.integer(p, "fp_folds", 5, 2, 20);
        tailStages = (int) Params.integer(p, "tail_stages", 0, 0, 64);
        personalJob = TaskParams.present(p, "personal_job") ? Params.string(p, "personal_job", 128) : null;
        fpPart = TaskParams.choice(p, "fp_part", "psi", "psi", "phi", "M");
        LocalTraining read = LocalTraining.fromParams(p);      // batch_size, weight_decay, temperature, seed
        recipe = new LocalTraining(Math.max(fpEpochs, 1), read.batchSize, 0.1, read.weightDecay, read.temperature, read.seed);
    }

    public static PersonalizeParams fromParams(Map<String, Object> params) throws TaskDeclined {
        return new PersonalizeParams(params);
    }

    private static double[] learningRates(Object v) throws TaskDeclined {
        if (!(v instanceof List) || ((List<?>) v).size() > 16)
            throw new TaskDeclined("bad " + KIND + " params: fp_lrs must be a list of at most 16 numbers");
        List<?> list = (List<?>) v;
        double[] out = new double[list.size()];
        for (int i = 0; i < out.length; i++) {
            Object x = list.get(i);
            if (x instanceof Double) out[i] = (Double) x;
            else if (x instanceof BigInteger) out[i] = ((BigInteger) x).doubleValue();
            else throw new TaskDeclined("bad " + KIND + " params: fp_lrs must be a list of numbers, got " + x);
            if (!Double.isFinite(out[i]) || out[i] <= 0)
                throw new TaskDeclined("bad " + KIND + " params: fp_lrs: candidate learning rates must be finite and > 0, got " + x);
        }
        return out;
    }

    public Map<String, Object> toParams() {
        Map<String, Object> out = new LinkedHashMap<>();
        model.toParams(out);
        out.put("feature_dim", BigInteger.valueOf(featureDim));
        out.put("fallback", fallback);
        out.put("fp_epochs", BigInteger.valueOf(fpEpochs));
        out.put("batch_size", BigInteger.valueOf(recipe.batchSize));
        List<Object> lrs = new ArrayList<>();
        for (double lr : fpLrs) lrs.add(lr);
        out.put("fp_lrs", lrs);
        out.put("fp_folds", BigInteger.valueOf(fpFolds));
        out.put("weight_decay", recipe.weightDecay);
        out.put("temperature", recipe.temperature);
        out.put("seed", recipe.seed);
        out.put("tail_stages", BigInteger.valueOf(tailStages));
        if (personalJob != null) out.put("personal_job", personalJob);
        out.put("fp_part", fpPart);
        out.put(TaskParams.VERSION_KEY, TaskParams.VERSION);
        return out;
    }
}
