// The signed configuration of one secure round (protocols/secagg/config.py), as a device checks
// it on RoundStart before generating any key: the group, thresholds, fixed-point scale and bound,
// vector length and neighbour graph, and the ring Z_{2^r} (the optional "ring_bits": 32 or 64,
// absent meaning 64). Also the member bitmaps and the SecAgg+ graph.
package org.fedfleet.secagg;

import java.math.BigDecimal;
import java.math.BigInteger;
import java.math.RoundingMode;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.HashMap;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.TreeSet;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Json;

public final class RoundConfig {
    static final int MAX_VECTOR_LENGTH = 1 << 27, MIN_GROUP_SIZE = 3;
    /** The most members a group may have (protocols/secagg/config.py MAX_GROUP_SIZE: no aggregator
     *  sends more); a larger group is refused before its list is read, with Python's words. */
    static final int MAX_GROUP_SIZE = 10_000;
    /** The most mask words a round may ask a member to expand, (its pairwise masks, one per graph
     *  neighbour, + its self mask) x vector_length, each word AES-CTR keystream worked out outside
     *  any task's deadline (protocols/secagg/config.py MAX_MASK_WORDS: the same value, the same rule
     *  and words). A config past it is refused when RoundStart is read, before any key or mask. */
    static final long MAX_MASK_WORDS = 1L << 29;
    private static final Set<String> KEYS = new HashSet<>(Arrays.asList("job_id", "round_id", "group_id",
            "aggregator_id", "members", "vector_length", "threshold", "scale_bits", "bound", "graph", "degree",
            "share_threshold", "graph_seed", "consistency_check"));
    /** The one optional key: absent for the default 64-bit ring (the server writes it only for 32). */
    private static final String RING_BITS = "ring_bits";

    public final String jobId, groupId, aggregatorId, graph;
    public final long roundId;
    public final List<String> members;
    public final int vectorLength, threshold, scaleBits, degree, shareThreshold;
    /** r: the round sums in Z_{2^r}, 32 or 64. */
    public final int ringBits;
    public final double bound;
    public final byte[] graphSeed;
    public final boolean consistencyCheck;
    private final Map<String, Integer> index = new HashMap<>();

    @SuppressWarnings("unchecked")
    public static RoundConfig fromMap(Object value) throws SecAggException {
        if (!(value instanceof Map)) throw new SecAggException("round config must be a JSON object");
        Set<String> keys = new HashSet<>(((Map<String, Object>) value).keySet());
        keys.remove(RING_BITS);
        if (!keys.equals(KEYS))
            throw new SecAggException("round config must have exactly the keys " + new TreeSet<>(KEYS) + " and optionally " + RING_BITS);
        return new RoundConfig((Map<String, Object>) value);
    }

    @SuppressWarnings("unchecked")
    private RoundConfig(Map<String, Object> m) throws SecAggException {
        jobId = id(m, "job_id"); groupId = id(m, "group_id"); aggregatorId = id(m, "aggregator_id");
        roundId = integer(m, "round_id", 0, Long.MAX_VALUE);
        if (!(m.get("members") instanceof List)) throw new SecAggException("members must be a list");
        int listed = ((List<Object>) m.get("members")).size();
        if (listed > MAX_GROUP_SIZE)
            throw new SecAggException("a group has at most " + MAX_GROUP_SIZE + " members, got " + listed);
        List<String> ms = new ArrayList<>();
        for (Object o : (List<Object>) m.get("members")) {
            if (!(o instanceof String) || ((String) o).isEmpty() || Json.characters((String) o) > 256)
                throw new SecAggException("member ids must be non-empty strings");
            ms.add((String) o);
        }
        members = Collections.unmodifiableList(ms);
        int n = ms.size();
        for (int i = 0; i < n; i++) {
            if (i > 0 && Json.CODE_POINT_ORDER.compare(ms.get(i - 1), ms.get(i)) >= 0)
                throw new SecAggException("members must be sorted and unique");
            index.put(ms.get(i), i);
        }
        if (n < MIN_GROUP_SIZE) throw new SecAggException("a group needs at least " + MIN_GROUP_SIZE + " members, got " + n);
        if (index.containsKey(aggregatorId)) throw new SecAggException("the aggregator cannot be a member of the group");
        vectorLength = (int) integer(m, "vector_length", 1, MAX_VECTOR_LENGTH);
        threshold = (int) integer(m, "threshold", 2, n);
        if (2 * threshold <= n) throw new SecAggException("threshold " + threshold + " must be a strict majority of " + n + " members");
        ringBits = m.containsKey(RING_BITS) ? ringBits(m.get(RING_BITS)) : RingVector.BITS_64;
        scaleBits = (int) integer(m, "scale_bits", 0, ringBits - 2);
        Object b = m.get("bound");
        // one config, one JSON form (protocols/secagg/config.py): the bound a float, the seed lower-case hex
        if (!(b instanceof Double)) throw new SecAggException("bound must be a JSON number with a fraction or exponent (a float)");
        bound = ((Number) b).doubleValue();
        if (!(bound > 0) || Double.isInfinite(bound)) throw new SecAggException("bound must be a positive finite number");
        checkCapacity(n);
        if (!(m.get("consistency_check") instanceof Boolean)) throw new SecAggException("consistency_check must be a bool");
        consistencyCheck = (Boolean) m.get("consistency_check");
        Object seed = m.get("graph_seed");
        if (!(seed instanceof String) || !((String) seed).matches("[0-9a-f]{64}")) throw new SecAggException("graph_seed must be 32 bytes of lower-case hex");
        graphSeed = Envelope.unhex((String) seed);
        if (!(m.get("graph") instanceof String)) throw new SecAggException("graph must be a string");
        graph = (String) m.get("graph");
        degree = (int) integer(m, "degree", 0, MAX_VECTOR_LENGTH);
        shareThreshold = (int) integer(m, "share_threshold", 0, MAX_VECTOR_LENGTH);
        if (graph.equals("complete")) {
            if (degree != n - 1 || shareThreshold != threshold)
                throw new SecAggException("complete graph: degree must be n-1 and share_threshold == threshold");
        } else if (graph.equals("regular")) {
            if (degree < 2 || degree % 2 != 0) throw new SecAggException("graph degree must be even and >= 2, got " + degree);
            int holders = Math.min(degree, n - 1) + 1;
            if (shareThreshold < 1 || shareThreshold > Math.min(holders, threshold) || 2 * shareThreshold <= holders)
                throw new SecAggException("share_threshold " + shareThreshold + " must be a strict majority of the " + holders + " share holders, at most t");
        } else {
            throw new SecAggException("graph must be 'complete' or 'regular', got " + graph);
        }
        // a degree past the group is the complete graph: n - 1 pairwise masks at most, + the self mask.
        // Written whole: at most 10,000 masks of 2^27 words (n and vectorLength are checked above), which
        // Python writes whole too (config.py WHOLE_DIGITS; only a caller's own larger count is abbreviated)
        long masks = Math.min(degree, n - 1) + 1L, words = masks * vectorLength;
        if (words > MAX_MASK_WORDS)
            throw new SecAggException("the round asks each member to expand " + masks + " masks of " + vectorLength
                    + " words (" + words + " words), more than a device expands (" + MAX_MASK_WORDS + ")");
    }

    /** The key's value: only 32 is ever written (absent means 64), so one config has one JSON form,
     *  the one the server signed and every client re-reads alike. */
    private static int ringBits(Object v) throws SecAggException {
        if (v instanceof BigInteger && v.equals(BigInteger.valueOf(RingVector.BITS_64)))
            throw new SecAggException("ring_bits is written only for a 32-bit ring (absent means 64)");
        if (!(v instanceof BigInteger) || !v.equals(BigInteger.valueOf(RingVector.BITS_32)))
            throw new SecAggException("ring_bits must be the integer 32 or 64, got " + v);
        return RingVector.BITS_32;
    }

    /** n · floor(B·2^f + 1/2) < 2^(r-1) and n · B · 2^f < 2^(r-1): no sum of admissible inputs
     *  wraps (and, as n >= 1, every encoded value fits in a signed r-bit word). */
    private void checkCapacity(int n) throws SecAggException {
        BigInteger halfRing = BigInteger.ONE.shiftLeft(ringBits - 1);
        BigDecimal scaled = new BigDecimal(bound).multiply(new BigDecimal(BigInteger.ONE.shiftLeft(scaleBits)));
        BigInteger q = scaled.add(new BigDecimal("0.5")).setScale(0, RoundingMode.FLOOR).toBigIntegerExact();
        BigDecimal nn = new BigDecimal(n);
        if (q.compareTo(halfRing) >= 0 || nn.multiply(new BigDecimal(q)).compareTo(new BigDecimal(halfRing)) >= 0
                || nn.multiply(scaled).compareTo(new BigDecimal(halfRing)) >= 0)
            throw new SecAggException("n * B * 2^f >= 2^" + (ringBits - 1) + ": the sum could overflow the " + ringBits + "-bit ring");
    }

    public boolean isMember(String device) { return index.containsKey(device); }

    /** The member's Shamir x: its 1-based position in the sorted member list. */
    public long holderX(String member) { return index.get(member) + 1; }

    /** Members whose bit is set (numpy packbits order: the first member is the top bit of byte 0). */
    public List<String> fromBitmap(byte[] bitmap) throws SecAggException {
        int n = members.size();
        if (bitmap.length != (n + 7) / 8) throw new SecAggException("member bitmap must be " + (n + 7) / 8 + " bytes");
        List<String> out = new ArrayList<>();
        for (int i = 0; i < 8 * bitmap.length; i++) {
            boolean set = (bitmap[i / 8] >> (7 - i % 8) & 1) != 0;
            if (set && i >= n) throw new SecAggException("member bitmap has bits set past the last member");
            if (set) out.add(members.get(i));
        }
        return out;
    }

    /** The device's neighbours in the graph over the participants U1 (complete, or the SecAgg+ Harary graph). */
    public Set<String> neighbours(List<String> participants, String device) {
        List<String> ordered = new ArrayList<>(participants);
        ordered.sort(Json.CODE_POINT_ORDER);
        int n = ordered.size();
        Set<String> out = new HashSet<>();
        if (graph.equals("complete") || degree >= n - 1) {
            out.addAll(ordered);
            out.remove(device);
            return out;
        }
        List<String> ring = ring(ordered);
        int position = ring.indexOf(device), half = degree / 2;
        for (int offset = -half; offset <= half; offset++)
            if (offset != 0) out.add(ring.get(Math.floorMod(position + offset, n)));
        return out;
    }

    /** The SecAgg+ ring: Fisher-Yates over the sorted participants, driven by the PRG of
     *  SHA-256(domain || seed || U1 joined by NUL). */
    private List<String> ring(List<String> ordered) {
        int n = ordered.size();
        List<String> ring = new ArrayList<>(ordered);
        byte[] digest = Crypto.sha256("fedfleet/secagg/graph/v1".getBytes(StandardCharsets.US_ASCII), graphSeed,
                String.join("\0", ordered).getBytes(StandardCharsets.UTF_8));
        long[] words = new long[n];
        Crypto.addMask(words, digest, 1);
        for (int i = n - 1; i > 0; i--) {
            int j = (int) Long.remainderUnsigned(words[i], i + 1);
            Collections.swap(ring, i, j);
        }
        return ring;
    }

    /** Whether the survivors' induced subgraph of the graph over the participants is connected
     *  (protocols/secagg/graph.py connects): on the ring, at most one run of >= k/2 removed positions. */
    public boolean connects(List<String> participants, Set<String> survivors) {
        List<String> ordered = new ArrayList<>(participants);
        ordered.sort(Json.CODE_POINT_ORDER);
        int n = ordered.size();
        if (survivors.isEmpty()) return false;
        if (graph.equals("complete") || degree >= n - 1) return true;
        List<String> ring = ring(ordered);
        int start = 0;
        while (!survivors.contains(ring.get(start))) start++;
        int longRuns = 0, run = 0, half = degree / 2;
        for (int step = 1; step <= n; step++) {
            if (survivors.contains(ring.get((start + step) % n))) {
                if (run >= half) longRuns++;
                run = 0;
            } else {
                run++;
            }
        }
        return longRuns <= 1;
    }

    /** q = rint(x · 2^f) as the ring's r-bit word with the same bits; values outside ±bound or
     *  non-finite are refused. */
    public RingVector encode(double[] x) throws SecAggException {
        if (x.length != vectorLength) throw new SecAggException("input length " + x.length + " != " + vectorLength);
        RingVector out = RingVector.zeros(ringBits, x.length);
        double scale = Math.scalb(1.0, scaleBits);
        for (int i = 0; i < x.length; i++) {
            if (!(x[i] >= -bound && x[i] <= bound))
                throw new SecAggException("input value " + x[i] + " at " + i + " is non-finite or outside the bound ±" + bound);
            out.set(i, (long) Math.rint(x[i] * scale));     // |q| <= Q < 2^(r-1) (checkCapacity)
        }
        return out;
    }

    private static String id(Map<String, Object> m, String key) throws SecAggException {
        Object v = m.get(key);
        if (!(v instanceof String) || ((String) v).isEmpty() || Json.characters((String) v) > 256)
            throw new SecAggException(key + " must be a non-empty string (<= 256 chars)");
        return (String) v;
    }

    private static long integer(Map<String, Object> m, String key, long low, long high) throws SecAggException {
        Object v = m.get(key);
        if (!(v instanceof BigInteger) || ((BigInteger) v).compareTo(BigInteger.valueOf(low)) < 0
                || ((BigInteger) v).compareTo(BigInteger.valueOf(high)) > 0)
            throw new SecAggException(key + " must be an integer in " + low + ".." + high + ", got " + v);
        return ((BigInteger) v).longValue();
    }
}
