// Building and reading envelope tensors: little-endian, C order, the wire dtypes of
// docs/protocol.md ("Envelope"). Only float32/float64/int64/uint8 are needed by a device.
package org.fedfleet.wire;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;

public final class Tensors {
    private Tensors() {}

    /** Doubles as float64, or rounded to float32 when dtype is "float32" (the stats dtype a task asks for). */
    public static Envelope.Tensor floats(String name, String dtype, long[] shape, double[] values) {
        checkCount(name, shape, values.length);
        if ("float64".equals(dtype)) {
            ByteBuffer b = le(8 * values.length);
            for (double v : values) b.putDouble(v);
            return new Envelope.Tensor(name, dtype, shape.clone(), b.array());
        }
        if ("float32".equals(dtype)) {
            ByteBuffer b = le(4 * values.length);
            for (double v : values) b.putFloat((float) v);
            return new Envelope.Tensor(name, dtype, shape.clone(), b.array());
        }
        throw new IllegalArgumentException("tensor '" + name + "': floats are float32 or float64, not " + dtype);
    }

    public static Envelope.Tensor int64(String name, long[] shape, long[] values) {
        checkCount(name, shape, values.length);
        ByteBuffer b = le(8 * values.length);
        for (long v : values) b.putLong(v);
        return new Envelope.Tensor(name, "int64", shape.clone(), b.array());
    }

    public static Envelope.Tensor uint8(String name, byte[] data) {
        return new Envelope.Tensor(name, "uint8", new long[] {data.length}, data.clone());
    }

    /** A float32/float64 tensor's elements as doubles (exact for both). */
    public static double[] doubles(Envelope.Tensor t) throws Envelope.EnvelopeError {
        ByteBuffer b = ByteBuffer.wrap(t.data).order(ByteOrder.LITTLE_ENDIAN);
        if (t.dtype.equals("float64")) {
            double[] out = new double[t.data.length / 8];
            for (int k = 0; k < out.length; k++) out[k] = b.getDouble();
            return out;
        }
        if (t.dtype.equals("float32")) {
            double[] out = new double[t.data.length / 4];
            for (int k = 0; k < out.length; k++) out[k] = b.getFloat();
            return out;
        }
        throw new Envelope.EnvelopeError("tensor '" + t.name + "' must be float32 or float64, got " + t.dtype);
    }

    private static ByteBuffer le(int n) { return ByteBuffer.allocate(n).order(ByteOrder.LITTLE_ENDIAN); }

    private static void checkCount(String name, long[] shape, int count) {
        long prod = 1;
        for (long s : shape) prod *= s;
        if (prod != count) throw new IllegalArgumentException("tensor '" + name + "': " + count + " values for a shape of " + prod);
    }
}
