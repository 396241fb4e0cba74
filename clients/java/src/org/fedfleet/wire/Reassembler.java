// Chunk reassembly (docs/protocol.md "Chunking"): per (sender, parent), repeated chunks are
// ignored, chunks contradicting the first one seen are refused, size and digest are verified,
// partial messages expire after a time-to-live. add() returns the whole message's bytes once
// complete (already decoded and checked against the chunks' sender and parent), else null.
package org.fedfleet.wire;

import java.math.BigInteger;
import java.util.*;

public final class Reassembler {
    public static final int MAX_CHUNKS = 4096;

    private static final class Partial {
        final long count, total;
        final String sha256;
        final double firstSeen;
        final Map<Long, byte[]> parts = new HashMap<>();
        long held;
        Partial(long count, long total, String sha256, double firstSeen) {
            this.count = count; this.total = total; this.sha256 = sha256; this.firstSeen = firstSeen;
        }
    }

    private final double ttlSeconds;
    private final int maxPendingPerSender;
    private final long maxTotalBytes;
    private final Map<List<String>, Partial> partials = new HashMap<>();
    private final Set<List<String>> done = new HashSet<>();

    public Reassembler(double ttlSeconds) { this(ttlSeconds, 16, Envelope.MAX_MESSAGE_BYTES); }

    /** At most maxPendingPerSender partial messages per sender (the oldest is dropped for a new
     *  one), each at most maxTotalBytes long: what one sender can make a receiver hold is bounded. */
    public Reassembler(double ttlSeconds, int maxPendingPerSender, long maxTotalBytes) {
        this.ttlSeconds = ttlSeconds; this.maxPendingPerSender = maxPendingPerSender; this.maxTotalBytes = maxTotalBytes;
    }

    public byte[] add(Envelope.Message chunk, double now) throws Envelope.EnvelopeError {
        if (!"chunk".equals(chunk.type())) throw new Envelope.EnvelopeError("expected a chunk, got " + chunk.type());
        Map<String, Object> b = chunk.body();
        String parent = text(b, "parent"), digest = text(b, "sha256");
        long index = integer(b, "index"), count = integer(b, "count"), total = integer(b, "total");
        if (chunk.tensors.size() != 1 || !chunk.tensors.get(0).name.equals("data")
                || !chunk.tensors.get(0).dtype.equals("uint8") || chunk.tensors.get(0).shape.length != 1)
            throw new Envelope.EnvelopeError("a chunk carries exactly one 1-D uint8 tensor 'data'");
        byte[] data = chunk.tensors.get(0).data;
        List<String> key = Arrays.asList(chunk.sender(), parent);
        if (done.contains(key)) return null;
        if (count < 1 || count > MAX_CHUNKS || index < 0 || index >= count)
            throw new Envelope.EnvelopeError("chunk index " + index + " / count " + count + " out of range");
        if (total <= 0 || total > Math.min(maxTotalBytes, Envelope.MAX_MESSAGE_BYTES))
            throw new Envelope.EnvelopeError("chunked message total " + total + " out of range");
        Partial p = partials.get(key);
        if (p == null) {
            makeRoom(chunk.sender());
            partials.put(key, p = new Partial(count, total, digest, now));
        }
        else if (p.count != count || p.total != total || !p.sha256.equals(digest))
            throw new Envelope.EnvelopeError("chunk " + index + " of " + parent + " contradicts the first chunk seen (count/total/sha256)");
        if (p.parts.containsKey(index)) return null;
        if (p.held + data.length > total) {
            partials.remove(key);
            throw new Envelope.EnvelopeError("chunks of " + parent + " exceed the announced total " + total);
        }
        p.parts.put(index, data);
        p.held += data.length;
        if (p.parts.size() < count) return null;
        partials.remove(key);
        byte[] whole = new byte[(int) p.held];
        int at = 0;
        for (long k = 0; k < count; k++) {
            byte[] part = p.parts.get(k);
            System.arraycopy(part, 0, whole, at, part.length);
            at += part.length;
        }
        if (whole.length != total || !Envelope.hex(Envelope.sha256(whole)).equals(digest))
            throw new Envelope.EnvelopeError("reassembled message " + parent + " fails its size/sha256 check");
        done.add(key);
        Envelope.Message inner = Envelope.decode(whole);
        if (!inner.sender().equals(chunk.sender()) || !inner.header.get("id").equals(parent))
            throw new Envelope.EnvelopeError("reassembled message's sender/id do not match its chunks");
        return whole;
    }

    private void makeRoom(String sender) {
        List<String> oldest = null;
        int pending = 0;
        for (Map.Entry<List<String>, Partial> e : partials.entrySet()) {
            if (!e.getKey().get(0).equals(sender)) continue;
            pending++;
            if (oldest == null || e.getValue().firstSeen < partials.get(oldest).firstSeen) oldest = e.getKey();
        }
        if (pending >= maxPendingPerSender) partials.remove(oldest);
    }

    /** Forget partial messages first seen more than the TTL ago; returns how many were dropped. */
    public int expire(double now) {
        int before = partials.size();
        partials.values().removeIf(p -> now - p.firstSeen > ttlSeconds);
        return before - partials.size();
    }

    private static String text(Map<String, Object> b, String k) throws Envelope.EnvelopeError {
        if (!(b.get(k) instanceof String)) throw new Envelope.EnvelopeError("chunk body field '" + k + "' must be a string");
        return (String) b.get(k);
    }

    private static long integer(Map<String, Object> b, String k) throws Envelope.EnvelopeError {
        if (!(b.get(k) instanceof BigInteger) || ((BigInteger) b.get(k)).bitLength() > 62)
            throw new Envelope.EnvelopeError("chunk body field '" + k + "' must be an integer");
        return ((BigInteger) b.get(k)).longValue();
    }
}
