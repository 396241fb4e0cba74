// Shamir sharing of 32-byte secrets (protocols/secagg/shamir.py): the secret, read as a
// little-endian integer, is cut into 31-bit digits, each shared over GF(p), p = 2^32 - 5, with a
// random polynomial of degree threshold-1; a share is the digits' values at x as little-endian
// uint32. A device only splits; reconstruction is the aggregator's.
package org.fedfleet.secagg;

import java.math.BigInteger;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;

public final class Shamir {
    public static final long PRIME = (1L << 32) - 5;
    static final int DIGIT_BITS = 31;

    private Shamir() {}

    public static int digitCount(int secretBytes) { return (8 * secretBytes + DIGIT_BITS - 1) / DIGIT_BITS; }

    public static int shareBytes(int secretBytes) { return 4 * digitCount(secretBytes); }

    /** shares[holder][secret] for holders at distinct x in 1..p-1; any `threshold` of them rebuild a secret. */
    public static byte[][][] split(byte[][] secrets, int threshold, long[] holders) {
        if (threshold < 1 || threshold > holders.length) throw new IllegalArgumentException("threshold must be in 1.." + holders.length);
        int len = secrets[0].length, digits = digitCount(len);
        byte[][][] out = new byte[holders.length][secrets.length][];
        for (int s = 0; s < secrets.length; s++) {
            if (secrets[s].length != len) throw new IllegalArgumentException("secrets must have the same length");
            long[] constant = toDigits(secrets[s], digits);
            ByteBuffer[] rows = new ByteBuffer[holders.length];
            for (int h = 0; h < holders.length; h++) rows[h] = ByteBuffer.allocate(4 * digits).order(ByteOrder.LITTLE_ENDIAN);
            for (int d = 0; d < digits; d++) {
                long[] coefficients = new long[threshold];
                coefficients[0] = constant[d];
                for (int j = 1; j < threshold; j++) coefficients[j] = randomElement();
                for (int h = 0; h < holders.length; h++) {
                    long x = holders[h], value = coefficients[threshold - 1];
                    for (int j = threshold - 2; j >= 0; j--)       // Horner; (p-1)^2 + p < 2^64 unsigned
                        value = Long.remainderUnsigned(value * x + coefficients[j], PRIME);
                    rows[h].putInt((int) value);
                }
            }
            for (int h = 0; h < holders.length; h++) out[h][s] = rows[h].array();
        }
        return out;
    }

    private static long[] toDigits(byte[] secret, int digits) {
        byte[] be = new byte[secret.length + 1];                 // little-endian bytes -> unsigned BigInteger
        for (int i = 0; i < secret.length; i++) be[secret.length - i] = secret[i];
        BigInteger value = new BigInteger(be);
        long[] out = new long[digits];
        BigInteger mask = BigInteger.ONE.shiftLeft(DIGIT_BITS).subtract(BigInteger.ONE);
        for (int i = 0; i < digits; i++) out[i] = value.shiftRight(DIGIT_BITS * i).and(mask).longValue();
        return out;
    }

    /** Uniform in GF(p) from the CSPRNG (rejecting the 5 values >= p). */
    private static long randomElement() {
        while (true) {
            long v = Integer.toUnsignedLong(Crypto.RANDOM.nextInt());
            if (v < PRIME) return v;
        }
    }
}
