// A device's open secure-aggregation rounds, keyed by (job, round, group)
// (edge_client/tasks/secure_update.py): a secure task opens one, every `secagg` envelope from
// the aggregator is fed to its round, and the replies go back. A task re-sent for a (job, round,
// group) whose round is live is a duplicate: the live round is kept (replacing it with fresh keys
// mid-round would drop this device out). A round its client's ReleaseGuard refused (the device's
// secure-input ledger) is aborted and left, the reason logged.
//
// A round ends here where it can no longer complete: at its task's deadline plus the clocks' grace
// (endsAt, WorkDeadline: the aggregator gives the round up at its deadline), or when maxSessions
// newer rounds push it out. SecAgg's security assumes a round's secrets (its private keys, its
// neighbours' shares, its input) are erased when the round ends, so an ending round's client is
// timed out (ClientSecAgg.timeOut: its own abort path erases them) and forgotten; a late message
// for it is refused, as for a round the aggregator aborted. MqttAgent calls expire on every tick;
// each message and task checks the clock (unix s, the device's: what the deadline is read on)
// first too, so a late message finds its round over between ticks. A task of a later round of the
// same job ends the job's earlier rounds still open here (the aggregator runs a job's rounds one at
// a time: they can no longer sum this device's input). A round opened with a RoundEnd tells it,
// once, whether the round FINISHED here (the device answered the unmask request as a survivor: its
// input is in the unmasked sum) or ended any other way (SecureStatefulHeadTask: Scaffold's c_k).
// A round whose answer cannot be sent (its encoder's EnvelopeError: over the envelope's limits, more
// chunks than a reassembler takes) ends at once, as on the Python device (edge_client/agent.py's
// _answer, SecAggSessions.unsendable): the device sits it out (a dropout) and keeps no secret of it
// until its deadline. Each open round is one OpenRound (its client, end, RoundEnd and task).
// A round whose authenticated RoundStart has no room for this device's input (InputRefused) is left,
// and the task that opened it (open's task) is declined through Leaving with INPUT_DOES_NOT_FIT:
// the aggregator turns the decline into MemberOffline and the round's first phase stops waiting for
// this device at once (it waited up to its budget, half the round); a replay of that RoundStart
// finds no round.
package org.fedfleet.secagg;

import java.util.ArrayList;
import java.util.Arrays;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.function.DoubleSupplier;
import java.util.logging.Logger;
import org.fedfleet.wire.LogText;
import org.fedfleet.wire.Envelope;

public final class SecAggSessions {
    private static final Logger LOG = LogText.oneLineLogger("fedfleet.device.secagg");
    private final String deviceId;
    private final int maxSessions;
    private final DoubleSupplier clock;
    private final Map<List<Object>, OpenRound> rounds = new LinkedHashMap<>();     // oldest first: the first pushed out
    private final Leaving leaving;

    /** What this device holds for one open round: one entry, so opening, ending and expiring it touch it whole. */
    private static final class OpenRound {
        final ClientSecAgg client;
        final Double endsAt;        // unix s, the device's clock; null: no end but maxSessions
        final RoundEnd roundEnd;    // the task kind that asked to be told how the round ended; null: none
        final String task;          // the task that opened it, declined if the device leaves at its start; null: none

        OpenRound(ClientSecAgg client, Double endsAt, RoundEnd roundEnd, String task) {
            this.client = client; this.endsAt = endsAt; this.roundEnd = roundEnd; this.task = task;
        }
    }

    /** The decline of a task whose input cannot enter its round (edge_client/tasks/secure_update.py says the same). */
    public static final String INPUT_DOES_NOT_FIT = "this device's input does not fit the secure round's configuration "
            + "(its length, its bound or its ring): it leaves the round";

    /** Told when this device leaves a round at its start: the task (job, round, task id) to decline, and why. */
    public interface Leaving {
        void left(String job, long round, String task, String reason);
    }

    /** Told once, when a round's session ends here, whether the round FINISHED (summed: true) or
     *  ended any other way (aborted, declared dropped, past its deadline, pushed out: false). */
    public interface RoundEnd {
        void ended(boolean summed);
    }

    /** A reply as what travels (MqttAgent: OutboxParts.secagg, its signed envelope's MQTT payloads);
     *  EnvelopeError where it cannot be sent. */
    public interface ReplyEncoder<T> {
        T encode(SecAggMessage reply) throws Envelope.EnvelopeError;
    }

    public SecAggSessions(String deviceId, int maxSessions) {
        this(deviceId, maxSessions, () -> System.currentTimeMillis() / 1000.0);
    }

    /** clock: unix seconds, the device's (a test's own). */
    public SecAggSessions(String deviceId, int maxSessions, DoubleSupplier clock) {
        this(deviceId, maxSessions, clock, null);
    }

    /** leaving: told of each round left at its start whose task is known (null: nobody). */
    public SecAggSessions(String deviceId, int maxSessions, DoubleSupplier clock, Leaving leaving) {
        this.deviceId = deviceId; this.maxSessions = maxSessions; this.clock = clock; this.leaving = leaving;
    }

    /** Opens the round with client, with no end but maxSessions; false (nothing changed) where a live round holds the key. */
    public boolean open(String job, long round, String group, ClientSecAgg client) {
        return open(job, round, group, client, null);
    }

    /** Opens the round with client until endsAt (unix s, the device's clock; null: no end but
     *  maxSessions); false (nothing changed) where a live round holds the key. */
    public boolean open(String job, long round, String group, ClientSecAgg client, Double endsAt) {
        return open(job, round, group, client, endsAt, null);
    }

    /** As above, roundEnd (null: none) told how the round ended. */
    public boolean open(String job, long round, String group, ClientSecAgg client, Double endsAt, RoundEnd roundEnd) {
        return open(job, round, group, null, client, endsAt, roundEnd);
    }

    /** As above, task (the id of the task that opened the round; null: none) declined if the
     *  device leaves the round at its start. */
    public boolean open(String job, long round, String group, String task, ClientSecAgg client, Double endsAt,
                        RoundEnd roundEnd) {
        List<Object> key = Arrays.<Object>asList(job, round, group);
        expire();
        if (live(job, round, group)) {
            LOG.info(deviceId + ": task for the live secure round " + key + " again: a duplicate");
            return false;
        }
        end(key, "over");
        rounds.put(key, new OpenRound(client, endsAt, roundEnd, task));
        while (rounds.size() > maxSessions)       // the oldest rounds: this device leaves them
            end(rounds.keySet().iterator().next(), "pushed out by newer rounds");
        return true;
    }

    /** Ends every round over by the clock. */
    public void expire() { expire(clock.getAsDouble()); }

    /** Ends every round over by now (unix s, the device's clock). */
    public void expire(double now) {
        List<List<Object>> over = new ArrayList<>();
        for (Map.Entry<List<Object>, OpenRound> e : rounds.entrySet()) {
            Double endsAt = e.getValue().endsAt;
            if (endsAt != null && now > endsAt) over.add(e.getKey());
        }
        for (List<Object> key : over) end(key, "past its deadline");
    }

    /** Whether a round waits for its end. */
    public boolean expiring() {
        for (OpenRound opened : rounds.values()) if (opened.endsAt != null) return true;
        return false;
    }

    /** Ends the open rounds of job before round (a task of round came: they are over). */
    public void leaveEarlierRounds(String job, long round) {
        List<List<Object>> over = new ArrayList<>();
        for (List<Object> key : rounds.keySet())
            if (job.equals(key.get(0)) && ((Number) key.get(1)).longValue() < round) over.add(key);
        for (List<Object> key : over) end(key, "over (round " + round + " of its job began)");
    }

    /** Forgets key's round, a live one timed out first (its secrets erased), and tells its
     *  RoundEnd, once, whether the round finished here. */
    private void end(List<Object> key, String why) {
        OpenRound opened = rounds.remove(key);
        if (opened == null) return;
        ClientSecAgg client = opened.client;
        if (!client.done()) {
            client.timeOut();
            LOG.info(deviceId + ": secure round " + key + " " + why + ": left, its secrets erased");
        }
        if (opened.roundEnd != null) opened.roundEnd.ended(client.state() == ClientSecAgg.State.FINISHED);
    }

    /** Whether the round (job, round, group) is open here and not over. */
    public boolean live(String job, long round, String group) {
        ClientSecAgg client = session(job, round, group);
        return client != null && !client.done();
    }

    /** The round open for (job, round, group), or null. */
    public ClientSecAgg session(String job, long round, String group) {
        OpenRound opened = rounds.get(Arrays.<Object>asList(job, round, group));
        return opened == null ? null : opened.client;
    }

    public int open() { return rounds.size(); }

    /** The replies to one `secagg` envelope; a message that fails its checks is logged and changes
     *  nothing, but a RoundStart with no room for the input: its round is left (leaving told). */
    public List<SecAggMessage> onMessage(Envelope.Message env) {
        return onMessage(env, reply -> reply);
    }

    /** The replies to one `secagg` envelope, each encoded by encoder, all before any is sent: where one
     *  cannot be (an EnvelopeError), none is, and the round ends here at once (its secrets erased, its
     *  RoundEnd told), one warning; a message that fails its checks is logged and changes nothing. */
    public <T> List<T> onMessage(Envelope.Message env, ReplyEncoder<T> encoder) {
        SecAggMessage m;
        try {
            m = SecAggMessage.fromEnvelope(env);
        } catch (SecAggException e) {
            LOG.warning(deviceId + ": malformed secagg message: " + e.getMessage());
            return Collections.emptyList();
        }
        expire();
        Object round = m.header.get("round_id");
        List<Object> key = Arrays.<Object>asList(m.header.get("job_id"),
                round instanceof java.math.BigInteger ? ((java.math.BigInteger) round).longValue() : round, m.header.get("group_id"));
        OpenRound opened = rounds.get(key);
        if (opened == null) {
            LOG.info(deviceId + ": secagg message for an unknown session " + key);
            return Collections.emptyList();
        }
        ClientSecAgg client = opened.client;
        try {
            List<T> out = new ArrayList<>();
            for (SecAggMessage reply : client.handle(m)) out.add(encoder.encode(reply));
            return out;
        } catch (SecAggException.ReleaseRefused e) {       // the round is aborted: the input does not leave
            LOG.warning(deviceId + ": leaves secure round " + m.header.get("job_id") + "/" + round + ": " + e.getMessage());
            return Collections.emptyList();
        } catch (SecAggException.InputRefused e) {     // the encoder's words stay here: they may quote the input
            end(key, "its input does not fit the round");
            LOG.warning(deviceId + ": leaves secure round " + key + " at its start: " + e.getMessage());
            if (opened.task != null && leaving != null)
                leaving.left((String) key.get(0), ((Number) key.get(1)).longValue(), opened.task, INPUT_DOES_NOT_FIT);
            return Collections.emptyList();
        } catch (SecAggException e) {
            LOG.warning(deviceId + ": secagg error: " + e.getMessage());
            return Collections.emptyList();
        } catch (Envelope.EnvelopeError e) {    // its answer cannot travel: sit the round out (a dropout)
            end(key, "its answer cannot be sent");
            LOG.warning(deviceId + ": leaves secure round " + m.header.get("job_id") + "/" + round
                        + ": its answer cannot be sent: " + e.getMessage());
            return Collections.emptyList();
        } finally {
            if (client.done()) {
                end(key, "over");
                if (client.abortReason != null) LOG.info(deviceId + ": secure round " + key + " aborted by the aggregator: " + client.abortReason);
            }
        }
    }
}
