// Task kind "scaffold.head" (Scaffold, Karimireddy et al. 2020, option II, on the linear head;
// protocols/payloads/scaffold.py, the Python device's edge_client/tasks/scaffold_training.py): the
// device's control c_k is kept in its DeviceStateStore (0 the first time and after it went stale);
// K local steps y ← y − lr (∇f_k(y) + wd·y) − lr (c − c_k) from the task's head w, then
// c_k⁺ = c_k − c + (w − y) / (K lr), all in float32 as the Python device. c_k⁺ is stored (with the
// stored c_k it started from) before the result goes out: tensors weight, bias (y) and
// delta_control.weight, delta_control.bias (Δc = c_k⁺ − c_k); body n and restarted.
package org.fedfleet.device;

import java.math.BigInteger;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Tensors;

public final class ScaffoldTask extends StatefulHeadTask {
    public static final String KIND = "scaffold.head";
    private static final String CONTROL = "control.", DELTA_CONTROL = "delta_control.";
    private static final String[] HEAD = {"weight", "bias"};

    public ScaffoldTask(LocalData data, FeatureExtractor extractor, DeviceStateStore store) {
        super(data, null, extractor, store);
    }

    @Override String kind() { return KIND; }

    @Override StatefulHeadParams parse(Map<String, Object> params) throws TaskDeclined {
        return StatefulHeadParams.scaffold(params);
    }

    @Override
    public Result run(Map<String, Object> params, List<Envelope.Tensor> tensors) throws TaskDeclined {
        Read t = read(params, tensors);
        LocalTraining recipe = t.params.head.recipe;
        Map<String, float[]> head = new LinkedHashMap<>(), control = new LinkedHashMap<>(), zero = new LinkedHashMap<>();
        head.put("weight", t.weight);
        head.put("bias", t.bias);
        for (String k : HEAD) {
            float[] c = float32(tensors, CONTROL + k, t.shape(k));
            if (c == null || !finite(c))
                throw new TaskDeclined(KIND + " task must carry finite float32 control.weight and control.bias shaped like the head");
            control.put(k, c);
            zero.put(k, new float[head.get(k).length]);
        }
        admit(t, 4L * (t.weight.length + t.bias.length));
        Map<String, float[]> stored = startValue(t, HEAD);
        Map<String, float[]> replaced = stored == null ? replacedValue(t, HEAD) : null;   // a stale c_k, restarted
        Map<String, float[]> start = stored != null ? stored : zero;
        Map<String, float[]> counted = replaced != null ? replaced : start;     // the c_k the server's c holds
        float lr = (float) recipe.lr;
        Map<String, float[]> correction = new LinkedHashMap<>();
        for (String k : HEAD) correction.put(k, times(minus(control.get(k), start.get(k)), lr));
        HeadTrainer.Trained y = train(new HeadTrainer(t.numClasses, t.dim, recipe).corrected(correction.get("weight"), correction.get("bias")),
                t.weight, t.bias, t, recipe);
        float scale = (float) (1.0 / (y.steps * recipe.lr));
        Map<String, float[]> trained = new LinkedHashMap<>(), newControl = new LinkedHashMap<>();
        trained.put("weight", y.weight);
        trained.put("bias", y.bias);
        for (String k : HEAD) {
            float[] c = minus(start.get(k), control.get(k)), moved = times(minus(head.get(k), trained.get(k)), scale);
            for (int i = 0; i < c.length; i++) c[i] += moved[i];
            try {
                HeadTrainer.checkBounded("control." + k, c);
            } catch (ArithmeticException e) {
                throw new TaskDeclined(e.getMessage());
            }
            newControl.put(k, c);
        }
        // Δc checked before c_k is kept: a result past the wire's bound declines with the state as it
        // was, never a c_k the server's c did not count (as the Python device)
        Map<String, float[]> deltas = new LinkedHashMap<>();
        for (String k : HEAD) {
            float[] delta = minus(newControl.get(k), counted.get(k));
            try {
                HeadTrainer.checkBounded(DELTA_CONTROL + k, delta);
            } catch (ArithmeticException e) {
                throw new TaskDeclined(e.getMessage());
            }
            deltas.put(k, delta);
        }
        keep(t, stored, newControl, replaced);
        Map<String, Object> body = new LinkedHashMap<>();
        body.put("n", BigInteger.valueOf(y.n));
        body.put("restarted", stored == null);
        List<Envelope.Tensor> out = new ArrayList<>();
        for (String k : HEAD) out.add(Tensors.floats(k, "float32", t.shape(k), widen(trained.get(k))));
        for (String k : HEAD) out.add(Tensors.floats(DELTA_CONTROL + k, "float32", t.shape(k), widen(deltas.get(k))));
        return new Result(body, out);
    }

    /** a − b in float32. */
    static float[] minus(float[] a, float[] b) {
        float[] out = new float[a.length];
        for (int i = 0; i < a.length; i++) out[i] = a[i] - b[i];
        return out;
    }

    static float[] times(float[] a, float s) {
        float[] out = new float[a.length];
        for (int i = 0; i < a.length; i++) out[i] = a[i] * s;
        return out;
    }

    static double[] widen(float[] v) {
        double[] out = new double[v.length];
        for (int k = 0; k < v.length; k++) out[k] = v[k];
        return out;
    }
}
