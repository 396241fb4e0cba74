// The fedfleet envelope (docs/protocol.md "Envelope"): "FFE1" | uint32 LE header_len |
// canonical JSON header | payload. decode() validates everything the spec and
// protocols/schema/envelope.schema.json require before anything is handed out.
import java.math.BigInteger;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.CodingErrorAction;
import java.nio.charset.StandardCharsets;
import java.security.*;
import java.security.spec.X509EncodedKeySpec;
import java.util.*;
import java.util.regex.Pattern;

final class Envelope {
    static final byte[] MAGIC = {'F', 'F', 'E', '1'};
    static final int MAX_HEADER_BYTES = 64 * 1024;
    static final long MAX_MESSAGE_BYTES = 512L * 1024 * 1024;
    static final int MAX_TENSORS = 64, MAX_NDIM = 8;
    static final Map<String, Integer> ITEMSIZE = Map.of("float32", 4, "float64", 8, "int8", 1,
            "uint8", 1, "int32", 4, "int64", 8, "uint64", 8);
    private static final Set<String> FIELDS = Set.of("v", "type", "id", "sender", "ts", "body",
            "tensors", "payload_sha256", "sig");
    private static final Set<String> TENSOR_FIELDS = Set.of("name", "dtype", "shape", "offset", "nbytes");
    private static final Pattern TYPE = Pattern.compile("[a-z][a-z0-9_]*(\\.[a-z][a-z0-9_]*)*"),
            ID = Pattern.compile("[0-9a-f]{32}"), SENDER = Pattern.compile("[A-Za-z0-9_.-]{1,64}"),
            NAME = Pattern.compile("[A-Za-z_][A-Za-z0-9_.]{0,63}"), SHA = Pattern.compile("[0-9a-f]{64}"),
            SIG = Pattern.compile("[0-9a-f]{128}");
    private static final BigInteger MAX_DIM = BigInteger.valueOf(4294967295L);

    static final class EnvelopeError extends Exception {
        EnvelopeError(String m) { super(m); }
    }

    static final class Tensor {
        final String name, dtype;
        final long[] shape;
        final byte[] data;
        Tensor(String name, String dtype, long[] shape, byte[] data) {
            this.name = name; this.dtype = dtype; this.shape = shape; this.data = data;
        }
    }

    /** A decoded message: the header exactly as parsed, plus its tensors. */
    static final class Message {
        final Map<String, Object> header;
        final List<Tensor> tensors;
        Message(Map<String, Object> header, List<Tensor> tensors) { this.header = header; this.tensors = tensors; }
        String type() { return (String) header.get("type"); }
        String sender() { return (String) header.get("sender"); }
        @SuppressWarnings("unchecked") Map<String, Object> body() { return (Map<String, Object>) header.get("body"); }
    }

    // ---------------- decode ----------------
    static Message decode(byte[] data) throws EnvelopeError { return decode(data, null, MAX_MESSAGE_BYTES); }

    /** With a public key (raw 32 bytes) the signature is mandatory and verified. */
    @SuppressWarnings("unchecked")
    static Message decode(byte[] data, byte[] publicKey, long maxBytes) throws EnvelopeError {
        if (data.length > maxBytes) throw new EnvelopeError("message too large: " + data.length + " > " + maxBytes + " bytes");
        if (data.length < 8 || !Arrays.equals(Arrays.copyOf(data, 4), MAGIC))
            throw new EnvelopeError("not a fedfleet envelope (bad magic or shorter than 8 bytes)");
        long hlen = Integer.toUnsignedLong(ByteBuffer.wrap(data, 4, 4).order(ByteOrder.LITTLE_ENDIAN).getInt());
        if (hlen > MAX_HEADER_BYTES) throw new EnvelopeError("header length " + hlen + " > " + MAX_HEADER_BYTES);
        if (8 + hlen > data.length) throw new EnvelopeError("header length " + hlen + " runs past the message end");
        String text;
        try {
            text = StandardCharsets.UTF_8.newDecoder().onMalformedInput(CodingErrorAction.REPORT)
                    .onUnmappableCharacter(CodingErrorAction.REPORT)
                    .decode(ByteBuffer.wrap(data, 8, (int) hlen)).toString();
        } catch (CharacterCodingException e) {
            throw new EnvelopeError("header is not UTF-8: " + e);
        }
        Object parsed;
        try { parsed = Json.parse(text); } catch (Json.JsonError e) { throw new EnvelopeError("header is not JSON: " + e.getMessage()); }
        if (!(parsed instanceof Map)) throw new EnvelopeError("header is not a JSON object");
        Map<String, Object> h = (Map<String, Object>) parsed;
        validateHeader(h);
        byte[] payload = Arrays.copyOfRange(data, (int) (8 + hlen), data.length);
        if (!hex(sha256(payload)).equals(h.get("payload_sha256")))
            throw new EnvelopeError("payload sha256 mismatch (corrupted or truncated message)");
        if (publicKey != null) verifySignature(h, publicKey);
        return new Message(h, tiles((List<Object>) h.get("tensors"), payload));
    }

    @SuppressWarnings("unchecked")
    private static void validateHeader(Map<String, Object> h) throws EnvelopeError {
        for (String k : h.keySet()) if (!FIELDS.contains(k)) throw new EnvelopeError("unknown header field '" + k + "'");
        for (String k : FIELDS) if (!k.equals("sig") && !h.containsKey(k)) throw new EnvelopeError("missing header field '" + k + "'");
        if (!BigInteger.ONE.equals(h.get("v"))) throw new EnvelopeError("unsupported protocol version " + h.get("v"));
        str(h, "type", TYPE); str(h, "id", ID); str(h, "sender", SENDER); str(h, "payload_sha256", SHA);
        if (h.containsKey("sig")) str(h, "sig", SIG);
        Object ts = h.get("ts");
        boolean tsOk = ts instanceof BigInteger ? ((BigInteger) ts).signum() >= 0 : ts instanceof Double && (Double) ts >= 0;
        if (!tsOk) throw new EnvelopeError("ts must be a number >= 0, got " + ts);
        if (!(h.get("body") instanceof Map)) throw new EnvelopeError("body must be an object");
        if (!(h.get("tensors") instanceof List)) throw new EnvelopeError("tensors must be an array");
        List<Object> ts_ = (List<Object>) h.get("tensors");
        if (ts_.size() > MAX_TENSORS) throw new EnvelopeError("too many tensors: " + ts_.size() + " > " + MAX_TENSORS);
        Set<String> names = new HashSet<>();
        for (Object o : ts_) {
            if (!(o instanceof Map)) throw new EnvelopeError("tensor descriptor is not an object");
            Map<String, Object> d = (Map<String, Object>) o;
            if (!d.keySet().equals(TENSOR_FIELDS)) throw new EnvelopeError("tensor descriptor keys " + d.keySet() + " != " + TENSOR_FIELDS);
            String name = str(d, "name", NAME);
            if (!names.add(name)) throw new EnvelopeError("duplicate tensor name '" + name + "'");
            if (!(d.get("dtype") instanceof String) || !ITEMSIZE.containsKey(d.get("dtype")))
                throw new EnvelopeError("tensor '" + name + "': unknown dtype " + d.get("dtype"));
            if (!(d.get("shape") instanceof List)) throw new EnvelopeError("tensor '" + name + "': shape is not an array");
            List<Object> shape = (List<Object>) d.get("shape");
            if (shape.size() > MAX_NDIM) throw new EnvelopeError("tensor '" + name + "': " + shape.size() + " dims > " + MAX_NDIM);
            for (Object s : shape)
                if (!(s instanceof BigInteger) || ((BigInteger) s).signum() < 0 || ((BigInteger) s).compareTo(MAX_DIM) > 0)
                    throw new EnvelopeError("tensor '" + name + "': shape entry " + s + " is not an integer in [0, 2^32-1]");
            for (String k : new String[] {"offset", "nbytes"})
                if (!(d.get(k) instanceof BigInteger) || ((BigInteger) d.get(k)).signum() < 0)
                    throw new EnvelopeError("tensor '" + name + "': " + k + " " + d.get(k) + " is not an integer >= 0");
        }
    }

    private static String str(Map<String, Object> m, String key, Pattern p) throws EnvelopeError {
        Object v = m.get(key);
        if (!(v instanceof String) || !p.matcher((String) v).matches())
            throw new EnvelopeError("field '" + key + "' = " + v + " does not match " + p);
        return (String) v;
    }

    /** Blobs tile the payload in order: no gap, no overlap, nbytes = prod(shape) * itemsize. */
    @SuppressWarnings("unchecked")
    private static List<Tensor> tiles(List<Object> descs, byte[] payload) throws EnvelopeError {
        List<Tensor> out = new ArrayList<>();
        BigInteger expected = BigInteger.ZERO;
        for (Object o : descs) {
            Map<String, Object> d = (Map<String, Object>) o;
            String name = (String) d.get("name"), dtype = (String) d.get("dtype");
            List<Object> shapeList = (List<Object>) d.get("shape");
            long[] shape = new long[shapeList.size()];
            BigInteger count = BigInteger.ONE;
            for (int k = 0; k < shape.length; k++) {
                shape[k] = ((BigInteger) shapeList.get(k)).longValueExact();
                count = count.multiply(BigInteger.valueOf(shape[k]));
            }
            BigInteger offset = (BigInteger) d.get("offset"), nbytes = (BigInteger) d.get("nbytes");
            if (!offset.equals(expected))
                throw new EnvelopeError("tensor '" + name + "' offset " + offset + " != " + expected + " (gap or overlap)");
            if (!nbytes.equals(count.multiply(BigInteger.valueOf(ITEMSIZE.get(dtype)))))
                throw new EnvelopeError("tensor '" + name + "': nbytes " + nbytes + " != prod(shape " + Arrays.toString(shape) + ") * itemsize of " + dtype);
            BigInteger end = expected.add(nbytes);
            if (end.compareTo(BigInteger.valueOf(payload.length)) > 0)
                throw new EnvelopeError("tensor '" + name + "' runs past the payload end (truncated message)");
            out.add(new Tensor(name, dtype, shape, Arrays.copyOfRange(payload, expected.intValue(), end.intValue())));
            expected = end;
        }
        if (expected.longValue() != payload.length)
            throw new EnvelopeError((payload.length - expected.longValue()) + " trailing payload bytes not described by any tensor");
        return out;
    }

    // ---------------- encode ----------------
    /** Encode header fields v,type,id,sender,ts,body (+ optional sig) and the tensors, in order. */
    static byte[] encode(Map<String, Object> fields, List<Tensor> tensors, PrivateKey signer) throws EnvelopeError {
        if (tensors.size() > MAX_TENSORS) throw new EnvelopeError("too many tensors: " + tensors.size());
        Map<String, Object> h = new LinkedHashMap<>(fields);
        h.remove("sig");
        List<Object> descs = new ArrayList<>();
        java.io.ByteArrayOutputStream payload = new java.io.ByteArrayOutputStream();
        for (Tensor t : tensors) {
            Map<String, Object> d = new LinkedHashMap<>();
            d.put("name", t.name); d.put("dtype", t.dtype);
            List<Object> shape = new ArrayList<>();
            for (long s : t.shape) shape.add(BigInteger.valueOf(s));
            d.put("shape", shape);
            d.put("offset", BigInteger.valueOf(payload.size()));
            d.put("nbytes", BigInteger.valueOf(t.data.length));
            descs.add(d);
            payload.writeBytes(t.data);
        }
        h.put("tensors", descs);
        byte[] body = payload.toByteArray();
        h.put("payload_sha256", hex(sha256(body)));
        if (signer != null) h.put("sig", hex(sign(signer, canonical(h))));
        else if (fields.get("sig") != null) h.put("sig", fields.get("sig"));
        return frame(h, body);
    }

    /** Magic, length and canonical header in front of a payload; no validation (tests use it to forge). */
    static byte[] frame(Map<String, Object> header, byte[] payload) throws EnvelopeError {
        byte[] hb = canonical(header);
        if (hb.length > MAX_HEADER_BYTES) throw new EnvelopeError("header too large: " + hb.length);
        ByteBuffer b = ByteBuffer.allocate(8 + hb.length + payload.length).order(ByteOrder.LITTLE_ENDIAN);
        return b.put(MAGIC).putInt(hb.length).put(hb).put(payload).array();
    }

    static byte[] canonical(Object header) throws EnvelopeError {
        try { return Json.canonical(header); } catch (Json.JsonError e) { throw new EnvelopeError(e.getMessage()); }
    }

    // ---------------- signatures (Ed25519 over canonical(header without sig)) ----------------
    private static final byte[] ED25519_SPKI_PREFIX = unhex("302a300506032b6570032100");

    static void verifySignature(Map<String, Object> h, byte[] rawPublicKey) throws EnvelopeError {
        if (!(h.get("sig") instanceof String)) throw new EnvelopeError("unsigned message from " + h.get("sender"));
        Map<String, Object> unsigned = new LinkedHashMap<>(h);
        unsigned.remove("sig");
        try {
            byte[] spki = new byte[44];
            System.arraycopy(ED25519_SPKI_PREFIX, 0, spki, 0, 12);
            System.arraycopy(rawPublicKey, 0, spki, 12, 32);
            PublicKey key = KeyFactory.getInstance("Ed25519").generatePublic(new X509EncodedKeySpec(spki));
            Signature v = Signature.getInstance("Ed25519");
            v.initVerify(key);
            v.update(canonical(unsigned));
            if (!v.verify(unhex((String) h.get("sig")))) throw new EnvelopeError("Ed25519 signature does not verify");
        } catch (GeneralSecurityException e) {
            throw new EnvelopeError("Ed25519 signature does not verify: " + e);
        }
    }

    static byte[] sign(PrivateKey key, byte[] data) throws EnvelopeError {
        try {
            Signature s = Signature.getInstance("Ed25519");
            s.initSign(key);
            s.update(data);
            return s.sign();
        } catch (GeneralSecurityException e) { throw new EnvelopeError("signing failed: " + e); }
    }

    static byte[] sha256(byte[] b) {
        try { return MessageDigest.getInstance("SHA-256").digest(b); }
        catch (NoSuchAlgorithmException e) { throw new IllegalStateException(e); }
    }

    static String hex(byte[] b) {
        StringBuilder s = new StringBuilder();
        for (byte x : b) s.append(String.format("%02x", x & 0xff));
        return s.toString();
    }

    static byte[] unhex(String s) {
        byte[] b = new byte[s.length() / 2];
        for (int k = 0; k < b.length; k++) b[k] = (byte) Integer.parseInt(s.substring(2 * k, 2 * k + 2), 16);
        return b;
    }
}
