// A deployed model's head file (protocols/payloads/deployment.py): an .npz (a zip of .npy arrays)
// holding a linear classifier over the backbone's features, weight/bias (FedAvg) or coef/intercept
// (Fed3R), C×d and C, little-endian float32 or float64; logits = features · Wᵀ + b, computed in
// double as the Python device does (edge_client/deployment.py HeadVersion).
package org.fedfleet.device;

import java.io.ByteArrayInputStream;
import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.util.HashMap;
import java.util.Map;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import java.util.zip.ZipEntry;
import java.util.zip.ZipInputStream;

public final class HeadFile {
    public static final long MAX_HEAD_BYTES = 64L * 1024 * 1024;       // as the Python device
    private static final String[][] NAMES = {{"coef", "intercept"}, {"weight", "bias"}};
    private static final Pattern DESCR = Pattern.compile("'descr':\\s*'([<|=]f[48])'");
    private static final Pattern FORTRAN = Pattern.compile("'fortran_order':\\s*(True|False)");
    private static final Pattern SHAPE = Pattern.compile("'shape':\\s*\\(([0-9,\\s]*)\\)");

    public final int classes, dim;
    private final double[] weight, bias;        // C·d row-major, C

    private HeadFile(double[] weight, double[] bias, int dim) {
        this.weight = weight; this.bias = bias; this.classes = bias.length; this.dim = dim;
    }

    /** The head in ``data``; IOException naming what is wrong (not a zip, no head arrays, shapes, non-finite). */
    public static HeadFile parse(byte[] data) throws IOException {
        if (data.length > MAX_HEAD_BYTES) throw new IOException("head of " + data.length + " bytes: at most " + MAX_HEAD_BYTES);
        Map<String, Object[]> arrays = new HashMap<>();      // name -> {long[] shape, double[] values}
        try (ZipInputStream zip = new ZipInputStream(new ByteArrayInputStream(data))) {
            for (ZipEntry e; (e = zip.getNextEntry()) != null; ) {
                String name = e.getName();
                if (!name.endsWith(".npy")) continue;
                arrays.put(name.substring(0, name.length() - 4), npy(readAll(zip)));
            }
        }
        for (String[] pair : NAMES) {
            if (!arrays.containsKey(pair[0]) || !arrays.containsKey(pair[1])) continue;
            long[] ws = (long[]) arrays.get(pair[0])[0], bs = (long[]) arrays.get(pair[1])[0];
            if (ws.length != 2 || bs.length != 1 || bs[0] != ws[0] || ws[0] < 1 || ws[1] < 1)
                throw new IOException("head shapes are not (C, d) / (C,)");
            double[] w = (double[]) arrays.get(pair[0])[1], b = (double[]) arrays.get(pair[1])[1];
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

    private static byte[] readAll(ZipInputStream zip) throws IOException {
        ByteArrayOutputStream out = new ByteArrayOutputStream();
        byte[] buf = new byte[1 << 16];
        for (int n; (n = zip.read(buf)) > 0; ) {
            if (out.size() + n > MAX_HEAD_BYTES) throw new IOException("an array of the head is larger than " + MAX_HEAD_BYTES + " bytes");
            out.write(buf, 0, n);
        }
        return out.toByteArray();
    }

    /** {shape, values as double} of a little-endian float32/float64 C-order .npy file. */
    private static Object[] npy(byte[] b) throws IOException {
        if (b.length < 10 || (b[0] & 0xff) != 0x93 || !new String(b, 1, 5, StandardCharsets.US_ASCII).equals("NUMPY"))
            throw new IOException("not an .npy array");
        ByteBuffer buf = ByteBuffer.wrap(b).order(ByteOrder.LITTLE_ENDIAN);
        int major = b[6], at = major == 1 ? 10 : 12;
        long hlen = major == 1 ? Short.toUnsignedInt(buf.getShort(8)) : Integer.toUnsignedLong(buf.getInt(8));
        if (major < 1 || major > 3 || at + hlen > b.length) throw new IOException("bad .npy header");
        String header = new String(b, at, (int) hlen, StandardCharsets.ISO_8859_1);
        Matcher d = DESCR.matcher(header), f = FORTRAN.matcher(header), s = SHAPE.matcher(header);
        if (!d.find() || !f.find() || !s.find() || f.group(1).equals("True"))
            throw new IOException("array is not little-endian float32/float64 in C order: " + header.trim());
        String[] dims = s.group(1).split(",");
        long[] shape = java.util.Arrays.stream(dims).map(String::trim).filter(x -> !x.isEmpty()).mapToLong(Long::parseLong).toArray();
        long count = 1;
        for (long n : shape) count = Math.multiplyExact(count, n);
        int size = d.group(1).endsWith("8") ? 8 : 4;
        int start = at + (int) hlen;
        if (count * size != b.length - start) throw new IOException("array data is " + (b.length - start) + " bytes, shape needs " + count * size);
        double[] values = new double[(int) count];
        for (int i = 0; i < values.length; i++)
            values[i] = size == 8 ? buf.getDouble(start + 8 * i) : buf.getFloat(start + 4 * i);
        return new Object[]{shape, values};
    }
}
