// A device's open secure-aggregation rounds, keyed by (job, round, group)
// (edge_client/tasks/secure_update.py): a secure task opens one, every `secagg` envelope from
// the aggregator is fed to its round, and the replies go back. At most maxSessions are kept. A
// task re-sent for a (job, round, group) whose round is live is a duplicate: the live round is
// kept (replacing it with fresh keys mid-round would drop this device out). A round its client's
// ReleaseGuard refused (the device's secure-input ledger) is aborted and left, the reason logged.
package org.fedfleet.secagg;

import java.util.Arrays;
import java.util.Collections;
import java.util.Iterator;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.logging.Logger;
import org.fedfleet.wire.LogText;
import org.fedfleet.wire.Envelope;

public final class SecAggSessions {
    private static final Logger LOG = LogText.oneLineLogger("fedfleet.device.secagg");
    private final String deviceId;
    private final int maxSessions;
    private final Map<List<Object>, ClientSecAgg> sessions = new LinkedHashMap<>();

    public SecAggSessions(String deviceId, int maxSessions) { this.deviceId = deviceId; this.maxSessions = maxSessions; }

    /** Opens the round with client; false (nothing changed) where a live round holds the key. */
    public boolean open(String job, long round, String group, ClientSecAgg client) {
        List<Object> key = Arrays.<Object>asList(job, round, group);
        if (live(job, round, group)) {
            LOG.info(deviceId + ": task for the live secure round " + key + " again: a duplicate");
            return false;
        }
        sessions.remove(key);
        sessions.put(key, client);
        Iterator<List<Object>> oldest = sessions.keySet().iterator();
        while (sessions.size() > maxSessions) { oldest.next(); oldest.remove(); }
        return true;
    }

    /** Whether the round (job, round, group) is open here and not over. */
    public boolean live(String job, long round, String group) {
        ClientSecAgg client = session(job, round, group);
        return client != null && !client.done();
    }

    /** The round open for (job, round, group), or null. */
    public ClientSecAgg session(String job, long round, String group) {
        return sessions.get(Arrays.<Object>asList(job, round, group));
    }

    public int open() { return sessions.size(); }

    /** The replies to one `secagg` envelope; a message that fails its checks is logged and changes nothing. */
    public List<SecAggMessage> onMessage(Envelope.Message env) {
        SecAggMessage m;
        try {
            m = SecAggMessage.fromEnvelope(env);
        } catch (SecAggException e) {
            LOG.warning(deviceId + ": malformed secagg message: " + e.getMessage());
            return Collections.emptyList();
        }
        Object round = m.header.get("round_id");
        List<Object> key = Arrays.<Object>asList(m.header.get("job_id"),
                round instanceof java.math.BigInteger ? ((java.math.BigInteger) round).longValue() : round, m.header.get("group_id"));
        ClientSecAgg client = sessions.get(key);
        if (client == null) {
            LOG.info(deviceId + ": secagg message for an unknown session " + key);
            return Collections.emptyList();
        }
        try {
            return client.handle(m);
        } catch (SecAggException.ReleaseRefused e) {       // the round is aborted: the input does not leave
            LOG.warning(deviceId + ": leaves secure round " + m.header.get("job_id") + "/" + round + ": " + e.getMessage());
            return Collections.emptyList();
        } catch (SecAggException e) {
            LOG.warning(deviceId + ": secagg error: " + e.getMessage());
            return Collections.emptyList();
        } finally {
            if (client.done()) {
                sessions.remove(key);
                if (client.abortReason != null) LOG.info(deviceId + ": secure round " + key + " aborted by the aggregator: " + client.abortReason);
            }
        }
    }
}
