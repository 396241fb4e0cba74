// Replays the golden traces of the device's round machine (protocols/golden/traces/, written by
// protocols/golden_traces.py) through the Java library's DeviceSession, so
// tests/test_device_session_traces.py can compare its actions and states with the recorded ones.
// In the library's package: a decoded task is built here without a signed envelope.
// Usage: java org.fedfleet.device.SessionTraces <trace.json>...; prints one JSON line per trace:
//   {"trace": <file name>, "steps": [{"actions": [...], "state": "IDLE"}, ...], "memory": <memory()>,
//    "memory_changes": n}
// java org.fedfleet.device.SessionTraces --recall [NOW]: standard input's first line is a valid
// session memory (as a device's session.json holds it), each further line another one, checked or
// not: for each, a fresh session recalls the first, then that line (by the device's clock NOW, unix
// seconds, when given: recall(memory, now)), and prints {"refused": whether the line was refused (not
// JSON, or recall threw: the device's file refused whole), "memory": its memory(), "memory_changes": n}.
// java org.fedfleet.device.SessionTraces --load-file NOW PATH...: each file read by the device's own
// reader (SessionMemoryFile.loadInto(session, NOW), a fresh session each), one line each:
// {"file": PATH, "loaded": its answer, "memory": the session's memory(), "warnings": warnings logged}.
// java org.fedfleet.device.SessionTraces --save-failing PATH: PATH a folder (the write's rename over it
// fails), three changes of a session's memory each saved three times, then the folder removed and
// saved again without a change, then after one; prints {"warnings": n, "failed": whether PATH was
// still a folder, "retried": whether the unchanged memory was written, "written": whether the
// changed one was, "same_kind": whether two errors naming different temporary files are one kind}.
package org.fedfleet.device;

import java.io.File;
import java.math.BigInteger;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.logging.Handler;
import java.util.logging.Level;
import java.util.logging.LogRecord;
import java.util.logging.Logger;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Json;

public final class SessionTraces {
    public static void main(String[] args) throws Exception {
        if (args.length >= 1 && args.length <= 2 && args[0].equals("--recall")) {
            recallEach(args.length == 2 ? Double.parseDouble(args[1]) : Double.NaN);
            return;
        }
        if (args.length == 2 && args[0].equals("--save-failing")) {
            saveFailing(new File(args[1]));
            return;
        }
        if (args.length >= 2 && args[0].equals("--load-file")) {
            loadEach(Double.parseDouble(args[1]), Arrays.asList(args).subList(2, args.length));
            return;
        }
        for (String file : args) {
            Path path = Paths.get(file);
            Map<String, Object> trace = map(Json.parse(new String(Files.readAllBytes(path), StandardCharsets.UTF_8)));
            Map<String, Object> settings = map(trace.get("session"));
            DeviceSession session = new DeviceSession(num(settings.get("retry_after_s")),
                    (int) num(settings.get("max_retries")), (int) num(settings.get("keep_finished")));
            List<Object> steps = new ArrayList<>();
            for (Object step : list(trace.get("steps"))) {
                List<Object> actions = new ArrayList<>();
                for (DeviceSession.Action a : feed(session, map(map(step).get("event")))) actions.add(json(a));
                Map<String, Object> out = new LinkedHashMap<>();
                out.put("actions", actions);
                out.put("state", session.state().name());
                steps.add(out);
            }
            Map<String, Object> line = new LinkedHashMap<>();
            line.put("trace", path.getFileName().toString());
            line.put("steps", steps);
            line.put("memory", session.memory());
            line.put("memory_changes", BigInteger.valueOf(session.memoryChanges()));
            System.out.println(new String(Json.canonical(line), StandardCharsets.UTF_8));
        }
    }

    /** A logger that counts its warnings in warnings[0] and prints nothing. */
    private static Logger counting(int[] warnings) {
        Logger log = Logger.getAnonymousLogger();
        log.setUseParentHandlers(false);
        log.addHandler(new Handler() {
            @Override public void publish(LogRecord record) { if (record.getLevel() == Level.WARNING) warnings[0]++; }
            @Override public void flush() {}
            @Override public void close() {}
        });
        return log;
    }

    private static void startTask(DeviceSession session, int n) {
        session.onTask(new Messages.Task(new TaskRef("j" + n, 1, "t" + n), "fed3r.stats", new LinkedHashMap<>(), 1e12, 1000.0 + n),
                       Collections.<Envelope.Tensor>emptyList(), Double.NaN);
    }

    private static void saveFailing(File path) throws Exception {
        int[] warnings = {0};
        DeviceSession session = new DeviceSession();
        SessionMemoryFile file = new SessionMemoryFile(path, counting(warnings));
        for (int change = 0; change < 3; change++) {
            startTask(session, change);
            for (int k = 0; k < 3; k++) file.saveIfChanged(session);      // the agent saves before every batch of actions
        }
        boolean failed = path.isDirectory();
        if (!path.delete()) throw new IllegalStateException("cannot remove " + path);
        file.saveIfChanged(session);
        boolean retried = path.exists();
        startTask(session, 3);
        file.saveIfChanged(session);
        String folder = path.getParent();
        Map<String, Object> line = new LinkedHashMap<>();
        line.put("warnings", BigInteger.valueOf(warnings[0]));
        line.put("failed", failed);
        line.put("retried", retried);
        line.put("written", path.isFile());
        String tmp = folder + "/" + DeviceStateStore.TMP;       // the store's temporary prefix, as the writes name it
        line.put("same_kind", SessionMemoryFile.failureKind(new java.io.FileNotFoundException(tmp + "8123.json.part (No space left on device)"))
                .equals(SessionMemoryFile.failureKind(new java.io.FileNotFoundException(tmp + "90210.json.part (No space left on device)"))));
        System.out.println(new String(Json.canonicalAscii(line), StandardCharsets.US_ASCII));
    }

    private static void loadEach(double now, List<String> files) throws Exception {
        int[] warnings = {0};
        Logger log = counting(warnings);
        for (String file : files) {
            DeviceSession session = new DeviceSession();
            warnings[0] = 0;
            boolean loaded = new SessionMemoryFile(new File(file), log).loadInto(session, now);
            Map<String, Object> line = new LinkedHashMap<>();
            line.put("file", file);
            line.put("loaded", loaded);
            line.put("memory", session.memory());
            line.put("warnings", BigInteger.valueOf(warnings[0]));
            System.out.println(new String(Json.canonicalAscii(line), StandardCharsets.US_ASCII));
        }
    }

    private static void recallEach(double now) throws Exception {
        java.io.BufferedReader in = new java.io.BufferedReader(new java.io.InputStreamReader(System.in, StandardCharsets.UTF_8));
        Object base = Json.parse(in.readLine());
        for (String text; (text = in.readLine()) != null; ) {
            DeviceSession session = new DeviceSession();
            session.recall(base);
            boolean refused = false;
            try {
                session.recall(Json.parse(text), now);
            } catch (Json.JsonError | IllegalArgumentException e) {
                refused = true;
            }
            Map<String, Object> line = new LinkedHashMap<>();
            line.put("refused", refused);
            line.put("memory", session.memory());
            line.put("memory_changes", BigInteger.valueOf(session.memoryChanges()));
            System.out.println(new String(Json.canonicalAscii(line), StandardCharsets.US_ASCII));   // whatever stdout's charset
        }
    }

    private static List<DeviceSession.Action> feed(DeviceSession s, Map<String, Object> e) {
        String type = (String) e.get("type");
        switch (type) {
            case "task":
                return s.onTask(new Messages.Task(ref(e), "fed3r.stats", new LinkedHashMap<>(),
                                                  e.containsKey("deadline") ? num(e.get("deadline")) : 0.0,
                                                  e.containsKey("sent_at") ? num(e.get("sent_at")) : Double.NaN),
                                Collections.<Envelope.Tensor>emptyList(),
                                e.containsKey("received_at") ? num(e.get("received_at")) : Double.NaN);
            case "finished": {
                Object message = e.get("message");
                byte[] bytes = message == Json.NULL ? null : ((String) message).getBytes(StandardCharsets.UTF_8);
                return s.onWorkFinished(ref(e), bytes, (String) e.get("message_id"), (Boolean) e.get("expects_ack"));
            }
            case "failed":
                return s.onWorkFailed(ref(e), (String) e.get("reason"));
            case "stopped":
                return s.onWorkStopped(ref(e), (Boolean) e.get("round_over"));
            case "sent":
                s.onResultSent(num(e.get("now")));
                return Collections.emptyList();
            case "ack":
                s.onAck((String) e.get("ref_id"));
                return Collections.emptyList();
            case "tick":
                return s.onTick(num(e.get("now")));
            default:
                throw new IllegalArgumentException("unknown trace event " + type);
        }
    }

    private static Map<String, Object> json(DeviceSession.Action a) {
        Map<String, Object> out = new LinkedHashMap<>();
        if (a instanceof DeviceSession.StartWork) {
            out.put("type", "StartWork");
            out.put("ref", refJson(((DeviceSession.StartWork) a).task.ref));
        } else if (a instanceof DeviceSession.SendResult) {
            DeviceSession.SendResult r = (DeviceSession.SendResult) a;
            out.put("type", "SendResult");
            out.put("message", r.message == null ? Json.NULL : new String(r.message, StandardCharsets.UTF_8));
            out.put("attempt", BigInteger.valueOf(r.attempt));
        } else if (a instanceof DeviceSession.SkipTask) {
            DeviceSession.SkipTask k = (DeviceSession.SkipTask) a;
            out.put("type", "SkipTask");
            out.put("ref", refJson(k.ref));
            out.put("reason", k.reason);
        } else {
            DeviceSession.SendDecline d = (DeviceSession.SendDecline) a;
            out.put("type", "SendDecline");
            out.put("ref", refJson(d.ref));
            out.put("reason", d.reason);
        }
        return out;
    }

    private static TaskRef ref(Map<String, Object> e) {
        List<Object> r = list(e.get("ref"));
        return new TaskRef((String) r.get(0), ((BigInteger) r.get(1)).longValue(), (String) r.get(2));
    }

    private static List<Object> refJson(TaskRef ref) {
        List<Object> out = new ArrayList<>();
        out.add(ref.job);
        out.add(BigInteger.valueOf(ref.round));
        out.add(ref.task);
        return out;
    }

    private static double num(Object v) { return ((Number) v).doubleValue(); }

    @SuppressWarnings("unchecked")
    private static Map<String, Object> map(Object v) { return (Map<String, Object>) v; }

    @SuppressWarnings("unchecked")
    private static List<Object> list(Object v) { return (List<Object>) v; }
}
