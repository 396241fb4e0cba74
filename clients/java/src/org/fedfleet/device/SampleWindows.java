// The device's sample-window ledger (the Java side of edge_client/sample_windows.py: same rule, same
// words, same file). A fed3r.stats answer (and fed3r.secure's, the same statistics masked) covers the
// window [s, e) of the device's samples the aggregator chose (from_sample; max_samples with
// cap_samples); answers over windows one sample apart differ by exactly that sample's z z^T and z y^T.
//
// The boundary rule: the device keeps both ends of every window it answered, 0 among them from the
// start. A window is answered only when each of its ends is a kept boundary or lies at least
// minDifference samples (default 8) from every kept boundary and from the window's other end; then
// every answered window, and every sum or difference of answers, is a union of blocks of at least
// minDifference samples. One exception: the device's first answer when it starts at its first
// sample ([0, e), all its data or its first e under a cap), whatever e.
//
// Kept in the device's state folder (sample_windows.json, {"boundaries":[0,...]}) and in memory:
// written atomically before the answer leaves the handler; an answer whose window could not be
// written is declined and its boundaries taken back. A window that would add a boundary past
// MAX_BOUNDARIES is declined (a boundary is never forgotten). Not job state: DeviceStateStore.forget()
// leaves it. It fails closed in two cases, by the Python device's rule and words:
// Lost: the file is read once; a missing file is a fresh device, any other file that is not a regular
// file of at most MAX_FILE_BYTES, strict JSON, strictly ascending integers from 0 (at most
// MAX_BOUNDARIES) makes the ledger lost: a warning naming the file, then every window declined with
// LOST_REASON, nothing written (the bad file stays for the operator, who repairs it or moves it aside:
// a lost ledger reads the file again at every window asked, so no restart is needed). Starting from {0}
// instead would exempt a first answer [0, n - 1) again.
// Unkept (no state folder, path null): only a window of all the device's samples from the first is
// answered (the same answer after any restart); capped windows of fewer and streaming increments are
// declined (unkeptReason, naming the missing state folder).
package org.fedfleet.device;

import java.io.File;
import java.io.IOException;
import java.math.BigInteger;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.TreeSet;
import java.util.logging.Logger;
import org.fedfleet.wire.Json;
import org.fedfleet.wire.LogText;

public final class SampleWindows {
    public static final String NAME = "sample_windows.json";
    public static final int MIN_DIFFERENCE = 8;
    public static final int MAX_BOUNDARIES = 4096;
    /** edge_client/sample_windows.py's MAX_FILE_BYTES. */
    public static final int MAX_FILE_BYTES = 96 * 1024;
    private static final Logger LOG = LogText.oneLineLogger("fedfleet.device");
    /** The decline of every window once the kept file could not be read (edge_client/sample_windows.py LOST_REASON). */
    public static final String LOST_REASON = "this device's sample-window ledger (" + NAME + " in its state folder) could "
            + "not be read: it answers no Fed3R window until an operator repairs that file or moves it aside (a fresh "
            + "ledger forgets every window this device answered)";

    private final File path;
    private final int minDifference;
    private TreeSet<Long> boundaries = new TreeSet<>();
    /** Why the kept file could not be read (then no window is answered), or null. */
    private String lost;

    /** No state folder (only windows of all the device's samples are answered), the default rule. */
    public SampleWindows() { this(null, MIN_DIFFERENCE); }

    /** path: where the windows are kept (null: no state folder, only windows of all the device's samples). */
    public SampleWindows(File path, int minDifference) {
        if (minDifference < 1) throw new IllegalArgumentException("minDifference must be >= 1, got " + minDifference);
        this.path = path;
        this.minDifference = minDifference;
        boundaries.add(0L);
        if (path != null) load();
    }

    public synchronized List<Long> boundaries() { return new ArrayList<>(boundaries); }

    /** Why the kept file could not be read (every window is then declined), or null. */
    public synchronized String lost() { return lost; }

    /** The decline of a window that is not all of a device's samples, on a device without a state folder. */
    static String unkeptReason(long start, long end, long samples) {
        return "samples [" + start + ", " + end + ") of " + samples + ": this device has no state folder (--state-dir) to "
                + "keep the windows it answered across a restart, so it answers only a window of all its samples from the first";
    }

    /** Why the window [start, end) of the device's `samples` samples may not be answered, or null. */
    public synchronized String refusal(long start, long end, long samples) {
        if (lost != null && load() != null) return LOST_REASON;     // read again: repaired or moved aside meanwhile?
        if (path == null && (start != 0 || end != samples)) return unkeptReason(start, end, samples);
        List<Long> fresh = new ArrayList<>();
        if (!boundaries.contains(start)) fresh.add(start);
        if (!boundaries.contains(end)) fresh.add(end);
        if (fresh.isEmpty() || (boundaries.size() == 1 && start == 0)) return null;   // a re-run, or the first answer from sample 0
        if (boundaries.size() + fresh.size() > MAX_BOUNDARIES)
            return "this device keeps " + boundaries.size() + " sample-window boundaries, its most: it answers only "
                    + "windows whose ends are among them";
        for (long b : fresh) {
            Long below = boundaries.floor(b), above = boundaries.ceiling(b);
            long near = below != null && (above == null || b - below <= above - b) ? below : above;
            long gap = Math.abs(near - b);
            if (b == end && !boundaries.contains(start) && end - start < gap) { near = start; gap = end - start; }
            if (gap < minDifference)
                return "samples [" + start + ", " + end + "): a window boundary at " + b + " lies " + gap
                        + " sample(s) from the boundary " + near + " of a window answered (or this one): answers could be "
                        + "differenced down to fewer than " + minDifference + " samples";
        }
        return null;
    }

    /** Keep [start, end) as answered (checked again) and write it down; why the answer may not go out, or null. */
    public synchronized String record(long start, long end, long samples) {
        String reason = refusal(start, end, samples);
        if (reason != null) return reason;
        if (boundaries.contains(start) && boundaries.contains(end)) return null;
        TreeSet<Long> before = boundaries;
        boundaries = new TreeSet<>(before);
        boundaries.add(start);
        boundaries.add(end);
        if (path == null) return null;
        try {
            List<Object> values = new ArrayList<>();
            for (long b : boundaries) values.add(BigInteger.valueOf(b));
            Map<String, Object> doc = new LinkedHashMap<>();
            doc.put("boundaries", values);
            AtomicFile.write(path, Json.canonical(doc), DeviceStateStore.TMP, ".json.part");
        } catch (IOException | Json.JsonError e) {
            boundaries = before;              // not remembered across a restart: not answered
            LOG.warning("writing the device's sample windows " + path + " failed (" + e.getMessage() + ")");
            return "this device could not write down the sample window [" + start + ", " + end + ") ("
                    + e.getClass().getSimpleName() + "): a window it could forget is not answered";
        }
        return null;
    }

    /** Read the kept file: its boundaries, or {0} where there is none (a fresh device, or one whose lost
     *  file the operator moved aside); lost, and returned: why it cannot be read. A lost ledger is read
     *  again at every window asked of it, so a repaired file (or one moved aside) serves the next task
     *  without a restart; the warning is logged once per reason. */
    private String load() {
        try {
            java.nio.file.attribute.BasicFileAttributes kind = null;
            try {      // only a missing file is a fresh device (File.exists() is false for an unreadable folder too)
                kind = java.nio.file.Files.readAttributes(path.toPath(), java.nio.file.attribute.BasicFileAttributes.class);
            } catch (java.nio.file.NoSuchFileException e) {
                boundaries = new TreeSet<>();
                boundaries.add(0L);
            }
            if (kind != null) {
                if (!kind.isRegularFile()) throw new IOException("not a regular file");     // a FIFO would block the open
                boundaries = checked(Json.parseHeader(SmallTextFile.read(path, MAX_FILE_BYTES)));
            }
        } catch (IOException | Json.JsonError | IllegalArgumentException e) {
            String why = String.valueOf(e.getMessage());
            why = why.substring(0, Math.min(200, why.length()));
            if (!why.equals(lost))          // the file stays as it is, for the operator: never written over
                LOG.warning("the device's sample windows " + path + " are unreadable (" + why
                        + "): no Fed3R window is answered until the file is repaired or moved aside");
            lost = why;
            return why;
        }
        if (lost != null)
            LOG.warning("the device's sample windows " + path + " are readable again: Fed3R windows are answered by them");
        lost = null;
        return null;
    }

    /** The file's boundaries: strictly ascending integers from 0, at most MAX_BOUNDARIES. */
    static TreeSet<Long> checked(Object doc) {
        if (!(doc instanceof Map) || ((Map<?, ?>) doc).size() != 1 || !(((Map<?, ?>) doc).get("boundaries") instanceof List))
            throw new IllegalArgumentException("not {\"boundaries\": [...]}");
        List<?> values = (List<?>) ((Map<?, ?>) doc).get("boundaries");
        if (values.isEmpty() || values.size() > MAX_BOUNDARIES)
            throw new IllegalArgumentException(values.size() + " boundaries (1 to " + MAX_BOUNDARIES + ")");
        TreeSet<Long> out = new TreeSet<>();
        long last = -1;
        for (Object v : values) {
            if (!(v instanceof BigInteger) || ((BigInteger) v).bitLength() > 63)
                throw new IllegalArgumentException("a boundary that is not an integer");
            long b = ((BigInteger) v).longValue();
            if ((last < 0 && b != 0) || (last >= 0 && b <= last))
                throw new IllegalArgumentException("boundaries not strictly ascending from 0");
            out.add(b);
            last = b;
        }
        return out;
    }
}
