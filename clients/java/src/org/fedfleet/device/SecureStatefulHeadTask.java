// Task kinds "scaffold.head.secure" and "ditto.head.secure" (edge_client/tasks/secure_fedavg_training.py
// SecureScaffoldTraining, SecureFedAvgTraining around ditto.head): the plain stateful handler
// (ScaffoldTask, DittoTask) runs as in plain rounds, keeping its state (c_k, v_k) in the device's
// store, and what it would upload is masked instead: Ditto's global head as fedavg.secure's vector
// ([n·ψ_k | n], SecureFedAvgTask.vector: bounds, update_clip_norm, distributed DP), Scaffold's
// [n·y | clip(Δc) | n] (protocols/payloads/secagg.py pack_controlled), Δc clipped as one vector to
// the task's control_clip_norm (protocols/clipping.py clip_update), as the plain server clips it.
// Scaffold's c_k⁺ holds only where the round FINISHED on the device (its input in the sum): a round
// that ends any other way puts the job's entry back to before the task (roundEnd), else the server's
// c drifts from the mean of the c_k. Ditto's v_k is the device's own: kept either way.
package org.fedfleet.device;

import java.math.BigInteger;
import java.util.Arrays;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Tensors;

public final class SecureStatefulHeadTask implements SecureTask {
    public static final String SCAFFOLD_KIND = SecureScaffoldParams.KIND, DITTO_KIND = SecureDittoParams.KIND;
    private static final String DELTA_CONTROL = "delta_control.";
    private final StatefulHeadTask training;
    private final boolean scaffold;
    private final SkellamNoise noise;

    private SecureStatefulHeadTask(StatefulHeadTask training, boolean scaffold, SkellamNoise noise) {
        this.training = training; this.scaffold = scaffold; this.noise = noise;
    }

    public static SecureStatefulHeadTask scaffold(ScaffoldTask training) {
        return new SecureStatefulHeadTask(training, true, new SkellamNoise());
    }

    public static SecureStatefulHeadTask ditto(DittoTask training) { return ditto(training, new SkellamNoise()); }

    public static SecureStatefulHeadTask ditto(DittoTask training, SkellamNoise noise) {
        return new SecureStatefulHeadTask(training, false, noise);
    }

    @Override
    public Contribution contribute(Map<String, Object> params, List<Envelope.Tensor> tensors) throws TaskDeclined {
        SecureScaffoldParams control = scaffold ? SecureScaffoldParams.fromParams(params) : null;
        SecureUpdateRound round = scaffold ? control.round : SecureDittoParams.fromParams(params).round;
        // declined before the plain handler runs and keeps its state: a device that can never be
        // summed must not advance its c_k / v_k round after round
        if (training.sampleCount() > round.maxSamples)
            throw new TaskDeclined(training.sampleCount() + " local samples exceed the round's bound of " + round.maxSamples);
        String job = training.jobOf(params);
        DeviceStateStore.Entry before = training.stateBefore(job);
        TaskHandler.Result r = training.run(params, tensors);      // the plain handler: its state kept as in plain rounds
        try {
            SecureTask.Contribution mine = masked(control, round, r, tensors);
            if (!scaffold) return mine;
            StateBinding binding = training.bindingOf(params);
            return new SecureTask.Contribution(mine.group, mine.vector, mine.distributedDp, mine.inputKey, summed -> {
                if (summed) return;
                DeviceStateStore.Entry now = training.stateBefore(job);     // only this round's own entry
                if (now != null && now.run.equals(binding.run) && now.round == binding.round) training.putBack(job, before);
            });
        } catch (Throwable failed) {
            // sends nothing: its state goes back to before the round, whatever ended the task (a decline,
            // a RuntimeException, an Error: MqttAgent declines those too and goes on serving the job), as
            // the Python device's state_restored_on_decline
            training.putBack(job, before);
            throw failed;
        }
    }

    private Contribution masked(SecureScaffoldParams control, SecureUpdateRound round, TaskHandler.Result r,
                                List<Envelope.Tensor> tensors) throws TaskDeclined {
        Map<String, double[]> out = new HashMap<>();
        for (Envelope.Tensor t : r.tensors) out.put(t.name, values(t));
        List<String> order = round.vectorOrder;
        if (order.size() != 2 || !order.containsAll(SecureUpdateRound.HEAD_ORDER))
            throw new TaskDeclined("vector_order " + order + " does not name exactly the trained tensors [bias, weight]");
        int classes = out.get("bias").length;
        long n = ((BigInteger) r.body.get("n")).longValue();
        double[] weighted = SecureFedAvgTask.vector(round, n, concat(out.get(order.get(0)), out.get(order.get(1))),
                SecureFedAvgTask.start(order, classes, out.get("weight").length / classes, tensors), noise);
        if (!scaffold) return new Contribution(round.group, weighted, round.dp != null);
        double[] delta = concat(out.get(DELTA_CONTROL + order.get(0)), out.get(DELTA_CONTROL + order.get(1)));
        double sq = 0;
        for (double d : delta) sq += d * d;
        double norm = Math.sqrt(sq), factor = norm > 0 ? Math.min(1.0, control.controlClipNorm / norm) : 1.0;
        for (int i = 0; i < delta.length; i++) delta[i] *= factor;
        double[] v = new double[weighted.length + delta.length];           // [n·y | clip(Δc) | n]
        System.arraycopy(weighted, 0, v, 0, weighted.length - 1);
        System.arraycopy(delta, 0, v, weighted.length - 1, delta.length);
        v[v.length - 1] = weighted[weighted.length - 1];
        return new Contribution(round.group, v, round.dp != null);
    }

    private static double[] values(Envelope.Tensor t) throws TaskDeclined {
        try {
            return Tensors.doubles(t);
        } catch (Envelope.EnvelopeError e) {
            throw new TaskDeclined(e.getMessage());
        }
    }

    private static double[] concat(double[] a, double[] b) {
        double[] out = Arrays.copyOf(a, a.length + b.length);
        System.arraycopy(b, 0, out, a.length, b.length);
        return out;
    }
}
