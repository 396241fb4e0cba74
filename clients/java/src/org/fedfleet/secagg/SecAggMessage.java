// A secure-aggregation message as it travels (protocols/payloads/secagg.py): an envelope of type
// `secagg` whose body is {"secagg": header} and whose tensors are the message's arrays. The
// header's base64 `signature` is Ed25519 over
//   "fedfleet/secagg/message/v1\n" + JSON(sort_keys, compact, ASCII) of
//   {"header": header without signature, "arrays": {name: [numpy dtype, shape, sha256 hex]}}.
package org.fedfleet.secagg;

import java.math.BigInteger;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Base64;
import java.util.Collections;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.bouncycastle.crypto.params.Ed25519PublicKeyParameters;
import org.bouncycastle.crypto.signers.Ed25519Signer;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Json;

public final class SecAggMessage {
    public static final String ENVELOPE_TYPE = "secagg";
    private static final byte[] DOMAIN = "fedfleet/secagg/message/v1\n".getBytes(StandardCharsets.US_ASCII);
    private static final Map<String, String> NUMPY_DTYPE = new HashMap<>();
    static {
        NUMPY_DTYPE.put("uint8", "|u1"); NUMPY_DTYPE.put("int8", "|i1"); NUMPY_DTYPE.put("uint64", "<u8");
        NUMPY_DTYPE.put("uint32", "<u4");
        NUMPY_DTYPE.put("int64", "<i8"); NUMPY_DTYPE.put("int32", "<i4"); NUMPY_DTYPE.put("float32", "<f4");
        NUMPY_DTYPE.put("float64", "<f8");
    }

    public final Map<String, Object> header;        // with "type" and "signature"
    public final Map<String, Envelope.Tensor> arrays;

    SecAggMessage(Map<String, Object> header, Map<String, Envelope.Tensor> arrays) { this.header = header; this.arrays = arrays; }

    public String type() { return (String) header.get("type"); }

    /** The message carried by a decoded `secagg` envelope; its sender must be the envelope's. */
    @SuppressWarnings("unchecked")
    public static SecAggMessage fromEnvelope(Envelope.Message env) throws SecAggException {
        Object h = env.body().get("secagg");
        if (!ENVELOPE_TYPE.equals(env.type()) || !(h instanceof Map) || env.body().size() != 1)
            throw new SecAggException("not a secagg envelope");
        Map<String, Object> header = (Map<String, Object>) h;
        if (!(header.get("type") instanceof String)) throw new SecAggException("secagg header has no type");
        if (!env.sender().equals(header.get("sender")))
            throw new SecAggException("secagg sender " + header.get("sender") + " differs from envelope sender " + env.sender());
        Map<String, Envelope.Tensor> arrays = new LinkedHashMap<>();
        for (Envelope.Tensor t : env.tensors) arrays.put(t.name, t);
        return new SecAggMessage(header, arrays);
    }

    /** The envelope header fields (v, type, id, sender, ts, body) and tensors to encode. */
    public Map<String, Object> envelopeBody() {
        Map<String, Object> body = new LinkedHashMap<>();
        body.put("secagg", header);
        return body;
    }

    public List<Envelope.Tensor> tensors() { return new ArrayList<>(arrays.values()); }

    /** A signed client message: common fields, payload fields, arrays. */
    static SecAggMessage signed(String type, String jobId, long roundId, String groupId, String sender, String recipient,
                                Map<String, Object> payload, Map<String, Envelope.Tensor> arrays,
                                Envelope.Signer signer) throws SecAggException {
        Map<String, Object> h = commonHeader(type, jobId, roundId, groupId, sender, recipient);
        h.putAll(payload);
        h.put("signature", b64(signer.sign(canonicalBytes(h, arrays))));
        return new SecAggMessage(h, arrays);
    }

    static Map<String, Object> commonHeader(String type, String jobId, long roundId, String groupId, String sender, String recipient) {
        Map<String, Object> h = new LinkedHashMap<>();
        h.put("type", type);
        h.put("job_id", jobId);
        h.put("round_id", BigInteger.valueOf(roundId));
        h.put("group_id", groupId);
        h.put("sender", sender);
        h.put("recipient", recipient);
        return h;
    }

    /** What the signature covers (the header's own "signature" left out). */
    static byte[] canonicalBytes(Map<String, Object> header, Map<String, Envelope.Tensor> arrays) throws SecAggException {
        Map<String, Object> h = new LinkedHashMap<>(header);
        h.remove("signature");
        Map<String, Object> digests = new LinkedHashMap<>();
        for (Envelope.Tensor t : arrays.values()) {
            List<Object> shape = new ArrayList<>();
            for (long s : t.shape) shape.add(BigInteger.valueOf(s));
            List<Object> d = new ArrayList<>();
            d.add(NUMPY_DTYPE.get(t.dtype));
            d.add(shape);
            d.add(Envelope.hex(Envelope.sha256(t.data)));
            digests.put(t.name, d);
        }
        Map<String, Object> doc = new LinkedHashMap<>();
        doc.put("header", h);
        doc.put("arrays", digests);
        try {
            byte[] json = Json.canonicalAscii(doc);
            byte[] out = new byte[DOMAIN.length + json.length];
            System.arraycopy(DOMAIN, 0, out, 0, DOMAIN.length);
            System.arraycopy(json, 0, out, DOMAIN.length, json.length);
            return out;
        } catch (Json.JsonError e) {
            throw new SecAggException("secagg header cannot be encoded: " + e.getMessage());
        }
    }

    /** Ed25519 over canonicalBytes under a raw 32-byte key; SecAggException when absent or forged. */
    static void verify(Map<String, Object> header, Map<String, Envelope.Tensor> arrays, byte[] publicKey) throws SecAggException {
        byte[] sig = unb64(header.get("signature"), "signature", 64);
        byte[] data = canonicalBytes(header, arrays);
        if (!verifyRaw(publicKey, data, sig)) throw new SecAggException(header.get("type") + " from " + header.get("sender") + ": bad signature");
    }

    static boolean verifyRaw(byte[] publicKey, byte[] data, byte[] sig) {
        Ed25519Signer v = new Ed25519Signer();
        v.init(false, new Ed25519PublicKeyParameters(publicKey, 0));
        v.update(data, 0, data.length);
        return v.verifySignature(sig);
    }

    static String b64(byte[] raw) { return Base64.getEncoder().encodeToString(raw); }

    static byte[] unb64(Object value, String what, int length) throws SecAggException {
        if (!(value instanceof String)) throw new SecAggException(what + " must be a base64 string");
        byte[] raw;
        try {
            raw = Base64.getDecoder().decode((String) value);
        } catch (IllegalArgumentException e) {
            throw new SecAggException(what + " is not valid base64");
        }
        // only the canonical text (protocols/secagg/wire_fields.py unb64): the decoder also takes a
        // text without its padding, which Python refuses, and one whose unused bits are set
        if (!b64(raw).equals(value))
            throw new SecAggException(what + " is not canonical base64 (RFC 4648: padded, unused bits zero)");
        if (length >= 0 && raw.length != length) throw new SecAggException(what + " must be " + length + " bytes, got " + raw.length);
        return raw;
    }

    static Map<String, Envelope.Tensor> arrays(Envelope.Tensor... ts) {
        Map<String, Envelope.Tensor> m = new LinkedHashMap<>();
        for (Envelope.Tensor t : ts) m.put(t.name, t);
        return m;
    }

    static Map<String, Envelope.Tensor> noArrays() { return Collections.emptyMap(); }
}
