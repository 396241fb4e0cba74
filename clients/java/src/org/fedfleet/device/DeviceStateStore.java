// A device's own store of per-job state (the Java side of edge_client/state.py, same rules, same
// files): what a stateful algorithm keeps between its rounds (Scaffold's control c_k, Ditto's and
// FedSim/FedAlt's personal head v_k). Handlers are built once per app start and an app may be
// killed between rounds, so the state lives on disk:
//
// * one file per job, <sha256(job id)[:32]>.npz in the store's folder: the job's float32 arrays
//   plus "__state_header__" (uint8 JSON: job_id, run, round, expires_at), the Python store's
//   format, so either library opens what the other wrote;
// * atomic: written to a ".fedfleet-tmp-" file in the same folder, synced, renamed over the old one
//   (rename(2)): a device killed mid-write finds the previous state or the new one; a torn or
//   foreign file reads as "no state" and is removed. Unlike the Python store the folder itself is
//   not fsynced (java.io cannot open a folder): after a power cut right after a save the device may
//   find the state before it, and its next round continues from that older value (as from a
//   state one round staler);
// * bound to (job id, run, round): an entry of another run is dropped on sight; one written more
//   than max_staleness rounds before the task's round is treated as absent (the algorithm
//   restarts: c_k = 0, v_k = the global head);
// * bounded: one byte budget for all jobs together; admit refuses a job whose state would not fit
//   next to the other jobs' (the task is declined with that reason); nothing is evicted for room
//   (a file larger than the whole budget and 1 MiB of framing, left by a store with a larger one,
//   is not read and goes as a foreign one: its job could not keep it, since its next save would
//   not fit);
// * dropped when the aggregator says the job ended (`job.ended`, JobEnded: dropRun, only the run
//   that ended), when it expires (each task names the job's horizon ttl_s: the fallback for a device
//   that missed the notice; expired entries go on the next open), when the job's run changes, and
//   all at once by forget() (the device forgotten);
// * never sent: nothing here publishes anything.
// java.io only (Android), as ModelSlot.
package org.fedfleet.device;

import java.io.File;
import java.io.FileInputStream;
import java.io.IOException;
import java.math.BigInteger;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.function.DoubleSupplier;
import java.util.regex.Pattern;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Json;

public final class DeviceStateStore {
    public static final long DEFAULT_BUDGET_BYTES = 16L << 20;     // all jobs together, as the Python device
    public static final double DEFAULT_TTL_S = 7 * 24 * 3600.0;
    static final String HEADER = "__state_header__";
    private static final String SUFFIX = ".npz";
    static final String TMP = ".fedfleet-tmp-";  // temporary files (this store's and SessionMemoryFile's): swept
    // The folder may hold the operator's own files: the store reads, sweeps and forgets only the names
    // it writes (a review found the Python store deleting a user's model.npz; this one did the same).
    private static final Pattern OWN_NAME = Pattern.compile("[0-9a-f]{32}" + Pattern.quote(SUFFIX));
    private static final Pattern OWN_TEMP = Pattern.compile(Pattern.quote(TMP) + "[0-9]+(\\.npz\\.part|\\.json\\.part)");

    /** A job's state would not fit in the device's state budget (the task is declined). */
    public static final class BudgetExceeded extends Exception {
        BudgetExceeded(String m) { super(m); }
    }

    /** One job's state as stored: float32 arrays by name, the round it was written at, the job's run. */
    public static final class Entry {
        public final String jobId, run;
        public final long round;
        public final Map<String, Npz.Array> arrays;
        public final double expiresAt;
        Entry(String jobId, String run, long round, Map<String, Npz.Array> arrays, double expiresAt) {
            this.jobId = jobId; this.run = run; this.round = round; this.arrays = arrays; this.expiresAt = expiresAt;
        }
        public long nbytes() { return bytes(arrays); }
    }

    private final File root;
    private final long budgetBytes;
    private final DoubleSupplier clock;                 // seconds since the epoch

    public DeviceStateStore(File root) throws IOException {
        this(root, DEFAULT_BUDGET_BYTES, () -> System.currentTimeMillis() / 1000.0);
    }

    public DeviceStateStore(File root, long budgetBytes, DoubleSupplier clock) throws IOException {
        if (budgetBytes < 0) throw new IllegalArgumentException("budgetBytes must be >= 0, got " + budgetBytes);
        if (!root.isDirectory() && !root.mkdirs()) throw new IOException("cannot create the state folder " + root);
        this.root = root; this.budgetBytes = budgetBytes; this.clock = clock;
        sweep();
    }

    /** The store's folder (the agent keeps its session memory there, SessionMemoryFile.NAME). */
    public File root() { return root; }

    /** Bytes the arrays take in the store (their data; the header and framing are small). */
    public static long bytes(Map<String, Npz.Array> arrays) {
        long n = 0;
        for (Npz.Array a : arrays.values()) n += a.bytes().length;
        return n;
    }

    // ------------------------------------------------------------------ files
    private File path(String jobId) {
        // hashed: a job id never becomes a path component (no traversal, no odd characters)
        return new File(root, Envelope.hex(Envelope.sha256(jobId.getBytes(StandardCharsets.UTF_8))).substring(0, 32) + SUFFIX);
    }

    /** The entry in `file`, or null (and the file removed) when it is torn or not ours. */
    private Entry read(File file) {
        if (!file.exists()) return null;
        try {
            Map<String, Npz.Array> arrays = Npz.read(readAll(file), budgetBytes + (1 << 20));
            Npz.Array header = arrays.remove(HEADER);
            @SuppressWarnings("unchecked")
            Map<String, Object> h = (Map<String, Object>) Json.parse(new String(header.bytes(), StandardCharsets.UTF_8));
            BigInteger round = (BigInteger) h.get("round");
            if (round.bitLength() > 62) throw new IOException("round out of range");
            if (!(h.get("job_id") instanceof String) || !(h.get("run") instanceof String))
                throw new IOException("state header without its job_id and run");   // as torn: Python drops it too
            double expiresAt = ((Number) h.get("expires_at")).doubleValue();
            if (!Double.isFinite(expiresAt))   // a 400-digit integer is +Infinity here: never expiring; Python drops it
                throw new IOException("state header: expires_at must be a finite number");
            return new Entry((String) h.get("job_id"), (String) h.get("run"), round.longValue(), arrays, expiresAt);
        } catch (Exception e) {          // torn, foreign or tampered: never trusted, never fatal
            // a folder under the name is not ours to remove (File.delete took an empty one; Python's unlink cannot)
            if (!file.isDirectory()) file.delete();
            return null;
        }
    }

    private Map<File, Entry> entries() {
        return entries(null);
    }

    /** Every readable entry but the file `skip` (not even read). */
    private Map<File, Entry> entries(File skip) {
        Map<File, Entry> out = new LinkedHashMap<>();
        File[] files = root.listFiles((d, name) -> OWN_NAME.matcher(name).matches());
        if (files == null) return out;
        Arrays.sort(files);
        for (File f : files) {
            if (f.equals(skip)) continue;
            Entry e = read(f);
            if (e != null) out.put(f, e);
        }
        return out;
    }

    /** Remove expired entries (and leftover temporary files); how many entries went. */
    public synchronized int sweep() {
        File[] tmps = root.listFiles((d, name) -> OWN_TEMP.matcher(name).matches());
        if (tmps != null) for (File t : tmps) t.delete();
        double now = clock.getAsDouble();
        int gone = 0;
        for (Map.Entry<File, Entry> e : entries().entrySet())
            if (e.getValue().expiresAt <= now && e.getKey().delete()) gone++;
        return gone;
    }

    /** Bytes of state held for every job but `excluding` (null: all), whose own file is not even
     *  read: a task admits its job's state twice, and the file it will replace is no other job's. */
    public synchronized long usedBytes(String excluding) {
        long n = 0;
        for (Entry e : entries(excluding == null ? null : path(excluding)).values()) if (!e.jobId.equals(excluding)) n += e.nbytes();
        return n;
    }

    // ------------------------------------------------------------------ the API handlers use
    /** BudgetExceeded unless `nbytes` of state for `jobId` fit next to the other jobs' state. */
    public synchronized void admit(String jobId, long nbytes) throws BudgetExceeded {
        long others = usedBytes(jobId);
        if (others + nbytes > budgetBytes)
            throw new BudgetExceeded("job " + jobId + "'s device state needs " + nbytes + " bytes; this device's state budget is "
                    + budgetBytes + " bytes with " + others + " held by other jobs");
    }

    /** The job's entry, or null: none stored, another run's (dropped), expired, or (with round and
     *  maxStaleness not null) written more than maxStaleness rounds before `round`. run null:
     *  whichever run's the store holds. */
    public synchronized Entry load(String jobId, String run, Long round, Long maxStaleness) {
        File file = path(jobId);
        Entry e = read(file);
        if (e == null) return null;
        if (!jobId.equals(e.jobId) || (run != null && !run.equals(e.run)) || e.expiresAt <= clock.getAsDouble()) {
            file.delete();
            return null;
        }
        if (round != null && maxStaleness != null && round - e.round > maxStaleness)
            return null;            // too old to trust: the caller restarts (overwritten on save)
        return e;
    }

    /** Store the job's state atomically (after admitting its size). */
    public synchronized Entry save(String jobId, String run, long round, Map<String, Npz.Array> arrays, double ttlS)
            throws BudgetExceeded, IOException {
        if (arrays.containsKey(HEADER)) throw new IllegalArgumentException("state arrays must not be named " + HEADER);
        admit(jobId, bytes(arrays));
        Entry e = new Entry(jobId, run, round, new LinkedHashMap<>(arrays), clock.getAsDouble() + ttlS);
        Map<String, Object> h = new LinkedHashMap<>();
        h.put("job_id", jobId);
        h.put("run", run);
        h.put("round", BigInteger.valueOf(round));
        h.put("expires_at", e.expiresAt);
        Map<String, Npz.Array> file = new LinkedHashMap<>(arrays);
        try {
            file.put(HEADER, Npz.uint8(Json.canonical(h)));
        } catch (Json.JsonError err) {
            throw new IllegalArgumentException("state header: " + err.getMessage());
        }
        AtomicFile.write(path(jobId), Npz.write(file), TMP, SUFFIX + ".part");   // TMP: sweep() removes a crash's leftover
        return e;
    }

    /** Put back an entry load returned (its run, round, arrays and expiry): what a task that declined
     *  after its handler had saved leaves behind, so the next round starts where this one did. */
    public synchronized void restore(Entry e) throws BudgetExceeded, IOException {
        save(e.jobId, e.run, e.round, e.arrays, Math.max(e.expiresAt - clock.getAsDouble(), 1e-3));
    }

    /** Remove the job's state (its job ended); whether there was any. */
    public synchronized boolean drop(String jobId) {
        return path(jobId).delete();
    }

    /** Remove the job's state if it is `run`'s (that run of the job ended: `job.ended`); whether it was.
     *  Another run's state stays: a notice replayed from an older run never wipes a newer one's. */
    public synchronized boolean dropRun(String jobId, String run) {
        File file = path(jobId);
        Entry e = read(file);
        return e != null && jobId.equals(e.jobId) && run.equals(e.run) && file.delete();
    }

    /** Remove every job's state (the device forgotten); how many files went. */
    public synchronized int forget() {
        File[] files = root.listFiles((d, name) -> OWN_NAME.matcher(name).matches() || OWN_TEMP.matcher(name).matches());
        int n = 0;
        if (files != null) for (File f : files) if (f.delete()) n++;
        return n;
    }

    public synchronized List<String> jobs() {
        List<String> out = new ArrayList<>();
        for (Entry e : entries().values()) out.add(e.jobId);
        return out;
    }

    private byte[] readAll(File file) throws IOException {
        // only a regular file is opened: opening a FIFO waits for a writer for ever (the store's start
        // reads every state file), as edge_client/state.py's open_regular refuses it
        if (!file.isFile()) throw new IOException(file + " is not a regular file");
        if (file.length() > budgetBytes + (1 << 20)) throw new IOException(file + " is larger than the state budget");
        byte[] data = new byte[(int) file.length()];
        try (FileInputStream in = new FileInputStream(file)) {
            int at = 0;
            for (int n; at < data.length && (n = in.read(data, at, data.length - at)) > 0; ) at += n;
            if (at != data.length) throw new IOException(file + " changed while it was read");
        }
        return data;
    }
}
