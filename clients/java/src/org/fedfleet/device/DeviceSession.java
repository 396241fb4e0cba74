// The device side of the round rules (docs/protocol.md "Round rules"), sans-IO: events in,
// actions out, a mirror of protocols/rounds.py's DeviceSession.
//
//   IDLE      task(new)             StartWork                   -> WORKING
//   WORKING   task(same)            -                           (redelivery while busy)
//   any       task(expired, first)  SendDecline                 (once per job: the device's clock may be ahead)
//   any       task(expired)         SkipTask                    (received after deadline + grace: its round is over)
//   any       task(created earlier) SkipTask                    (than its job's last task started, by signed ts: a replay)
//   (these three rows come before the rows that answer a task already answered)
//   WORKING   workFinished(result)  SendResult                  -> REPORTED
//   WORKING   workFailed(reason)    SendDecline                 -> IDLE
//   REPORTED  resultSent(now)       -                           (the retry timer starts when the upload ends)
//   REPORTED  task(same)            SendResult (same message)   (the server may have lost it; nothing for a secure task's)
//   REPORTED  tick(now > retry)     SendResult (same message)   exponential back-off, up to maxRetries
//   REPORTED  ack(ref = result id)  -                           -> IDLE
package org.fedfleet.device;

import java.util.ArrayList;
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

    /** SkipTask's reasons and the expired task's decline: the words of protocols/rounds.py's EXPIRED,
     *  STALE and EXPIRED_DECLINE. */
    public static final String EXPIRED = "its deadline has passed";
    public static final String STALE = "created before the last task of its job this device started";
    public static final String EXPIRED_DECLINE = "received after its deadline by this device's clock: is the clock ahead? "
            + "(devices need NTP-close clocks; later expired tasks of this job are skipped silently)";
    static final int MAX_JOBS_REMEMBERED = 64;    // protocols/rounds.py's: the jobs a session keeps (oldest dropped)

    public static final class SendDecline extends Action {
        public final TaskRef ref;
        public final String reason;
        SendDecline(TaskRef ref, String reason) { this.ref = ref; this.reason = reason; }
    }

    private static final class Finished {
        final byte[] message;
        final String messageId;
        final boolean expectsAck;
        Finished(byte[] message, String messageId, boolean expectsAck) { this.message = message; this.messageId = messageId; this.expectsAck = expectsAck; }
    }

    private final double retryAfterS, deadlineGraceS;
    private final int maxRetries, keepFinished;
    private State state = State.IDLE;
    private TaskRef current;
    // job -> its last task started and that task's signed ts: another of the job created before it is a replay
    private final Map<String, Object[]> lastStarted = bounded();
    private final Map<String, Boolean> expiredDeclined = bounded();     // jobs told once that a task came expired
    private final Map<TaskRef, Finished> finished = new LinkedHashMap<>();   // answered tasks, for redelivery
    private int attempts;
    private double nextRetry, now;

    /** deadlineGraceS: a task runs until it is received later than its deadline plus this (device
     *  and aggregator clocks are NTP-close, not equal). */
    public DeviceSession(double retryAfterS, int maxRetries, int keepFinished, double deadlineGraceS) {
        this.retryAfterS = retryAfterS; this.maxRetries = maxRetries; this.keepFinished = keepFinished;
        this.deadlineGraceS = deadlineGraceS;
    }

    public DeviceSession(double retryAfterS, int maxRetries, int keepFinished) { this(retryAfterS, maxRetries, keepFinished, 60.0); }

    public DeviceSession() { this(10.0, 5, 4); }

    public State state() { return state; }

    /** receivedAt: this device's clock (unix seconds) when the task came; NaN: its deadline is not checked. */
    public List<Action> onTask(Messages.Task task, List<org.fedfleet.wire.Envelope.Tensor> tensors, double receivedAt) {
        if (!Double.isNaN(receivedAt) && receivedAt > task.deadline + deadlineGraceS) {
            if (expiredDeclined.containsKey(task.ref.job)) return one(new SkipTask(task.ref, EXPIRED));
            expiredDeclined.put(task.ref.job, Boolean.TRUE);     // once per job: the clock may be ahead
            return one(new SendDecline(task.ref, EXPIRED_DECLINE));
        }
        Object[] last = lastStarted.get(task.ref.job);
        if (last != null && !Double.isNaN(task.sentAt) && !task.ref.equals(last[0]) && task.sentAt < (Double) last[1])
            return one(new SkipTask(task.ref, STALE));
        Finished done = finished.get(task.ref);
        if (done != null)   // a secure task's result (no message) is answered with nothing, as Python's table says
            return done.message == null ? Collections.<Action>emptyList() : one(new SendResult(done.message, done.messageId, attempts + 1));
        if (state == State.WORKING && task.ref.equals(current)) return Collections.emptyList();
        if (!Double.isNaN(task.sentAt)) {
            lastStarted.remove(task.ref.job);
            lastStarted.put(task.ref.job, new Object[] {task.ref, task.sentAt});
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
        finished.put(ref, new Finished(message, messageId, expectsAck));
        Iterator<TaskRef> oldest = finished.keySet().iterator();
        while (finished.size() > keepFinished) { oldest.next(); oldest.remove(); }
        state = State.REPORTED;
        attempts = 1;
        nextRetry = expectsAck ? now + retryAfterS : Double.POSITIVE_INFINITY;
        return one(new SendResult(message, messageId, 1));
    }

    public List<Action> onWorkFailed(TaskRef ref, String reason) {
        if (state != State.WORKING || !ref.equals(current)) return Collections.emptyList();
        state = State.IDLE;
        current = null;
        return one(new SendDecline(ref, reason));
    }

    /** A slow upload must not count against the ack timeout: the back-off starts when it ends. */
    public void onResultSent(double now) {
        this.now = now;
        if (state == State.REPORTED && finished.get(current).expectsAck) nextRetry = now + retryAfterS * Math.pow(2, attempts - 1);
    }

    public void onAck(String refId) {
        Finished done = current == null ? null : finished.get(current);
        if (state == State.REPORTED && done != null && done.messageId.equals(refId)) state = State.IDLE;
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
