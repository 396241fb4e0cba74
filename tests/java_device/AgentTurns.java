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
// application's bug of any kind) and without it answers {}.
package org.fedfleet.device;

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.net.URI;
import java.util.Base64;
import java.util.Collections;
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
        MqttAgent agent = new MqttAgent(a[0], new URI("tcp://127.0.0.1:9"), Collections.singletonMap("test.throws", throwing), o);
        System.out.println("READY");
        System.out.flush();
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
        for (String line; (line = in.readLine()) != null; ) {
            agent.turn(Base64.getDecoder().decode(line.trim()));
            Throwable stopped = agent.stoppedBy();
            System.out.println("ENDED " + ended.get() + " DONE " + agent.tasksDone.get() + " DECLINED "
                               + agent.tasksDeclined.get() + " STOPPED " + (stopped == null ? "-" : stopped.getClass().getName()));
            System.out.flush();
        }
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
