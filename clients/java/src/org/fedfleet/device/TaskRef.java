// One unit of work: (job, round) and the task message's id.
package org.fedfleet.device;

import java.util.Objects;

public final class TaskRef {
    public final String job, task;
    public final long round;

    public TaskRef(String job, long round, String task) { this.job = job; this.round = round; this.task = task; }

    @Override public boolean equals(Object o) {
        if (!(o instanceof TaskRef)) return false;
        TaskRef r = (TaskRef) o;
        return job.equals(r.job) && round == r.round && task.equals(r.task);
    }

    @Override public int hashCode() { return Objects.hash(job, round, task); }

    @Override public String toString() { return job + "/" + round + "/" + task; }
}
