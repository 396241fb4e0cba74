// What the stateful head tasks (scaffold.head, ditto.head, pp.head) share, as on the Python device
// (edge_client/tasks/stateful_head.py): reading a task that carries a global head and a state
// binding, the local features (and held-out ones, for the personal report), and the device's
// DeviceStateStore. A task's state is written *before* its result goes out, together with the stored
// value the round started from ("previous.<name>"): a task redelivered for the same round (the device
// was killed before its result was acknowledged) starts from that value again, so a redelivery
// computes the same result instead of training twice. A round that started fresh (from the task
// alone) stores no start value: its redelivery starts fresh again and reports restarted as the first did.
package org.fedfleet.device;

import java.io.IOException;
import java.math.BigInteger;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Tensors;

public abstract class StatefulHeadTask implements TaskHandler {
    static final String PREVIOUS = "previous.";
    // the stored value a restarted round replaced (a state too stale to start from): Scaffold measures
    // Δc from it, and a redelivery of that round from the same value (stateful_head.py REPLACED)
    static final String REPLACED = "replaced.";
    private final LocalData data, heldOut;                 // heldOut: null when the device keeps none
    private final FeatureExtractor extractor;
    private final DeviceStateStore store;                  // null: the device keeps no state and declines

    /** A validated task: its params, the global head, the local features and labels, the held-out ones (or null). */
    static final class Read {
        final StatefulHeadParams params;
        final int numClasses, dim;
        final float[] weight, bias;
        final float[][] features, heldOutFeatures;
        final int[] labels, heldOutLabels;
        Read(StatefulHeadParams params, float[] weight, float[] bias, float[][] features, int[] labels,
             float[][] heldOutFeatures, int[] heldOutLabels) {
            this.params = params; this.numClasses = params.head.model.numClasses; this.dim = params.head.featureDim;
            this.weight = weight; this.bias = bias; this.features = features; this.labels = labels;
            this.heldOutFeatures = heldOutFeatures; this.heldOutLabels = heldOutLabels;
        }
        long[] shape(String name) { return name.endsWith("weight") ? new long[] {numClasses, dim} : new long[] {numClasses}; }
    }

    protected StatefulHeadTask(LocalData data, LocalData heldOut, FeatureExtractor extractor, DeviceStateStore store) {
        this.data = data; this.heldOut = heldOut; this.extractor = extractor; this.store = store;
    }

    abstract String kind();

    abstract StatefulHeadParams parse(Map<String, Object> params) throws TaskDeclined;

    /** The task's inputs, checked in the Python device's order; TaskDeclined with the reason otherwise. */
    final Read read(Map<String, Object> params, List<Envelope.Tensor> tensors) throws TaskDeclined {
        if (store == null)
            throw new TaskDeclined(kind() + " keeps state on the device and this device has no state store");
        if (data.size() == 0) throw new TaskDeclined("no local training data");
        StatefulHeadParams p = parse(params);
        int numClasses = p.head.model.numClasses, dim = p.head.featureDim;
        float[] weight = float32(tensors, "weight", new long[] {numClasses, dim}), bias = float32(tensors, "bias", new long[] {numClasses});
        if (weight == null || bias == null)
            throw new TaskDeclined(kind() + " task must carry float32 weight (" + numClasses + ", " + dim + ") and bias (" + numClasses + ",)");
        if (!finite(weight) || !finite(bias)) throw new TaskDeclined("global head contains NaN or Inf");
        int[] labels = LocalFeatures.labels(data, numClasses);
        extractor.checkModel(p.head.model);
        if (extractor.featureDim() != dim)
            throw new TaskDeclined("backbone gives " + extractor.featureDim() + "-d features, task expects " + dim);
        float[][] features = LocalFeatures.extract(data, extractor), heldOutFeatures = null;
        int[] heldOutLabels = null;
        if (heldOut != null && heldOut.size() > 0 && labelsWithin(heldOut, numClasses)) {
            heldOutLabels = LocalFeatures.labels(heldOut, numClasses);
            heldOutFeatures = LocalFeatures.extract(heldOut, extractor);
        }
        return new Read(p, weight, bias, features, labels, heldOutFeatures, heldOutLabels);
    }

    /** A float32 tensor of exactly `shape` (null when absent, of another dtype or shape). */
    static float[] float32(List<Envelope.Tensor> tensors, String name, long[] shape) throws TaskDeclined {
        for (Envelope.Tensor t : tensors == null ? java.util.Collections.<Envelope.Tensor>emptyList() : tensors) {
            if (!t.name.equals(name)) continue;
            if (!t.dtype.equals("float32") || !java.util.Arrays.equals(t.shape, shape)) return null;
            try {
                double[] v = Tensors.doubles(t);
                float[] out = new float[v.length];
                for (int k = 0; k < v.length; k++) out[k] = (float) v[k];
                return out;
            } catch (Envelope.EnvelopeError e) {
                throw new TaskDeclined(e.getMessage());
            }
        }
        return null;
    }

    static boolean finite(float[] values) {
        for (float v : values) if (!Float.isFinite(v)) return false;
        return true;
    }

    private static boolean labelsWithin(LocalData d, int numClasses) {
        for (int i = 0; i < d.size(); i++) if (d.label(i) < 0 || d.label(i) >= numClasses) return false;
        return true;
    }

    /** Declines unless the job's state (kept twice: the value and the one it started from) fits. */
    final void admit(Read t, long stateBytes) throws TaskDeclined {
        try {
            store.admit(t.params.jobId, 2 * stateBytes);
        } catch (DeviceStateStore.BudgetExceeded e) {
            throw new TaskDeclined(e.getMessage());
        }
    }

    /** How many local samples a task trains on (its n): a secure wrapper declines before training,
     *  and before any state is kept, when the round's max_samples is smaller. */
    final int sampleCount() { return data.size(); }

    /** The stored state this round starts from, or null (none, another run's, stale, malformed). A
     *  task of the round the state was written at (a redelivery) starts from what that round started
     *  from. A task of an earlier round than the state's is declined: an old task (replayed, or one
     *  that lost its way) would start afresh and its state replace the newer one. */
    final Map<String, float[]> startValue(Read t, String... names) throws TaskDeclined {
        StateBinding b = t.params.state;
        DeviceStateStore.Entry e = store.load(t.params.jobId, b.run, b.round, b.maxStaleness);
        if (e == null) return null;
        if (e.round > b.round)
            throw new TaskDeclined("this device holds the job's state of round " + e.round + ", later than the task's "
                + "round " + b.round + ": an older round is not run (its state would replace the newer one)");
        return checked(e, e.round == b.round ? PREVIOUS : "", t, names);
    }

    /** For a round that starts fresh (startValue null): the state it replaces, or null (never stored,
     *  dropped, expired, another run's): the stored value itself when it was too stale to start from,
     *  or, for a redelivery of the round, what the first delivery replaced. Scaffold measures Δc from
     *  it, so that the server's c stays the mean of the devices' controls (stateful_head.py replaced_value). */
    final Map<String, float[]> replacedValue(Read t, String... names) {
        StateBinding b = t.params.state;
        DeviceStateStore.Entry e = store.load(t.params.jobId, b.run, null, null);
        if (e == null || e.round > b.round) return null;
        return checked(e, e.round == b.round ? REPLACED : "", t, names);
    }

    /** The entry's arrays prefix + name, each finite float32 of the task's shape, or null. */
    private static Map<String, float[]> checked(DeviceStateStore.Entry e, String prefix, Read t, String... names) {
        Map<String, float[]> out = new LinkedHashMap<>();
        for (String name : names) {
            Npz.Array a = e.arrays.get(prefix + name);
            float[] v = a == null || !java.util.Arrays.equals(a.shape, t.shape(name)) ? null : a.floats();
            if (v == null || !finite(v)) return null;
            out.put(name, v);
        }
        return out;
    }

    /** The job a task is for, from its typed params (a secure wrapper's, to keep its entry aside). */
    final String jobOf(Map<String, Object> params) throws TaskDeclined { return parse(params).jobId; }

    /** The state binding of a task (its run and round: which entry its round keeps). */
    final StateBinding bindingOf(Map<String, Object> params) throws TaskDeclined { return parse(params).state; }

    /** The job's entry before a secure wrapper runs this handler (null: none, or no store): what
     *  {@link #putBack} restores when the wrapper declines after the handler saved. */
    final DeviceStateStore.Entry stateBefore(String jobId) {
        return store == null ? null : store.load(jobId, null, null, null);
    }

    /** The plain task sends nothing after run saved the round's state (MqttAgent.work: declined, failed,
     *  stopped, its result unsendable): the job's entry goes back to what it is now, as putBack. */
    @Override
    public final Runnable stateRestorer(Map<String, Object> params) throws TaskDeclined {
        if (store == null) return () -> { };        // run declines: nothing saved
        String job = jobOf(params);
        DeviceStateStore.Entry before = stateBefore(job);
        return () -> putBack(job, before);
    }

    /** A task (plain or a secure wrapper's) sent nothing after this handler saved the round's state: the
     *  job's entry goes back to `before` (none: dropped), so the server's state never counted a step the
     *  device never sent (Python: stateful_head.DeviceStateKeeper.state_put_back_on_failure). */
    final void putBack(String jobId, DeviceStateStore.Entry before) {
        if (store == null) return;
        try {
            if (before == null) store.drop(jobId);
            else store.restore(before);
        } catch (DeviceStateStore.BudgetExceeded | IOException e) {
            store.drop(jobId);          // cannot write the old entry back: start fresh rather than drift
        }
    }

    /** Stores this round's state before the result goes out, with `stored` (the stored value the
     *  round started from, startValue's answer; null when it started fresh). */
    final void keep(Read t, Map<String, float[]> stored, Map<String, float[]> now) throws TaskDeclined {
        keep(t, stored, now, null);
    }

    /** The same, with `replaced` (replacedValue's answer) for a round that started fresh. */
    final void keep(Read t, Map<String, float[]> stored, Map<String, float[]> now, Map<String, float[]> replaced)
            throws TaskDeclined {
        Map<String, Npz.Array> arrays = new LinkedHashMap<>();
        for (Map.Entry<String, float[]> e : now.entrySet()) arrays.put(e.getKey(), Npz.float32(t.shape(e.getKey()), e.getValue()));
        if (stored != null)
            for (Map.Entry<String, float[]> e : stored.entrySet())
                arrays.put(PREVIOUS + e.getKey(), Npz.float32(t.shape(e.getKey()), e.getValue()));
        if (replaced != null)
            for (Map.Entry<String, float[]> e : replaced.entrySet())
                arrays.put(REPLACED + e.getKey(), Npz.float32(t.shape(e.getKey()), e.getValue()));
        StateBinding b = t.params.state;
        try {
            store.save(t.params.jobId, b.run, b.round, arrays, b.ttlS);
        } catch (DeviceStateStore.BudgetExceeded e) {
            throw new TaskDeclined(e.getMessage());
        } catch (IOException e) {
            throw new TaskDeclined("cannot store the job's device state: " + e.getMessage());
        }
    }

    /** The held-out counts with the device's personal head and with the task's global head
     *  (protocols/payloads/partial.py PersonalReport), into `body`. */
    final void personalReport(Read t, float[] weight, float[] bias, boolean restarted, Map<String, Object> body) {
        int nTest = t.heldOutLabels == null ? 0 : t.heldOutLabels.length, mine = 0, global = 0;
        for (int i = 0; i < nTest; i++) {
            if (OllHead.argmax(weight, bias, t.dim, t.heldOutFeatures[i]) == t.heldOutLabels[i]) mine++;
            if (OllHead.argmax(t.weight, t.bias, t.dim, t.heldOutFeatures[i]) == t.heldOutLabels[i]) global++;
        }
        body.put("n_test", BigInteger.valueOf(nTest));
        body.put("correct", BigInteger.valueOf(mine));
        body.put("correct_global", BigInteger.valueOf(global));
        body.put("restarted", restarted);
    }

    /** Declined, before any pass trains, when the task's passes over its rows ask more SGD steps, or
     *  multiply-adds through its head, together than a device takes (LocalTraining.checkPasses;
     *  edge_client's within_passes_budget). */
    static void withinBudget(Read t, String what, LocalTraining... passes) throws TaskDeclined {
        try {
            LocalTraining.Pass[] each = new LocalTraining.Pass[passes.length];
            for (int i = 0; i < passes.length; i++) each[i] = passes[i].over(t.labels.length);
            LocalTraining.checkPasses(what, (long) t.numClasses * (t.dim + 1), each);
        } catch (IllegalArgumentException e) {
            throw new TaskDeclined(e.getMessage());
        }
    }

    /** HeadTrainer's training, an ArithmeticException (diverged) or bad input declining the task. */
    static HeadTrainer.Trained train(HeadTrainer trainer, float[] weight, float[] bias, Read t, LocalTraining recipe) throws TaskDeclined {
        try {
            return trainer.train(weight, bias, t.features, t.labels, recipe);
        } catch (ArithmeticException | IllegalArgumentException e) {
            throw new TaskDeclined(e.getMessage());
        }
    }
}
