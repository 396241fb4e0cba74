// Task kind "fed3r.secure" (Fed3R-Sync): the dense float64 statistics of Fed3RStatsTask packed as
// [A_upper (p(p+1)/2) | b (C·p, class-major) | n] (protocols/payloads/secagg.py pack_sync_vector).
// Under distributed DP (a task with "dp": features clipped, samples capped by the stats task) the
// count would be an un-noised release, so it is left out (0) and the statistics carry the
// device's Skellam noise share (SkellamNoise).
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
    public double[] vector(Map<String, Object> params, List<Envelope.Tensor> tensors) throws TaskDeclined {
        long maxSamples = Params.integer(params, "max_samples", 1, Long.MAX_VALUE);
        Fed3RAccumulator acc = stats.accumulate(params);
        if (acc.n() > maxSamples) throw new TaskDeclined(acc.n() + " local samples exceed the round's bound of " + maxSamples);
        double[] a = acc.aUpper();
        long[] all = new long[acc.numClasses];
        for (int c = 0; c < all.length; c++) all[c] = c;
        double[] b = acc.bRows(all);
        double[] v = new double[a.length + b.length + 1];
        System.arraycopy(a, 0, v, 0, a.length);
        System.arraycopy(b, 0, v, a.length, b.length);
        if (params.containsKey("dp")) return noise.add(v, params.get("dp"), v.length - 1);    // count 0
        v[v.length - 1] = acc.n();
        return v;
    }
}
