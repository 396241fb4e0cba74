// LocalData read from a file of precomputed features (what the bundle's exported program
// produced for the device's images), little-endian: int32 n, int32 d, n·d float32 (row-major),
// n int32 labels. Used by HeadlessDevices and the tests.
package org.fedfleet.device;

import java.io.DataInputStream;
import java.io.FileInputStream;
import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;

public final class FeatureFile implements LocalData {
    private static final int MAX_VALUES = 1 << 28;
    public final int n, dim;
    private final float[][] rows;
    private final int[] labels;

    private FeatureFile(float[][] rows, int[] labels, int dim) { this.rows = rows; this.labels = labels; this.n = rows.length; this.dim = dim; }

    public static FeatureFile read(String path) throws IOException {
        try (DataInputStream in = new DataInputStream(new FileInputStream(path))) {
            byte[] head = new byte[8];
            in.readFully(head);
            ByteBuffer h = ByteBuffer.wrap(head).order(ByteOrder.LITTLE_ENDIAN);
            int n = h.getInt(), d = h.getInt();
            if (n < 0 || d < 1 || (long) n * d > MAX_VALUES) throw new IOException(path + ": bad shape (" + n + ", " + d + ")");
            byte[] body = new byte[4 * (n * d + n)];
            in.readFully(body);
            if (in.read() != -1) throw new IOException(path + ": trailing bytes after the labels");
            ByteBuffer b = ByteBuffer.wrap(body).order(ByteOrder.LITTLE_ENDIAN);
            float[][] rows = new float[n][d];
            for (float[] row : rows) for (int j = 0; j < d; j++) row[j] = b.getFloat();
            int[] labels = new int[n];
            for (int i = 0; i < n; i++) labels[i] = b.getInt();
            return new FeatureFile(rows, labels, d);
        }
    }

    @Override public int size() { return n; }
    @Override public float[] input(int i) { return rows[i]; }
    @Override public int label(int i) { return labels[i]; }
}
