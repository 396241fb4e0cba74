// A vector in the round's ring Z_{2^r} (protocols/secagg/fixedpoint.py; RoundConfig.ringBits):
// r = 64 (the default) as long[], r = 32 as int[], so a 32-bit round holds 4 bytes an element.
// Words are two's complement; Java's integer arithmetic wraps at exactly the ring's width, so
// adding a mask (the PRG keystream read as little-endian r-bit words, Crypto.addMask) is the
// ring's addition. On the wire the words are "uint64" or "uint32", little-endian.
package org.fedfleet.secagg;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import org.fedfleet.wire.Envelope;

public abstract class RingVector {
    /** The ring widths a round may declare. */
    public static final int BITS_32 = 32, BITS_64 = 64;

    /** r: the ring is Z_{2^r}. */
    public final int bits;

    private RingVector(int bits) { this.bits = bits; }

    /** The zero vector of the given length in Z_{2^bits} (bits 32 or 64). */
    public static RingVector zeros(int bits, int length) {
        if (bits == BITS_64) return new Words64(new long[length]);
        if (bits == BITS_32) return new Words32(new int[length]);
        throw new IllegalArgumentException("ring_bits must be 32 or 64, got " + bits);
    }

    public abstract int length();

    /** Element i as a signed integer (its two's-complement r-bit word, sign-extended). */
    public abstract long get(int i);

    /** Stores q's low r bits at i (q a signed integer, |q| < 2^(r-1) for an encoded value). */
    abstract void set(int i, long q);

    public abstract RingVector copy();

    /** this += sign · PRG(seed) mod 2^r. */
    public abstract void addMask(byte[] seed, int sign);

    /** The words little-endian, r/8 bytes each. */
    public abstract byte[] toLittleEndian();

    /** The wire dtype of the words: "uint64" or "uint32". */
    public String dtype() { return bits == BITS_32 ? "uint32" : "uint64"; }

    /** The words as a 1-D envelope tensor. */
    public Envelope.Tensor tensor(String name) {
        return new Envelope.Tensor(name, dtype(), new long[] {length()}, toLittleEndian());
    }

    private static ByteBuffer buffer(int bytes) { return ByteBuffer.allocate(bytes).order(ByteOrder.LITTLE_ENDIAN); }

    private static final class Words64 extends RingVector {
        private final long[] w;

        Words64(long[] w) { super(BITS_64); this.w = w; }

        @Override public int length() { return w.length; }
        @Override public long get(int i) { return w[i]; }
        @Override void set(int i, long q) { w[i] = q; }
        @Override public RingVector copy() { return new Words64(w.clone()); }
        @Override public void addMask(byte[] seed, int sign) { Crypto.addMask(w, seed, sign); }

        @Override public byte[] toLittleEndian() {
            ByteBuffer b = buffer(Long.BYTES * w.length);
            b.asLongBuffer().put(w);
            return b.array();
        }
    }

    private static final class Words32 extends RingVector {
        private final int[] w;

        Words32(int[] w) { super(BITS_32); this.w = w; }

        @Override public int length() { return w.length; }
        @Override public long get(int i) { return w[i]; }
        @Override void set(int i, long q) { w[i] = (int) q; }
        @Override public RingVector copy() { return new Words32(w.clone()); }
        @Override public void addMask(byte[] seed, int sign) { Crypto.addMask(w, seed, sign); }

        @Override public byte[] toLittleEndian() {
            ByteBuffer b = buffer(Integer.BYTES * w.length);
            b.asIntBuffer().put(w);
            return b.array();
        }
    }
}
