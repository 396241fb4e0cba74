// numpy's `np.random.default_rng(seed)` as far as a device needs it: `permutation(n)`, the order in
// which the Python device visits its samples each epoch (edge_client/tasks/numpy_head.py
// batch_schedule). Same seed, same permutation, bit for bit, so a Java device trains on the same
// mini-batches as a Python one. Written from numpy's published algorithms:
//   SeedSequence(seed)      the seed as uint32 words, hash-mixed into a 4-word pool, expanded by
//                           generate_state(4, uint64) (numpy/random/bit_generator.pyx);
//   PCG64                   the 128-bit LCG with the XSL-RR output, seeded by pcg64_set_seed;
//   permutation(n)          Fisher-Yates from the last position down, j = random_interval(i)
//                           (bit-masked rejection on 32-bit draws, which PCG64 serves in halves).
package org.fedfleet.device;

import java.math.BigInteger;

public final class NumpyGenerator {
    private static final int INIT_A = 0x43b0d7e5, MULT_A = 0x931e8875, INIT_B = 0x8b51f9dd, MULT_B = 0x58f38ded;
    private static final int MIX_MULT_L = 0xca01f9dd, MIX_MULT_R = 0x4973f715, POOL_SIZE = 4;
    private static final long MULT_HI = 2549297995355413924L, MULT_LO = 4865540595714422341L;

    private long stateHi, stateLo;
    private final long incHi, incLo;
    private boolean hasHalf;
    private int half;

    private NumpyGenerator(long[] seed) {      // pcg64_set_seed: state = seed[0:2], inc = seed[2:4]
        incHi = (seed[2] << 1) | (seed[3] >>> 63);
        incLo = (seed[3] << 1) | 1L;
        stateHi = 0; stateLo = 0;
        step();
        long lo = stateLo + seed[1];
        stateHi += seed[0] + (Long.compareUnsigned(lo, stateLo) < 0 ? 1 : 0);
        stateLo = lo;
        step();
    }

    /** default_rng(seed) for a seed >= 0 (numpy refuses negative seeds). */
    public static NumpyGenerator fromSeed(BigInteger seed) {
        if (seed.signum() < 0) throw new IllegalArgumentException("seed must be >= 0, got " + seed);
        int words = Math.max(1, (seed.bitLength() + 31) / 32);
        int[] entropy = new int[words];
        for (int k = 0; k < words; k++) entropy[k] = seed.shiftRight(32 * k).intValue();
        int[] pool = mixEntropy(entropy);
        int[] state = new int[8];                    // generate_state(4, uint64): 8 uint32 words
        int hashConst = INIT_B;
        for (int k = 0; k < state.length; k++) {
            int v = pool[k % POOL_SIZE] ^ hashConst;
            hashConst *= MULT_B;
            v *= hashConst;
            state[k] = v ^ (v >>> 16);
        }
        long[] seed64 = new long[4];                 // little-endian view: word 2k is the low half
        for (int k = 0; k < 4; k++) seed64[k] = (state[2 * k] & 0xffffffffL) | ((long) state[2 * k + 1] << 32);
        return new NumpyGenerator(seed64);
    }

    public static NumpyGenerator fromSeed(long seed) { return fromSeed(BigInteger.valueOf(seed)); }

    /** permutation(n): the integers 0..n-1, shuffled. */
    public int[] permutation(int n) {
        int[] out = new int[n];
        for (int k = 0; k < n; k++) out[k] = k;
        for (int i = n - 1; i >= 1; i--) {
            int j = (int) randomInterval(i);
            int t = out[i]; out[i] = out[j]; out[j] = t;
        }
        return out;
    }

    /** random_interval(max): uniform in [0, max] by rejection on the smallest covering bit mask. */
    long randomInterval(long max) {
        if (max == 0) return 0;
        long mask = max;
        for (int s = 1; s <= 32; s <<= 1) mask |= mask >>> s;
        long v;
        if (max <= 0xffffffffL) {
            do { v = nextUint32() & mask; } while (v > max);
        } else {
            do { v = nextUint64() & mask; } while (Long.compareUnsigned(v, max) > 0);
        }
        return v;
    }

    long nextUint32() {
        if (hasHalf) { hasHalf = false; return half & 0xffffffffL; }
        long next = nextUint64();
        hasHalf = true;
        half = (int) (next >>> 32);
        return next & 0xffffffffL;
    }

    long nextUint64() {
        step();
        return Long.rotateRight(stateHi ^ stateLo, (int) (stateHi >>> 58));
    }

    private void step() {                            // state = state * MULT + inc (mod 2^128)
        long lo = stateLo * MULT_LO;
        long hi = unsignedMultiplyHigh(stateLo, MULT_LO) + stateLo * MULT_HI + stateHi * MULT_LO;
        long sumLo = lo + incLo;
        stateHi = hi + incHi + (Long.compareUnsigned(sumLo, lo) < 0 ? 1 : 0);
        stateLo = sumLo;
    }

    private static long unsignedMultiplyHigh(long x, long y) {
        return Math.multiplyHigh(x, y) + ((x >> 63) & y) + ((y >> 63) & x);
    }

    private static int hashmix(int value, int[] hashConst) {
        value ^= hashConst[0];
        hashConst[0] *= MULT_A;
        value *= hashConst[0];
        return value ^ (value >>> 16);
    }

    private static int mix(int x, int y) {
        int r = MIX_MULT_L * x - MIX_MULT_R * y;
        return r ^ (r >>> 16);
    }

    private static int[] mixEntropy(int[] entropy) {
        int[] mixer = new int[POOL_SIZE];
        int[] hashConst = {INIT_A};
        for (int i = 0; i < POOL_SIZE; i++) mixer[i] = hashmix(i < entropy.length ? entropy[i] : 0, hashConst);
        for (int src = 0; src < POOL_SIZE; src++)
            for (int dst = 0; dst < POOL_SIZE; dst++)
                if (src != dst) mixer[dst] = mix(mixer[dst], hashmix(mixer[src], hashConst));
        for (int src = POOL_SIZE; src < entropy.length; src++)
            for (int dst = 0; dst < POOL_SIZE; dst++) mixer[dst] = mix(mixer[dst], hashmix(entropy[src], hashConst));
        return mixer;
    }
}
