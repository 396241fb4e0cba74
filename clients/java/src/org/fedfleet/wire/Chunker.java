// The sender's side of docs/protocol.md "Chunking": a message longer than the chunk size travels
// as ceil(length / size) `chunk` envelopes, slice i = bytes [i*size, min((i+1)*size, length)).
// Reassembler is the receiver's side.
package org.fedfleet.wire;

import java.math.BigInteger;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

public final class Chunker {
    public static final int DEFAULT_CHUNK_SIZE = 256 * 1024;

    /** Where a chunk's id and timestamp come from: random and now on a device, fixed in the golden vectors. */
    public interface Stamps {
        String id(int index);
        double ts();
    }

    private final int chunkSize;
    private final Envelope.Signer signer;

    public Chunker(int chunkSize, Envelope.Signer signer) {
        if (chunkSize <= 0) throw new IllegalArgumentException("chunk size must be positive");
        this.chunkSize = chunkSize;
        this.signer = signer;
    }

    /** The encoded chunk envelopes of {@code whole} (already encoded and signed), or [whole] when it fits. */
    public List<byte[]> split(byte[] whole, String parentId, String sender, Stamps stamps) throws Envelope.EnvelopeError {
        if (whole.length <= chunkSize) return Collections.singletonList(whole);
        long count = (whole.length + (long) chunkSize - 1) / chunkSize;
        if (count > Reassembler.MAX_CHUNKS)
            throw new Envelope.EnvelopeError("message of " + whole.length + " bytes needs " + count + " chunks > "
                    + Reassembler.MAX_CHUNKS + "; raise the chunk size");
        String digest = Envelope.hex(Envelope.sha256(whole));
        List<byte[]> out = new ArrayList<>();
        for (int i = 0; i < count; i++) {
            Map<String, Object> body = new LinkedHashMap<>();
            body.put("parent", parentId);
            body.put("index", BigInteger.valueOf(i));
            body.put("count", BigInteger.valueOf(count));
            body.put("total", BigInteger.valueOf(whole.length));
            body.put("sha256", digest);
            Map<String, Object> h = new LinkedHashMap<>();
            h.put("v", BigInteger.ONE);
            h.put("type", "chunk");
            h.put("id", stamps.id(i));
            h.put("sender", sender);
            h.put("ts", stamps.ts());
            h.put("body", body);
            byte[] slice = Arrays.copyOfRange(whole, i * chunkSize, (int) Math.min((long) (i + 1) * chunkSize, whole.length));
            out.add(Envelope.encode(h, Collections.singletonList(Tensors.uint8("data", slice)), signer));
        }
        return out;
    }
}
