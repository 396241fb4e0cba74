// A device's outgoing message as the MQTT payloads that carry it (protocols/chunking.py encode_parts):
// the encoded envelope itself, or its chunks above the chunk size (fresh chunk ids, the message's id
// as their parent), each signed. An EnvelopeError says the message cannot be sent at all (a header
// or message over the envelope's limits, more chunks than a reassembler takes): found here, before
// any part is published. A SecAgg reply that cannot be sent ends its round (SecAggSessions.onMessage).
package org.fedfleet.device;

import java.util.List;
import java.util.Map;
import org.fedfleet.secagg.SecAggMessage;
import org.fedfleet.wire.Chunker;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Envelope.EnvelopeError;

public final class OutboxParts {
    private static final Chunker.Stamps FRESH = new Chunker.Stamps() {
        @Override public String id(int index) { return Messages.newId(); }
        @Override public double ts() { return Messages.now(); }
    };
    private final String deviceId;
    private final Envelope.Signer signer;
    private final Chunker chunker;

    /** deviceId: the sender; chunkSize: the largest payload (MqttAgent.Options.chunkSize); signer: the
     *  device's Identity where the aggregator requires signatures (null: none). */
    public OutboxParts(String deviceId, int chunkSize, Envelope.Signer signer) {
        this.deviceId = deviceId; this.signer = signer;
        this.chunker = new Chunker(chunkSize, signer);
    }

    /** The payloads of an encoded message whose header's id is id. */
    public List<byte[]> of(byte[] message, String id) throws EnvelopeError {
        return chunker.split(message, id, deviceId, FRESH);
    }

    /** A SecAgg reply as a signed `secagg` envelope's payloads (SecAggSessions.ReplyEncoder). */
    public List<byte[]> secagg(SecAggMessage reply) throws EnvelopeError {
        Map<String, Object> h = Messages.header(SecAggMessage.ENVELOPE_TYPE, deviceId, reply.envelopeBody(), Messages.newId(), Messages.now());
        return of(Envelope.encode(h, reply.tensors(), signer), (String) h.get("id"));
    }
}
