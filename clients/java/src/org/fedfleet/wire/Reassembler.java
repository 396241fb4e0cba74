// Chunk reassembly (docs/protocol.md "Chunking"): per (sender, parent), repeated chunks are
// ignored, chunks contradicting the first one seen are refused, size and digest are verified,
// partial messages expire after a time-to-live. add() returns the whole message's bytes once
// complete (already decoded and checked against the chunks' sender and parent), else null.
// The limits and what is refused or dropped are protocols/chunking.py's Reassembler, so a Java
// and a Python device take the same decision on the same chunks.
package org.fedfleet.wire;

import java.math.BigInteger;
import java.util.*;
import java.util.regex.Pattern;

public final class Reassembler {
    public static final int MAX_CHUNKS = 4096;
    public static final int DEFAULT_MAX_PENDING_PER_SENDER = 4;
    public static final long DEFAULT_MAX_PENDING_BYTES = 1024L * 1024 * 1024;
    /** Completed / refused parents remembered per sender (the latest). */
    public static final int RECENT_PER_SENDER = 16;
    private static final Pattern MESSAGE_ID = Pattern.compile("[0-9a-f]{32}");   // what a parent names
    private static final Pattern DIGEST = Pattern.compile("[0-9a-f]{64}");       // the whole message's sha256

    private static final class Partial {
        final long count, total;
        final String sha256;
        final double firstSeen;
        double lastSeen;             // when its latest chunk came: the least recent goes first for room
        final Map<Long, byte[]> parts = new HashMap<>();
        long held;
        Partial(long count, long total, String sha256, double firstSeen) {
            this.count = count; this.total = total; this.sha256 = sha256; this.firstSeen = firstSeen; this.lastSeen = firstSeen;
        }
    }

    private final double ttlSeconds;
    private final long maxMessageBytes, maxPendingBytes, maxPendingBytesPerSender;
    private final int maxPendingPerSender;
    private final Map<List<String>, Partial> partials = new HashMap<>();
    private final Map<String, List<List<String>>> perSender = new HashMap<>();   // its partials' keys, oldest first
    private final Map<String, Long> heldBy = new HashMap<>();                    // bytes a sender's partials hold
    private long held;                                                           // bytes held over all partials
    // sender -> {parent: when}, the latest RECENT_PER_SENDER each, forgotten after the TTL (a sender
    // sending message after message would otherwise grow them outside every budget). Recently
    // completed: a partial of one is a resend, the first dropped when its sender needs room.
    private final Map<String, LinkedHashMap<String, Double>> done = new HashMap<>();
    // Dropped because the buffer was full: their later chunks are refused unheld (held, they could
    // never complete and would keep the buffer full for every other sender until the TTL).
    private final Map<String, LinkedHashMap<String, Double>> refused = new HashMap<>();

    public Reassembler(double ttlSeconds) {
        this(ttlSeconds, Envelope.MAX_MESSAGE_BYTES, DEFAULT_MAX_PENDING_PER_SENDER, DEFAULT_MAX_PENDING_BYTES);
    }

    /** At most maxPendingPerSender partial messages of each sender, each at most maxMessageBytes long. */
    public Reassembler(double ttlSeconds, int maxPendingPerSender, long maxMessageBytes) {
        this(ttlSeconds, maxMessageBytes, maxPendingPerSender, DEFAULT_MAX_PENDING_BYTES);
    }

    /** One sender may hold at most one largest message's worth and never half of maxPendingBytes,
     *  the bound over all senders: one sender can never fill the buffer for everyone. */
    public Reassembler(double ttlSeconds, long maxMessageBytes, int maxPendingPerSender, long maxPendingBytes) {
        this.ttlSeconds = ttlSeconds;
        this.maxMessageBytes = Math.min(maxMessageBytes, Envelope.MAX_MESSAGE_BYTES);
        this.maxPendingPerSender = maxPendingPerSender;
        this.maxPendingBytes = maxPendingBytes;
        this.maxPendingBytesPerSender = Math.min(this.maxMessageBytes, maxPendingBytes / 2);
    }

    public byte[] add(Envelope.Message chunk, double now) throws Envelope.EnvelopeError {
        if (!"chunk".equals(chunk.type())) throw new Envelope.EnvelopeError("expected a chunk, got " + chunk.type());
        Map<String, Object> b = chunk.body();
        String parent = text(b, "parent");
        if (!MESSAGE_ID.matcher(parent).matches())    // refused before anything is held under it
            throw new Envelope.EnvelopeError("a chunk's parent must be its message's id (32 lowercase hex digits)");
        String digest = text(b, "sha256");
        if (!DIGEST.matcher(digest).matches())        // refused at once, as by the Python receivers (which skip the digest itself)
            throw new Envelope.EnvelopeError("a chunk's sha256 must be the whole message's digest (64 lowercase hex digits)");
        long index = integer(b, "index"), count = integer(b, "count"), total = integer(b, "total");
        if (chunk.tensors.size() != 1 || !chunk.tensors.get(0).name.equals("data")
                || !chunk.tensors.get(0).dtype.equals("uint8") || chunk.tensors.get(0).shape.length != 1)
            throw new Envelope.EnvelopeError("a chunk carries exactly one 1-D uint8 tensor 'data'");
        byte[] data = chunk.tensors.get(0).data;
        String sender = chunk.sender();
        List<String> key = Arrays.asList(sender, parent);
        if (count < 1 || count > MAX_CHUNKS || index < 0 || index >= count)
            throw new Envelope.EnvelopeError("chunk index " + index + " / count " + count + " out of range");
        if (total <= 0 || total > maxMessageBytes)
            throw new Envelope.EnvelopeError("chunked message total " + total + " out of range");
        if (recalls(refused, key)) {
            if (index != 0)
                throw new Envelope.EnvelopeError("chunk " + index + " of " + parent + ": the message was dropped (reassembly buffer full)");
            refused.get(sender).remove(parent);        // the sender resends it from the start: a fresh try
        }
        Partial p = partials.get(key);
        if (p == null) {
            makeRoom(sender);
            partials.put(key, p = new Partial(count, total, digest, now));
            perSender.computeIfAbsent(sender, s -> new ArrayList<>()).add(key);
        }
        else if (p.count != count || p.total != total || !p.sha256.equals(digest))
            throw new Envelope.EnvelopeError("chunk " + index + " of " + parent + " contradicts the first chunk seen (count/total/sha256)");
        if (p.parts.containsKey(index)) return null;   // a redelivery
        if (p.held + data.length > total) {
            drop(key);
            throw new Envelope.EnvelopeError("chunks of " + parent + " exceed the announced total " + total);
        }
        if (heldBy.getOrDefault(sender, 0L) + data.length > maxPendingBytesPerSender) {
            drop(key);
            throw new Envelope.EnvelopeError("sender '" + sender + "' exceeds its reassembly budget ("
                    + maxPendingBytesPerSender + " bytes)");
        }
        if (held + data.length > maxPendingBytes) {
            drop(key);
            remember(refused, key, now);
            throw new Envelope.EnvelopeError("reassembly buffer full: message " + parent + " dropped");
        }
        p.parts.put(index, data);
        p.held += data.length;
        p.lastSeen = now;
        held += data.length;
        heldBy.merge(sender, (long) data.length, Long::sum);
        if (p.parts.size() < count) return null;
        drop(key);
        byte[] whole = new byte[(int) p.held];
        int at = 0;
        for (long k = 0; k < count; k++) {
            byte[] part = p.parts.get(k);
            System.arraycopy(part, 0, whole, at, part.length);
            at += part.length;
        }
        if (whole.length != total || !Envelope.hex(Envelope.sha256(whole)).equals(digest))
            throw new Envelope.EnvelopeError("reassembled message " + parent + " fails its size/sha256 check");
        // remembered, not blocked: a resend under the same parent is reassembled and returned again,
        // so the receiver answers it as it did the first copy (docs/protocol.md "Chunking")
        remember(done, key, now);
        Envelope.Message inner = Envelope.decode(whole);
        if (!inner.sender().equals(sender) || !inner.header.get("id").equals(parent))
            throw new Envelope.EnvelopeError("reassembled message's sender/id do not match its chunks");
        return whole;
    }

    /** Room for one more partial message of sender, at its limit: its oldest resend of an already
     *  reassembled message goes, else its partial that received a chunk least recently (the oldest of
     *  those tied), as protocols/chunking.py's _make_room: refusing the new message let replayed first
     *  chunks of earlier messages keep every chunked task out until the TTL. */
    private void makeRoom(String sender) {
        List<List<String>> pending = perSender.getOrDefault(sender, Collections.<List<String>>emptyList());
        if (pending.size() < maxPendingPerSender) return;
        for (List<String> k : pending)                 // oldest first
            if (recalls(done, k)) { drop(k); return; }
        List<String> stalest = pending.get(0);
        for (List<String> k : pending)
            if (partials.get(k).lastSeen < partials.get(stalest).lastSeen) stalest = k;
        drop(stalest);
    }

    private void drop(List<String> key) {
        Partial p = partials.remove(key);
        held -= p.held;
        String sender = key.get(0);
        long left = heldBy.remove(sender) - p.held;
        if (left > 0) heldBy.put(sender, left);
        List<List<String>> keys = perSender.get(sender);
        keys.remove(key);
        if (keys.isEmpty()) perSender.remove(sender);
    }

    /** Bytes held by partial messages now. */
    public long pendingBytes() { return held; }

    /** Forget partial messages first seen more than the TTL ago, and completed or refused parents
     *  noted more than the TTL ago; returns how many partial messages were dropped. */
    public int expire(double now) {
        List<List<String>> stale = new ArrayList<>();
        for (Map.Entry<List<String>, Partial> e : partials.entrySet())
            if (now - e.getValue().firstSeen > ttlSeconds) stale.add(e.getKey());
        for (List<String> k : stale) drop(k);
        for (Map<String, LinkedHashMap<String, Double>> table : Arrays.asList(done, refused))
            for (Iterator<LinkedHashMap<String, Double>> it = table.values().iterator(); it.hasNext(); ) {
                LinkedHashMap<String, Double> recent = it.next();
                recent.values().removeIf(t -> now - t > ttlSeconds);
                if (recent.isEmpty()) it.remove();
            }
        return stale.size();
    }

    /** Note (sender, parent) at now, keeping only the sender's latest RECENT_PER_SENDER. */
    private static void remember(Map<String, LinkedHashMap<String, Double>> table, List<String> key, double now) {
        LinkedHashMap<String, Double> recent = table.computeIfAbsent(key.get(0), s -> new LinkedHashMap<>());
        recent.remove(key.get(1));
        recent.put(key.get(1), now);
        while (recent.size() > RECENT_PER_SENDER) recent.remove(recent.keySet().iterator().next());
    }

    private static boolean recalls(Map<String, LinkedHashMap<String, Double>> table, List<String> key) {
        Map<String, Double> recent = table.get(key.get(0));
        return recent != null && recent.containsKey(key.get(1));
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
