// The device side of the round rules (docs/protocol.md "Round rules"), sans-IO: events in,
// actions out, a mirror of protocols/device_session.py's DeviceSession.
//
//   IDLE      task(new)             StartWork                   -> WORKING
//   WORKING   task(same)            -                           (redelivery while busy)
//   any       task(expired, first)  SendDecline                 (once per job, one a minute: the device's clock may be ahead)
//   any       task(expired)         SkipTask                    (received after deadline + grace: its round is over)
//   any       task(created earlier) SkipTask                    (than its job's last task started, by signed ts: a replay)
//   (these three rows come before the rows that answer a task already answered)
//   any       task(answered before) SkipTask                    (its job's last start, answered, its answer no longer
//                                                                kept, signed no later: a replay; after the rows that answer)
//   WORKING   workFinished(result)  SendResult                  -> REPORTED
//   WORKING   workFailed(reason)    SendDecline                 -> IDLE
//   REPORTED  resultSent(now)       -                           (the retry timer starts when the upload ends)
//   any       task(answered)        SendResult / SendDecline    (the same answer, at most maxRetries times; nothing for a secure task's)
//   REPORTED  tick(now > retry)     SendResult (same message)   exponential back-off, up to maxRetries
//   REPORTED  ack(ref = result id)  -                           -> IDLE
//
// memory() is what a device keeps of the per-job rows across restarts (SessionMemoryFile writes it
// beside the state store, in the Python device's layout), recall() takes it back.
package org.fedfleet.device;

import java.math.BigInteger;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.Iterator;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

public final class DeviceSession {
    public enum State { IDLE, WORKING, REPORTED }

    /** What the agent must do next. */
    public abstract static class Action {}

    public static final class StartWork extends Action {
        public final Messages.Task task;
        public final List<org.fedfleet.wire.Envelope.Tensor> tensors;
        StartWork(Messages.Task task, List<org.fedfleet.wire.Envelope.Tensor> tensors) { this.task = task; this.tensors = tensors; }
    }

    /** Publish the encoded (signed) message again: always the same bytes, so the same message id
     *  (null for a secure task: nothing to publish). */
    public static final class SendResult extends Action {
        public final byte[] message;
        public final String messageId;
        public final int attempt;
        SendResult(byte[] message, String messageId, int attempt) { this.message = message; this.messageId = messageId; this.attempt = attempt; }
    }

    /** A task not run and not answered: its round is over (expired, or a replayed older round). */
    public static final class SkipTask extends Action {
        public final TaskRef ref;
        public final String reason;
        SkipTask(TaskRef ref, String reason) { this.ref = ref; this.reason = reason; }
    }

    /** SkipTask's reasons and the expired task's decline: the words of protocols/device_session.py's EXPIRED,
     *  STALE and EXPIRED_DECLINE. */
    public static final String EXPIRED = "its deadline has passed";
    public static final String STALE = "created before the last task of its job this device started";
    /** protocols/device_session.py's ANSWERED: the job's last task started, answered, its answer no longer kept. */
    public static final String ANSWERED = "answered already by this device, its answer no longer kept";
    public static final String EXPIRED_DECLINE = "received after its deadline by this device's clock: is the clock ahead? "
            + "(devices need NTP-close clocks; later expired tasks of this job are skipped silently)";
    /** protocols/device_session.py's EXPIRED_AT_WORK_DECLINE: the first task of a job whose round went over during its work. */
    public static final String EXPIRED_AT_WORK_DECLINE = "its deadline passed during the work by this device's clock: is "
            + "the clock ahead? (devices need NTP-close clocks; later expired tasks of this job are skipped silently)";
    static final int MAX_JOBS_REMEMBERED = 64;    // protocols/device_session.py's: the jobs a session keeps (oldest dropped)
    /** protocols/device_session.py's EXPIRED_DECLINE_GAP_S: at most one expired decline per this many seconds of
     *  the device's clock, whatever the job (replayed tasks of more jobs than it remembers, in turn). */
    static final double EXPIRED_DECLINE_GAP_S = 60.0;
    static final int MEMORY_VERSION = 1;          // memory()'s layout, protocols/replay_guard.py's MEMORY_VERSION
    static final int MAX_MEMORY_ID_CHARS = 256;   // a remembered job or task id, in code points as Python counts

    public static final class SendDecline extends Action {
        public final TaskRef ref;
        public final String reason;
        SendDecline(TaskRef ref, String reason) { this.ref = ref; this.reason = reason; }
    }

    /** A job's last task started, that task's signed ts, and whether it was answered
     *  (protocols/replay_guard.py's LastStart): another of the job created before it is a replay, and
     *  so is this task signed no later once answered. */
    private static final class Started {
        final TaskRef ref;
        final double sentAt;
        boolean answered;
        Started(TaskRef ref, double sentAt) { this.ref = ref; this.sentAt = sentAt; }
    }

    /** A task answered: its result (message; null for a secure task's) or its decline (declined: the
     *  reason), and how often a redelivery had it answered again (at most maxRetries times). */
    private static final class Finished {
        final byte[] message;
        final String messageId;
        final boolean expectsAck;
        final String declined;
        int answeredAgain;
        Finished(byte[] message, String messageId, boolean expectsAck, String declined) {
            this.message = message; this.messageId = messageId; this.expectsAck = expectsAck; this.declined = declined;
        }
    }

    private final double retryAfterS, deadlineGraceS;
    private final int maxRetries, keepFinished;
    private State state = State.IDLE;
    private TaskRef current;
    private final Map<String, Started> lastStarted = bounded();         // job -> its last task started
    private final Map<String, Boolean> expiredDeclined = bounded();     // jobs told once that a task came expired
    private final Map<TaskRef, Finished> finished = new LinkedHashMap<>();   // answered tasks, for redelivery
    private double expiredToldAt = Double.NaN;      // the device's clock at the last expired decline (not kept)
    private int attempts;
    private double nextRetry, now;
    private long memoryChanges;         // how often memory() changed: an adapter that persists it writes on change

    /** deadlineGraceS: a task runs until it is received later than its deadline plus this (device
     *  and aggregator clocks are NTP-close, not equal). */
    public DeviceSession(double retryAfterS, int maxRetries, int keepFinished, double deadlineGraceS) {
        this.retryAfterS = retryAfterS; this.maxRetries = maxRetries; this.keepFinished = keepFinished;
        this.deadlineGraceS = deadlineGraceS;
    }

    public DeviceSession(double retryAfterS, int maxRetries, int keepFinished) { this(retryAfterS, maxRetries, keepFinished, 60.0); }

    public DeviceSession() { this(10.0, 5, 4); }

    public State state() { return state; }

    /** How long past a task's deadline (by this device's clock) its round may still be open: a task
     *  received later is skipped, a task's work running later is stopped (WorkDeadline). */
    public double deadlineGraceS() { return deadlineGraceS; }

    /** receivedAt: this device's clock (unix seconds) when the task came; NaN: its deadline is not checked. */
    public List<Action> onTask(Messages.Task task, List<org.fedfleet.wire.Envelope.Tensor> tensors, double receivedAt) {
        if (!Double.isNaN(receivedAt) && receivedAt > task.deadline + deadlineGraceS) {
            if (expiredDeclined.containsKey(task.ref.job)
                    || (!Double.isNaN(expiredToldAt) && receivedAt < expiredToldAt + EXPIRED_DECLINE_GAP_S))
                return one(new SkipTask(task.ref, EXPIRED));
            expiredToldAt = receivedAt;
            expiredDeclined.put(task.ref.job, Boolean.TRUE);     // once per job: the clock may be ahead
            memoryChanges++;
            return one(new SendDecline(task.ref, EXPIRED_DECLINE));
        }
        Started last = lastStarted.get(task.ref.job);
        // a last start dated past this device's clock plus the grace is no evidence (protocols/device_session.py
        // _stale): the aggregator's clock ran ahead when it was created and has been set back
        boolean trusted = Double.isNaN(receivedAt) || last == null || last.sentAt <= receivedAt + deadlineGraceS;
        if (last != null && !Double.isNaN(task.sentAt) && !task.ref.equals(last.ref) && task.sentAt < last.sentAt && trusted)
            return one(new SkipTask(task.ref, STALE));
        Finished done = finished.get(task.ref);
        if (done != null) {     // answered again, at most maxRetries times; a secure task's result (no message) never
            if ((done.declined == null && done.message == null) || done.answeredAgain >= maxRetries)
                return Collections.emptyList();
            done.answeredAgain++;
            return done.declined != null ? one(new SendDecline(task.ref, done.declined))
                    : one(new SendResult(done.message, done.messageId, attempts + 1));
        }
        // the job's last start, answered, its answer pushed out (or lost in a restart): the captured
        // message is skipped (before: it ran again); the aggregator's re-send, signed later, runs
        if (last != null && last.answered && !Double.isNaN(task.sentAt) && task.ref.equals(last.ref) && task.sentAt <= last.sentAt)
            return one(new SkipTask(task.ref, ANSWERED));
        if (state == State.WORKING && task.ref.equals(current)) return Collections.emptyList();
        if (!Double.isNaN(task.sentAt)) {
            lastStarted.remove(task.ref.job);
            lastStarted.put(task.ref.job, new Started(task.ref, task.sentAt));
            memoryChanges++;
        }
        current = task.ref;
        state = State.WORKING;
        return one(new StartWork(task, tensors));
    }

    public List<Action> onWorkFinished(TaskRef ref, byte[] message, String messageId) {
        return onWorkFinished(ref, message, messageId, true);
    }

    /** expectsAck false: a secure task, whose protocol messages go out through its own session
     *  (message null); nothing is retried, a redelivered task is answered with nothing. */
    public List<Action> onWorkFinished(TaskRef ref, byte[] message, String messageId, boolean expectsAck) {
        if (state != State.WORKING || !ref.equals(current)) return Collections.emptyList();   // abandoned task
        keep(ref, new Finished(message, messageId, expectsAck, null));
        state = State.REPORTED;
        attempts = 1;
        nextRetry = expectsAck ? now + retryAfterS : Double.POSITIVE_INFINITY;
        return one(new SendResult(message, messageId, 1));
    }

    public List<Action> onWorkFailed(TaskRef ref, String reason) {
        if (state != State.WORKING || !ref.equals(current)) return Collections.emptyList();
        keep(ref, new Finished(null, null, false, reason));
        state = State.IDLE;
        current = null;
        return one(new SendDecline(ref, reason));
    }

    /** A task's answer, for its redelivery; a long-lived device keeps only the recent ones. */
    private void keep(TaskRef ref, Finished answer) {
        finished.put(ref, answer);
        Iterator<TaskRef> oldest = finished.keySet().iterator();
        while (finished.size() > keepFinished) { oldest.next(); oldest.remove(); }
        Started last = lastStarted.get(ref.job);      // what outlives the answer (and a restart)
        if (last != null && last.ref.equals(ref) && !last.answered) {
            last.answered = true;
            memoryChanges++;
        }
    }

    /** The task at work stopped unanswered: its round went over during the work (roundOver: the
     *  deadline plus the grace passed by this device's clock, WorkDeadline) or the device dropped out.
     *  The first of a job whose round went over is declined once, as an expired arrival (the clock may
     *  be ahead), and the job's later expired tasks are skipped; otherwise nothing is sent. */
    public List<Action> onWorkStopped(TaskRef ref, boolean roundOver) {
        if (state != State.WORKING || !ref.equals(current)) return Collections.emptyList();
        state = State.IDLE;
        current = null;
        if (!roundOver || expiredDeclined.containsKey(ref.job)) return Collections.emptyList();
        expiredDeclined.put(ref.job, Boolean.TRUE);
        memoryChanges++;
        return one(new SendDecline(ref, EXPIRED_AT_WORK_DECLINE));
    }

    /** A slow upload must not count against the ack timeout: the back-off starts when it ends. */
    public void onResultSent(double now) {
        this.now = now;
        if (state == State.REPORTED && finished.get(current).expectsAck) nextRetry = now + retryAfterS * Math.pow(2, attempts - 1);
    }

    public void onAck(String refId) {
        Finished done = current == null ? null : finished.get(current);
        if (state == State.REPORTED && done != null && refId.equals(done.messageId)) state = State.IDLE;
    }

    public List<Action> onTick(double now) {
        this.now = now;
        if (state == State.REPORTED && now >= nextRetry && attempts <= maxRetries) {
            attempts++;
            nextRetry = now + retryAfterS * Math.pow(2, attempts - 1);
            Finished done = finished.get(current);
            return one(new SendResult(done.message, done.messageId, attempts));
        }
        return Collections.emptyList();
    }

    // ---------------- what a device keeps across restarts (its replay guard) ----------------
    /** How often memory() changed (a task with a signed ts started or answered, a job told its task came expired);
     *  recall() is no change: what was read needs no writing back. */
    public long memoryChanges() { return memoryChanges; }

    /** The per-job memory the replay rows read, as JSON data (Json's types, oldest job first), the
     *  layout of protocols/device_session.py's DeviceSession.memory(): {"version": 1, "started": [[job,
     *  round, task id, signed ts], ...], "expired_declined": [job, ...], "answered": [job, ...]}
     *  (answered: the jobs whose last task started was answered). */
    public Map<String, Object> memory() {
        List<Object> started = new ArrayList<>();
        for (Started s : lastStarted.values())
            started.add(new ArrayList<Object>(Arrays.asList(s.ref.job, BigInteger.valueOf(s.ref.round), s.ref.task, s.sentAt)));
        Map<String, Object> out = new LinkedHashMap<>();
        out.put("version", BigInteger.valueOf(MEMORY_VERSION));
        out.put("started", started);
        out.put("expired_declined", new ArrayList<Object>(expiredDeclined.keySet()));
        List<Object> answered = new ArrayList<>();
        for (Started s : lastStarted.values()) if (s.answered) answered.add(s.ref.job);
        out.put("answered", answered);
        return out;
    }

    /** Take back what memory() gave, as Json.parseHeader read it (a restarted device), every entry
     *  checked as protocols/replay_guard.py's parse_memory does (a file on the device's disk, torn or
     *  edited: never trusted). A malformed one (any entry, however old) throws IllegalArgumentException
     *  and changes nothing; of more than MAX_JOBS_REMEMBERED jobs in a list the newest are kept. No
     *  start is forgotten for lying in the future: recall(memory, now) does that. */
    public void recall(Object memory) { recall(memory, Double.NaN); }

    /** recall(memory), and with `now` (the device's clock, unix seconds; NaN: not checked) a job's
     *  last start created later than now plus deadlineGraceS is forgotten, silently: written while
     *  the aggregator's clock ran ahead (or edited), it would have the job's every later task skipped
     *  as a replay, across restarts (protocols/device_session.py's DeviceSession.recall(memory, now)). */
    public void recall(Object memory, double now) {
        if (!(memory instanceof Map) || !BigInteger.valueOf(MEMORY_VERSION).equals(((Map<?, ?>) memory).get("version")))
            throw new IllegalArgumentException("device session memory: not a version " + MEMORY_VERSION + " object");
        Object started = ((Map<?, ?>) memory).get("started"), declined = ((Map<?, ?>) memory).get("expired_declined");
        // absent from a file written before it was kept: none answered (protocols/replay_guard.py)
        Object answered = ((Map<?, ?>) memory).containsKey("answered") ? ((Map<?, ?>) memory).get("answered") : List.of();
        if (!(started instanceof List) || !(declined instanceof List))
            throw new IllegalArgumentException("device session memory: 'started' and 'expired_declined' must be lists");
        if (!(answered instanceof List) || !((List<?>) answered).stream().allMatch(DeviceSession::isId))
            throw new IllegalArgumentException("device session memory: 'answered' must list job ids");
        Map<String, Started> recalled = new LinkedHashMap<>();
        for (Object entry : (List<?>) started) {
            Started s = startedEntry(entry);
            if (s == null) {
                String shown = String.valueOf(entry);
                throw new IllegalArgumentException("device session memory: a started entry is not [job, round, task, ts]: "
                        + shown.substring(0, Math.min(200, shown.length())));
            }
            recalled.remove(s.ref.job);      // a job listed twice: its later entry, in its place
            recalled.put(s.ref.job, s);
        }
        for (Object job : (List<?>) declined)
            if (!isId(job)) throw new IllegalArgumentException("device session memory: 'expired_declined' must list job ids");
        for (Object job : (List<?>) answered) {      // a job not among the starts: its start forgotten, nothing to mark
            Started s = recalled.get(job);
            if (s != null) s.answered = true;
        }
        lastStarted.clear();
        for (Started s : recalled.values())     // the bounded map keeps the newest MAX_JOBS_REMEMBERED
            if (Double.isNaN(now) || s.sentAt <= now + deadlineGraceS) lastStarted.put(s.ref.job, s);
        expiredDeclined.clear();
        for (Object job : (List<?>) declined) expiredDeclined.put((String) job, Boolean.TRUE);   // one listed twice: its first place
    }

    /** [job, round, task, ts] as memory() writes it, or null: ids non-empty strings of at most
     *  MAX_MEMORY_ID_CHARS, the round an integer a task's round can be (Messages.integer's range, not
     *  1.0 or true), ts a finite number. */
    private static Started startedEntry(Object entry) {
        if (!(entry instanceof List) || ((List<?>) entry).size() != 4) return null;
        List<?> e = (List<?>) entry;
        Object job = e.get(0), round = e.get(1), task = e.get(2), ts = e.get(3);
        if (!isId(job) || !isId(task) || !(round instanceof BigInteger) || ((BigInteger) round).bitLength() > 62
                || !(ts instanceof BigInteger || ts instanceof Double))
            return null;
        double sentAt = ((Number) ts).doubleValue();        // a 400-digit integer is +Infinity here: refused
        if (!Double.isFinite(sentAt)) return null;
        return new Started(new TaskRef((String) job, ((BigInteger) round).longValue(), (String) task), sentAt);
    }

    private static boolean isId(Object value) {
        if (!(value instanceof String)) return false;
        int chars = ((String) value).codePointCount(0, ((String) value).length());
        return chars > 0 && chars <= MAX_MEMORY_ID_CHARS;
    }

    private static <V> Map<String, V> bounded() {
        return new LinkedHashMap<String, V>() {
            @Override protected boolean removeEldestEntry(Map.Entry<String, V> eldest) { return size() > MAX_JOBS_REMEMBERED; }
        };
    }

    private static List<Action> one(Action a) {
        List<Action> out = new ArrayList<>(1);
        out.add(a);
        return out;
    }
}
