// The device's replay guard on disk (the Java side of edge_client/session_memory.py, same file, same
// layout: either device reads what the other wrote). DeviceSession skips a task created before the
// last task of its job the device started (a captured task re-published) and declines an expired
// task once per job; kept only in the process, a restarted device would run a captured task once
// more while its deadline lasts. A device with a state store keeps that memory in its folder, in
// session.json:
//
// * written atomically (AtomicFile) each time it changes, before the task's work starts, so a
//   device killed mid-task still skips that task's replay;
// * read once when the agent starts, checked entry by entry (DeviceSession.recall): a torn, edited
//   or foreign file is refused whole with one warning and the device starts with an empty memory
//   (as one without a state store does), never stops;
// * bounded: at most MAX_BYTES are read, at most DeviceSession.MAX_JOBS_REMEMBERED jobs kept;
// * not job state: DeviceStateStore.forget() and its budget leave it alone (it holds job and task
//   ids and the aggregator's timestamps, nothing learned from the device's data).
//
// A write that fails (a full disk) is logged once per distinct error; the session keeps its memory
// in the process, as a device without a state store does.
package org.fedfleet.device;

import java.io.File;
import java.io.FileInputStream;
import java.io.IOException;
import java.io.InputStream;
import java.nio.ByteBuffer;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.CodingErrorAction;
import java.nio.charset.StandardCharsets;
import java.util.HashSet;
import java.util.Set;
import java.util.logging.Logger;
import org.fedfleet.wire.Json;

public final class SessionMemoryFile {
    public static final String NAME = "session.json";
    /** 64 jobs x (a 256-character id, a task id, a ts) in JSON, with room: edge_client/session_memory.py's MAX_MEMORY_BYTES. */
    public static final int MAX_BYTES = 256 * 1024;
    private static final int MAX_DISTINCT_FAILURES = 16;     // distinct write errors logged (then silence)

    private final File path;
    private final Logger log;
    private long saved = -1;                                  // the session's memoryChanges last written (or read)
    private final Set<String> failedWrites = new HashSet<>();

    /** path: where the session's memory lives (<state folder>/session.json); log: the agent's logger. */
    public SessionMemoryFile(File path, Logger log) { this.path = path; this.log = log; }

    /** Recall the file's memory into `session`; whether there was a valid one (none, or one refused
     *  with a warning, leaves the session as it was). */
    public boolean loadInto(DeviceSession session) {
        try {
            // none: a first start (FileInputStream's FileNotFoundException also means a file it may not read: warned of)
            if (!path.exists()) return false;
            session.recall(Json.parse(read()));
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

    /** Write the session's memory if it changed since the last write (or load). */
    public void saveIfChanged(DeviceSession session) {
        long changes = session.memoryChanges();
        if (changes == saved) return;
        try {
            // the store's temporary prefix: its sweep() removes what a crash mid-write left
            AtomicFile.write(path, Json.canonical(session.memory()), DeviceStateStore.TMP, ".json.part");
        } catch (IOException | Json.JsonError e) {
            String key = (e.getClass().getSimpleName() + ": " + e.getMessage());
            key = key.substring(0, Math.min(200, key.length()));
            if (failedWrites.size() < MAX_DISTINCT_FAILURES && failedWrites.add(key))
                log.warning("writing the device's session memory " + path + " failed (" + key + "): it is kept in memory until the next change");
            return;
        }
        saved = changes;
    }

    /** The file's text: at most MAX_BYTES, strict UTF-8, what either device writes (Python's json.loads
     *  would also take UTF-16 or a byte order mark: a file no device wrote, refused here). */
    private String read() throws IOException {
        byte[] data = new byte[MAX_BYTES + 1];
        int at = 0;
        try (InputStream in = new FileInputStream(path)) {
            for (int n; at < data.length && (n = in.read(data, at, data.length - at)) > 0; ) at += n;
        }
        if (at > MAX_BYTES) throw new IOException("larger than " + MAX_BYTES + " bytes");
        try {
            return StandardCharsets.UTF_8.newDecoder().onMalformedInput(CodingErrorAction.REPORT)
                    .onUnmappableCharacter(CodingErrorAction.REPORT).decode(ByteBuffer.wrap(data, 0, at)).toString();
        } catch (CharacterCodingException e) {
            throw new IOException("not UTF-8 text");
        }
    }
}
