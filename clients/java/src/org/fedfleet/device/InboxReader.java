// What a device takes from the aggregator (its inbox, its deployment topics): each payload decoded
// and, with the aggregator's key, verified; chunks reassembled (docs/protocol.md "Chunking"); only
// the aggregator's messages handed out. A chunk claiming any other sender is refused before it is
// held, as the whole message would be: held, it took one of the aggregator's partial-message slots
// and bytes until the TTL (a signature under the aggregator's key does not name the sender).
package org.fedfleet.device;

import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Envelope.EnvelopeError;
import org.fedfleet.wire.Reassembler;

public final class InboxReader {
    /** A whole message from the aggregator: decoded, and its encoded bytes (a chunked one's joined). */
    public static final class Whole {
        public final Envelope.Message message;
        public final byte[] bytes;
        Whole(Envelope.Message message, byte[] bytes) { this.message = message; this.bytes = bytes; }
    }

    private final byte[] aggregatorKey;
    private final long maxMessageBytes;
    private final Reassembler reassembler;

    /** aggregatorKey: raw Ed25519 key, or null (development: nothing verified). */
    public InboxReader(byte[] aggregatorKey, long maxMessageBytes, Reassembler reassembler) {
        this.aggregatorKey = aggregatorKey; this.maxMessageBytes = maxMessageBytes; this.reassembler = reassembler;
    }

    /** The whole message, or null while a chunked one is incomplete; EnvelopeError for anything refused. */
    public Whole receive(byte[] payload, double now) throws EnvelopeError {
        Envelope.Message env = Envelope.decode(payload, aggregatorKey, maxMessageBytes);
        byte[] whole = payload;
        if ("chunk".equals(env.type())) {
            requireAggregator(env);
            whole = reassembler.add(env, now);
            if (whole == null) return null;
            env = Envelope.decode(whole, aggregatorKey, maxMessageBytes);
        }
        requireAggregator(env);
        return new Whole(env, whole);
    }

    /** Partial messages past the reassembler's TTL go (an aggregator that stopped mid-send, or forged
     *  first chunks, would otherwise hold its slots and refuse its later messages for ever). */
    public int expire(double now) { return reassembler.expire(now); }

    private static void requireAggregator(Envelope.Message env) throws EnvelopeError {
        if (!Topics.AGGREGATOR_ID.equals(env.sender()))
            throw new EnvelopeError("message from '" + env.sender() + "', expected the aggregator");
    }
}
