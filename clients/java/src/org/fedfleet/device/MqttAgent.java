// One device on MQTT (docs/protocol.md "Transport"): a persistent session (clean session off, so
// tasks published while it reconnects are delivered), retained presence whose `offline` message is
// the last will, presence `online` again after every reconnect, and the round session's retries.
// The MQTT client's thread only queues raw payloads; the agent's own thread decodes them, drives
// the DeviceSession and runs the task handlers, so a slow task never blocks the connection; a
// task's work stops once its round is surely over (WorkDeadline), no result sent. Given the device's
// state store, it keeps the session's replay guard in the store's folder across restarts
// (SessionMemoryFile). What one message or one task throws is that message's failure, logged with it,
// and the agent goes on; only a broken VM, ThreadDeath or an interrupt ends its thread, and then
// cleanly: one log line, presence `offline`, and the cause in stoppedBy() (endsTheLoop).
package org.fedfleet.device;

import java.io.File;
import java.net.URI;
import java.util.ArrayList;
import java.util.Collections;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.TreeSet;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.logging.Level;
import java.util.logging.Logger;
import org.fedfleet.wire.LogText;
import org.fedfleet.secagg.SecAggMessage;
import org.fedfleet.secagg.SecAggSessions;
import org.fedfleet.wire.Chunker;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Envelope.EnvelopeError;
import org.fedfleet.wire.Reassembler;
import org.fusesource.hawtbuf.UTF8Buffer;
import org.fusesource.mqtt.client.Callback;
import org.fusesource.mqtt.client.CallbackConnection;
import org.fusesource.mqtt.client.MQTT;
import org.fusesource.mqtt.client.QoS;
import org.fusesource.mqtt.client.Topic;

public final class MqttAgent implements AutoCloseable {
    private static final Logger LOG = LogText.oneLineLogger("fedfleet.device");

    /** Everything but the identity and the handlers; the defaults are a real device's. */
    public static final class Options {
        public Topics topics = new Topics();
        public Envelope.Signer signer;          // the device's Identity when the aggregator requires signatures
        public byte[] aggregatorKey;            // raw Ed25519 key: only messages the aggregator signed are taken
        public String username, password;
        public int chunkSize = Chunker.DEFAULT_CHUNK_SIZE;
        public double retryAfterS = 10.0, tickS = 0.5, publishTimeoutS = 60.0;
        // what waits unread for the agent thread, per topic and in all: the devices' one rule,
        // DEVICE_INBOX_BOUND (protocols/device_inbox.py), a few times the largest task a job sends
        public long maxQueuedTopicBytes = 128L << 20, maxQueuedBytes = 160L << 20;
        // the largest message taken; the reader holds no more than the queue's per-topic bytes either
        // (the same rule: the aggregator refuses a job whose task would be larger, and
        // tests/test_java_inbox_bound.py holds these defaults to protocols/device_inbox.py)
        public long maxMessageBytes = 128L << 20;
        public Map<String, Object> info = new LinkedHashMap<>();   // published with presence
        /** Task kinds answered under secure aggregation (e.g. SecureFed3RTask.KIND); they need
         *  signer to be the device's Identity (enrolled with the aggregator) and aggregatorKey. */
        public Map<String, SecureTask> secure = new LinkedHashMap<>();
        /** The stateful handlers' store: a job's state goes when the aggregator says the job ended
         *  (`job.ended` on the retained Topics.jobEnds, verified like every aggregator message); the
         *  session's replay guard is kept in its folder across restarts (SessionMemoryFile), and so are
         *  the member sets each secure input went to (SecureInputLedger; without a store, in memory). */
        public DeviceStateStore state;
    }

    public final String deviceId;
    private final Map<String, TaskHandler> handlers;
    private final Options o;
    private final DeviceSession session;
    private final SessionMemoryFile memoryFile;     // null without a state store: the replay guard lives in the process only
    private final InboxReader reader;
    private final OutboxParts outbox;
    private final CallbackConnection connection;
    private final InboxQueue<byte[]> inbox;
    private volatile boolean running;
    private volatile Throwable stoppedBy;           // why the agent's thread ended on its own (endsTheLoop)
    private final java.util.concurrent.atomic.AtomicBoolean wentOffline = new java.util.concurrent.atomic.AtomicBoolean();
    private String inHand = "";                     // the message being handled, for a failure's log line
    private Thread thread;
    public final AtomicInteger tasksDone = new AtomicInteger(), tasksDeclined = new AtomicInteger(),
            tasksSkipped = new AtomicInteger(), reconnects = new AtomicInteger();
    /** Tasks whose work stopped when their round was surely over (no result sent). */
    public final AtomicInteger tasksStopped = new AtomicInteger();
    public final Map<String, Integer> acks = Collections.synchronizedMap(new HashMap<String, Integer>());
    private final CountDownLatch firstConnect = new CountDownLatch(1);
    private final SecAggSessions secagg;
    private final SecureRounds secureRounds;        // null: no secure kinds
    // the "job run"s whose end this device handled, oldest first: a task of one that arrives later
    // (queued behind the notice, redelivered) is skipped, or it would write that run's state again
    private final java.util.Set<String> endedRuns = new java.util.LinkedHashSet<>();
    private final java.util.Set<String> skippedFor = new java.util.HashSet<>();    // (job, reason) of skipped or stopped tasks, logged once (at most 64)

    public MqttAgent(String deviceId, URI broker, Map<String, TaskHandler> handlers, Options options) throws Exception {
        this.deviceId = Topics.checkDeviceId(deviceId);
        this.handlers = new LinkedHashMap<>(handlers);
        this.o = options;
        this.session = new DeviceSession(options.retryAfterS, 5, 4);
        this.memoryFile = options.state == null ? null : new SessionMemoryFile(new File(options.state.root(), SessionMemoryFile.NAME), LOG);
        if (memoryFile != null) memoryFile.loadInto(session);
        this.outbox = new OutboxParts(deviceId, options.chunkSize, options.signer);
        this.inbox = new InboxQueue<>("agent-" + deviceId, options.maxQueuedTopicBytes, options.maxQueuedBytes);
        // a round left at its start (the input does not fit it) declines its task: the group stops waiting
        this.secagg = new SecAggSessions(deviceId, 4, () -> System.currentTimeMillis() / 1000.0,
                (job, round, task, reason) -> sendDecline(new TaskRef(job, round, task), reason));
        this.reader = reader(options);
        if (!options.secure.isEmpty() && (!(options.signer instanceof Identity) || options.aggregatorKey == null))
            throw new IllegalArgumentException("secure task kinds need the device's Identity as signer and the aggregator's key");
        // one member set per secure input, across rounds (SecureInputLedger)
        this.secureRounds = options.secure.isEmpty() ? null : new SecureRounds(deviceId, (Identity) options.signer,
                options.aggregatorKey, secagg, new SecureInputLedger(options.state == null ? null
                        : new File(options.state.root(), SecureInputLedger.NAME)));
        if (options.aggregatorKey == null)
            LOG.warning(deviceId + ": not verifying the aggregator's messages (no aggregator key): development mode only");
        MQTT mqtt = DeviceConnection.settings(broker, deviceId, options.username, options.password);
        mqtt.setWillTopic(options.topics.presence(deviceId));
        mqtt.setWillMessage(new UTF8Buffer(presence(false)));   // binary envelope; UTF8Buffer only wraps the bytes
        mqtt.setWillRetain(true);
        mqtt.setWillQos(QoS.AT_LEAST_ONCE);
        connection = mqtt.callbackConnection();
        DeviceConnection.listen(connection, deviceId + ":", this::announce,
                () -> LOG.info(deviceId + ": disconnected, reconnecting"), (topic, payload) -> inbox.offer(topic, payload, payload.length));
    }

    // ---------------- lifecycle ----------------
    public MqttAgent start() {
        running = true;
        thread = DeviceConnection.start(connection, deviceId, this::run, "fedfleet-agent-" + deviceId);
        return this;
    }

    /** Inbox messages dropped unread so far: past the bound while the agent was busy (a flood). */
    public long inboxDropped() { return inbox.dropped(); }

    /** Blocks until the first connection is up (and presence announced), or the timeout passes. */
    public boolean awaitConnected(double seconds) throws InterruptedException {
        return firstConnect.await((long) (seconds * 1000), TimeUnit.MILLISECONDS);
    }

    /** Presence `offline` (retained), then a clean disconnect: the will is not fired. */
    @Override
    public void close() {
        running = false;
        DeviceConnection.join(thread);
        goOffline();
    }

    /** Why the agent's thread ended on its own, or null (running, or ended by close()): an error that
     *  ends the loop (endsTheLoop) or an interrupt. The device then said `offline` and handles nothing
     *  more; the application restarts it (a new agent, or the process). */
    public Throwable stoppedBy() { return stoppedBy; }

    /** Once, by close() or by the agent's end: presence `offline`, then a clean disconnect. */
    private void goOffline() {
        if (!wentOffline.compareAndSet(false, true)) return;
        try {
            publish(o.topics.presence(deviceId), presence(false), true, Math.min(o.publishTimeoutS, 5.0));
        } catch (Exception e) {
            LOG.warning(deviceId + ": could not publish offline presence: " + e);
        }
        DeviceConnection.disconnect(connection);
    }

    private void announce() {
        // on every (re)connect: subscribe again (harmless with a persistent session) and say online
        Topic inbox = new Topic(o.topics.inbox(deviceId), QoS.AT_LEAST_ONCE);
        Topic[] topics = o.state == null ? new Topic[] {inbox} : new Topic[] {inbox, new Topic(o.topics.jobEnds(), QoS.AT_LEAST_ONCE)};
        connection.subscribe(topics, new Callback<byte[]>() {
            @Override public void onSuccess(byte[] granted) {       // on the client's thread too: guarded
                DeviceConnection.onClientThread(deviceId + ":", "saying online", () -> sayOnline());
            }
            @Override public void onFailure(Throwable e) { LOG.warning(deviceId + ": subscribe failed: " + e); }
        });
    }

    private void sayOnline() {
        try {
            connection.publish(o.topics.presence(deviceId), presence(true), QoS.AT_LEAST_ONCE, true, new Callback<Void>() {
                @Override public void onSuccess(Void v) {
                    if (firstConnect.getCount() == 0) reconnects.incrementAndGet();
                    firstConnect.countDown();
                }
                @Override public void onFailure(Throwable e) { LOG.warning(deviceId + ": presence failed: " + e); }
            });
        } catch (EnvelopeError e) {
            LOG.severe(deviceId + ": cannot encode presence: " + e.getMessage());
        }
    }

    private byte[] presence(boolean online) throws EnvelopeError {
        Map<String, Object> info = null;
        if (online) {
            info = new LinkedHashMap<>(o.info);
            TreeSet<String> kinds = new TreeSet<>(handlers.keySet());
            kinds.addAll(o.secure.keySet());
            info.put("kinds", new ArrayList<Object>(kinds));
        }
        return Envelope.encode(Messages.presence(deviceId, online, info, Messages.newId(), Messages.now()),
                Collections.<Envelope.Tensor>emptyList(), o.signer);
    }

    /** How the agent reads its inbox (tests/java_device/WireEdges drives it): the Python device's
     *  reassembly limits (protocols/chunking.py, edge_client/inbox.py), 4 partial messages and one
     *  message's worth of bytes, where no message, and no sender's partial messages together, are
     *  larger than what the inbox queue holds of one topic (a review found one sender's chunks
     *  could pin 256 MiB while the queue held 128). */
    public static InboxReader reader(Options options) {
        long largest = Math.min(options.maxMessageBytes, options.maxQueuedTopicBytes);
        return new InboxReader(options.aggregatorKey, largest, new Reassembler(300,
                largest, Reassembler.DEFAULT_MAX_PENDING_PER_SENDER, Reassembler.DEFAULT_MAX_PENDING_BYTES));
    }

    // ---------------- the agent thread ----------------
    private void run() {
        while (running) {
            byte[] payload;
            try {
                payload = inbox.poll((long) (o.tickS * 1000));
            } catch (InterruptedException e) {     // not close(), which only clears `running`: the application's
                if (running) stop(e, "its thread was interrupted");
                return;
            }
            if (!turn(payload)) return;
        }
    }

    /** What ends the agent's loop rather than one step of a turn: a VirtualMachineError other than the
     *  heap's and the stack's (one task can exhaust those and the next run: an InternalError, an
     *  UnknownError leave the VM itself in doubt), ThreadDeath, and an InterruptedException thrown
     *  through a handler (the thread is asked to end). Anything else (an AssertionError, a LinkageError
     *  of a class loaded lazily, an application's own Error) is the failure of the message in hand, as
     *  the Python agent's loop ends only for KeyboardInterrupt and SystemExit (protocols/message_loop.py
     *  ENDS_THE_LOOP). ThreadDeath by name: it is deprecated for removal (JDK 20), and a reference to
     *  a class that is gone would fail to link just when it is needed. */
    static boolean endsTheLoop(Throwable t) {
        return (t instanceof VirtualMachineError && !(t instanceof OutOfMemoryError) && !(t instanceof StackOverflowError))
                || t instanceof InterruptedException || "java.lang.ThreadDeath".equals(t.getClass().getName());
    }

    /** The agent's thread ends: said once, loudly, presence `offline` (a device that announced itself
     *  online and answered nothing, for ever, was what an uncaught Error left), the cause kept for
     *  the application (stoppedBy). */
    private void stop(Throwable cause, String what) {
        stoppedBy = cause;
        running = false;
        LOG.log(Level.SEVERE, deviceId + ": the agent stopped (" + what + "): it handles no more messages;"
                + " the application must restart it (MqttAgent.stoppedBy)", cause);
        try {
            goOffline();
        } catch (Throwable t) {     // a broken VM may fail this too: the log line and stoppedBy stand
            LOG.log(Level.SEVERE, deviceId + ": could not say offline", t);
        }
    }

    /** One turn of the agent's thread: the message taken (null: none), the session's tick, then what
     *  ends on the clock, each step guarded on its own: one that throws (a bad message, a handler's
     *  bug) skips no other, above all not the expiry, which erases the secrets of SecAgg rounds past
     *  their deadline (in one try, a handler that threw on every turn kept them until it stopped).
     *  False: the agent stopped (endsTheLoop), the turn's other steps not taken (none, once stopped). */
    boolean turn(byte[] payload) {
        if (stoppedBy != null) return false;
        if (payload != null) {
            boolean goesOn = guarded("handling a message", () -> handleRaw(payload));
            inHand = "";
            if (!goesOn) return false;
        }
        return guarded("the session's tick", () -> execute(session.onTick(monotonic())))
                && guarded("expiring partial messages", () -> reader.expire(monotonic()))
                // rounds end at a task's deadline: wall clock
                && guarded("expiring secure rounds", () -> secagg.expire(System.currentTimeMillis() / 1000.0));
    }

    private boolean guarded(String what, Runnable step) {
        try {
            step.run();
            return true;
        } catch (Throwable e) {
            String about = what + (inHand.isEmpty() ? "" : " (" + inHand + ")");
            if (endsTheLoop(e)) {
                stop(e, e + ", " + about);
                return false;
            }
            // one bad message or handler bug never stops the device: uncaught, an Error (an
            // AssertionError, a NoClassDefFoundError) ended this thread and left a device that
            // announced itself online answering nothing, for ever
            LOG.log(Level.SEVERE, deviceId + ": unexpected error " + about + "; the agent goes on", e);
            return true;
        }
    }

    private void handleRaw(byte[] payload) {
        inHand = "not yet decoded";
        try {
            onPayload(payload);
        } catch (EnvelopeError e) {
            LOG.warning(deviceId + ": dropped a malformed message: " + cut(e.getMessage(), MAX_LOGGED_CHARS));
        }
    }

    private void onPayload(byte[] payload) throws EnvelopeError {
        InboxReader.Whole got = reader.receive(payload, monotonic());
        if (got == null) return;
        Envelope.Message env = got.message;
        inHand = cut("a " + env.type() + " message " + env.header.get("id"), MAX_LOGGED_CHARS);
        if ("task".equals(env.type())) {
            Messages.Task task = Messages.parseTask(env);
            String addressee = Messages.taskAddressee(env);
            if (addressee != null && !addressee.equals(deviceId))      // re-published from another device's inbox
                execute(Collections.<DeviceSession.Action>singletonList(new DeviceSession.SkipTask(task.ref,
                        "addressed to '" + addressee + "', not to this device")));
            else if (endedRuns.contains(task.ref.job + " " + StatefulHeadParams.boundRun(task.params)))
                execute(Collections.<DeviceSession.Action>singletonList(new DeviceSession.SkipTask(task.ref,
                        "its job ended: this device dropped the run's state and keeps none")));
            else
                execute(session.onTask(task, env.tensors, System.currentTimeMillis() / 1000.0));
        } else if (SecAggMessage.ENVELOPE_TYPE.equals(env.type())) {
            // every reply encoded before any is published: a round whose answer cannot be sent ends
            // here at once (SecAggSessions); a publish that fails leaves the round to its deadline
            for (List<byte[]> parts : secagg.onMessage(env, outbox::secagg)) {
                try {
                    publishParts(parts);
                } catch (Exception e) {
                    LOG.warning(deviceId + ": could not send a secagg reply: " + e);
                }
            }
        } else if (JobEnded.TYPE.equals(env.type())) {
            if (o.state != null) onJobEnded(JobEnded.parse(env));
        } else if ("ack".equals(env.type())) {
            String[] ack = Messages.parseAck(env);
            acks.merge(ack[1], 1, Integer::sum);
            if (ack[1].equals("rejected")) LOG.warning(deviceId + ": result " + cut(ack[0], 64) + " rejected: " + cut(ack[2], MAX_LOGGED_CHARS));
            session.onAck(ack[0]);
        } else {
            LOG.info(deviceId + ": ignoring message type " + env.type());
        }
    }

    /** Drop the state of each ended job held for the run that ended, and remember the run (its later
     *  tasks are skipped); once per (job, run), say a notice changed nothing. */
    private void onJobEnded(List<JobEnded> notices) {
        List<JobEnded> dropped = JobEnded.apply(notices, o.state);
        for (JobEnded n : notices) {
            String key = n.job + " " + n.run;
            boolean fresh = !endedRuns.contains(key);
            if (fresh && endedRuns.size() >= 4 * JobEnded.MAX_NOTICES) {     // bounded, whoever sends notices
                java.util.Iterator<String> oldest = endedRuns.iterator();
                oldest.next();
                oldest.remove();
            }
            endedRuns.add(key);
            if (dropped.contains(n)) {
                LOG.info(deviceId + ": job " + n.job + " " + n.reason + ": its state dropped");
            } else if (fresh) {
                LOG.info(deviceId + ": job " + n.job + " (run " + n.run + ") " + n.reason + ": no state of that run here");
            }
        }
    }

    private void execute(List<DeviceSession.Action> actions) {
        if (memoryFile != null) memoryFile.saveIfChanged(session);  // before any work starts: a device killed mid-task remembers it
        for (DeviceSession.Action a : actions) {
            try {
                if (a instanceof DeviceSession.StartWork) work((DeviceSession.StartWork) a);
                else if (a instanceof DeviceSession.SendResult) {
                    DeviceSession.SendResult r = (DeviceSession.SendResult) a;
                    if (r.message != null) publishMessage(r.message, r.messageId);   // null: a secure task's
                    session.onResultSent(monotonic());
                } else if (a instanceof DeviceSession.SkipTask) {
                    DeviceSession.SkipTask k = (DeviceSession.SkipTask) a;
                    tasksSkipped.incrementAndGet();
                    if (skippedFor.size() < 64 && skippedFor.add(k.ref.job + " " + k.reason))
                        LOG.warning(deviceId + ": skipped task " + k.ref.task + " of job " + k.ref.job + " round "
                                    + k.ref.round + ": " + k.reason + " (logged once per job and reason)");
                } else if (a instanceof DeviceSession.SendDecline) {
                    DeviceSession.SendDecline d = (DeviceSession.SendDecline) a;
                    sendDecline(d.ref, d.reason);
                }
            } catch (Exception e) {   // a failed upload is retried by the session's timer
                LOG.warning(deviceId + ": could not send: " + e);
            }
        }
    }

    private void sendDecline(TaskRef ref, String reason) {
        tasksDeclined.incrementAndGet();
        try {
            Map<String, Object> h = Messages.decline(deviceId, ref, reason);
            publishMessage(Envelope.encode(h, Collections.<Envelope.Tensor>emptyList(), o.signer), (String) h.get("id"));
        } catch (Exception e) {
            LOG.warning(deviceId + ": could not send a decline: " + e);
        }
    }

    private void work(DeviceSession.StartWork w) throws EnvelopeError {
        SecureTask secure = o.secure.get(w.task.kind);
        TaskHandler handler = handlers.get(w.task.kind);
        if (secure == null && handler == null) {
            execute(session.onWorkFailed(w.task.ref, "unsupported task kind '" + w.task.kind + "'"));
            return;
        }
        String foreign = StatefulHeadParams.foreignJob(w.task.params, w.task.ref.job);
        if (foreign != null) {              // a stateful task's state is keyed by it: never another job's
            execute(session.onWorkFailed(w.task.ref, foreign));
            return;
        }
        if (secure != null) {
            startSecure(w, secure);
            return;
        }
        TaskHandler.Result result;
        // a stateful handler saves the job's next state before its result goes out: a task that then
        // sends nothing puts it back, or the device's state runs a round ahead of the server's
        Runnable[] putBack = {() -> { }};
        try {
            result = untilRoundOver(w.task, () -> {
                putBack[0] = handler.stateRestorer(w.task.params);
                return handler.run(w.task.params, w.tensors);
            });
        } catch (WorkDeadline.PastDeadline e) {     // nobody waits for the answer any more: no result is sent
            putBack[0].run();
            stopped(w.task.ref, e);
            return;
        } catch (TaskDeclined e) {
            putBack[0].run();
            execute(session.onWorkFailed(w.task.ref, e.getMessage()));
            return;
        } catch (Throwable e) {
            if (endsTheLoop(e)) throw e;        // the agent's thread ends (guarded): no answer
            putBack[0].run();
            // a handler bug (an Error too: an AssertionError, a class that failed to load), or a task
            // whose numbers a check missed outgrowing the heap, must not kill the agent: tell the
            // server (what the task allocated is garbage by now)
            failed(w.task, "task", e);
            return;
        }
        String id = Messages.newId();
        byte[] message;
        try {       // encoded now, once: a result that cannot be (over the limits, past the heap) is a decline
            message = Envelope.encode(Messages.result(deviceId, w.task.ref, w.task.kind, result.body, id, Messages.now()),
                    result.tensors, o.signer);
        } catch (EnvelopeError | OutOfMemoryError e) {      // as the Python agent's "result cannot be sent"
            putBack[0].run();
            LOG.warning(deviceId + ": a " + w.task.kind + " result cannot be sent: " + e);
            execute(session.onWorkFailed(w.task.ref, "result cannot be sent: " + e));
            return;
        }
        tasksDone.incrementAndGet();
        execute(session.onWorkFinished(w.task.ref, message, id));
    }

    /** A secure task: its vector becomes this device's input to the group's SecAgg round, whose
     *  messages then come and go as `secagg` envelopes; the task itself is never acknowledged. A task
     *  re-sent for a live round is a duplicate, found before any training (SecureRounds). */
    private void startSecure(DeviceSession.StartWork w, SecureTask secure) {
        TaskRef ref = w.task.ref;
        try {
            untilRoundOver(w.task, () -> secureRounds.start(ref, w.task.kind, w.task.params, w.tensors, secure));
        } catch (WorkDeadline.PastDeadline e) {
            stopped(ref, e);
            return;
        } catch (TaskDeclined e) {
            execute(session.onWorkFailed(ref, e.getMessage()));
            return;
        } catch (Throwable e) {      // as work()'s
            if (endsTheLoop(e)) throw e;
            failed(w.task, "secure task", e);
            return;
        }
        tasksDone.incrementAndGet();
        execute(session.onWorkFinished(ref, null, ref.task + ":protocol", false));
    }

    private void failed(Messages.Task task, String what, Throwable e) {
        LOG.log(Level.SEVERE, deviceId + ": " + what + " " + task.ref + " (" + task.kind + ") failed; declined, the agent goes on", e);
        execute(session.onWorkFailed(task.ref, "error: " + e));
    }

    /** A handler's work, until the task's deadline plus the session's grace passes by this device's
     *  clock (the arrival check's moment): past it the training loops throw PastDeadline. */
    private <T> T untilRoundOver(Messages.Task task, Work<T> work) throws TaskDeclined {
        WorkDeadline.Scope until = WorkDeadline.until(task.deadline + session.deadlineGraceS());
        try {
            return work.run();
        } finally {
            until.close();
        }
    }

    private interface Work<T> { T run() throws TaskDeclined; }

    /** A task's work stopped past its round: the session back to idle (the aggregator no longer waits
     *  for an answer; the job's first is declined once, saying the clock may be ahead), the device
     *  free for its next task. */
    private void stopped(TaskRef ref, WorkDeadline.PastDeadline e) {
        tasksStopped.incrementAndGet();
        if (skippedFor.size() < 64 && skippedFor.add(ref.job + " stopped"))
            LOG.warning(deviceId + ": stopped task " + ref.task + " of job " + ref.job + " round " + ref.round + ": "
                        + e.getMessage() + " (logged once per job)");
        execute(session.onWorkStopped(ref, true));
    }

    /** Encoded message to the outbox, chunked above the chunk size (OutboxParts). */
    private void publishMessage(byte[] message, String id) throws Exception {
        publishParts(outbox.of(message, id));
    }

    private void publishParts(List<byte[]> parts) throws Exception {
        for (byte[] part : parts) publish(o.topics.outbox(deviceId), part, false, o.publishTimeoutS);
    }

    /** QoS 1 publish, waiting for the broker's PUBACK (the client resends across reconnects). */
    private void publish(String topic, byte[] data, boolean retain, double timeoutS) throws Exception {
        CountDownLatch done = new CountDownLatch(1);
        Throwable[] failure = new Throwable[1];
        connection.getDispatchQueue().execute(() -> connection.publish(topic, data, QoS.AT_LEAST_ONCE, retain, new Callback<Void>() {
            @Override public void onSuccess(Void v) { done.countDown(); }
            @Override public void onFailure(Throwable e) { failure[0] = e; done.countDown(); }
        }));
        if (!done.await((long) (timeoutS * 1000), TimeUnit.MILLISECONDS))
            throw new Exception("publish to " + topic + " not acknowledged in " + timeoutS + " s");
        if (failure[0] != null) throw new Exception("publish to " + topic + " failed: " + failure[0]);
    }

    private static double monotonic() { return System.nanoTime() / 1e9; }

    /** The most characters of a peer's text (a rejection's reason, what a refusal quotes) one log line
     *  holds, as the Python agent's MAX_REASON_CHARS: a signed ack's reason of 60,000 was logged whole. */
    static final int MAX_LOGGED_CHARS = 200;

    private static String cut(String text, int chars) { return text == null || text.length() <= chars ? text : text.substring(0, chars); }
}
