// LocalData read from a file of precomputed features (what the bundle's exported program
// produced for the device's images), little-endian: int32 n, int32 d, n·d float32 (row-major),
// n int32 labels. Used by HeadlessDevices and the tests.
// The header is judged against the file's own length before any array is made (a header promising
// 2^28 rows in an 8-byte file would otherwise allocate gigabytes, or overflow the int size into a
// NegativeArraySizeException), and only a regular file is opened (a FIFO waits for a writer for ever):
// every bad file is the IOException the callers report. java.io only (Android), as the rest of the library.
package org.fedfleet.device;

import java.io.DataInputStream;
import java.io.File;
import java.io.FileInputStream;
import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;

public final class FeatureFile implements LocalData {
    private static final int MAX_VALUES = 1 << 28;
    private static final int HEADER_BYTES = 8;
    public final int n, dim;
    private final float[][] rows;
    private final int[] labels;

    private FeatureFile(float[][] rows, int[] labels, int dim) { this.rows = rows; this.labels = labels; this.n = rows.length; this.dim = dim; }

    public static FeatureFile read(String path) throws IOException {
        if (!new File(path).isFile()) throw new IOException(path + ": not a regular file");
        try (FileInputStream file = new FileInputStream(path); DataInputStream in = new DataInputStream(file)) {
            long fileBytes = file.getChannel().size();
            if (fileBytes < HEADER_BYTES) throw new IOException(path + ": " + fileBytes + " bytes, shorter than the 8-byte header");
            byte[] head = new byte[HEADER_BYTES];
            in.readFully(head);
            ByteBuffer h = ByteBuffer.wrap(head).order(ByteOrder.LITTLE_ENDIAN);
            int n = h.getInt(), d = h.getInt();
            if (n < 0 || d < 1 || (long) n * d > MAX_VALUES) throw new IOException(path + ": bad shape (" + n + ", " + d + ")");
            // in long: 4 * (n * d + n) reaches 2^31 within MAX_VALUES
            long bodyBytes = 4L * ((long) n * d + n);
            if (HEADER_BYTES + bodyBytes != fileBytes)
                throw new IOException(path + ": shape (" + n + ", " + d + ") needs " + (HEADER_BYTES + bodyBytes) + " bytes, the file holds " + fileBytes);
            if (bodyBytes > Integer.MAX_VALUE - 8) throw new IOException(path + ": shape (" + n + ", " + d + ") is too large to read");
            byte[] body = new byte[(int) bodyBytes];
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
