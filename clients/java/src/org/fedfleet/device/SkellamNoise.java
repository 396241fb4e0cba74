// A device's share of distributed-DP noise (protocols/secagg/distributed_dp.py add_skellam_noise):
// the vector rounded to the 2^-f grid (f = the round's scale_bits), plus Sk(μ)·2^-f on the noised
// entries, Sk(μ) = Poisson(μ) − Poisson(μ), μ = (σ_dev·2^f)²/2. Drawn from the OS's entropy
// (SecureRandom): a seeded generator would let anyone who knows the seed remove the noise. Poisson
// by numpy's samplers: the multiplication method below μ = 10, Hörmann's PTRS above it.
package org.fedfleet.device;

import java.security.SecureRandom;
import java.util.Random;

public final class SkellamNoise {
    /** |q + noise| < 2^52 ring units: the float64 path to SecAgg's encoder stays exact. */
    public static final int EXACT_BITS = 52;
    /** The largest Poisson mean numpy draws (Long.MAX_VALUE − 10·√Long.MAX_VALUE; "lam value too
     *  large" past it): beyond it PTRS's candidate saturates at Long.MAX_VALUE, both draws agree and
     *  the "noise" is 0, an un-noised release where the Python device declines. */
    static final double POISSON_LAM_MAX = 9.223372006484771e18;
    private final Random random;

    public SkellamNoise() { this(new SecureRandom()); }

    SkellamNoise(Random random) { this.random = random; }

    /** The round's dp noise applied to v's entries [0, noisedEnd); TaskDeclined for a noise this
     *  device cannot add (stddev 0, scale_bits beyond 52, a Poisson mean past POISSON_LAM_MAX) or a noisy value beyond 2^52 ring units. */
    public double[] add(double[] v, DpRound dp, int noisedEnd) throws TaskDeclined {
        double stddev = dp.stddev;
        int bits = dp.scaleBits;
        if (!(stddev > 0) || bits > EXACT_BITS)
            throw new TaskDeclined("bad dp params " + dp + ": needs stddev > 0 and scale_bits <= " + EXACT_BITS);
        double mu = Math.pow(stddev * Math.scalb(1.0, bits), 2) / 2;
        if (!(mu <= POISSON_LAM_MAX))
            throw new TaskDeclined("bad dp params " + dp + ": noise stddev·2^scale_bits too large to draw (Poisson mean " + mu + ")");
        double[] out = new double[v.length];
        for (int k = 0; k < v.length; k++) {
            double q = Math.rint(Math.scalb(v[k], bits));           // half to even, as np.rint
            if (k < noisedEnd) q += (double) (poisson(mu) - poisson(mu));
            if (Math.abs(q) >= Math.scalb(1.0, EXACT_BITS))
                throw new TaskDeclined("bad dp params " + dp + ": noisy value beyond 2^52 ring units: scale bits too fine for this bound");
            out[k] = Math.scalb(q, -bits);
        }
        return out;
    }

    /** A Poisson(mu) draw (numpy's random_poisson). */
    long poisson(double mu) {
        if (mu >= 10) return ptrs(mu);
        if (mu == 0) return 0;
        double enlam = Math.exp(-mu), prod = 1.0;
        long x = 0;
        while (true) {
            prod *= random.nextDouble();
            if (prod > enlam) x++;
            else return x;
        }
    }

    private long ptrs(double lam) {
        double slam = Math.sqrt(lam), loglam = Math.log(lam);
        double b = 0.931 + 2.53 * slam, a = -0.059 + 0.02483 * b;
        double invalpha = 1.1239 + 1.1328 / (b - 3.4), vr = 0.9277 - 3.6224 / (b - 2);
        while (true) {
            double u = random.nextDouble() - 0.5, v = random.nextDouble(), us = 0.5 - Math.abs(u);
            long k = (long) Math.floor((2 * a / us + b) * u + lam + 0.43);
            if (us >= 0.07 && v <= vr) return k;
            if (k < 0 || (us < 0.013 && v > us)) continue;
            if (Math.log(v) + Math.log(invalpha) - Math.log(a / (us * us) + b) <= -lam + k * loglam - logGamma(k + 1)) return k;
        }
    }

    private static final double[] LOGGAM = {8.333333333333333e-02, -2.777777777777778e-03, 7.936507936507937e-04,
            -5.952380952380952e-04, 8.417508417508418e-04, -1.917526917526918e-03, 6.410256410256410e-03,
            -2.955065359477124e-02, 1.796443723688307e-01, -1.39243221690590e+00};

    /** log Γ(x) by Stirling's series (numpy's random_loggam). */
    static double logGamma(double x) {
        if (x == 1.0 || x == 2.0) return 0.0;
        int n = x < 7.0 ? (int) (7 - x) : 0;
        double x0 = x + n, x2 = (1.0 / x0) * (1.0 / x0), gl0 = LOGGAM[9];
        for (int k = 8; k >= 0; k--) { gl0 *= x2; gl0 += LOGGAM[k]; }
        double gl = gl0 / x0 + 0.5 * 1.8378770664093453 + (x0 - 0.5) * Math.log(x0) - x0;
        for (int k = 1; k <= n; k++) { gl -= Math.log(x0 - 1.0); x0 -= 1.0; }
        return gl;
    }
}
