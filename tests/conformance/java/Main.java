// Conformance run of the Java codec against protocols/golden (see tests/test_conformance_java.py).
// Usage: java Main <golden_dir> [--signed <envelope.bin> <ed25519 public key hex>]
//                  [--canonical <file of canonical JSON lines>] [--prg <seed hex> <words>]
// Prints PASS/FAIL per check, VALUES lines (decoded tensor elements), PRG lines and a SUMMARY;
// exits 1 on any failure.
import java.math.BigInteger;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.nio.file.*;
import java.security.*;
import java.util.*;
import javax.crypto.Cipher;
import javax.crypto.spec.IvParameterSpec;
import javax.crypto.spec.SecretKeySpec;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Json;
import org.fedfleet.wire.Reassembler;

public final class Main {
    interface Action { Object run() throws Exception; }
    interface Mutation { void apply(Map<String, Object> header) throws Exception; }

    private int checks, failures, signedGolden;

    private void check(String name, boolean ok, String detail) {
        checks++;
        if (!ok) failures++;
        System.out.println((ok ? "PASS " : "FAIL ") + name + (ok || detail.isEmpty() ? "" : ": " + detail));
    }

    /** The action must fail with an EnvelopeError whose message contains `why`. */
    private void rejects(String name, String why, Action a) {
        try {
            a.run();
            check("reject " + name, false, "was accepted");
        } catch (Envelope.EnvelopeError e) {
            check("reject " + name + " (" + e.getMessage() + ")", e.getMessage().contains(why), "expected '" + why + "'");
        } catch (Exception e) {
            check("reject " + name, false, "crashed instead of a clear error: " + e);
        }
    }

    public static void main(String[] args) throws Exception {
        Main m = new Main();
        Path dir = Paths.get(args[0]);
        int golden = m.goldenVectors(dir);
        m.corruptions(Files.readAllBytes(dir.resolve("result_fed3r_stats.bin")));
        m.signatures(Files.readAllBytes(dir.resolve("result_fedavg_head.bin")));
        for (int k = 1; k < args.length; k++) {
            if (args[k].equals("--signed")) m.foreignSignature(Files.readAllBytes(Paths.get(args[++k])), Envelope.unhex(args[++k]));
            else if (args[k].equals("--canonical")) m.canonicalLines(Files.readAllBytes(Paths.get(args[++k])));
            else if (args[k].equals("--prg")) printPrg(Envelope.unhex(args[++k]), Integer.parseInt(args[++k]));
        }
        System.out.println("SUMMARY golden=" + golden + " signed=" + m.signedGolden + " checks=" + m.checks + " failures=" + m.failures);
        System.exit(m.failures == 0 ? 0 : 1);
    }

    // ---- (a) every golden vector decodes to index.json and re-encodes to the same bytes; (b) chunks ----
    @SuppressWarnings("unchecked")
    private int goldenVectors(Path dir) throws Exception {
        Map<String, Object> index = (Map<String, Object>) Json.parse(Files.readString(dir.resolve("index.json")));
        Map<String, byte[]> byId = new HashMap<>();
        List<Envelope.Message> chunks = new ArrayList<>();
        int n = 0;
        for (String name : new TreeSet<>(index.keySet())) {
            Map<String, Object> entry = (Map<String, Object>) index.get(name);
            byte[] bytes = Files.readAllBytes(dir.resolve((String) entry.get("file")));
            n++;
            try {
                Envelope.Message msg = Envelope.decode(bytes);
                if (entry.containsKey("public_key")) {   // a signed vector: verify under its published key
                    byte[] key = Envelope.unhex((String) entry.get("public_key"));
                    check("golden " + name + " signature verifies", Envelope.decode(bytes, key, Envelope.MAX_MESSAGE_BYTES) != null, "");
                    signedGolden++;
                }
                check("golden " + name + " size", BigInteger.valueOf(bytes.length).equals(entry.get("bytes")), "");
                check("golden " + name + " header == index.json", Json.same(msg.header, entry.get("header")), "");
                byte[] again = Envelope.encode(msg.header, msg.tensors, null);
                check("golden " + name + " re-encodes byte-identical", Arrays.equals(again, bytes),
                        new String(again, StandardCharsets.UTF_8));
                for (Envelope.Tensor t : msg.tensors)
                    System.out.println("VALUES " + name + " " + t.name + " " + t.dtype + " " + String.join(",", values(t)));
                byId.put((String) msg.header.get("id"), bytes);
                if (msg.type().equals("chunk")) chunks.add(msg);
            } catch (Envelope.EnvelopeError e) {
                check("golden " + name + " decodes", false, e.getMessage());
            }
        }
        reassembly(chunks, byId);
        return n;
    }

    @SuppressWarnings("unchecked")
    private void reassembly(List<Envelope.Message> chunks, Map<String, byte[]> byId) throws Exception {
        check("golden set has chunk vectors", !chunks.isEmpty(), "");
        if (chunks.isEmpty()) return;
        String parent = (String) chunks.get(0).body().get("parent");
        byte[] expected = byId.get(parent);
        check("chunk parent " + parent + " is itself a golden vector", expected != null, "");
        List<List<Envelope.Message>> orders = new ArrayList<>();
        orders.add(chunks);
        List<Envelope.Message> shuffled = new ArrayList<>(chunks);
        Collections.reverse(shuffled);
        shuffled.add(1, shuffled.get(0));  // a QoS-1 redelivery in the middle
        orders.add(shuffled);
        for (List<Envelope.Message> order : orders) {
            Reassembler r = new Reassembler(300);
            byte[] whole = null;
            int completions = 0;
            for (Envelope.Message c : order) {
                byte[] out = r.add(c, 0);
                if (out != null) { whole = out; completions++; }
            }
            check("reassembly of " + order.size() + " chunk deliveries == whole", Arrays.equals(whole, expected) && completions == 1, "");
            check("late duplicate after completion is ignored", r.add(order.get(0), 1) == null, "");
        }
        Envelope.Message first = chunks.get(0);
        Reassembler r = new Reassembler(300);
        r.add(first, 0);
        Map<String, Object> liar = copy(first.header);
        ((Map<String, Object>) liar.get("body")).put("total", BigInteger.valueOf(10_000));
        ((Map<String, Object>) liar.get("body")).put("index", BigInteger.ONE);
        Envelope.Message lie = Envelope.decode(Envelope.encode(liar, first.tensors, null));
        rejects("chunk contradicting the first one", "contradicts", () -> r.add(lie, 1));
        check("partial message expires after its TTL", r.expire(301) == 1, "");
        Reassembler bounded = new Reassembler(300, 2, Envelope.MAX_MESSAGE_BYTES);
        List<Envelope.Message> others = new ArrayList<>();
        for (int k = 0; k < 3; k++) {   // three partial messages from one sender, room for two
            Map<String, Object> other = copy(first.header);
            ((Map<String, Object>) other.get("body")).put("parent", String.format("%032x", k));
            others.add(Envelope.decode(Envelope.encode(other, first.tensors, null)));
        }
        bounded.add(others.get(0), 0);
        bounded.add(others.get(1), 1);
        bounded.add(others.get(2), 2);  // room for two: the one that received a chunk least recently goes
        check("a sender's pending partial messages are bounded (its stalest goes for a new one)",
                bounded.expire(1.5 + 300) == 1 && bounded.expire(1000) == 1, "");
        Map<String, Object> bad = copy(first.header);
        ((Map<String, Object>) bad.get("body")).put("count", BigInteger.ONE);
        ((Map<String, Object>) bad.get("body")).put("total", BigInteger.valueOf(first.tensors.get(0).data.length));
        Envelope.Message single = Envelope.decode(Envelope.encode(bad, first.tensors, null));
        rejects("chunk whose bytes miss the announced sha256", "size/sha256", () -> new Reassembler(300).add(single, 0));
        ((Map<String, Object>) bad.get("body")).put("count", BigInteger.valueOf(Reassembler.MAX_CHUNKS + 1));
        Envelope.Message tooMany = Envelope.decode(Envelope.encode(bad, first.tensors, null));
        rejects("chunk count over " + Reassembler.MAX_CHUNKS, "out of range", () -> new Reassembler(300).add(tooMany, 0));
    }

    // ---- (c) corrupted variants of one golden vector ----
    @SuppressWarnings("unchecked")
    private void corruptions(byte[] good) throws Exception {
        int hlen = ByteBuffer.wrap(good, 4, 4).order(ByteOrder.LITTLE_ENDIAN).getInt();
        String text = new String(good, 8, hlen, StandardCharsets.UTF_8);
        byte[] payload = Arrays.copyOfRange(good, 8 + hlen, good.length);
        check("base vector decodes", Envelope.decode(good) != null, "");
        rejects("flipped payload byte", "sha256 mismatch", () -> { byte[] b = good.clone(); b[b.length - 3] ^= 1; return Envelope.decode(b); });
        rejects("truncated by one byte", "sha256 mismatch", () -> Envelope.decode(Arrays.copyOf(good, good.length - 1)));
        rejects("shorter than the prefix", "bad magic", () -> Envelope.decode(Arrays.copyOf(good, 6)));
        rejects("wrong magic", "bad magic", () -> { byte[] b = good.clone(); b[3] = '2'; return Envelope.decode(b); });
        rejects("header length over 64 KiB", "> 65536", () -> Envelope.decode(withLength(good, 65537)));
        rejects("header length past the end", "runs past", () -> Envelope.decode(withLength(good, good.length)));
        rejects("message over the size limit", "too large", () -> Envelope.decode(good, null, good.length - 1));
        rejects("header not UTF-8", "not UTF-8", () -> { byte[] b = good.clone(); b[10] = (byte) 0xff; return Envelope.decode(b); });
        rejects("NaN in the header", "NaN", () -> raw(text.replace("\"ts\":1767225605.0", "\"ts\":NaN"), payload));
        rejects("Infinity in the body", "NaN/Infinity", () -> raw(text.replace("\"body\":{", "\"body\":{\"x\":-Infinity,"), payload));
        rejects("duplicate JSON key", "duplicate key", () -> raw(text.replace("\"body\":{", "\"body\":{\"n\":4,"), payload));
        rejects("text after the JSON object", "trailing", () -> raw(text + " {}", payload));
        rejects("header is an array", "not a JSON object", () -> raw("[" + text + "]", payload));
        rejects("lone surrogate escape", "surrogate", () -> raw(text.replace("\"body\":{", "\"body\":{\"x\":\"\\ud800\","), payload));
        rejects("unknown header field", "unknown header field", () -> forge(good, h -> h.put("extra", BigInteger.ONE), null));
        rejects("missing payload_sha256", "missing header field", () -> forge(good, h -> h.remove("payload_sha256"), null));
        rejects("protocol version 2", "unsupported protocol version", () -> forge(good, h -> h.put("v", BigInteger.TWO), null));
        rejects("version 1.0 (a float)", "unsupported protocol version", () -> forge(good, h -> h.put("v", 1.0), null));
        rejects("upper-case id", "field 'id'", () -> forge(good, h -> h.put("id", "AB".repeat(16)), null));
        rejects("negative ts", "ts must be", () -> forge(good, h -> h.put("ts", -1.0), null));
        rejects("tiling gap", "gap or overlap", () -> forge(good, h -> tensor(h, 1).put("offset", BigInteger.valueOf(56)), null));
        rejects("tiling overlap", "gap or overlap", () -> forge(good, h -> tensor(h, 1).put("offset", BigInteger.valueOf(40)), null));
        rejects("nbytes != prod(shape)*itemsize", "nbytes", () -> forge(good, h -> tensor(h, 0).put("nbytes", BigInteger.valueOf(40)), null));
        rejects("int64 relabelled int32", "nbytes", () -> forge(good, h -> tensor(h, 1).put("dtype", "int32"), null));
        rejects("unknown dtype", "unknown dtype", () -> forge(good, h -> tensor(h, 0).put("dtype", "float16"), null));
        rejects("shape entry 6.0 (a float)", "not an integer", () -> forge(good, h -> tensor(h, 0).put("shape", List.of(6.0)), null));
        rejects("negative offset", "not an integer >= 0", () -> forge(good, h -> tensor(h, 0).put("offset", BigInteger.valueOf(-1)), null));
        rejects("extra key in a tensor descriptor", "tensor descriptor keys", () -> forge(good, h -> tensor(h, 0).put("order", "C"), null));
        rejects("duplicate tensor name", "duplicate tensor name", () -> forge(good, h -> tensor(h, 1).put("name", "A_upper"), null));
        rejects("9 dimensions", "dims > 8", () -> forge(good, h -> tensor(h, 0).put("shape", Collections.nCopies(9, BigInteger.ONE)), null));
        rejects("65 tensors", "too many tensors", () -> forge(good, h -> {
            List<Object> many = new ArrayList<>();
            for (int k = 0; k < 65; k++) many.add(Json.parse("{\"name\":\"t" + k + "\",\"dtype\":\"uint8\",\"shape\":[0],\"offset\":0,\"nbytes\":0}"));
            h.put("tensors", many);
        }, new byte[0]));
        rejects("payload with trailing bytes", "trailing payload bytes", () -> forge(good, h -> {}, Arrays.copyOf(payload, payload.length + 8)));
        rejects("payload shorter than its tensors", "past the payload end", () -> forge(good, h -> {}, Arrays.copyOf(payload, payload.length - 8)));
        rejects("encoding a header over 64 KiB", "header too large", () -> {
            Map<String, Object> h = copy(Envelope.decode(good).header);
            ((Map<String, Object>) h.get("body")).put("pad", "x".repeat(70_000));
            return Envelope.encode(h, List.of(), null);
        });
        rejects("encoding NaN", "NaN", () -> {
            Map<String, Object> h = copy(Envelope.decode(good).header);
            h.put("ts", Double.NaN);
            return Envelope.encode(h, List.of(), null);
        });
    }

    // ---- signatures: our own key pair, and (optionally) a vector signed by Python's `cryptography` ----
    private void signatures(byte[] good) throws Exception {
        Envelope.Message msg = Envelope.decode(good);
        KeyPairGenerator g = KeyPairGenerator.getInstance("Ed25519");
        KeyPair kp = g.generateKeyPair(), other = g.generateKeyPair();
        // signed by the JDK's Ed25519, verified by the codec's (BouncyCastle): two implementations agree
        byte[] signed = Envelope.encode(msg.header, msg.tensors, data -> jdkSign(kp.getPrivate(), data));
        check("signed message verifies", Envelope.decode(signed, raw(kp.getPublic()), Envelope.MAX_MESSAGE_BYTES) != null, "");
        rejects("signature under another key", "does not verify", () -> Envelope.decode(signed, raw(other.getPublic()), Envelope.MAX_MESSAGE_BYTES));
        rejects("unsigned message where a key is enrolled", "unsigned", () -> Envelope.decode(good, raw(kp.getPublic()), Envelope.MAX_MESSAGE_BYTES));
        rejects("signed header edited after signing", "does not verify", () -> forge(signed, h -> h.put("ts", 1.0), null, raw(kp.getPublic())));
        byte[] edited = Arrays.copyOfRange(signed, signed.length - 4, signed.length);  // the last float32 of the payload
        edited[3] ^= 0x40;
        rejects("signed payload edited after signing", "does not verify", () -> {
            byte[] b = signed.clone();
            System.arraycopy(edited, 0, b, b.length - 4, 4);
            return forge(b, h -> {}, null, raw(kp.getPublic()));
        });
    }

    private void foreignSignature(byte[] signed, byte[] publicKey) throws Exception {
        Envelope.Message msg;
        try {
            msg = Envelope.decode(signed, publicKey, Envelope.MAX_MESSAGE_BYTES);
        } catch (Envelope.EnvelopeError e) {
            check("python-signed vector verifies", false, e.getMessage());
            return;
        }
        check("python-signed vector verifies", true, "");
        check("python-signed vector re-encodes byte-identical", Arrays.equals(Envelope.encode(msg.header, msg.tensors, null), signed), "");
        for (Envelope.Tensor t : msg.tensors)
            System.out.println("VALUES signed " + t.name + " " + t.dtype + " " + String.join(",", values(t)));
    }

    /** Each '\n'-separated line is canonical JSON written by another implementation: parse, re-emit, compare. */
    private void canonicalLines(byte[] file) throws Exception {
        int start = 0, line = 0;
        for (int k = 0; k <= file.length; k++) {
            if (k < file.length && file[k] != '\n') continue;
            if (k > start) {
                byte[] expected = Arrays.copyOfRange(file, start, k);
                byte[] again = Json.canonical(Json.parse(new String(expected, StandardCharsets.UTF_8)));
                check("canonical JSON line " + line++ + " re-emitted byte-identical", Arrays.equals(again, expected),
                        new String(again, StandardCharsets.UTF_8));
            }
            start = k + 1;
        }
    }

    // ---- SecAgg mask PRG (docs/secure-aggregation.md "Mask PRG") ----
    private static void printPrg(byte[] seed, int words) throws Exception {
        MessageDigest sha = MessageDigest.getInstance("SHA-256");
        sha.update("fedfleet/secagg/prg/v1".getBytes(StandardCharsets.US_ASCII));
        byte[] key = Arrays.copyOf(sha.digest(seed), 16);
        Cipher aes = Cipher.getInstance("AES/CTR/NoPadding");
        aes.init(Cipher.ENCRYPT_MODE, new SecretKeySpec(key, "AES"), new IvParameterSpec(new byte[16]));
        ByteBuffer stream = ByteBuffer.wrap(aes.doFinal(new byte[8 * words])).order(ByteOrder.LITTLE_ENDIAN);
        for (int k = 0; k < words; k++) System.out.println("PRG " + k + " " + Long.toUnsignedString(stream.getLong()));
    }

    // ---- helpers ----
    private static List<String> values(Envelope.Tensor t) throws Json.JsonError {
        ByteBuffer b = ByteBuffer.wrap(t.data).order(ByteOrder.LITTLE_ENDIAN);
        List<String> out = new ArrayList<>();
        while (b.hasRemaining()) {
            switch (t.dtype) {
                case "float32": out.add(Json.formatFloat(b.getFloat())); break;
                case "float64": out.add(Json.formatFloat(b.getDouble())); break;
                case "int8": out.add(Byte.toString(b.get())); break;
                case "uint8": out.add(Integer.toString(b.get() & 0xff)); break;
                case "int32": out.add(Integer.toString(b.getInt())); break;
                case "uint32": out.add(Integer.toUnsignedString(b.getInt())); break;
                case "int64": out.add(Long.toString(b.getLong())); break;
                default: out.add(Long.toUnsignedString(b.getLong()));  // uint64
            }
        }
        return out;
    }

    private static byte[] jdkSign(PrivateKey key, byte[] data) {
        try {
            Signature s = Signature.getInstance("Ed25519");
            s.initSign(key);
            s.update(data);
            return s.sign();
        } catch (GeneralSecurityException e) { throw new IllegalStateException(e); }
    }

    private static byte[] raw(PublicKey k) { return Arrays.copyOfRange(k.getEncoded(), 12, 44); }

    @SuppressWarnings("unchecked")
    private static Map<String, Object> copy(Map<String, Object> h) throws Exception {
        return (Map<String, Object>) Json.parse(new String(Json.canonical(h), StandardCharsets.UTF_8));
    }

    @SuppressWarnings("unchecked")
    private static Map<String, Object> tensor(Map<String, Object> h, int k) { return (Map<String, Object>) ((List<Object>) h.get("tensors")).get(k); }

    private static byte[] withLength(byte[] good, int hlen) {
        byte[] b = good.clone();
        ByteBuffer.wrap(b, 4, 4).order(ByteOrder.LITTLE_ENDIAN).putInt(hlen);
        return b;
    }

    private static Object raw(String headerText, byte[] payload) throws Exception {
        byte[] hb = headerText.getBytes(StandardCharsets.UTF_8);
        ByteBuffer b = ByteBuffer.allocate(8 + hb.length + payload.length).order(ByteOrder.LITTLE_ENDIAN);
        return Envelope.decode(b.put(Envelope.MAGIC).putInt(hb.length).put(hb).put(payload).array());
    }

    private static Object forge(byte[] good, Mutation m, byte[] newPayload) throws Exception { return forge(good, m, newPayload, null); }

    /** Decode-free edit of a vector's header (and payload); payload_sha256 is kept consistent so only the edit is wrong. */
    @SuppressWarnings("unchecked")
    private static Object forge(byte[] good, Mutation m, byte[] newPayload, byte[] publicKey) throws Exception {
        int hlen = ByteBuffer.wrap(good, 4, 4).order(ByteOrder.LITTLE_ENDIAN).getInt();
        Map<String, Object> h = (Map<String, Object>) Json.parse(new String(good, 8, hlen, StandardCharsets.UTF_8));
        byte[] payload = newPayload != null ? newPayload : Arrays.copyOfRange(good, 8 + hlen, good.length);
        m.apply(h);
        if (h.containsKey("payload_sha256")) h.put("payload_sha256", Envelope.hex(Envelope.sha256(payload)));
        return Envelope.decode(Envelope.frame(h, payload), publicKey, Envelope.MAX_MESSAGE_BYTES);
    }
}
