// The fedfleet envelope (docs/protocol.md "Envelope"): "FFE1" | uint32 LE header_len |
// canonical JSON header | payload. decode() validates everything the spec and
// protocols/schema/envelope.schema.json require before anything is handed out.
package org.fedfleet.wire;

import java.math.BigInteger;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.CodingErrorAction;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.util.*;
import java.util.regex.Pattern;
import org.bouncycastle.crypto.params.Ed25519PublicKeyParameters;
import org.bouncycastle.crypto.signers.Ed25519Signer;

public final class Envelope {
    public static final byte[] MAGIC = {'F', 'F', 'E', '1'};
    public static final int MAX_HEADER_BYTES = 64 * 1024;
    public static final long MAX_MESSAGE_BYTES = 512L * 1024 * 1024;
    public static final int MAX_TENSORS = 64, MAX_NDIM = 8;
    public static final int MAX_TYPE_CHARS = 64;         // the schema's maxLength of "type"
    public static final Map<String, Integer> ITEMSIZE;
    static {  // no Map.of: Android offers it from API 30 only
        Map<String, Integer> m = new HashMap<>();
        m.put("float32", 4); m.put("float64", 8); m.put("int8", 1); m.put("uint8", 1);
        m.put("int32", 4); m.put("int64", 8); m.put("uint32", 4); m.put("uint64", 8);
        ITEMSIZE = Collections.unmodifiableMap(m);
    }
    private static final Set<String> FIELDS = new HashSet<>(Arrays.asList("v", "type", "id", "sender", "ts", "body",
            "tensors", "payload_sha256", "sig"));
    private static final Set<String> TENSOR_FIELDS = new HashSet<>(Arrays.asList("name", "dtype", "shape", "offset", "nbytes"));

    /** Signs the canonical header bytes (Ed25519, 64-byte signature): {@link org.fedfleet.device.Identity#sign}. */
    public interface Signer { byte[] sign(byte[] data); }
    private static final Pattern TYPE = Pattern.compile("[a-z][a-z0-9_]*(\\.[a-z][a-z0-9_]*)*"),
            ID = Pattern.compile("[0-9a-f]{32}"), SENDER = Pattern.compile("[A-Za-z0-9_.-]{1,64}"),
            NAME = Pattern.compile("[A-Za-z_][A-Za-z0-9_.]{0,63}"), SHA = Pattern.compile("[0-9a-f]{64}"),
            SIG = Pattern.compile("[0-9a-f]{128}");
    private static final BigInteger MAX_DIM = BigInteger.valueOf(4294967295L);
    // a tensor's non-zero dimensions times its item size, at most (protocols/envelope.py MAX_SHAPE_BYTES)
    private static final BigInteger MAX_SHAPE_BYTES = BigInteger.valueOf(Long.MAX_VALUE);

    public static final class EnvelopeError extends Exception {
        public EnvelopeError(String m) { super(m); }
    }

    public static final class Tensor {
        public final String name, dtype;
        public final long[] shape;
        public final byte[] data;
        public Tensor(String name, String dtype, long[] shape, byte[] data) {
            this.name = name; this.dtype = dtype; this.shape = shape; this.data = data;
        }
    }

    /** A decoded message: the header exactly as parsed, plus its tensors. */
    public static final class Message {
        public final Map<String, Object> header;
        public final List<Tensor> tensors;
        public Message(Map<String, Object> header, List<Tensor> tensors) { this.header = header; this.tensors = tensors; }
        public String type() { return (String) header.get("type"); }
        public String sender() { return (String) header.get("sender"); }
        @SuppressWarnings("unchecked") public Map<String, Object> body() { return (Map<String, Object>) header.get("body"); }
    }

    // ---------------- decode ----------------
    public static Message decode(byte[] data) throws EnvelopeError { return decode(data, null, MAX_MESSAGE_BYTES); }

    /** With a public key (raw 32 bytes) the signature is mandatory and verified. */
    @SuppressWarnings("unchecked")
    public static Message decode(byte[] data, byte[] publicKey, long maxBytes) throws EnvelopeError {
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
        try { parsed = Json.parseHeader(text); } catch (Json.JsonError e) { throw new EnvelopeError("header is not JSON: " + e.getMessage()); }
        if (!(parsed instanceof Map)) throw new EnvelopeError("header is not a JSON object");
        Map<String, Object> h = (Map<String, Object>) parsed;
        validateHeader(h);
        byte[] payload = Arrays.copyOfRange(data, (int) (8 + hlen), data.length);
        if (!hex(sha256(payload)).equals(h.get("payload_sha256")))
            throw new EnvelopeError("payload sha256 mismatch (corrupted or truncated message)");
        if (publicKey != null) verifySignature(h, Arrays.copyOfRange(data, 8, (int) (8 + hlen)), publicKey);
        return new Message(h, tiles((List<Object>) h.get("tensors"), payload));
    }

    @SuppressWarnings("unchecked")
    private static void validateHeader(Map<String, Object> h) throws EnvelopeError {
        for (String k : h.keySet()) if (!FIELDS.contains(k)) throw new EnvelopeError("unknown header field '" + k + "'");
        for (String k : FIELDS) if (!k.equals("sig") && !h.containsKey(k)) throw new EnvelopeError("missing header field '" + k + "'");
        if (!BigInteger.ONE.equals(h.get("v"))) throw new EnvelopeError("unsupported protocol version " + h.get("v"));
        if (str(h, "type", TYPE).length() > MAX_TYPE_CHARS)
            throw new EnvelopeError("field 'type' is longer than " + MAX_TYPE_CHARS + " characters");
        str(h, "id", ID); str(h, "sender", SENDER); str(h, "payload_sha256", SHA);
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
            BigInteger nonZero = BigInteger.valueOf(ITEMSIZE.get(dtype));     // an empty tensor's other dims count too
            for (long n : shape) if (n != 0) nonZero = nonZero.multiply(BigInteger.valueOf(n));
            if (nonZero.compareTo(MAX_SHAPE_BYTES) > 0)
                throw new EnvelopeError("tensor '" + name + "': shape " + Arrays.toString(shape) + " of " + dtype
                        + " cannot be held (its non-zero dimensions times the item size reach 2^63)");
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
    public static byte[] encode(Map<String, Object> fields, List<Tensor> tensors, Signer signer) throws EnvelopeError {
        if (tensors.size() > MAX_TENSORS) throw new EnvelopeError("too many tensors: " + tensors.size());
        long tensorBytes = 0;       // refused before the payload is copied: no receiver takes more (protocols/envelope.py)
        for (Tensor t : tensors) tensorBytes += t.data.length;
        if (tensorBytes > MAX_MESSAGE_BYTES - 8)
            throw new EnvelopeError("message too large: its tensors alone hold " + tensorBytes + " > " + MAX_MESSAGE_BYTES + " bytes");
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
            payload.write(t.data, 0, t.data.length);
        }
        h.put("tensors", descs);
        byte[] body = payload.toByteArray();
        h.put("payload_sha256", hex(sha256(body)));
        if (signer != null) h.put("sig", hex(signer.sign(canonical(h))));
        else if (fields.get("sig") != null) h.put("sig", fields.get("sig"));
        byte[] message = frame(h, body);
        if (message.length > MAX_MESSAGE_BYTES)
            throw new EnvelopeError("message too large: " + message.length + " > " + MAX_MESSAGE_BYTES + " bytes");
        return message;
    }

    /** Magic, length and canonical header in front of a payload; no validation (tests use it to forge). */
    public static byte[] frame(Map<String, Object> header, byte[] payload) throws EnvelopeError {
        byte[] hb = canonical(header);
        if (hb.length > MAX_HEADER_BYTES) throw new EnvelopeError("header too large: " + hb.length);
        ByteBuffer b = ByteBuffer.allocate(8 + hb.length + payload.length).order(ByteOrder.LITTLE_ENDIAN);
        return b.put(MAGIC).putInt(hb.length).put(hb).put(payload).array();
    }

    public static byte[] canonical(Object header) throws EnvelopeError {
        try { return Json.canonical(header); } catch (Json.JsonError e) { throw new EnvelopeError(e.getMessage()); }
    }

    // ---------------- signatures (Ed25519 over canonical(header without sig)) ----------------
    /** Verifies the parsed header {@code h}'s signature over the header bytes exactly as received
     *  ({@code headerBytes}) with the "sig" member cut out ({@link #signedHeaderBytes}), never over
     *  this side's re-encoding, so that no float written differently by another codec can make a
     *  valid signature fail. */
    public static void verifySignature(Map<String, Object> h, byte[] headerBytes, byte[] rawPublicKey) throws EnvelopeError {
        if (!(h.get("sig") instanceof String)) throw new EnvelopeError("unsigned message from " + h.get("sender"));
        if (rawPublicKey.length != 32) throw new EnvelopeError("an Ed25519 public key is 32 bytes, got " + rawPublicKey.length);
        String sigHex = (String) h.get("sig");
        byte[] data = signedHeaderBytes(headerBytes, sigHex), sig = unhex(sigHex);
        // BouncyCastle's RFC 8032 Ed25519: Android's own provider has it only from API 33
        Ed25519Signer v = new Ed25519Signer();
        v.init(false, new Ed25519PublicKeyParameters(rawPublicKey, 0));
        v.update(data, 0, data.length);
        if (!v.verifySignature(sig)) throw new EnvelopeError("Ed25519 signature does not verify");
    }

    /** What a received header's signature covers (protocols/envelope.py signed_header_bytes): the
     *  header bytes with the member "sig":"&lt;sig&gt;" and the comma joining it to a neighbour cut
     *  out; for the canonical header every sender writes, canonical(header without sig). The member
     *  must occur exactly once, written canonically. */
    public static byte[] signedHeaderBytes(byte[] header, String sigHex) throws EnvelopeError {
        byte[] member = ("\"sig\":\"" + sigHex + "\"").getBytes(StandardCharsets.US_ASCII);
        int at = indexOf(header, member, 0);
        if (at < 0 || indexOf(header, member, at + 1) >= 0)
            throw new EnvelopeError("the header must hold its \"sig\" member exactly once, written canonically");
        int end = at + member.length;
        if (at > 0 && header[at - 1] == ',') at--;
        else if (end < header.length && header[end] == ',') end++;
        byte[] out = new byte[header.length - (end - at)];
        System.arraycopy(header, 0, out, 0, at);
        System.arraycopy(header, end, out, at, header.length - end);
        return out;
    }

    private static int indexOf(byte[] hay, byte[] needle, int from) {
        outer:
        for (int i = from; i + needle.length <= hay.length; i++) {
            for (int k = 0; k < needle.length; k++) if (hay[i + k] != needle[k]) continue outer;
            return i;
        }
        return -1;
    }

    public static byte[] sha256(byte[] b) {
        try { return MessageDigest.getInstance("SHA-256").digest(b); }
        catch (NoSuchAlgorithmException e) { throw new IllegalStateException(e); }
    }

    public static String hex(byte[] b) {
        StringBuilder s = new StringBuilder();
        for (byte x : b) s.append(String.format("%02x", x & 0xff));
        return s.toString();
    }

    public static byte[] unhex(String s) {
        byte[] b = new byte[s.length() / 2];
        for (int k = 0; k < b.length; k++) b[k] = (byte) Integer.parseInt(s.substring(2 * k, 2 * k + 2), 16);
        return b;
    }
}
