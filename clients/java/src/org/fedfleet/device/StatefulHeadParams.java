// A stateful head task's params (protocols/payloads/stateful.py StatefulHeadParams: scaffold.head,
// ditto.head, pp.head): fedavg.head's (HeadTrainingParams, read in the task's kind) plus the job
// whose state the device keeps (job_id) and the state binding (StateBinding); both required.
package org.fedfleet.device;

import java.util.Map;
import org.fedfleet.wire.Json;

public class StatefulHeadParams {
    public final HeadTrainingParams head;
    public final String jobId;
    public final StateBinding state;

    StatefulHeadParams(Map<String, Object> p, String kind) throws TaskDeclined {
        TaskParams.checkVersion(p, kind);
        TaskParams.require(p, kind, "job_id", "state");
        head = HeadTrainingParams.fromParams(p, kind);
        Object job = p.get("job_id");
        if (!(job instanceof String) || Json.characters((String) job) > 128)
            throw new TaskDeclined("bad " + kind + " params: job_id must be a string of at most 128 characters, got " + job);
        if (((String) job).isEmpty()) throw new TaskDeclined("bad " + kind + " params: a stateful task needs a job_id");
        jobId = (String) job;
        state = StateBinding.fromParams(p.get("state"), kind);
    }

    /** The run a stateful task's params bind its state to (`state.run`), null where they name none:
     *  what a device matches against the runs `job.ended` named (protocols/payloads/stateful.py bound_run). */
    static String boundRun(Map<String, Object> params) {
        Object state = params.get("state");
        Object run = state instanceof Map ? ((Map<?, ?>) state).get("run") : null;
        return run instanceof String ? (String) run : null;
    }

    /** Why a task of job `job` whose params name another job_id is declined (null: they do not): a
     *  stateful task keys the device's state by that param (protocols/payloads/stateful.py foreign_job). */
    static String foreignJob(Map<String, Object> params, String job) {
        if (!params.containsKey("job_id")) return null;
        Object named = params.get("job_id");
        if (job.equals(named)) return null;
        if (!(named instanceof String)) return "the task's job_id param is not a string";
        String text = (String) named;       // the first 64 code points, as Python slices
        int end = text.codePointCount(0, text.length()) > 64 ? text.offsetByCodePoints(0, 64) : text.length();
        return "the task's job_id param '" + text.substring(0, end) + "' is not its job '" + job + "'";
    }

    /** scaffold.head's params (protocols/payloads/scaffold.py ScaffoldParams): nothing beyond these. */
    public static StatefulHeadParams scaffold(Map<String, Object> params) throws TaskDeclined {
        return new StatefulHeadParams(params, ScaffoldTask.KIND);
    }

    public Map<String, Object> toParams() {
        Map<String, Object> out = head.toParams();
        putBinding(out);
        return out;
    }

    /** The job and state binding into `out` (what every stateful kind adds to its base params). */
    void putBinding(Map<String, Object> out) {
        out.put("job_id", jobId);
        out.put("state", state.toParams());
    }
}
