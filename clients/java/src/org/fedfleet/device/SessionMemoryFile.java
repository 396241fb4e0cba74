// The device's replay guard on disk (the Java side of edge_client/session_memory.py, same file, same
// layout: either device reads what the other wrote). DeviceSession skips a task created before the
// last task of its job the device started (a captured task re-published), and that last task too
// once it was answered, and declines an expired task once per job; kept only in the process, a restarted device would run a captured task once
// more while its deadline lasts. A device with a state store keeps that memory in its folder, in
// session.json:
//
// * written atomically (AtomicFile) each time it changes, before the task's work starts, so a
//   device killed mid-task still skips that task's replay, and before its answer is sent, so a
//   restarted device (which keeps no answers) skips the answered task's replay;
// * read once when the agent starts: a regular file of at most MAX_BYTES (a FIFO in its place is
//   not opened: it would block the start), strict UTF-8, strict JSON as a message header is read
//   (Json.parseHeader: no NaN, no duplicate keys, no lone surrogates, integers within the wire's
//   range, nesting bounded), every entry checked (DeviceSession.recall); a torn or malformed file is
//   refused whole with one warning and the device starts with an empty memory (as one without a
//   state store does), never stops or blocks;
// * a job's last start created later than the device's clock plus the grace is forgotten when read
//   (written while the aggregator's clock ran ahead, it would have had the job's every later task
//   skipped, across restarts);
// * bounded: at most DeviceSession.MAX_JOBS_REMEMBERED jobs kept, the newest;
// * not job state: DeviceStateStore.forget() and its budget leave it alone (it holds job and task
//   ids and the aggregator's timestamps, nothing learned from the device's data).
//
// A write that fails (a full disk) is logged once per kind of error and not retried until the memory
// changes again; the session keeps its memory in the process meanwhile, as a device without a state
// store does. tests/test_device_session_traces.py feeds both devices' readers the same files.
package org.fedfleet.device;

import java.io.File;
import java.io.FileInputStream;
import java.io.IOException;
import java.util.HashSet;
import java.util.Set;
import java.util.logging.Logger;
import java.util.regex.Matcher;
import java.util.regex.Pattern;
import org.fedfleet.wire.Json;

public final class SessionMemoryFile {
    public static final String NAME = "session.json";
    /** 64 jobs x (a 256-character id, a task id, a ts, the id again declined and again answered) in JSON, with
     *  room: edge_client/session_memory.py's MAX_MEMORY_BYTES. */
    public static final int MAX_BYTES = 320 * 1024;
    private static final int MAX_DISTINCT_FAILURES = 16;     // kinds of write errors logged (then silence)
    private static final String TMP_SUFFIX = ".json.part";
    private static final Pattern TEMP_NAME = Pattern.compile(Pattern.quote(DeviceStateStore.TMP) + "[0-9]+" + Pattern.quote(TMP_SUFFIX));

    private final File path;
    private final Logger log;
    private long saved = -1;                                  // the session's memoryChanges last written (or read)
    private final Set<String> failedWrites = new HashSet<>();

    /** path: where the session's memory lives (<state folder>/session.json); log: the agent's logger. */
    public SessionMemoryFile(File path, Logger log) { this.path = path; this.log = log; }

    /** Recall the file's memory into `session` by the device's clock; whether there was a valid one
     *  (none, or one refused with a warning, leaves the session as it was). */
    public boolean loadInto(DeviceSession session) { return loadInto(session, System.currentTimeMillis() / 1000.0); }

    /** loadInto(session) with `now` the device's clock (unix seconds): a job's start created later
     *  than now plus the session's grace is forgotten (edge_client/session_memory.py's load_into(session, now)). */
    public boolean loadInto(DeviceSession session, double now) {
        try {
            // none: a first start (FileInputStream's FileNotFoundException also means a file it may not read: warned of)
            if (!path.exists()) return false;
            if (!path.isFile()) throw new IOException("not a regular file");    // a FIFO would block the open
            session.recall(Json.parseHeader(SmallTextFile.read(path, MAX_BYTES)), now);
            return true;
        } catch (IOException | Json.JsonError | IllegalArgumentException e) {
            String why = String.valueOf(e.getMessage());
            log.warning("the device's session memory " + path + " is unreadable (" + why.substring(0, Math.min(200, why.length()))
                    + "): starting without it, so a replayed task within its deadline may run once more");
            return false;
        } finally {
            saved = session.memoryChanges();
        }
    }

    /** Write the session's memory if it changed since the last write (or load). A failed write is
     *  logged once per kind of error and tried again only at the next change (not every tick). */
    public void saveIfChanged(DeviceSession session) {
        long changes = session.memoryChanges();
        if (changes == saved) return;
        saved = changes;                // written, or failed: tried again at the next change
        try {
            // the store's temporary prefix: its sweep() removes what a crash mid-write left
            AtomicFile.write(path, Json.canonical(session.memory()), DeviceStateStore.TMP, TMP_SUFFIX);
        } catch (IOException | Json.JsonError e) {
            String why = String.valueOf(e.getMessage());
            String key = failureKind(e);
            if (failedWrites.size() < MAX_DISTINCT_FAILURES && failedWrites.add(key))
                log.warning("writing the device's session memory " + path + " failed (" + key + ": "
                        + why.substring(0, Math.min(200, why.length())) + "): it is kept in memory and written at its next change");
        }
    }

    /** A write error's kind: its class and its message less the random temporary file's name
     *  (FileOutputStream's "….tmp-8123….json.part (No space left on device)"), as
     *  edge_client/session_memory.py keys on the exception's type and errno, not its text. */
    static String failureKind(Exception e) {
        String why = TEMP_NAME.matcher(String.valueOf(e.getMessage())).replaceAll(Matcher.quoteReplacement(DeviceStateStore.TMP + "*" + TMP_SUFFIX));
        String key = e.getClass().getSimpleName() + ": " + why;
        return key.substring(0, Math.min(200, key.length()));
    }
}
