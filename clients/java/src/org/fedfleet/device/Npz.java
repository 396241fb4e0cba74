// NumPy's .npz files (a zip of .npy arrays), the format of the Python device's head files
// (HeadFile) and of its per-job state (DeviceStateStore): read any little-endian C-order array
// of the dtypes below, write float32 and uint8 ones as np.savez does (.npy format 1.0), so a
// file either library wrote the other opens.
package org.fedfleet.device;

import java.io.ByteArrayInputStream;
import java.io.ByteArrayOutputStream;
import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import java.util.zip.ZipEntry;
import java.util.zip.ZipInputStream;
import java.util.zip.ZipOutputStream;

public final class Npz {
    /** The header as numpy and {@link #npyHeader} write it, the only one taken (protocols/files.py's
     *  CANONICAL_NPY_HEADER, the same rule): matching its parts anywhere in the header took (02, 3), (2,,3)
     *  and a key named twice, which the Python device refuses. */
    private static final String DIMENSION = "(?:0|[1-9][0-9]*)";
    private static final Pattern HEADER = Pattern.compile(
            "\\{'descr': '([<>|=][a-zA-Z][0-9]{1,2})', 'fortran_order': (False|True), 'shape': \\((|"
            + DIMENSION + ",|" + DIMENSION + "(?:, " + DIMENSION + ")+)\\), \\} *\n");
    private static final Pattern DESCR = Pattern.compile("[<|=][fu][1248]");
    private static final int MAX_HEADER_BYTES = 10_000;     // numpy's max_header_size

    /** One array: its dtype ("f4", "f8", "u1", ...), shape and little-endian data. */
    public static final class Array {
        public final String dtype;
        public final long[] shape;
        final ByteBuffer data;
        Array(String dtype, long[] shape, ByteBuffer data) { this.dtype = dtype; this.shape = shape; this.data = data; }

        public int count() { return data.capacity() / Integer.parseInt(dtype.substring(1)); }

        /** The values as double (float32 or float64 arrays; IOException otherwise). */
        public double[] doubles() throws IOException {
            if (!dtype.equals("f4") && !dtype.equals("f8")) throw new IOException("array of dtype " + dtype + " is not float32/float64");
            double[] out = new double[count()];
            for (int i = 0; i < out.length; i++) out[i] = dtype.equals("f8") ? data.getDouble(8 * i) : data.getFloat(4 * i);
            return out;
        }

        /** The values of a float32 array (null for any other dtype). */
        public float[] floats() {
            if (!dtype.equals("f4")) return null;
            float[] out = new float[count()];
            for (int i = 0; i < out.length; i++) out[i] = data.getFloat(4 * i);
            return out;
        }

        public byte[] bytes() {
            byte[] out = new byte[data.capacity()];
            ByteBuffer all = data.duplicate();
            ((java.nio.Buffer) all).rewind();          // Buffer's: ByteBuffer.rewind() is Java 9+ (Android 34+)
            all.get(out);
            return out;
        }
    }

    private Npz() {}

    private static String cut(String text) { return text.length() > 100 ? text.substring(0, 100) : text; }

    /** The arrays of an .npz (by name, without ".npy"); IOException when it is not one, a member
     *  is not one array named *.npy or names an array twice (numpy would read another of the two:
     *  one file, two heads), an array is malformed, or the arrays' data would pass maxBytes. */
    public static Map<String, Array> read(byte[] npz, long maxBytes) throws IOException { return read(npz, maxBytes, false); }

    /** {@link #read(byte[], long)}; with ``canonical`` (a file both SDKs read: a head) the zip's layout
     *  leaves nothing to choose and its members are read by {@link ZipLayout} (protocols/zip_layout.py and
     *  protocols/canonical_npz.py are the Python device's side). */
    public static Map<String, Array> read(byte[] npz, long maxBytes, boolean canonical) throws IOException {
        if (canonical) return readCanonical(npz, maxBytes);
        Map<String, Array> arrays = new LinkedHashMap<>();
        long total = 0;
        int entries = 0;
        try (ZipInputStream zip = new ZipInputStream(new ByteArrayInputStream(npz))) {
            for (ZipEntry e; (e = zip.getNextEntry()) != null; entries++) {
                String name = e.getName();
                if (!name.endsWith(".npy") || arrays.containsKey(name.substring(0, name.length() - 4)))
                    throw new IOException("member '" + cut(name) + "': every member must be one array named *.npy");
                byte[] b = readAll(zip, maxBytes - total);
                total += b.length;
                arrays.put(name.substring(0, name.length() - 4), npy(b));
            }
        } catch (IllegalArgumentException | IndexOutOfBoundsException e) {     // a name that is not UTF-8, a bad field
            throw new IOException("not a readable zip file: " + e.getMessage());
        }
        requireEndRecord(npz, entries);
        return arrays;
    }

    /** The members {@link ZipLayout} reads (never ZipInputStream), each one array named *.npy, named once. */
    private static Map<String, Array> readCanonical(byte[] npz, long maxBytes) throws IOException {
        Map<String, Array> arrays = new LinkedHashMap<>();
        for (Map.Entry<String, byte[]> m : ZipLayout.members(npz, maxBytes).entrySet()) {
            String name = m.getKey();
            if (!name.endsWith(".npy") || arrays.containsKey(name.substring(0, name.length() - 4)))
                throw new IOException("member '" + cut(name) + "': every member must be one array named *.npy");
            arrays.put(name.substring(0, name.length() - 4), npy(m.getValue()));
        }
        return arrays;
    }

    /** IOException unless the zip ends with its end-of-central-directory record, naming `entries`
     *  entries and a central directory right before it. ZipInputStream reads the entries front to
     *  back and never looks there, so a file cut short after its last entry's data (a torn write)
     *  would read as whole; numpy (zipfile) starts from that record and refuses such a file, and a
     *  state store must drop what the other library's drops (tests/fuzz_stateful.py). */
    private static void requireEndRecord(byte[] zip, int entries) throws IOException {
        ByteBuffer b = ByteBuffer.wrap(zip).order(ByteOrder.LITTLE_ENDIAN);
        for (int at = zip.length - 22; at >= Math.max(0, zip.length - 22 - 0xffff); at--) {
            if (b.getInt(at) != 0x06054b50 || Short.toUnsignedInt(b.getShort(at + 20)) != zip.length - at - 22) continue;
            long size = Integer.toUnsignedLong(b.getInt(at + 12)), offset = Integer.toUnsignedLong(b.getInt(at + 16));
            if (Short.toUnsignedInt(b.getShort(at + 10)) == entries && offset + size == at) return;
            break;
        }
        throw new IOException("not a whole zip file (no end of central directory record naming its " + entries + " entries)");
    }

    private static byte[] readAll(ZipInputStream zip, long maxBytes) throws IOException {
        ByteArrayOutputStream out = new ByteArrayOutputStream();
        byte[] buf = new byte[1 << 16];
        for (int n; (n = zip.read(buf)) > 0; ) {
            if (out.size() + n > maxBytes) throw new IOException("the arrays are larger than " + maxBytes + " bytes");
            out.write(buf, 0, n);
        }
        return out.toByteArray();
    }

    private static Array npy(byte[] b) throws IOException {
        if (b.length < 10 || (b[0] & 0xff) != 0x93 || !new String(b, 1, 5, StandardCharsets.US_ASCII).equals("NUMPY"))
            throw new IOException("not an .npy array");
        ByteBuffer buf = ByteBuffer.wrap(b).order(ByteOrder.LITTLE_ENDIAN);
        int major = b[6], at = major == 1 ? 10 : 12;
        if (major < 1 || major > 3 || b[7] != 0 || at > b.length) throw new IOException("bad .npy version or header");
        long hlen = major == 1 ? Short.toUnsignedInt(buf.getShort(8)) : Integer.toUnsignedLong(buf.getInt(8));
        // numpy refuses a header longer than its max_header_size (10,000) when it reads one
        if (hlen > MAX_HEADER_BYTES || at + hlen > b.length) throw new IOException("bad .npy header length " + hlen);
        String header = new String(b, at, (int) hlen, StandardCharsets.ISO_8859_1);
        Matcher h = HEADER.matcher(header);
        if (!h.matches()) throw new IOException("the .npy header is not written as numpy writes one: " + cut(header.trim()));
        if (!DESCR.matcher(h.group(1)).matches() || h.group(2).equals("True"))
            throw new IOException("array is not a little-endian float or unsigned array in C order: " + header.trim());
        long[] shape;
        long count = 1, bytes;
        String dtype = h.group(1).substring(1);
        int size = Integer.parseInt(dtype.substring(1)), start = at + (int) hlen;
        try {           // a dimension past a long, or a product past one, is a malformed array, never a crash
            shape = Arrays.stream(h.group(3).split(",")).map(String::trim).filter(x -> !x.isEmpty())
                    .mapToLong(Long::parseLong).toArray();
            for (long n : shape) {
                if (n > Integer.MAX_VALUE) throw new IOException("array dimension " + n + " is past any array's");
                count = Math.multiplyExact(count, n);
            }
            bytes = Math.multiplyExact(count, (long) size);
        } catch (NumberFormatException | ArithmeticException e) {
            throw new IOException("array shape (" + cut(h.group(3)) + ") is past any array's");
        }
        if (bytes != b.length - start) throw new IOException("array data is " + (b.length - start) + " bytes, shape needs " + bytes);
        ByteBuffer data = ByteBuffer.wrap(Arrays.copyOfRange(b, start, b.length)).order(ByteOrder.LITTLE_ENDIAN);
        return new Array(dtype, shape, data);
    }

    /** float32 values of the given shape, as an array to write. */
    public static Array float32(long[] shape, float[] values) {
        ByteBuffer data = ByteBuffer.allocate(4 * values.length).order(ByteOrder.LITTLE_ENDIAN);
        for (float v : values) data.putFloat(v);
        return new Array("f4", shape.clone(), data);
    }

    public static Array uint8(byte[] values) {
        return new Array("u1", new long[] {values.length}, ByteBuffer.wrap(values.clone()).order(ByteOrder.LITTLE_ENDIAN));
    }

    /** The .npz of `arrays` (deflated entries; numpy reads stored and deflated alike). */
    public static byte[] write(Map<String, Array> arrays) throws IOException {
        ByteArrayOutputStream out = new ByteArrayOutputStream();
        try (ZipOutputStream zip = new ZipOutputStream(out)) {
            for (Map.Entry<String, Array> e : arrays.entrySet()) {
                zip.putNextEntry(new ZipEntry(e.getKey() + ".npy"));
                zip.write(npyHeader(e.getValue()));
                zip.write(e.getValue().bytes());
                zip.closeEntry();
            }
        }
        return out.toByteArray();
    }

    /** .npy format 1.0's header: magic, version, length, the dict padded to a multiple of 64. */
    private static byte[] npyHeader(Array a) {
        StringBuilder shape = new StringBuilder("(");
        for (long n : a.shape) shape.append(n).append(a.shape.length == 1 ? "," : ", ");
        String dims = a.shape.length > 1 ? shape.substring(0, shape.length() - 2) + ")" : shape + ")";
        String endian = a.dtype.endsWith("1") ? "|" : "<";
        StringBuilder dict = new StringBuilder("{'descr': '" + endian + a.dtype + "', 'fortran_order': False, 'shape': " + dims + ", }");
        while ((10 + dict.length() + 1) % 64 != 0) dict.append(' ');
        dict.append('\n');
        ByteBuffer h = ByteBuffer.allocate(10 + dict.length()).order(ByteOrder.LITTLE_ENDIAN);
        h.put((byte) 0x93).put("NUMPY".getBytes(StandardCharsets.US_ASCII)).put((byte) 1).put((byte) 0);
        h.putShort((short) dict.length()).put(dict.toString().getBytes(StandardCharsets.US_ASCII));
        return h.array();
    }
}
