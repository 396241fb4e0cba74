// The deployed model the application predicts with (issue 29; the Java side of
// edge_client/deployment.py ModelSlot, on the same files, so either library can open a slot the
// other wrote): the current head and the one it replaced, in a directory holding <sha256>.npz per
// kept head and slot.json naming them ({"current": {sha256, deployment, bundle_sha256} or null,
// "previous": ..., "local_labels": [...] or null}).
//
// A swap verifies the head file against the sha256 its signed assignment named, writes the file,
// then replaces slot.json in one atomic rename, and only then changes the version in memory (one
// volatile reference to an immutable pair): a reader predicts with the old or the new head, never
// half of one, and a crash leaves the old or the new version on disk. A device that personalises
// (OLL) gives its training labels: it predicts with the head pruned to those classes, as it
// judged the candidate (the labels are kept in slot.json). java.io only (no java.nio.file), as the
// rest of the library, for Android: the rename is rename(2), atomic within one directory.
//
// The application may open a slot of its own on the folder (to predict as the device does) while
// the follower swaps heads, in another process, Java or Python: opening the slot and every commit
// hold the folder's lock (.slot.lock, a POSIX record lock: FileChannel.lock here, fcntl.lockf in
// edge_client/deployment.py, so the two exclude each other; an flock would not see this one;
// shared, or none where no lock file exists, on a folder this process may only read), and a commit
// reads what the other wrote again under it, by the Python slot's rules (a labels-only commit keeps
// the saved heads and sequence, a swap the higher sequence and the saved labels).
package org.fedfleet.device;

import java.io.File;
import java.io.FileInputStream;
import java.io.IOException;
import java.io.RandomAccessFile;
import java.math.BigInteger;
import java.nio.channels.FileLock;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.TreeSet;
import java.util.concurrent.ConcurrentHashMap;
import java.util.regex.Pattern;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Json;

public final class ModelSlot {
    public static final String STATE_FILE = "slot.json", ASSIGN = "deployment.assign", RUN = "run", ROLLBACK = "rollback";
    private static final Pattern SHA = Pattern.compile("^[0-9a-f]{64}$"), ID = Pattern.compile("^[A-Za-z0-9_.-]{1,64}$");
    private static final Pattern HEAD_FILE = Pattern.compile("[0-9a-f]{64}\\.npz");    // a version's head, named by its sha256
    private static final long MAX_STATE_BYTES = 1 << 20;    // slot.json: two versions' names, a sequence, class ids

    /** One kept version: its head file's sha256, the deployment that brought it, the bundle whose features it reads. */
    public static final class Version {
        public final String sha256, deployment, bundleSha256;
        public final HeadFile head;
        Version(String sha256, String deployment, String bundleSha256, HeadFile head) {
            this.sha256 = sha256; this.deployment = deployment; this.bundleSha256 = bundleSha256; this.head = head;
        }
    }

    /** A verified assignment for ``device`` under sequence ``seq``: run a head (sha256, nbytes,
     *  bundleSha256) or roll a deployment back (reason). */
    public static final class Assignment {
        public final String deployment, device, action, sha256, bundleSha256, reason;
        public final long seq, nbytes;
        Assignment(String deployment, String device, long seq, String action, String sha256, long nbytes, String bundleSha256,
                   String reason) {
            this.deployment = deployment; this.device = device; this.seq = seq; this.action = action; this.sha256 = sha256;
            this.nbytes = nbytes; this.bundleSha256 = bundleSha256; this.reason = reason;
        }
    }

    /** Why an assignment is refused before anything is done: its class (protocols/payloads/deployment.py
     *  REFUSAL_REASONS) and the text. */
    public static final class Refusal extends Exception {
        public final String reason;
        Refusal(String reason, String why) { super(why); this.reason = reason; }
    }

    private static final class State {
        final Version current, previous;
        State(Version current, Version previous) { this.current = current; this.previous = previous; }
    }

    /** The folders this JVM's slots lock, each a monitor: a record lock is the process's, so two slots of
     *  one JVM on a folder would both take it (FileChannel.lock refuses the second with an exception). */
    private static final Map<String, Object> IN_PROCESS = new ConcurrentHashMap<>();

    public final File dir;
    private volatile int[] localLabels;           // sorted, distinct; null: the full head
    private volatile State state;
    private volatile long seq;                    // the highest assignment sequence accepted: a lower one is a replay
    private String seqKey;                        // the aggregator key it was held under (sha256 hex; null: none)
    private boolean legacySeq;                    // slot.json from before sequences named their key

    public ModelSlot(File dir) throws IOException { this(dir, null); }

    /** ``localLabels``: the device personalises (OLL) with these training labels (null: those kept in slot.json, if any). */
    public ModelSlot(File dir, int[] localLabels) throws IOException {
        this.dir = dir;
        if (!dir.isDirectory() && !dir.mkdirs()) throw new IOException("cannot create " + dir);
        int[] own = localLabels != null ? distinctSorted(localLabels) : null;
        synchronized (this) {
            underFolderLock(() -> {
                load();
                if (own != null) {              // a labels-only commit: what was just read, these labels
                    this.localLabels = own;
                    write(state);
                }
            });
        }
    }

    /** What slot.json says (heads, sequence, key, labels); nothing when there is none. */
    private void load() throws IOException {
        Map<String, Object> saved = saved();
        if (saved == null) {
            state = new State(null, null);
            return;
        }
        state = new State(read(saved.get("current")), read(saved.get("previous")));
        seq = savedSeq(saved);
        legacySeq = !saved.containsKey("seq_key");
        seqKey = saved.get("seq_key") instanceof String ? (String) saved.get("seq_key") : null;
        localLabels = savedLabels(saved);
    }

    private Map<String, Object> saved() throws IOException {
        File file = new File(dir, STATE_FILE);
        return file.exists() ? checked(file, object(parseJson(readAll(file, MAX_STATE_BYTES)))) : null;
    }

    private static long savedSeq(Map<String, Object> saved) {
        return saved.get("seq") != null ? ((BigInteger) saved.get("seq")).longValue() : 0;
    }

    private static int[] savedLabels(Map<String, Object> saved) {
        Object kept = saved.get("local_labels");
        return kept instanceof List ? ((List<?>) kept).stream().mapToInt(x -> ((BigInteger) x).intValue()).toArray() : null;
    }

    private interface FolderWork { void run() throws IOException; }

    /** ``work`` holding the folder's lock: this JVM's monitor for it, then the record lock on .slot.lock
     *  (shared where the folder may only be read; none where no lock file exists on such a folder). */
    private void underFolderLock(FolderWork work) throws IOException {
        File lockFile = new File(dir, ".slot.lock");
        synchronized (IN_PROCESS.computeIfAbsent(lockFile.getCanonicalPath(), k -> new Object())) {
            RandomAccessFile file;
            boolean shared = false;
            try {
                file = new RandomAccessFile(lockFile, "rw");
            } catch (java.io.FileNotFoundException cannotWrite) {     // a read-only folder or file
                if (!lockFile.isFile()) {
                    work.run();
                    return;
                }
                file = new RandomAccessFile(lockFile, "r");
                shared = true;
            }
            try (RandomAccessFile closing = file) {
                FileLock held = closing.getChannel().lock(0, Long.MAX_VALUE, shared);   // released when the file closes
                try {
                    work.run();
                } finally {
                    held.release();
                }
            }
        }
    }

    public Version current() { return state.current; }

    public Version previous() { return state.previous; }

    public int[] localLabels() { return localLabels == null ? null : localLabels.clone(); }

    public long seq() { return seq; }

    /** The follower's aggregator key (null: none): a sequence held under another key, or under none
     *  (where anyone on the broker could publish an assignment), does not bind this one; one written
     *  before keys were recorded is taken as this key's. The rule of edge_client/deployment.py bind_key. */
    public synchronized void bindKey(byte[] aggregatorKey) throws IOException {
        String keyId = null;
        if (aggregatorKey != null) {
            try {
                StringBuilder hex = new StringBuilder();
                for (byte x : java.security.MessageDigest.getInstance("SHA-256").digest(aggregatorKey))
                    hex.append(String.format("%02x", x));
                keyId = hex.toString();
            } catch (java.security.NoSuchAlgorithmException e) {
                throw new IllegalStateException(e);
            }
        }
        if (legacySeq) {
            legacySeq = false;
        } else if (java.util.Objects.equals(keyId, seqKey)) {
            return;
        } else {
            seq = 0;
        }
        seqKey = keyId;
        commit(state);
    }

    /** Take assignment ``a`` on device ``deviceId``: Refusal when it names another device or carries a
     *  sequence below the one held (a replayed capture); else its sequence is held (durably, before
     *  anything is done). The same sequence again is a retained re-delivery, not a replay. The rule of
     *  edge_client/deployment.py refusal_of. */
    public synchronized void admit(Assignment a, String deviceId) throws Refusal, IOException {
        if (!a.device.equals(deviceId))
            throw new Refusal("device", "assignment " + a.seq + " of " + a.deployment + " is for '" + a.device
                    + "', not this device: refused");
        if (a.seq < seq)
            throw new Refusal("stale", "assignment " + a.seq + " of " + a.deployment + " is older than the one held ("
                    + seq + "): refused");
        if (a.seq > seq) {
            seq = a.seq;
            commit(state);
        }
    }

    /** Class ids for the rows of ``features`` with the deployed head (OLL-pruned when the device personalises). */
    public int[] predict(float[][] features) {
        Version v = state.current;
        if (v == null) throw new IllegalStateException("no model version is deployed on this device yet");
        return v.head.predict(features, localLabels);
    }

    /** The head file of a kept version (as written when it was swapped in). */
    public byte[] keptBytes(Version v) throws IOException { return readAll(new File(dir, v.sha256 + ".npz")); }

    /** How many labelled samples ``head`` gets right the way this device predicts (the counts it reports). */
    public int correct(HeadFile head, float[][] features, int[] labels) {
        int[] pred = head.predict(features, localLabels);
        int right = 0;
        for (int i = 0; i < pred.length; i++) if (pred[i] == labels[i]) right++;
        return right;
    }

    /** The assignment in a retained deploy message; with ``aggregatorKey`` (raw Ed25519) only one the
     *  aggregator signed. EnvelopeError says why it is refused. */
    public static Assignment assignment(byte[] message, byte[] aggregatorKey) throws Envelope.EnvelopeError {
        Envelope.Message env = Envelope.decode(message, aggregatorKey, 1 << 20);
        if (!ASSIGN.equals(env.type())) throw new Envelope.EnvelopeError("expected " + ASSIGN + ", got " + env.type());
        if (!Topics.AGGREGATOR_ID.equals(env.sender()))
            throw new Envelope.EnvelopeError("assignment from " + env.sender() + ", expected the aggregator");
        Map<String, Object> b = env.body();
        String deployment = text(b, "deployment", ID), device = text(b, "device", ID), action = text(b, "action", null);
        if (Topics.AGGREGATOR_ID.equals(device)) throw new Envelope.EnvelopeError("assignment for the aggregator");
        if (!(b.get("seq") instanceof BigInteger)) throw new Envelope.EnvelopeError("assignment sequence must be an integer");
        BigInteger bigSeq = (BigInteger) b.get("seq");
        if (bigSeq.signum() <= 0 || bigSeq.bitLength() > 62) throw new Envelope.EnvelopeError("assignment sequence " + bigSeq + ": 1..2**62");
        long seq = bigSeq.longValue();
        if (ROLLBACK.equals(action)) {      // a reason is a string (absent: ""), cut to 500 characters as Python cuts it
            String reason = b.containsKey("reason") ? text(b, "reason", null) : "";
            if (Json.characters(reason) > 500) reason = reason.substring(0, reason.offsetByCodePoints(0, 500));
            return new Assignment(deployment, device, seq, action, "", 0, "", reason);
        }
        if (!RUN.equals(action)) throw new Envelope.EnvelopeError("unknown deployment action " + action);
        if (!(b.get("nbytes") instanceof BigInteger)) throw new Envelope.EnvelopeError("nbytes must be an integer");
        // checked whole, as the Python device checks it: longValue() wraps 2^63 .. 2^64 - 1 (integers the
        // wire takes) to a negative count, which was refused naming that count, not the one sent
        BigInteger bigNbytes = (BigInteger) b.get("nbytes");
        if (bigNbytes.signum() <= 0 || bigNbytes.compareTo(BigInteger.valueOf(HeadFile.MAX_HEAD_BYTES)) > 0)
            throw new Envelope.EnvelopeError("head of " + bigNbytes + " bytes: at most " + HeadFile.MAX_HEAD_BYTES);
        long nbytes = bigNbytes.longValue();
        // not used here, but part of a run (docs/protocol.md "Messages"): one without it is refused, as by the Python device
        if (!(b.get("model_id") instanceof BigInteger)) throw new Envelope.EnvelopeError("model_id must be an integer");
        Object bundle = b.get("bundle_sha256");
        String bundleSha = bundle == null || "".equals(bundle) ? "" : text(b, "bundle_sha256", SHA);
        return new Assignment(deployment, device, seq, action, text(b, "sha256", SHA), nbytes, bundleSha, "");
    }

    /** The file an `artifact` carries (protocols/payloads/artifacts.py parse_artifact): exactly one
     *  tensor, `data`, 1-D uint8 (else a Refusal of class "load": no usable head), hashing to
     *  ``sha256`` (else class "hash"). The first tensor was taken whatever its name or shape, where
     *  the Python device took the one named `data`. */
    public static byte[] artifactBytes(Envelope.Message env, String sha256) throws Refusal {
        Envelope.Tensor data = env.tensors.size() == 1 ? env.tensors.get(0) : null;
        if (data == null || !"data".equals(data.name) || !"uint8".equals(data.dtype) || data.shape.length != 1)
            throw new Refusal("load", "the artifact does not carry exactly one 1-D uint8 tensor 'data'");
        String digest = Envelope.hex(Envelope.sha256(data.data));
        if (!digest.equals(sha256))
            throw new Refusal("hash", "sha256 " + digest.substring(0, 16) + "… differs from the requested " + sha256.substring(0, 16) + "…");
        return data.data;
    }

    /** Make the head file ``data`` current, keeping the current one as previous; IOException (and
     *  nothing changed) when it does not hash to ``sha256`` or is not a head. */
    public synchronized Version swap(byte[] data, String sha256, String deployment, String bundleSha256) throws IOException {
        String digest = Envelope.hex(Envelope.sha256(data));
        if (!digest.equals(sha256))
            throw new IOException("head sha256 " + digest.substring(0, 16) + "… differs from the assigned " + sha256);
        HeadFile head = HeadFile.parse(data);
        if (localLabels != null) head.predict(new float[0][], localLabels);     // a class it has no row for: refused now
        Version v = new Version(sha256, deployment, bundleSha256, head);
        // the file written under the lock, with the state naming it: written before, another slot's
        // commit in between would delete it as unnamed (the Python slot's review finding)
        commit(new State(v, state.current), data);
        return v;
    }

    /** The current head, judged again under ``deployment`` (the same head deployed anew): from now on it
     *  came from that one, as protocols' Python ModelSlot.relabel says (its re-delivered assignment is a
     *  re-delivery, its rollback reverts it). */
    public synchronized void relabel(String deployment) throws IOException {
        State s = state;
        if (s.current == null || s.current.deployment.equals(deployment)) return;
        commit(new State(new Version(s.current.sha256, deployment, s.current.bundleSha256, s.current.head), s.previous));
    }

    /** Back to the kept version if the current one came from ``deployment``; whether it did. */
    public synchronized boolean revert(String deployment) throws IOException {
        State s = state;
        if (s.current == null || !s.current.deployment.equals(deployment)) return false;
        commit(new State(s.previous, null));
        return true;
    }

    private void commit(State next) throws IOException { commit(next, null); }

    /** Write ``next`` (with ``newFile``, the current head's bytes, first), holding the folder's lock,
     *  after reading again what another slot on the folder wrote: the higher sequence under this key
     *  is kept, and its labels when this slot has none (edge_client/deployment.py ModelSlot._commit). */
    private void commit(State next, byte[] newFile) throws IOException {
        underFolderLock(() -> {
            Map<String, Object> saved = saved();
            if (saved != null) {
                boolean savedLegacy = !saved.containsKey("seq_key");
                String savedKey = saved.get("seq_key") instanceof String ? (String) saved.get("seq_key") : null;
                if (legacySeq && !savedLegacy) {    // keyed since by another slot: its key and sequence
                    legacySeq = false;
                    seqKey = savedKey;
                    seq = Math.max(seq, savedSeq(saved));
                } else if (savedLegacy || (!legacySeq && java.util.Objects.equals(savedKey, seqKey))) {
                    seq = Math.max(seq, savedSeq(saved));
                }
                if (localLabels == null) localLabels = savedLabels(saved);
            }
            if (newFile != null) {
                // labels saved since the swap was judged: a head without their classes is refused
                if (localLabels != null) next.current.head.predict(new float[0][], localLabels);
                AtomicFile.write(new File(dir, next.current.sha256 + ".npz"), newFile);
            }
            write(next);
        });
    }

    private void write(State next) throws IOException {
        Map<String, Object> doc = new LinkedHashMap<>();
        doc.put("current", entry(next.current));
        doc.put("previous", entry(next.previous));
        List<Object> labels = new ArrayList<>();
        if (localLabels != null) for (int c : localLabels) labels.add(BigInteger.valueOf(c));
        doc.put("local_labels", localLabels == null ? Json.NULL : labels);
        doc.put("seq", BigInteger.valueOf(seq));
        if (!legacySeq) doc.put("seq_key", seqKey == null ? Json.NULL : seqKey);
        try {
            AtomicFile.write(new File(dir, STATE_FILE), Json.canonical(doc));
        } catch (Json.JsonError e) {
            throw new IOException(e.getMessage());
        }
        state = next;
        File[] files = dir.listFiles();
        for (File f : files == null ? new File[0] : files) {        // versions neither kept nor running
            String name = f.getName();
            boolean kept = (next.current != null && name.equals(next.current.sha256 + ".npz"))
                    || (next.previous != null && name.equals(next.previous.sha256 + ".npz"));
            // only a head file this slot wrote (<sha256>.npz): the folder may hold the operator's files
            if (HEAD_FILE.matcher(name).matches() && !kept && !f.delete()) throw new IOException("cannot remove " + f);
        }
    }

    private static Object entry(Version v) {
        if (v == null) return Json.NULL;
        Map<String, Object> e = new LinkedHashMap<>();
        e.put("sha256", v.sha256);
        e.put("deployment", v.deployment);
        e.put("bundle_sha256", v.bundleSha256);
        return e;
    }

    private Version read(Object entry) throws IOException {
        if (!(entry instanceof Map)) return null;
        Map<String, Object> e = object(entry);
        String sha = (String) e.get("sha256");
        if (sha == null || !SHA.matcher(sha).matches()) throw new IOException(STATE_FILE + ": bad sha256 " + sha);
        byte[] data = readAll(new File(dir, sha + ".npz"));
        if (!Envelope.hex(Envelope.sha256(data)).equals(sha)) throw new IOException(sha + ".npz no longer hashes to its name");
        Object bundle = e.get("bundle_sha256");
        return new Version(sha, (String) e.get("deployment"), bundle instanceof String ? (String) bundle : "", HeadFile.parse(data));
    }

    /** slot.json read as strictly as it is written, the rule of edge_client/deployment.py ModelSlot._saved
     *  (a Java slot and a Python one decide alike on the same folder): ``seq`` an integer in [0, 2^62],
     *  ``seq_key`` null or a sha256, ``local_labels`` null or a list of class ids in [0, 2^31), each version
     *  null or {sha256, deployment, bundle_sha256 (optional)} of those types. A wrong type escaped as a
     *  ClassCastException, and a seq past a long wrapped to a small one (a review's findings). */
    private static Map<String, Object> checked(File file, Map<String, Object> saved) throws IOException {
        Object seq = saved.get("seq"), key = saved.get("seq_key"), labels = saved.get("local_labels");
        if (saved.containsKey("seq") && !(seq instanceof BigInteger && ((BigInteger) seq).signum() >= 0
                && ((BigInteger) seq).compareTo(BigInteger.ONE.shiftLeft(62)) <= 0))
            throw new IOException(file + ": seq must be an integer in [0, 2^62], got " + cut(seq));
        if (key != null && key != Json.NULL && !(key instanceof String && SHA.matcher((String) key).matches()))
            throw new IOException(file + ": seq_key must be null or a sha256, got " + cut(key));
        if (labels != null && labels != Json.NULL) {
            boolean ids = labels instanceof List;
            for (Object c : ids ? (List<?>) labels : List.of())
                ids &= c instanceof BigInteger && ((BigInteger) c).signum() >= 0 && ((BigInteger) c).bitLength() <= 31;
            if (!ids) throw new IOException(file + ": local_labels must be a list of class ids (integers >= 0)");
        }
        for (String k : new String[]{"current", "previous"}) {
            Object v = saved.get(k);
            if (v == null || v == Json.NULL) continue;
            Map<?, ?> e = v instanceof Map ? (Map<?, ?>) v : null;
            if (e == null || !(e.get("sha256") instanceof String) || !SHA.matcher((String) e.get("sha256")).matches()
                    || !(e.get("deployment") instanceof String)
                    || (e.containsKey("bundle_sha256") && !(e.get("bundle_sha256") instanceof String)))
                throw new IOException(file + ": " + k + " must be a version (sha256, deployment, bundle_sha256)");
        }
        return saved;
    }

    private static String cut(Object v) { String t = String.valueOf(v); return t.length() > 40 ? t.substring(0, 40) : t; }

    private static byte[] readAll(File file) throws IOException { return readAll(file, HeadFile.MAX_HEAD_BYTES); }

    /** At most ``maxBytes`` of a regular file (a FIFO in its place would block the device for ever). */
    private static byte[] readAll(File file, long maxBytes) throws IOException {
        if (!file.isFile()) throw new IOException(file + " is not a regular file");
        long size = file.length();
        if (size > maxBytes) throw new IOException(file + " is larger than " + maxBytes + " bytes");
        byte[] data = new byte[(int) size];
        try (FileInputStream in = new FileInputStream(file)) {
            int at = 0;
            for (int n; at < data.length && (n = in.read(data, at, data.length - at)) > 0; ) at += n;
            if (at != data.length || in.read() != -1) throw new IOException(file + " changed while read");
        }
        return data;
    }

    private static int[] distinctSorted(int[] labels) {
        TreeSet<Integer> set = new TreeSet<>();
        for (int c : labels) {
            if (c < 0) throw new IllegalArgumentException("local labels must be non-negative, got " + c);
            set.add(c);
        }
        if (set.isEmpty()) throw new IllegalArgumentException("no local labels");
        return set.stream().mapToInt(Integer::intValue).toArray();
    }

    /** As strictly as the Python device reads it (protocols/envelope.py parse_strict_json): UTF-8 that
     *  decodes (new String replaced a bad byte), integers within the wire's range anywhere (parseHeader's). */
    private static Object parseJson(byte[] data) throws IOException {
        try {
            String text = StandardCharsets.UTF_8.newDecoder().onMalformedInput(java.nio.charset.CodingErrorAction.REPORT)
                    .onUnmappableCharacter(java.nio.charset.CodingErrorAction.REPORT).decode(java.nio.ByteBuffer.wrap(data)).toString();
            return Json.parseHeader(text);
        } catch (java.nio.charset.CharacterCodingException e) {
            throw new IOException(STATE_FILE + ": not UTF-8: " + e);
        } catch (Json.JsonError e) {
            throw new IOException(STATE_FILE + ": " + e.getMessage());
        }
    }

    @SuppressWarnings("unchecked")
    private static Map<String, Object> object(Object o) throws IOException {
        if (!(o instanceof Map)) throw new IOException(STATE_FILE + ": not a JSON object");
        return (Map<String, Object>) o;
    }

    private static String text(Map<String, Object> b, String key, Pattern pattern) throws Envelope.EnvelopeError {
        Object v = b.get(key);
        if (!(v instanceof String) || (pattern != null && !pattern.matcher((String) v).matches()))
            throw new Envelope.EnvelopeError("assignment field '" + key + "' is missing or malformed: " + v);
        return (String) v;
    }
}
