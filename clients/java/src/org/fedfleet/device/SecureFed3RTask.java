// Task kind "fed3r.secure" (Fed3R-Sync): the dense float64 statistics of Fed3RStatsTask packed as
// [A_upper (p(p+1)/2) | b (C·p, class-major) | n] (protocols/payloads/secagg.py pack_sync_vector).
// Under distributed DP (a task with "dp": features clipped, samples capped by the stats task) the
// count would be an un-noised release, so it is left out (0) and the statistics carry the
// device's Skellam noise share (SkellamNoise), added after the task's block_scales scaled the
// vector's blocks (SyncBlockScales; the count slot then 1). The private feature center's round
// (center_round) contributes A's intercept column only, (Σ z, n) over the clipped rows, every
// entry noised (protocols/payloads/secagg.py sync_center_vector); a centered task's rows are
// shifted by its feature_center tensor first (Fed3RStatsTask). Params: SecureFed3RParams. Its input
// key is the vector before noise (SecureInputLedger.vectorKey, edge_client/tasks/secure_fed3r.py):
// the statistics are a function of the device's window, so the same window sent to two groups is
// the same input, whatever the task's ignored fields.
package org.fedfleet.device;

import java.util.List;
import java.util.Map;
import org.fedfleet.wire.Envelope;

public final class SecureFed3RTask implements SecureTask {
    public static final String KIND = "fed3r.secure";
    private final Fed3RStatsTask stats;
    private final SkellamNoise noise;

    public SecureFed3RTask(Fed3RStatsTask stats) { this(stats, new SkellamNoise()); }

    public SecureFed3RTask(Fed3RStatsTask stats, SkellamNoise noise) { this.stats = stats; this.noise = noise; }

    @Override
    public Contribution contribute(Map<String, Object> params, List<Envelope.Tensor> tensors) throws TaskDeclined {
        SecureFed3RParams task = SecureFed3RParams.fromParams(params);
        Fed3RAccumulator acc = stats.accumulate(task.stats, tensors);
        if (acc.n() > task.maxSamples)
            throw new TaskDeclined(acc.n() + " local samples exceed the round's bound of " + task.maxSamples);
        double[] a = acc.aUpper();
        if (Boolean.TRUE.equals(task.centerRound)) {     // (Σ z, n): row i's last packed entry is A[i][p-1]
            double[] column = new double[acc.p];
            for (int i = 0, end = 0; i < acc.p; i++) {
                end += acc.p - i;
                column[i] = a[end - 1];
            }
            return new Contribution(task.group, noise.add(column, task.dp, column.length), true,
                    SecureInputLedger.vectorKey(KIND, column));
        }
        long[] all = new long[acc.numClasses];
        for (int c = 0; c < all.length; c++) all[c] = c;
        double[] b = acc.bRows(all);
        double[] v = new double[a.length + b.length + 1];
        System.arraycopy(a, 0, v, 0, a.length);
        System.arraycopy(b, 0, v, a.length, b.length);
        if (task.dp != null) {              // count 0, or 1 once the blocks are scaled (SyncBlockScales)
            if (task.blockScales != null) task.blockScales.apply(v, acc.p);
            return new Contribution(task.group, noise.add(v, task.dp, v.length - 1), true, SecureInputLedger.vectorKey(KIND, v));
        }
        v[v.length - 1] = acc.n();
        return new Contribution(task.group, v, false, SecureInputLedger.vectorKey(KIND, v));
    }
}
