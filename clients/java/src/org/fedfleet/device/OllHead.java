// OLL (Only Local Labels, edge_client/oll.py): the global head (weight C×d, bias C) pruned to the
// rows of the labels the device trains on, local index i being the i-th smallest such label, so
// it predicts among the local classes only. Held-out labels outside them break OLL's closed-set
// assumption: with fallback "global" those samples are scored by the global head (and counted),
// with "error" scoring them is refused.
package org.fedfleet.device;

import java.util.Arrays;
import java.util.TreeSet;

public final class OllHead {
    public final int numClasses, dim;
    public final int[] globalIds;              // sorted local labels: local index -> global label
    public final boolean fallbackGlobal;
    final float[] globalWeight, globalBias;
    float[] weight, bias;                      // k×d, k: the personalised head

    /** Correct answers of a scoring, and how many samples the global head scored. */
    public static final class Scored {
        public final int correct, total, fallback;
        Scored(int correct, int total, int fallback) { this.correct = correct; this.total = total; this.fallback = fallback; }
    }

    public OllHead(float[] globalWeight, float[] globalBias, int dim, int[] trainLabels, boolean fallbackGlobal) {
        this.numClasses = globalBias.length; this.dim = dim; this.fallbackGlobal = fallbackGlobal;
        this.globalWeight = globalWeight; this.globalBias = globalBias;
        TreeSet<Integer> local = new TreeSet<>();
        for (int y : trainLabels) {
            if (y < 0 || y >= numClasses) throw new IllegalArgumentException("local labels must lie in [0, " + numClasses + "), got " + y);
            local.add(y);
        }
        if (local.isEmpty()) throw new IllegalArgumentException("no local labels");
        globalIds = local.stream().mapToInt(Integer::intValue).toArray();
        weight = new float[globalIds.length * dim];
        bias = new float[globalIds.length];
        for (int i = 0; i < globalIds.length; i++) {
            System.arraycopy(globalWeight, globalIds[i] * dim, weight, i * dim, dim);
            bias[i] = globalBias[globalIds[i]];
        }
    }

    public int k() { return globalIds.length; }

    public float[] weight() { return weight.clone(); }

    public float[] bias() { return bias.clone(); }

    /** Local index of a global label, or -1 outside the local labels. */
    public int toLocal(int label) {
        int i = Arrays.binarySearch(globalIds, label);
        return i >= 0 ? i : -1;
    }

    /** The global label the personalised head predicts (always a local label). */
    public int predict(float[] f) { return globalIds[argmax(weight, bias, dim, f)]; }

    /** Correct / total on labelled samples under the fallback policy; IllegalArgumentException
     *  naming the labels outside the local ones when the fallback is "error". */
    public Scored score(float[][] features, int[] labels) {
        int correct = 0, outside = 0;
        TreeSet<Integer> unknown = new TreeSet<>();
        for (int i = 0; i < labels.length; i++) {
            if (toLocal(labels[i]) >= 0) {
                if (predict(features[i]) == labels[i]) correct++;
            } else {
                outside++;
                unknown.add(labels[i]);
                if (argmax(globalWeight, globalBias, dim, features[i]) == labels[i]) correct++;
            }
        }
        if (outside > 0 && !fallbackGlobal)
            throw new IllegalArgumentException("labels " + unknown + " are not among the device's local labels "
                    + Arrays.toString(globalIds) + " (OLL predicts only local labels; use fallback='global' to score such samples with the global head)");
        return new Scored(correct, labels.length, outside);
    }

    /** The row of the largest logit f·W_c + b_c (the first on ties, as numpy's argmax). */
    static int argmax(float[] w, float[] b, int dim, float[] f) {
        int best = 0;
        double bestLogit = Double.NEGATIVE_INFINITY;
        for (int c = 0; c < b.length; c++) {
            double z = b[c];
            for (int j = 0; j < dim; j++) z += (double) f[j] * w[c * dim + j];
            if (z > bestLogit) { bestLogit = z; best = c; }
        }
        return best;
    }
}
