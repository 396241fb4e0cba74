// Follows a device's model rollout over MQTT (issue 29; the Java side of edge_client/deployment.py
// DeploymentFollower, protocols/payloads/deployment.py): its own connection, subscribed to the
// device's retained deploy topic (so an offline device gets its assignment on reconnect) and its
// deploy inbox. For a `run` it asks for the head (`artifact.get` on the deploy outbox, again every
// retryS until fetchTimeoutS), verifies it (ModelSlot.swap: sha256, shape), counts on the held-out
// split how many samples the candidate and its current head get right (OLL-pruned when the slot
// personalises), swaps and reports the counts; for a `rollback` it goes back to the kept version.
// An assignment the aggregator did not sign (with aggregatorKey), one for another device or older
// than the sequence the slot holds (ModelSlot.admit: a replayed capture), or a head that cannot be
// fetched, verified or loaded, is refused: the device keeps its version and reports why, with the
// reason's class (what fails on the device's own side, its held-out features or writing the slot, is
// tried again every retryS and refused only after fetchTimeoutS); what does not answer its own assignment is reported at most once per class per
// refusalIntervalS. A head is taken only as the answer to the assignment being fetched (its sha256
// and its deployment's file name). With a username, it logs in as "{username}/deploy" (its own
// account on the generated ACL broker: one MQTT identity per connection). What a message or a tick
// throws, an Error included (the application's held-out features, its signer), is that step's
// failure, logged, and the follower goes on, as MqttAgent does; only what ends that agent's loop
// (MqttAgent.endsTheLoop: a broken VM, ThreadDeath, an interrupt) ends the follower's thread, and
// then with one log line and the cause in stoppedBy(). It caught only RuntimeException: any Error
// ended its thread in silence, the device following no rollout again.
package org.fedfleet.device;

import java.net.URI;
import java.util.ArrayList;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.logging.Level;
import java.util.logging.Logger;
import org.fedfleet.wire.LogText;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Envelope.EnvelopeError;
import org.fedfleet.wire.Reassembler;
import org.fusesource.mqtt.client.Callback;
import org.fusesource.mqtt.client.CallbackConnection;
import org.fusesource.mqtt.client.QoS;
import org.fusesource.mqtt.client.Topic;

public final class DeploymentFollower implements AutoCloseable {
    private static final Logger LOG = LogText.oneLineLogger("fedfleet.device");

    /** The held-out split: its labels, and its features through the bundle a head reads ("": the device's own). */
    public interface HeldOut {
        float[][] features(String bundleSha256) throws Exception;
        int[] labels();
    }

    public static final class Options {
        public Topics topics = new Topics();
        public Envelope.Signer signer;          // the device's Identity when the aggregator requires signatures
        public byte[] aggregatorKey;            // only assignments and heads the aggregator signed are taken
        public String username, password;
        public double retryS = 5.0, fetchTimeoutS = 60.0, refusalIntervalS = 10.0;
    }

    public final String deviceId;
    public final ModelSlot slot;
    /** The latest refusals and reports a follower keeps in memory (edge_client/deployment.py KEPT_REFUSALS). */
    public static final int KEPT_REFUSALS = 256;
    /** Of a refusal's reason, as logged, kept and reported (edge_client/deployment.py MAX_WHY_CHARS). */
    public static final int MAX_WHY_CHARS = 500;
    // the latest refusals and reports, for a status page or a test: bounded, as the Python follower's,
    // since anyone on an open broker may publish on the deploy topics (a review's finding: each forged
    // message added its reason, a schema error quoting up to 64 KB of it, for the process's life)
    public final List<String> refusals = Collections.synchronizedList(new ArrayList<String>());
    public final List<Map<String, Object>> reports = Collections.synchronizedList(new ArrayList<Map<String, Object>>());
    private final HeldOut heldOut;
    private final Options o;
    private final CallbackConnection connection;
    // what waits unread, in bytes (as edge_client/deployment.py): two heads from one topic, four in all
    private final InboxQueue<Inbound> inbox = new InboxQueue<>("deploy", 2 * (HeadFile.MAX_HEAD_BYTES + (1L << 20)),
            4 * (HeadFile.MAX_HEAD_BYTES + (1L << 20)));
    private final InboxReader reader;
    private ModelSlot.Assignment pending;
    private Retry retry;                        // a fetched head whose adoption failed on this side, tried again
    private double pendingSince, pendingAsked;
    private final Map<String, Double> lastUnbound = new java.util.HashMap<>();   // refusal class -> when last reported
    private final java.util.Set<String> boundReasons = new java.util.HashSet<>(); // classes reported for assignment boundSeq
    private long boundSeq = -1;
    private volatile boolean running;
    private volatile Throwable stoppedBy;       // why the follower's thread ended on its own (MqttAgent.endsTheLoop)
    private Thread thread;

    public DeploymentFollower(String deviceId, URI broker, ModelSlot slot, HeldOut heldOut, Options options) throws Exception {
        this.deviceId = Topics.checkDeviceId(deviceId);
        this.slot = slot; this.heldOut = heldOut; this.o = options;
        slot.bindKey(options.aggregatorKey);
        // a head is the largest message here (as edge_client/deployment.py: room for two of them in all)
        reader = new InboxReader(options.aggregatorKey, HeadFile.MAX_HEAD_BYTES * 2, new Reassembler(300,
                HeadFile.MAX_HEAD_BYTES * 2, Reassembler.DEFAULT_MAX_PENDING_PER_SENDER, 4 * HeadFile.MAX_HEAD_BYTES));
        String account = options.username == null ? null : options.username + "/deploy";
        connection = DeviceConnection.settings(broker, account == null ? deviceId + ".deploy" : account, account,
                options.password).callbackConnection();
        DeviceConnection.listen(connection, deviceId + ": deployment", this::subscribe, () -> {},
                (topic, payload) -> inbox.offer(topic, new Inbound(topic, payload), payload.length));
    }

    public DeploymentFollower start() {
        running = true;
        thread = DeviceConnection.start(connection, deviceId, this::run, "fedfleet-deploy-" + deviceId);
        return this;
    }

    @Override
    public void close() {
        running = false;
        DeviceConnection.join(thread);
        DeviceConnection.disconnect(connection);
    }

    private void subscribe() {
        connection.subscribe(new Topic[] {new Topic(deployTopic(), QoS.AT_LEAST_ONCE), new Topic(deployTopic() + "/in", QoS.AT_LEAST_ONCE)},
                new Callback<byte[]>() {
                    @Override public void onSuccess(byte[] granted) {}
                    @Override public void onFailure(Throwable e) { LOG.warning(deviceId + ": deploy subscribe failed: " + e); }
                });
    }

    private String deployTopic() { return o.topics.root + "/v1/deploy/" + deviceId; }

    /** Why the follower's thread ended on its own, or null (running, or ended by close()): what ends
     *  MqttAgent's loop too (MqttAgent.endsTheLoop). It then follows no rollout; the application
     *  starts a new follower (or the process). */
    public Throwable stoppedBy() { return stoppedBy; }

    private void run() {
        while (running) {
            Inbound m;
            try {
                m = inbox.poll(200);
            } catch (InterruptedException e) {     // not close(), which only clears `running`: the application's
                if (running) stop(e, "its thread was interrupted");
                return;
            }
            if (!turn(m == null ? null : m.topic, m == null ? null : m.payload)) return;
        }
    }

    /** One turn of the follower's thread: the message taken (null: none), then the tick, each guarded
     *  on its own (a message that throws skips no tick: a fetch's retries and timeout). False: the
     *  follower stopped (MqttAgent.endsTheLoop). */
    boolean turn(String topic, byte[] payload) {
        if (stoppedBy != null) return false;
        if (payload != null && !guarded("handling a message on " + topic, () -> onPayload(topic, payload))) return false;
        return guarded("its tick", () -> tick(monotonic()));
    }

    private boolean guarded(String what, Runnable step) {
        try {
            step.run();
            return true;
        } catch (Throwable e) {
            if (MqttAgent.endsTheLoop(e)) {
                stop(e, e + ", " + what);
                return false;
            }
            LOG.log(Level.SEVERE, deviceId + ": deployment: unexpected error " + what + "; the follower goes on", e);
            return true;
        }
    }

    private void stop(Throwable cause, String what) {
        stoppedBy = cause;
        running = false;
        LOG.log(Level.SEVERE, deviceId + ": the deployment follower stopped (" + what + "): it follows no more"
                + " rollouts; the application must start it again (DeploymentFollower.stoppedBy)", cause);
    }

    private void onPayload(String topic, byte[] payload) {
        if (payload.length == 0) return;                  // a retained assignment cleared
        boolean isAssignment = topic.equals(deployTopic());
        Envelope.Message env;
        byte[] whole;
        try {
            InboxReader.Whole got = reader.receive(payload, monotonic());
            if (got == null) return;
            env = got.message;
            whole = got.bytes;
        } catch (EnvelopeError e) {     // not a message the aggregator signed: a forgery, or a tampered head
            refuse((isAssignment ? "assignment" : "head") + " refused: " + e.getMessage(), isAssignment ? null : pending, "signature");
            return;
        }
        try {
            if (isAssignment) onAssignment(ModelSlot.assignment(whole, o.aggregatorKey));
            else if ("artifact".equals(env.type()) && pending != null) onHead(env);
        } catch (EnvelopeError e) {
            refuse("assignment refused: " + e.getMessage(), null, "load");
        }
    }

    private void onAssignment(ModelSlot.Assignment a) {
        boolean redelivery = a.seq == slot.seq();
        try {
            slot.admit(a, deviceId);
        } catch (ModelSlot.Refusal r) {
            refuse(r.getMessage(), null, r.reason);
            return;
        } catch (java.io.IOException e) {
            refuse("assignment " + a.seq + " not written: " + e.getMessage(), null, "load");
            return;
        }
        if (retry != null) {
            if (retry.a.seq == a.seq) return;      // its re-delivery: the held head is still being adopted
            retry = null;                          // a newer assignment replaces it
        }
        // a newer assignment ends the older one's fetch, whatever it says: its head arriving later (late,
        // or replayed) swapped in a version the aggregator had since withdrawn (as the Python device's)
        if (pending != null && pending.seq != a.seq) pending = null;
        if (a.action.equals(ModelSlot.ROLLBACK)) {
            try {
                if (slot.revert(a.deployment))
                    LOG.warning(deviceId + ": deployment " + a.deployment + " rolled back (" + a.reason + "): running the kept version again");
            } catch (java.io.IOException e) {
                refuse("rollback of " + a.deployment + " not written: " + e.getMessage(), null, "load");
            }
            return;
        }
        ModelSlot.Version current = slot.current(), previous = slot.previous();
        if (current != null && current.sha256.equals(a.sha256)) {
            // judged again, kept: another deployment's, or a new sequence (the controller asks anew after the
            // device missed a rollback, e.g. its broker session lost); else a retained re-delivery
            if (!current.deployment.equals(a.deployment) || !redelivery) adopt(a, current.head, null, Double.NaN);
            return;
        }
        if (previous != null && previous.sha256.equals(a.sha256)) {
            try {
                adopt(a, previous.head, slot.keptBytes(previous), Double.NaN);
            } catch (java.io.IOException e) {
                refuse("kept head unreadable: " + e.getMessage(), a, "load");
            }
            return;
        }
        if (pending != null && pending.seq == a.seq) return;     // its re-delivery while its head is fetched:
        pending = a;                                             // the fetch's clock runs on (as the Python device's)
        pendingSince = monotonic();
        pendingAsked = Double.NEGATIVE_INFINITY;
    }

    private void tick(double now) {
        reader.expire(now);                     // parts of a head that never completed (a fifth was refused for ever)
        Retry r = retry;
        if (r != null && now >= r.at) {
            retry = null;                       // held again only if this try fails on this side too
            adopt(r.a, r.candidate, r.data, r.since);
        }
        ModelSlot.Assignment p = pending;
        if (p == null) return;
        if (now - pendingSince > o.fetchTimeoutS) {
            pending = null;
            refuse("no head " + p.sha256.substring(0, 16) + "… within " + o.fetchTimeoutS + "s", p, "timeout");
        } else if (now - pendingAsked >= o.retryS) {
            pendingAsked = now;
            Map<String, Object> body = new LinkedHashMap<>();
            body.put("sha256", p.sha256);
            publish("artifact.get", body);
        }
    }

    private void onHead(Envelope.Message env) {
        ModelSlot.Assignment p = pending;
        if (!p.sha256.equals(env.body().get("sha256")) || !(p.deployment + ".npz").equals(env.body().get("name"))) return;
        pending = null;
        byte[] data;
        try {
            data = ModelSlot.artifactBytes(env, p.sha256);
        } catch (ModelSlot.Refusal e) {
            refuse("head refused, staying on the current version: " + e.getMessage(), p, e.reason);
            return;
        }
        try {
            adopt(p, HeadFile.parse(data), data, Double.NaN);
        } catch (java.io.IOException e) {
            refuse("head cannot be loaded, staying on the current version: " + e.getMessage(), p, "load");
        }
    }

    /** Count on the held-out split, swap (unless ``data`` is null: the head is already current), report.
     *  A head that does not fit (shape, OLL labels) is refused at once; what fails on this device's own
     *  side (the held-out features, writing the slot) may pass a moment later, so the head is adopted
     *  again every retryS and refused only once fetchTimeoutS has passed since the first failure
     *  (``since``; NaN: none yet): a refusal is the device's answer, which a guard may roll back on. */
    private void adopt(ModelSlot.Assignment a, HeadFile candidate, byte[] data, double since) {
        ModelSlot.Version current = slot.current();
        float[][] z, zCurrent;
        int[] y;
        try {
            z = heldOut.features(a.bundleSha256);
            y = heldOut.labels();
            zCurrent = current == null || current.bundleSha256.equals(a.bundleSha256) ? z : heldOut.features(current.bundleSha256);
        } catch (Throwable e) {      // the application's held-out features: an Error too is this try's failure
            if (endsTheFollower(e)) return;
            tryAgain(a, candidate, data, since, "held-out features: " + e.getClass().getSimpleName() + ": " + e.getMessage());
            return;
        }
        Map<String, Object> counts = new LinkedHashMap<>();
        try {
            counts.put("n", y.length);
            counts.put("correct_candidate", slot.correct(candidate, z, y));
            counts.put("correct_current", current == null ? 0 : slot.correct(current.head, zCurrent, y));
        } catch (Throwable e) {      // the head does not fit the features, or the device's labels
            if (endsTheFollower(e)) return;
            cannotLoad(a, e);
            return;
        }
        if (data != null) {
            if (!Envelope.hex(Envelope.sha256(data)).equals(a.sha256)) {     // a kept file changed on disk: not the slot's fault
                cannotLoad(a, new java.io.IOException("head sha256 differs from the assigned " + a.sha256));
                return;
            }
            try {
                slot.swap(data, a.sha256, a.deployment, a.bundleSha256);
            } catch (java.io.IOException e) {      // the slot's folder: full, or read-only for a while
                tryAgain(a, candidate, data, since, "writing the slot: " + e.getMessage());
                return;
            } catch (Throwable e) {
                if (endsTheFollower(e)) return;
                cannotLoad(a, e);
                return;
            }
        } else {
            try {                   // the current head under a new deployment: it came from that one now
                slot.relabel(a.deployment);
            } catch (java.io.IOException e) {
                tryAgain(a, candidate, data, since, "writing the slot: " + e.getMessage());
                return;
            }
        }
        LOG.info(deviceId + ": now running " + a.sha256.substring(0, 12) + " of deployment " + a.deployment);
        report(a, counts);
    }

    /** Whether {@code e} ends the follower (MqttAgent.endsTheLoop) rather than this try: such an Error
     *  is thrown on to the turn's guard, which stops it; an interrupt is set again on the thread,
     *  whose next wait stops it (run). */
    private static boolean endsTheFollower(Throwable e) {
        if (!MqttAgent.endsTheLoop(e)) return false;
        if (e instanceof Error) throw (Error) e;
        Thread.currentThread().interrupt();
        return true;
    }

    private void cannotLoad(ModelSlot.Assignment a, Throwable e) {
        refuse("head cannot be loaded, staying on the current version: " + e.getClass().getSimpleName() + ": " + e.getMessage(), a, "load");
    }

    /** Hold the head and adopt it again in retryS; refuse it once fetchTimeoutS has passed since ``since``. */
    private void tryAgain(ModelSlot.Assignment a, HeadFile candidate, byte[] data, double since, String why) {
        double now = monotonic();
        double first = Double.isNaN(since) ? now : since;
        if (now - first >= o.fetchTimeoutS) {
            refuse("head not adopted within " + o.fetchTimeoutS + "s, staying on the current version: " + why, a, "load");
            return;
        }
        LOG.warning(deviceId + ": head " + a.sha256.substring(0, 12) + " of deployment " + a.deployment + " not adopted yet ("
                + why + "): trying again in " + o.retryS + "s");
        retry = new Retry(a, candidate, data, first, now + o.retryS);
    }

    private static final class Retry {
        final ModelSlot.Assignment a;
        final HeadFile candidate;
        final byte[] data;
        final double since, at;

        Retry(ModelSlot.Assignment a, HeadFile candidate, byte[] data, double since, double at) {
            this.a = a; this.candidate = candidate; this.data = data; this.since = since; this.at = at;
        }
    }

    /** Log and report a refusal of class ``reason``: as the answer to ``a`` when it is the assignment held,
     *  else (a forged, stale or misaddressed message) against the version running, once per class per
     *  refusalIntervalS (a flood of forgeries becomes a trickle of reports). */
    private void refuse(String why, ModelSlot.Assignment a, String reason) {
        if (why.length() > MAX_WHY_CHARS) why = why.substring(0, MAX_WHY_CHARS);
        LOG.warning(deviceId + ": " + why);
        String deployment = a == null ? null : a.deployment, sha = a == null ? null : a.sha256;
        if (a != null && a.seq == slot.seq()) {            // an assignment's own refusals: once per class
            if (a.seq != boundSeq) { boundSeq = a.seq; boundReasons.clear(); }
            if (!boundReasons.add(reason)) deployment = null;
        } else {
            ModelSlot.Version current = slot.current();
            double now = monotonic();
            Double last = lastUnbound.get(reason);
            boolean due = current != null && slot.seq() > 0 && (last == null || now - last >= o.refusalIntervalS);
            deployment = due ? current.deployment : null;
            sha = due ? current.sha256 : null;
            if (due) lastUnbound.put(reason, now);
        }
        if (deployment != null) {
            Map<String, Object> body = new LinkedHashMap<>();
            body.put("refused", why);
            body.put("reason", reason);
            report(deployment, slot.seq(), sha, body);
        }
        keep(refusals, why);     // after its report: whoever sees the refusal sees the report
    }

    /** `item` appended to `latest`, the oldest going past KEPT_REFUSALS. */
    private static <T> void keep(List<T> latest, T item) {
        synchronized (latest) {
            latest.add(item);
            if (latest.size() > KEPT_REFUSALS) latest.remove(0);
        }
    }

    private void report(ModelSlot.Assignment a, Map<String, Object> fields) { report(a.deployment, a.seq, a.sha256, fields); }

    private void report(String deployment, long seq, String sha256, Map<String, Object> fields) {
        Map<String, Object> body = new LinkedHashMap<>();
        body.put("deployment", deployment);
        body.put("seq", java.math.BigInteger.valueOf(seq));
        body.put("sha256", sha256);
        body.putAll(fields);
        keep(reports, body);
        publish("deployment.report", body);
    }

    private void publish(String type, Map<String, Object> body) {
        try {
            byte[] msg = Envelope.encode(Messages.header(type, deviceId, body, Messages.newId(), Messages.now()),
                    Collections.<Envelope.Tensor>emptyList(), o.signer);
            connection.getDispatchQueue().execute(() -> connection.publish(deployTopic() + "/out", msg, QoS.AT_LEAST_ONCE, false,
                    new Callback<Void>() {
                        @Override public void onSuccess(Void v) {}
                        @Override public void onFailure(Throwable e) { LOG.warning(deviceId + ": " + type + " not sent: " + e); }
                    }));
        } catch (EnvelopeError e) {
            LOG.severe(deviceId + ": cannot encode " + type + ": " + e.getMessage());
        }
    }

    private static double monotonic() { return System.nanoTime() / 1e9; }

    /** A message as the MQTT client's thread queued it for the follower's thread. */
    private static final class Inbound {
        final String topic;
        final byte[] payload;
        Inbound(String topic, byte[] payload) { this.topic = topic; this.payload = payload; }
    }
}
