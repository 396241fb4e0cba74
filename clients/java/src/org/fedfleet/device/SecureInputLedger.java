// The device's secure-input ledger (the Java side of edge_client/secure_inputs.py: the same rule, the
// same digests, the same file, the same words). SecAgg reveals a group's sum, never a member's input,
// within one round; across rounds a device sending the same input (Fed3R-Sync statistics of one
// window, a re-sent identical FedAvg task) to several groups lets an aggregator difference the sums.
//
// The rule: per input key (inputKey / vectorKey: docs/secure-aggregation.md, "The secure-input
// ledger's digests") the device keeps one member-set digest (memberDigest). Its masked input leaves
// only in a round whose key directory lists exactly that set (none kept yet: the participants U1 are
// kept, written before it leaves); it answers the unmask phase only when the survivors U3 are exactly
// the set kept, except in the round that first sent it, where U3 becomes the set kept (unless another
// round of the input sent its masked input on the set kept meanwhile: the set is then fixed). Otherwise the
// round is left (ClientSecAgg's ReleaseGuard: ReleaseRefused, OTHER_MEMBERS_REASON logged).
//
// Kept in the device's state folder (secure_inputs.json, {"forgotten":"<base64>","inputs":[[key, member
// digest], ...]} oldest first, canonical JSON: byte for byte what the Python device writes, so either
// reads the other's), else in memory for the process's life. Bounded: MAX_INPUTS entries, the oldest
// forgotten first. A forgotten input is never new again: its key goes into a Bloom filter of forgotten
// inputs (2^20 bits, FORGOTTEN_PROBES positions cut from the key: forgottenPositions), in the file once
// something was forgotten, and a key not kept but in the filter is refused (FORGOTTEN_REASON), else an
// aggregator could push an input out with 1,024 tasks of other inputs and regroup it; a false positive
// only makes the device sit a round out (about 0.65% of new inputs at 100,000 forgotten, 12% at 200,000). A
// file that cannot be read (not a regular file of at most MAX_FILE_BYTES, not strict JSON, an entry
// that is not two 32-digit lowercase hex strings, a key twice, a filter that is not the canonical
// base64 of 2^20 bits) fails closed: every secure input is refused with LOST_REASON (the task
// declined), the file left for the operator and read again at each secure task, so a repaired or
// moved-aside file serves without a restart. A write that fails keeps nothing and the input is not sent. Not job state: DeviceStateStore.forget() leaves it.
package org.fedfleet.device;

import java.io.File;
import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.NoSuchFileException;
import java.nio.file.attribute.BasicFileAttributes;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Base64;
import java.util.Collections;
import java.util.HashSet;
import java.util.Iterator;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.logging.Logger;
import java.util.regex.Pattern;
import org.fedfleet.secagg.ReleaseGuard;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Json;
import org.fedfleet.wire.LogText;

public final class SecureInputLedger {
    public static final String NAME = "secure_inputs.json";
    public static final int MAX_INPUTS = 1024;
    /** 128 bits of SHA-256, lowercase hex: a collision would need 2^64 inputs. */
    public static final int DIGEST_HEX = 32;
    /** m: the forgotten inputs' Bloom filter, 128 KiB. */
    public static final int FORGOTTEN_BITS = 1 << 20;
    /** k: positions per key (forgottenPositions). */
    public static final int FORGOTTEN_PROBES = 7;
    /** The filter's base64 in the file: 174,764 characters. */
    public static final int FORGOTTEN_TEXT = 4 * ((FORGOTTEN_BITS / 8 + 2) / 3);
    /** Each entry ["<32 hex>","<32 hex>"] is 72 bytes, "forgotten":"<base64>", 15 more than the base64
     *  (edge_client/secure_inputs.py MAX_FILE_BYTES). */
    public static final int MAX_FILE_BYTES = 80 * MAX_INPUTS + 64 + FORGOTTEN_TEXT + 16;
    public static final String OTHER_MEMBERS_REASON = "this device's input to this task already went to a secure round of "
            + "other members: revealed over these too, the two sums could be differenced (multi-round leakage), so it "
            + "takes part only in a round of those same members";
    public static final String FORGOTTEN_REASON = "this device forgot which members its input to this task went to (its "
            + "secure-input ledger keeps the newest " + MAX_INPUTS + " inputs): revealed over others, the sums could be "
            + "differenced (multi-round leakage), so it sends this input to no secure round again";
    public static final String LOST_REASON = "this device's secure-input ledger (" + NAME + " in its state folder) could "
            + "not be read: it sends no secure input until an operator repairs that file or moves it aside";
    private static final Logger LOG = LogText.oneLineLogger("fedfleet.device");
    private static final Pattern DIGEST = Pattern.compile("[0-9a-f]{" + DIGEST_HEX + "}");

    private final File path;
    private LinkedHashMap<String, String> kept = new LinkedHashMap<>();     // input key -> member digest, oldest first
    // keys whose set kept a round not the input's first sent its masked input on: fixed, its first
    // round may no longer narrow it to its survivors (the other may be revealed over it; secure_inputs.py)
    private final Set<String> relied = new HashSet<>();
    private byte[] forgotten;      // the Bloom filter of the keys forgotten (bit p: byte p / 8, value 1 << p % 8); null until one is
    private String lost;

    /** path: where the inputs are kept (<state folder>/secure_inputs.json); null: in memory. */
    public SecureInputLedger(File path) {
        this.path = path;
        if (path != null) load();
    }

    // ---------------- the digests (docs/secure-aggregation.md) ----------------
    /** A member set's digest: SHA-256 over the device ids sorted by code point, joined by "\n", UTF-8. */
    public static String memberDigest(Iterable<String> members) {
        List<String> sorted = new ArrayList<>();
        for (String m : members) sorted.add(m);
        sorted.sort(Json.CODE_POINT_ORDER);
        return hex(sha256().digest(String.join("\n", sorted).getBytes(StandardCharsets.UTF_8)));
    }

    /** The key of a task's input: SHA-256 over the canonical JSON of {"kind", "params" less "group"},
     *  then per tensor by name in code-point order the canonical JSON of [name, dtype, shape] and its
     *  bytes (little-endian, C order, as the envelope carries them). */
    public static String inputKey(String kind, Map<String, Object> params, List<Envelope.Tensor> tensors) throws Json.JsonError {
        Map<String, Object> rest = new LinkedHashMap<>(params);
        rest.remove("group");                      // the round's routing: the same input in any group
        Map<String, Object> head = new LinkedHashMap<>();
        head.put("kind", kind);
        head.put("params", rest);
        MessageDigest h = sha256();
        h.update(Json.canonical(head));
        List<Envelope.Tensor> byName = new ArrayList<>(tensors);
        byName.sort((a, b) -> Json.CODE_POINT_ORDER.compare(a.name, b.name));
        for (Envelope.Tensor t : byName) {
            List<Object> shape = new ArrayList<>();
            for (long d : t.shape) shape.add(d);
            h.update(Json.canonical(Arrays.<Object>asList(t.name, t.dtype, shape)));
            h.update(t.data);
        }
        return hex(h.digest());
    }

    /** The forgotten-inputs filter's bit positions of an input key: position i (0 to FORGOTTEN_PROBES - 1)
     *  is the 20-bit number whose 5 hex digits start at digit 5i of the 32-digit key, wrapping past its
     *  last digit to its first (the seventh: digits 30, 31, 0, 1, 2). */
    public static int[] forgottenPositions(String key) {
        String around = key + key;
        int[] positions = new int[FORGOTTEN_PROBES];
        for (int i = 0; i < positions.length; i++) positions[i] = Integer.parseInt(around.substring(5 * i, 5 * i + 5), 16);
        return positions;
    }

    /** The key of an input named by its vector (Fed3R-Sync's statistics before noise): inputKey of
     *  kind, no params, and the vector as the float64 tensor "input". */
    public static String vectorKey(String kind, double[] vector) {
        ByteBuffer bytes = ByteBuffer.allocate(8 * vector.length).order(ByteOrder.LITTLE_ENDIAN);
        for (double v : vector) bytes.putDouble(v);
        try {
            return inputKey(kind, Collections.<String, Object>emptyMap(),
                    Collections.singletonList(new Envelope.Tensor("input", "float64", new long[] {vector.length}, bytes.array())));
        } catch (Json.JsonError e) {            // a kind and a shape are always JSON
            throw new IllegalStateException(e);
        }
    }

    // ---------------- the ledger ----------------
    /** The release guard of one round carrying the input `key` (ClientSecAgg's ReleaseGuard). */
    public ReleaseGuard release(String key) { return new InputRelease(key); }

    /** The member-set digest kept for `key`, or null. */
    public synchronized String kept(String key) { return kept.get(key); }

    /** Why the kept file could not be read (every secure input is then refused), or null. */
    public synchronized String lost() { return lost; }

    /** Read the kept file again (a lost one may have been repaired or moved aside): why it cannot be, or null. */
    public synchronized String reload() { return path == null ? null : load(); }

    private final class InputRelease implements ReleaseGuard {
        private final String key;
        private boolean first;        // this round sent the input first: its survivors become the set kept

        InputRelease(String key) { this.key = key; }

        @Override
        public String maskedInput(Set<String> participants) {
            synchronized (SecureInputLedger.this) {
                first = false;
                if (lost != null && load() != null) return LOST_REASON;
                String digest = memberDigest(participants);
                if (!kept.containsKey(key)) {
                    if (wasForgotten(key)) return FORGOTTEN_REASON;    // its set is unknown now: new it is not
                    first = true;
                    return keep(key, digest);
                }
                if (!kept.get(key).equals(digest)) return OTHER_MEMBERS_REASON;
                relied.add(key);
                return null;
            }
        }

        @Override
        public String unmask(Set<String> survivors) {
            synchronized (SecureInputLedger.this) {
                if (lost != null && load() != null) return LOST_REASON;
                if (!kept.containsKey(key) && wasForgotten(key)) return FORGOTTEN_REASON;   // pushed out since it left
                String digest = memberDigest(survivors);
                // the set this round revealed it over is now known, unless another round relied on it
                if (first && !relied.contains(key)) return keep(key, digest);
                return digest.equals(kept.get(key)) ? null : OTHER_MEMBERS_REASON;
            }
        }
    }

    private boolean wasForgotten(String key) {
        if (forgotten == null) return false;
        for (int p : forgottenPositions(key)) if ((forgotten[p >>> 3] >> (p & 7) & 1) == 0) return false;
        return true;
    }

    private String keep(String key, String digest) {
        LinkedHashMap<String, String> before = kept;
        byte[] forgottenBefore = forgotten;
        kept = new LinkedHashMap<>(before);
        kept.remove(key);
        kept.put(key, digest);
        relied.remove(key);                      // kept anew: no other round sent on this set yet
        for (Iterator<String> oldest = kept.keySet().iterator(); kept.size() > MAX_INPUTS; ) {
            String gone = oldest.next();
            relied.remove(gone);
            oldest.remove();
            if (forgotten == forgottenBefore)    // a copy: a failed write keeps the old filter
                forgotten = forgottenBefore == null ? new byte[FORGOTTEN_BITS / 8] : forgottenBefore.clone();
            for (int p : forgottenPositions(gone)) forgotten[p >>> 3] |= (byte) (1 << (p & 7));
        }
        if (path == null) return null;
        try {
            List<Object> entries = new ArrayList<>();
            for (Map.Entry<String, String> e : kept.entrySet()) entries.add(Arrays.<Object>asList(e.getKey(), e.getValue()));
            Map<String, Object> doc = new LinkedHashMap<>();
            doc.put("inputs", entries);
            if (forgotten != null) doc.put("forgotten", Base64.getEncoder().encodeToString(forgotten));
            AtomicFile.write(path, Json.canonical(doc), DeviceStateStore.TMP, ".json.part");
        } catch (IOException | Json.JsonError e) {
            kept = before;                   // not remembered across a restart: not sent
            forgotten = forgottenBefore;
            LOG.warning("writing the device's secure inputs " + path + " failed (" + cut(String.valueOf(e.getMessage())) + ")");
            return "this device could not write down its secure input (" + e.getClass().getSimpleName() + "): it is not sent";
        }
        return null;
    }

    /** Read the kept file (a missing one: nothing kept); lost, and returned: why it cannot be read. */
    private String load() {
        try {
            BasicFileAttributes kind = null;
            try {      // only a missing file is a fresh device (File.exists() is false for an unreadable folder too)
                kind = Files.readAttributes(path.toPath(), BasicFileAttributes.class);
            } catch (NoSuchFileException e) {
                kept = new LinkedHashMap<>();
                forgotten = null;
            }
            if (kind != null) {
                if (!kind.isRegularFile()) throw new IOException("not a regular file");     // a FIFO would block the open
                Object doc = Json.parseHeader(SmallTextFile.read(path, MAX_FILE_BYTES));
                LinkedHashMap<String, String> entries = checked(doc);
                forgotten = ((Map<?, ?>) doc).containsKey("forgotten") ? checkedFilter(((Map<?, ?>) doc).get("forgotten")) : null;
                kept = entries;
            }
        } catch (IOException | Json.JsonError | IllegalArgumentException e) {
            String why = cut(String.valueOf(e.getMessage()));
            if (!why.equals(lost))          // the file stays as it is, for the operator: never written over
                LOG.warning("the device's secure inputs " + path + " are unreadable (" + why
                        + "): no secure input is sent until the file is repaired or moved aside");
            lost = why;
            return why;
        }
        lost = null;
        return null;
    }

    /** The file's entries: {"inputs": [[key, member digest], ...]} (and "forgotten"), distinct keys, oldest first. */
    static LinkedHashMap<String, String> checked(Object doc) {
        if (!(doc instanceof Map) || ((Map<?, ?>) doc).size() != (((Map<?, ?>) doc).containsKey("forgotten") ? 2 : 1)
                || !(((Map<?, ?>) doc).get("inputs") instanceof List))
            throw new IllegalArgumentException("not {\"inputs\": [...]} (and \"forgotten\")");
        LinkedHashMap<String, String> out = new LinkedHashMap<>();
        for (Object entry : (List<?>) ((Map<?, ?>) doc).get("inputs")) {
            if (!(entry instanceof List) || ((List<?>) entry).size() != 2 || !isDigest(((List<?>) entry).get(0))
                    || !isDigest(((List<?>) entry).get(1)) || out.containsKey(((List<?>) entry).get(0)))
                throw new IllegalArgumentException("an entry that is not [key, member digest]");
            out.put((String) ((List<?>) entry).get(0), (String) ((List<?>) entry).get(1));
        }
        if (out.size() > MAX_INPUTS) throw new IllegalArgumentException(out.size() + " entries, at most " + MAX_INPUTS);
        return out;
    }

    /** The filter's bits from its base64 (RFC 4648, padded), exactly FORGOTTEN_BITS, written as this device
     *  would write them (no other spelling: the two SDKs accept the same files). */
    private static byte[] checkedFilter(Object text) {
        String why = "a forgotten-inputs filter that is not the base64 of 2^20 bits";
        if (!(text instanceof String) || ((String) text).length() != FORGOTTEN_TEXT) throw new IllegalArgumentException(why);
        byte[] bits;
        try {
            bits = Base64.getDecoder().decode((String) text);
        } catch (IllegalArgumentException e) {     // a character or padding out of place
            throw new IllegalArgumentException(why);
        }
        if (bits.length != FORGOTTEN_BITS / 8 || !Base64.getEncoder().encodeToString(bits).equals(text))
            throw new IllegalArgumentException(why);
        return bits;
    }

    private static boolean isDigest(Object value) { return value instanceof String && DIGEST.matcher((String) value).matches(); }

    private static MessageDigest sha256() {
        try {
            return MessageDigest.getInstance("SHA-256");
        } catch (NoSuchAlgorithmException e) {      // every Java platform has it
            throw new IllegalStateException(e);
        }
    }

    private static String hex(byte[] digest) {
        StringBuilder b = new StringBuilder();
        for (int i = 0; i < DIGEST_HEX / 2; i++) b.append(String.format("%02x", digest[i] & 0xff));
        return b.toString();
    }

    private static String cut(String text) { return text.length() <= 200 ? text : text.substring(0, 200); }
}
