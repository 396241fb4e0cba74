// A Java device's MqttAgent driven turn by turn (MqttAgent.turn: what its thread runs for each
// payload its inbox gives it), never connected (nothing it would publish is needed: a secure task's
// answer is its SecAgg round). In the library's package: turn is the agent's own, not public.
// Usage: java org.fedfleet.device.AgentTurns <device> <seed hex> <aggregator key hex>
// The device answers the secure kind "test.secure" (four zeros in the task's group) whose round-end
// hook (SecAggSessions.RoundEnd) counts each call, then throws: a kind's bug. Prints "READY" once the
// agent is built; then each standard-input line, a base64 payload as the broker would deliver it to
// the device's inbox, is one turn, answered "ENDED <n>": the round-end calls so far (each one a
// round's session ended, its secrets erased), the tasks done and declined so far, and the Throwable
// that stopped the agent ("-": none; MqttAgent.stoppedBy). It also answers the plain kind
// "test.throws", whose handler throws what its params' "throw" names (AgentTurns.thrown: an
// application's bug of any kind) and without it answers {}. With <features> <state folder> after the
// key (tests/test_java_stateful.py) it also answers the stateful kinds scaffold.head and ditto.head
// over that FeatureFile and a DeviceStateStore in that folder, each handler's result then changed
// as the last line "FAIL <how>" said ("FAIL oversize": a body over the header limit, which the agent
// cannot encode; "FAIL throw": an exception after the handler saved; "FAIL none": as computed),
// answered "OK".
package org.fedfleet.device;

import java.io.BufferedReader;
import java.io.File;
import java.io.InputStreamReader;
import java.net.URI;
import java.util.Base64;
import java.util.Collections;
import java.util.HashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.atomic.AtomicInteger;
import org.fedfleet.wire.Envelope;

public final class AgentTurns {
    public static void main(String[] a) throws Exception {
        Identity identity = Identity.fromSeed(a[0], Envelope.unhex(a[1]));
        MqttAgent.Options o = new MqttAgent.Options();
        o.signer = identity;
        o.aggregatorKey = Envelope.unhex(a[2]);
        o.publishTimeoutS = 0.05;      // never connected: a decline or a result is given up at once
        AtomicInteger ended = new AtomicInteger();
        o.secure.put("test.secure", (params, tensors) -> new SecureTask.Contribution(SecureUpdateRound.group(params),
                new double[4], false, null, summed -> {
                    ended.incrementAndGet();
                    throw new IllegalStateException("a secure kind's bug: its round-end hook throws");
                }));
        TaskHandler throwing = (params, tensors) -> {
            Object what = params.get("throw");
            if (what != null) throw thrown((String) what);
            return new TaskHandler.Result(Collections.<String, Object>emptyMap(), Collections.<Envelope.Tensor>emptyList());
        };
        Map<String, TaskHandler> handlers = new HashMap<>();
        handlers.put("test.throws", throwing);
        String[] fail = {"none"};
        if (a.length > 4) {
            FeatureFile data = FeatureFile.read(a[3]);
            DeviceStateStore store = new DeviceStateStore(new File(a[4]), DeviceStateStore.DEFAULT_BUDGET_BYTES,
                    () -> System.currentTimeMillis() / 1000.0);
            handlers.put(ScaffoldTask.KIND, failing(new ScaffoldTask(data, new PrecomputedFeatures(data.dim), store), fail));
            handlers.put(DittoTask.KIND, failing(new DittoTask(data, null, new PrecomputedFeatures(data.dim), store), fail));
        }
        MqttAgent agent = new MqttAgent(a[0], new URI("tcp://127.0.0.1:9"), handlers, o);
        System.out.println("READY");
        System.out.flush();
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
        for (String line; (line = in.readLine()) != null; ) {
            if (line.startsWith("FAIL ")) {
                fail[0] = line.substring(5).trim();
                System.out.println("OK");
                System.out.flush();
                continue;
            }
            agent.turn(Base64.getDecoder().decode(line.trim()));
            Throwable stopped = agent.stoppedBy();
            System.out.println("ENDED " + ended.get() + " DONE " + agent.tasksDone.get() + " DECLINED "
                               + agent.tasksDeclined.get() + " STOPPED " + (stopped == null ? "-" : stopped.getClass().getName()));
            System.out.flush();
        }
    }

    /** `handler` (its state kept as its own), its result changed as `fail[0]` says (the class comment). */
    static TaskHandler failing(StatefulHeadTask handler, String[] fail) {
        return new TaskHandler() {
            @Override
            public Result run(Map<String, Object> params, List<Envelope.Tensor> tensors) throws TaskDeclined {
                Result r = handler.run(params, tensors);
                if (fail[0].equals("throw")) throw new IllegalStateException("failed after the handler saved");
                if (!fail[0].equals("oversize")) return r;
                Map<String, Object> body = new HashMap<>(r.body);
                body.put("note", new String(new char[Envelope.MAX_HEADER_BYTES + 10]).replace('\0', 'x'));
                return new Result(body, r.tensors);
            }

            @Override
            public Runnable stateRestorer(Map<String, Object> params) throws TaskDeclined {
                return handler.stateRestorer(params);
            }
        };
    }

    /** An application's own Error (not one of the JVM's). */
    static final class ApplicationError extends Error {
        private static final long serialVersionUID = 1L;
        ApplicationError(String message) { super(message); }
    }

    /** What "test.throws" throws for the name its task gives. */
    static RuntimeException thrown(String name) {
        switch (name) {
            case "assertion": throw new AssertionError("a handler's assert failed");
            case "no-class": throw new NoClassDefFoundError("org/example/LazilyLoaded");
            case "initializer": throw new ExceptionInInitializerError(new IllegalStateException("a static block threw"));
            case "application": throw new ApplicationError("the application's own Error");
            case "internal": throw new InternalError("the JVM's own error");
            default: return new IllegalArgumentException(name);
        }
    }
}
