// Message types of protocol v1 a device sends and receives (docs/protocol.md "Messages"), as
// header maps for Envelope.encode, and the checks applied to what arrives.
package org.fedfleet.device;

import java.math.BigInteger;
import java.security.SecureRandom;
import java.util.Arrays;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.Set;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Envelope.EnvelopeError;

public final class Messages {
    public static final Set<String> ACK_STATUSES = new HashSet<>(Arrays.asList("accepted", "duplicate", "late", "rejected"));
    /** A task's job id is 1 to 64 characters; a decline's reason is cut to 1,000 (protocols/messages.py). */
    public static final int MAX_JOB_ID_CHARS = 64, MAX_REASON_CHARS = 1000;
    private static final SecureRandom RANDOM = new SecureRandom();

    private Messages() {}

    /** A fresh message id: 32 lowercase hex characters, random (the idempotency key). */
    public static String newId() {
        byte[] b = new byte[16];
        RANDOM.nextBytes(b);
        return Envelope.hex(b);
    }

    public static double now() { return System.currentTimeMillis() / 1000.0; }

    /** The header fields before encoding (tensors, payload_sha256 and sig are added by Envelope.encode). */
    public static Map<String, Object> header(String type, String sender, Map<String, Object> body, String id, double ts) {
        Map<String, Object> h = new LinkedHashMap<>();
        h.put("v", BigInteger.ONE);
        h.put("type", type);
        h.put("id", id);
        h.put("sender", sender);
        h.put("ts", ts);
        h.put("body", body);
        return h;
    }

    public static Map<String, Object> presence(String sender, boolean online, Map<String, Object> info, String id, double ts) {
        Map<String, Object> body = new LinkedHashMap<>();
        body.put("state", online ? "online" : "offline");
        body.put("info", info == null ? new LinkedHashMap<String, Object>() : info);
        return header("presence", sender, body, id, ts);
    }

    public static Map<String, Object> result(String sender, TaskRef ref, String kind, Map<String, Object> fields, String id, double ts) {
        Map<String, Object> body = new LinkedHashMap<>(fields);
        body.put("job", ref.job);
        body.put("round", BigInteger.valueOf(ref.round));
        body.put("task", ref.task);
        body.put("kind", kind);
        return header("result", sender, body, id, ts);
    }

    public static Map<String, Object> decline(String sender, TaskRef ref, String reason) {
        Map<String, Object> body = new LinkedHashMap<>();
        body.put("job", ref.job);
        body.put("round", BigInteger.valueOf(ref.round));
        body.put("task", ref.task);
        // cut to MAX_REASON_CHARS code points, as protocols/messages.py does (a reason may quote the task)
        if (reason.codePointCount(0, reason.length()) > MAX_REASON_CHARS)
            reason = reason.substring(0, reason.offsetByCodePoints(0, MAX_REASON_CHARS));
        body.put("reason", reason);
        return header("decline", sender, body, newId(), now());
    }

    /** A decoded `task`: its reference, kind, params, deadline and its envelope's signed ts (NaN: not known). */
    public static final class Task {
        public final TaskRef ref;
        public final String kind;
        public final Map<String, Object> params;
        public final double deadline, sentAt;
        Task(TaskRef ref, String kind, Map<String, Object> params, double deadline, double sentAt) {
            this.ref = ref; this.kind = kind; this.params = params; this.deadline = deadline; this.sentAt = sentAt;
        }
        Task(TaskRef ref, String kind, Map<String, Object> params, double deadline) { this(ref, kind, params, deadline, Double.NaN); }
    }

    @SuppressWarnings("unchecked")
    public static Task parseTask(Envelope.Message msg) throws EnvelopeError {
        expect(msg, "task");
        Map<String, Object> b = msg.body();
        String job = field(b, "job", String.class);
        int jobChars = job.codePointCount(0, job.length());
        if (jobChars < 1 || jobChars > MAX_JOB_ID_CHARS)     // every answer echoes it: a long one makes them unsendable
            throw new EnvelopeError("task: job id of " + jobChars + " characters, not 1 to " + MAX_JOB_ID_CHARS);
        TaskRef ref = new TaskRef(job, integer(b, "round"), (String) msg.header.get("id"));
        Object deadline = b.get("deadline");
        if (!(deadline instanceof Double || deadline instanceof BigInteger))
            throw new EnvelopeError("task body field 'deadline' must be a number");
        return new Task(ref, field(b, "kind", String.class), field(b, "params", Map.class), ((Number) deadline).doubleValue(),
                        ((Number) msg.header.get("ts")).doubleValue());
    }

    /** The device a task names (signed with it), or null (a task of an aggregator that names none). */
    public static String taskAddressee(Envelope.Message msg) throws EnvelopeError {
        if (!msg.body().containsKey("device")) return null;
        Object device = msg.body().get("device");
        if (!(device instanceof String)) throw new EnvelopeError("task body field 'device' must be a string");
        return (String) device;
    }

    /** (ref, status, reason) of an `ack`. */
    public static String[] parseAck(Envelope.Message msg) throws EnvelopeError {
        expect(msg, "ack");
        Map<String, Object> b = msg.body();
        String status = field(b, "status", String.class);
        if (!ACK_STATUSES.contains(status)) throw new EnvelopeError("ack: unknown status '" + status + "'");
        Object reason = b.get("reason");
        return new String[] {field(b, "ref", String.class), status, reason instanceof String ? (String) reason : ""};
    }

    static long integer(Map<String, Object> b, String key) throws EnvelopeError {
        Object v = b.get(key);
        if (!(v instanceof BigInteger) || ((BigInteger) v).bitLength() > 62)
            throw new EnvelopeError("body field '" + key + "' must be an integer, got " + v);
        return ((BigInteger) v).longValue();
    }

    @SuppressWarnings("unchecked")
    static <T> T field(Map<String, Object> b, String key, Class<T> type) throws EnvelopeError {
        Object v = b.get(key);
        if (!type.isInstance(v)) throw new EnvelopeError("body field '" + key + "' must be a " + type.getSimpleName() + ", got " + v);
        return (T) v;
    }

    private static void expect(Envelope.Message msg, String type) throws EnvelopeError {
        if (!type.equals(msg.type())) throw new EnvelopeError("expected a " + type + " message, got " + msg.type());
    }
}
