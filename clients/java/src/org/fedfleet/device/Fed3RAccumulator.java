// Fed3R client statistics (edge_client/fed3r.py): A = ZᵀZ (kept as its packed upper triangle,
// row-major, the wire's A_upper order) and per-class feature sums b_c = Σ_{y=c} z, accumulated in
// double precision whatever the feature precision; with fitIntercept a constant-1 column is
// appended to Z, so A's last diagonal entry is n and b's last column holds the class counts. With a
// featureClipNorm > 0 (differential privacy) each feature row is first scaled to a norm of at most
// featureClipNorm, which bounds what one sample adds to A and b. weigh(total) then weighs the rows to
// `total` samples in all (a DP task's cap_by_weight).
package org.fedfleet.device;

import java.util.ArrayList;
import java.util.List;

public final class Fed3RAccumulator {
    public final int numClasses, featureDim, p;
    public final boolean fitIntercept;
    public final double featureClipNorm;
    private final double[] aUpper;   // p(p+1)/2
    private final double[][] b;      // numClasses x p
    private final long[] counts;
    private final double[] z;        // one augmented row, reused
    private double[] center;         // a centered task's feature_center, or null
    private List<double[]> rows;     // the augmented rows, for the exact factor form, while fewer than p
    private final List<Integer> rowLabels = new ArrayList<>();
    private double weight = 1.0;     // every row's weight (weigh)
    private long weighedN = -1;      // n once weighed, else -1

    /** Most statistics values a device holds (A's triangle + b): 2^27 doubles, 1 GiB, as SecAgg's longest vector. */
    public static final long MAX_VALUES = 1L << 27;

    public Fed3RAccumulator(int numClasses, int featureDim, boolean fitIntercept) { this(numClasses, featureDim, fitIntercept, 0.0); }

    public Fed3RAccumulator(int numClasses, int featureDim, boolean fitIntercept, double featureClipNorm) {
        if (!(featureClipNorm >= 0) || Double.isInfinite(featureClipNorm))
            throw new IllegalArgumentException("feature_clip_norm must be a finite number >= 0, got " + featureClipNorm);
        if (numClasses < 1 || featureDim < 1) throw new IllegalArgumentException("need at least one class and one feature");
        long p0 = featureDim + (fitIntercept ? 1L : 0L);
        if (p0 * (p0 + 1) / 2 + numClasses * p0 > MAX_VALUES)
            throw new IllegalArgumentException(numClasses + " classes x " + p0 + " features need more than " + MAX_VALUES + " statistics values");
        this.numClasses = numClasses; this.featureDim = featureDim; this.fitIntercept = fitIntercept;
        this.featureClipNorm = featureClipNorm;
        this.p = featureDim + (fitIntercept ? 1 : 0);
        this.aUpper = new double[p * (p + 1) / 2];
        this.b = new double[numClasses][p];
        this.counts = new long[numClasses];
        this.z = new double[p];
    }

    /** Adds one sample; features must be finite (a NaN means a broken backbone or input). */
    /** Shift every row by `c` (a centered task's released mean) before the clip; null: none. */
    public void center(double[] c) {
        if (c != null && c.length != featureDim) throw new IllegalArgumentException("feature_center must have " + featureDim + " values");
        center = c;
    }

    public void add(float[] features, int label) {
        if (weighedN >= 0) throw new IllegalArgumentException("the statistics are weighed: no more rows");
        if (features.length != featureDim) throw new IllegalArgumentException("features must have " + featureDim + " values, got " + features.length);
        if (label < 0 || label >= numClasses) throw new IllegalArgumentException("label " + label + " outside [0, " + numClasses + ")");
        for (int i = 0; i < featureDim; i++) {
            if (!Float.isFinite(features[i])) throw new IllegalArgumentException("features contain NaN or Inf");
            z[i] = center == null ? features[i] : (double) features[i] - center[i];
        }
        if (featureClipNorm > 0) {
            double sq = 0;
            for (int i = 0; i < featureDim; i++) sq += z[i] * z[i];
            double scale = Math.min(1.0, featureClipNorm / Math.max(Math.sqrt(sq), 1e-300));
            for (int i = 0; i < featureDim; i++) z[i] *= scale;
        }
        if (fitIntercept) z[p - 1] = 1.0;
        int k = 0;
        for (int i = 0; i < p; i++) {
            double zi = z[i];
            for (int j = i; j < p; j++) aUpper[k++] += zi * z[j];
        }
        double[] row = b[label];
        for (int j = 0; j < p; j++) row[j] += z[j];
        counts[label]++;
        if (rows != null) {
            rows.add(z.clone());
            rowLabels.add(label);
            if (rows.size() >= p) { rows = null; rowLabels.clear(); }
        }
    }

    /** Keep the rows (from now on) for the exact factor form; they are dropped once there are p. */
    public void keepRows() { rows = new ArrayList<>(); }

    /** The canonical factor form over the kept rows and the present classes, or null when the rows
     *  were not kept (not asked for, or n ≥ p). */
    public CanonicalFactor factor() {
        if (rows == null || rows.isEmpty()) return null;
        long[] classes = presentClasses();
        double[][] onehot = new double[rows.size()][classes.length];
        for (int i = 0; i < rows.size(); i++)
            for (int c = 0; c < classes.length; c++) onehot[i][c] = classes[c] == rowLabels.get(i) ? 1.0 : 0.0;
        CanonicalFactor f = CanonicalFactor.of(rows.toArray(new double[0][]), onehot);
        if (weighedN >= 0) {         // A = w RᵀR and b = w Rᵀ(QᵀY): both factors times √w
            double root = Math.sqrt(weight);
            for (double[] row : f.r) for (int k = 0; k < row.length; k++) row[k] *= root;
            for (double[] row : f.qty) for (int k = 0; k < row.length; k++) row[k] *= root;
        }
        return f;
    }

    /** Weigh the samples to `total` in all, once every row is in (edge_client/fed3r.py weigh): each
     *  of the n rows by total/n when n > total, so A and b are bounded as `total` rows are and n()
     *  is `total`; nothing changes when n <= total. */
    public void weigh(long total) {
        if (weighedN >= 0) throw new IllegalStateException("the statistics are weighed already");
        long rowsIn = n();
        if (rowsIn <= total) return;
        weight = (double) total / rowsIn;
        weighedN = total;
        for (int k = 0; k < aUpper.length; k++) aUpper[k] *= weight;
        for (double[] row : b) for (int k = 0; k < row.length; k++) row[k] *= weight;
    }

    public long n() {
        if (weighedN >= 0) return weighedN;
        long n = 0;
        for (long c : counts) n += c;
        return n;
    }

    public double[] aUpper() { return aUpper.clone(); }

    /** The classes present locally, increasing (the sparse form's class_ids). */
    public long[] presentClasses() {
        int m = 0;
        for (long c : counts) if (c > 0) m++;
        long[] ids = new long[m];
        for (int c = 0, k = 0; c < numClasses; c++) if (counts[c] > 0) ids[k++] = c;
        return ids;
    }

    /** Row-major b rows of the given classes. */
    public double[] bRows(long[] classes) {
        double[] out = new double[classes.length * p];
        for (int r = 0; r < classes.length; r++) System.arraycopy(b[(int) classes[r]], 0, out, r * p, p);
        return out;
    }
}
