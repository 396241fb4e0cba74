// Task kind "fedavg.head" (FedAvg(ψ), Fed3R+FT(ψ), FedBuff; protocols/payloads/fedavg.py): the
// global head (tensors weight (C, d), bias (C,)) trained for the recipe's local epochs on the
// device's features (HeadTrainer), returned as float32 tensors weight and bias with the body
// {n, num_classes, feature_dim}; an asynchronous (FedBuff) task's model_version is echoed so the
// server can weigh the update by its staleness.
package org.fedfleet.device;

import java.math.BigInteger;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Tensors;

public final class FedAvgHeadTask implements TaskHandler {
    public static final String KIND = "fedavg.head";
    private final LocalData data;
    private final FeatureExtractor extractor;
    /** The last trained head (for the app's own evaluation, and the tests). */
    public volatile HeadTrainer.Trained last;

    public FedAvgHeadTask(LocalData data, FeatureExtractor extractor) { this.data = data; this.extractor = extractor; }

    @Override
    public Result run(Map<String, Object> params, List<Envelope.Tensor> tensors) throws TaskDeclined {
        if (data.size() == 0) throw new TaskDeclined("no local training data");
        HeadTrainingParams task = HeadTrainingParams.fromParams(params);
        HeadTrainer.Trained trained = train(task, tensors);
        int numClasses = trained.bias.length;
        return encode(trained.weight, trained.bias, numClasses, trained.weight.length / numClasses, trained.n, task.modelVersion);
    }

    /** The task's head after local training (what the secure variant masks). */
    public HeadTrainer.Trained train(HeadTrainingParams task, List<Envelope.Tensor> tensors) throws TaskDeclined {
        if (data.size() == 0) throw new TaskDeclined("no local training data");
        int numClasses = task.model.numClasses, dim = task.featureDim;
        LocalTraining recipe = task.recipe;
        float[] weight = headTensor(KIND, tensors, "weight", new long[] {numClasses, dim});
        float[] bias = headTensor(KIND, tensors, "bias", new long[] {numClasses});
        int[] labels = LocalFeatures.labels(data, numClasses);
        extractor.checkModel(task.model);
        if (extractor.featureDim() != dim)
            throw new TaskDeclined("backbone gives " + extractor.featureDim() + "-d features, task expects " + dim);
        HeadTrainer.Trained trained;
        try {
            trained = new HeadTrainer(numClasses, dim, recipe).train(weight, bias, LocalFeatures.extract(data, extractor), labels, recipe);
        } catch (ArithmeticException | IllegalArgumentException e) {
            throw new TaskDeclined(e.getMessage());
        }
        last = trained;
        return trained;
    }

    /** Body and tensors of a fedavg.head result (protocols/payloads/fedavg.py encode_head_update),
     *  with the task's model_version when it named one (null: a synchronous round). */
    public static Result encode(float[] weight, float[] bias, int numClasses, int dim, long n, Long modelVersion) {
        Map<String, Object> body = new LinkedHashMap<>();
        body.put("n", BigInteger.valueOf(n));
        body.put("num_classes", BigInteger.valueOf(numClasses));
        body.put("feature_dim", BigInteger.valueOf(dim));
        if (modelVersion != null) body.put("model_version", BigInteger.valueOf(modelVersion));
        List<Envelope.Tensor> out = new ArrayList<>();
        out.add(Tensors.floats("weight", "float32", new long[] {numClasses, dim}, widen(weight)));
        out.add(Tensors.floats("bias", "float32", new long[] {numClasses}, widen(bias)));
        return new Result(body, out);
    }

    /** A float32/float64 head tensor of exactly `shape`, finite, as float32 (what the device trains);
     *  `kind`: the task's, named when the tensor is absent (the Python device's task_inputs.head_tensor). */
    static float[] headTensor(String kind, List<Envelope.Tensor> tensors, String name, long[] shape) throws TaskDeclined {
        for (Envelope.Tensor t : tensors) {
            if (!t.name.equals(name)) continue;
            if (!Arrays.equals(t.shape, shape))
                throw new TaskDeclined("head tensor " + name + " has shape " + Arrays.toString(t.shape)
                        + ", the task's params say " + Arrays.toString(shape));
            double[] values;
            try {
                values = Tensors.doubles(t);
            } catch (Envelope.EnvelopeError e) {
                throw new TaskDeclined(e.getMessage());
            }
            float[] out = new float[values.length];
            for (int k = 0; k < out.length; k++) {
                out[k] = (float) values[k];
                if (!Float.isFinite(out[k])) throw new TaskDeclined("global head contains NaN or Inf");
            }
            return out;
        }
        throw new TaskDeclined(kind + " task carries no head tensor '" + name + "' (weight, bias)");
    }

    private static double[] widen(float[] v) {
        double[] out = new double[v.length];
        for (int k = 0; k < v.length; k++) out[k] = v[k];
        return out;
    }
}
