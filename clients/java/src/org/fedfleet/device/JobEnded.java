// `job.ended` (protocols/payloads/job_end.py): the aggregator's retained list of the jobs that ended
// lately, each with the run whose device state goes and how it ended. The whole message is refused
// on any malformed entry (a half-read list could drop what it should not); a job's state is dropped
// only when the run the store holds is the one that ended, so a notice replayed from an older run
// of a reused job id never wipes a newer run's state.
package org.fedfleet.device;

import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.regex.Pattern;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Envelope.EnvelopeError;
import org.fedfleet.wire.Json;

public final class JobEnded {
    public static final String TYPE = "job.ended";
    public static final int MAX_NOTICES = 64, MAX_JOB_ID_CHARS = 128;
    private static final Pattern RUN = Pattern.compile("[0-9a-f]{8,64}");
    private static final List<String> REASONS = Arrays.asList("done", "cancelled", "failed");
    private static final HashSet<String> FIELDS = new HashSet<>(Arrays.asList("job", "run", "reason"));

    public final String job, run, reason;

    private JobEnded(String job, String run, String reason) { this.job = job; this.run = run; this.reason = reason; }

    public static List<JobEnded> parse(Envelope.Message env) throws EnvelopeError {
        if (!TYPE.equals(env.type())) throw new EnvelopeError("expected " + TYPE + ", got " + env.type());
        List<?> entries = Messages.field(env.body(), "ended", List.class);
        if (entries.size() > MAX_NOTICES)
            throw new EnvelopeError("job.ended carries at most " + MAX_NOTICES + " jobs, got " + entries.size());
        List<JobEnded> out = new ArrayList<>();
        for (Object e : entries) {
            if (!(e instanceof Map) || !((Map<?, ?>) e).keySet().equals(FIELDS))
                throw new EnvelopeError("job.ended: each entry is an object of exactly job, run, reason");
            Map<?, ?> m = (Map<?, ?>) e;
            Object job = m.get("job"), run = m.get("run"), reason = m.get("reason");
            if (!(job instanceof String) || ((String) job).isEmpty() || Json.characters((String) job) > MAX_JOB_ID_CHARS)
                throw new EnvelopeError("job.ended: job must be a string of 1-" + MAX_JOB_ID_CHARS + " characters");
            if (!(run instanceof String) || !RUN.matcher((String) run).matches())
                throw new EnvelopeError("job.ended: run must be 8-64 lowercase hex digits");
            if (!REASONS.contains(reason)) throw new EnvelopeError("job.ended: reason must be one of done/cancelled/failed");
            out.add(new JobEnded((String) job, (String) run, (String) reason));
        }
        return out;
    }

    /** Drops each listed job's state the store holds for the run that ended: the notices that dropped something. */
    public static List<JobEnded> apply(List<JobEnded> notices, DeviceStateStore store) {
        List<JobEnded> dropped = new ArrayList<>();
        for (JobEnded n : notices) if (store.dropRun(n.job, n.run)) dropped.add(n);
        return dropped;
    }
}
