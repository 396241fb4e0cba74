// How long a task's work may run on the device: until its round is surely over (the Python
// device's edge_client/work_deadline.py). A device skips a task that arrives after its deadline
// plus the clocks' grace (DeviceSession); a task that arrived in time may still outlast that moment
// (a slow device, a long recipe), and its result would be answered `late` and dropped: the rest of
// the work is waste, battery on a phone. MqttAgent runs each handler under until(deadline + grace)
// (the aggregator's clock read on the device's, as the arrival check reads it), and every local
// training loop checks it once per step (LocalTraining.Schedule's iterator, which HeadTrainer, and
// so every head task, iterates): past it, PastDeadline: no result is sent (the job's first stop declined once, DeviceSession.onWorkStopped) and the agent takes its next task.
//
// Per thread, not a parameter: the loops are the same code TaskRunner and the benches call outside
// any agent, where nothing is set and nothing is checked.
package org.fedfleet.device;

public final class WorkDeadline {
    private static final ThreadLocal<Double> UNTIL = new ThreadLocal<>();   // unix seconds, the device's clock; null: none

    private WorkDeadline() {}

    /** The task's round is over (its deadline and the grace passed during its work): stop, send nothing. */
    public static final class PastDeadline extends RuntimeException {
        private static final long serialVersionUID = 1L;
        PastDeadline(String message) { super(message); }
    }

    /** The calling thread's work under a moment; closing it restores the moment before (none, usually). */
    public static final class Scope implements AutoCloseable {
        private final Double previous;
        private Scope(Double previous) { this.previous = previous; }

        @Override public void close() {
            if (previous == null) UNTIL.remove();
            else UNTIL.set(previous);
        }
    }

    /** Run the calling thread's work until unixS (the device's clock) at the latest:
     *  {@code try (WorkDeadline.Scope s = WorkDeadline.until(t)) { ... }}. (MqttAgent, its one
     *  caller, passes a task's deadline, a finite number as Messages.parseTask reads it, plus the
     *  session's grace: never NaN; a NaN would stop nothing, as no comparison with it holds, as in
     *  edge_client/work_deadline.py.) */
    public static Scope until(double unixS) {
        Scope scope = new Scope(UNTIL.get());
        UNTIL.set(unixS);
        return scope;
    }

    /** The moment (unix s, the device's clock) the calling thread's work's round is surely over;
     *  null outside a task. A secure task's SecAgg session ends there (SecAggSessions). */
    public static Double roundOverAt() { return UNTIL.get(); }

    /** PastDeadline when the calling thread's work has run past its moment. */
    public static void stopIfPast() {
        Double until = UNTIL.get();
        if (until == null) return;
        double now = System.currentTimeMillis() / 1000.0;
        if (now > until)
            throw new PastDeadline(String.format(java.util.Locale.ROOT,
                    "its deadline passed during the work (%.1f s past it and the grace)", now - until));
    }
}
