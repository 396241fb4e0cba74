// A deployed model's head file (protocols/payloads/deployment.py): an .npz (a zip of .npy arrays)
// holding a linear classifier over the backbone's features, weight/bias (FedAvg) or coef/intercept
// (Fed3R), C×d and C, little-endian float32 or float64 (read by Npz); logits = features · Wᵀ + b, computed in
// double as the Python device does (edge_client/deployment.py HeadVersion).
package org.fedfleet.device;

import java.io.IOException;
import java.util.Map;

public final class HeadFile {
    public static final long MAX_HEAD_BYTES = 64L * 1024 * 1024;       // as the Python device
    private static final String[][] NAMES = {{"coef", "intercept"}, {"weight", "bias"}};

    public final int classes, dim;
    private final double[] weight, bias;        // C·d row-major, C

    private HeadFile(double[] weight, double[] bias, int dim) {
        this.weight = weight; this.bias = bias; this.classes = bias.length; this.dim = dim;
    }

    /** The head in ``data``; IOException naming what is wrong (not a zip, no head arrays, shapes, non-finite). */
    public static HeadFile parse(byte[] data) throws IOException {
        if (data.length > MAX_HEAD_BYTES) throw new IOException("head of " + data.length + " bytes: at most " + MAX_HEAD_BYTES);
        Map<String, Npz.Array> arrays = Npz.read(data, MAX_HEAD_BYTES, true);
        for (Map.Entry<String, Npz.Array> e : arrays.entrySet())      // every member, as the Python device
            if (!e.getValue().dtype.equals("f4") && !e.getValue().dtype.equals("f8"))
                throw new IOException("head array '" + e.getKey() + "' is " + e.getValue().dtype
                        + ": a little-endian float32 or float64 array in C order is what devices read");
        for (String[] pair : NAMES) {
            if (!arrays.containsKey(pair[0]) || !arrays.containsKey(pair[1])) continue;
            long[] ws = arrays.get(pair[0]).shape, bs = arrays.get(pair[1]).shape;
            if (ws.length != 2 || bs.length != 1 || bs[0] != ws[0] || ws[0] < 1 || ws[1] < 1)
                throw new IOException("head shapes are not (C, d) / (C,)");
            double[] w = arrays.get(pair[0]).doubles(), b = arrays.get(pair[1]).doubles();
            for (double v : w) if (!Double.isFinite(v)) throw new IOException("head weights are not finite");
            for (double v : b) if (!Double.isFinite(v)) throw new IOException("head bias is not finite");
            return new HeadFile(w, b, (int) ws[1]);
        }
        throw new IOException("head holds " + arrays.keySet() + ": expected coef/intercept or weight/bias");
    }

    /** Global class ids of the rows of ``features``; with ``localLabels`` (sorted, distinct) only
     *  those rows of the head compete (OLL), so the answer is always one of them. */
    public int[] predict(float[][] features, int[] localLabels) {
        int[] rows = localLabels;
        if (rows == null) {
            rows = new int[classes];
            for (int c = 0; c < classes; c++) rows[c] = c;
        }
        for (int c : rows)
            if (c < 0 || c >= classes) throw new IllegalArgumentException("local labels must lie in [0, " + classes + "), got " + c);
        int[] out = new int[features.length];
        for (int i = 0; i < features.length; i++) {
            float[] f = features[i];
            if (f.length != dim) throw new IllegalArgumentException("features must have " + dim + " values, got " + f.length);
            double best = Double.NEGATIVE_INFINITY;
            for (int c : rows) {
                double z = bias[c];
                for (int j = 0; j < dim; j++) z += (double) f[j] * weight[c * dim + j];
                if (z > best) { best = z; out[i] = c; }        // the first maximum, as numpy's argmax
            }
        }
        return out;
    }
}
