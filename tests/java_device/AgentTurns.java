// A Java device's MqttAgent driven turn by turn (MqttAgent.turn: what its thread runs for each
// payload its inbox gives it), never connected (nothing it would publish is needed: a secure task's
// answer is its SecAgg round). In the library's package: turn is the agent's own, not public.
// Usage: java org.fedfleet.device.AgentTurns <device> <seed hex> <aggregator key hex>
// The device answers the secure kind "test.secure" (four zeros in the task's group) whose round-end
// hook (SecAggSessions.RoundEnd) counts each call, then throws: a kind's bug. Prints "READY" once the
// agent is built; then each standard-input line, a base64 payload as the broker would deliver it to
// the device's inbox, is one turn, answered "ENDED <n>": the round-end calls so far (each one a
// round's session ended, its secrets erased).
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
        AtomicInteger ended = new AtomicInteger();
        o.secure.put("test.secure", (params, tensors) -> new SecureTask.Contribution(SecureUpdateRound.group(params),
                new double[4], false, null, summed -> {
                    ended.incrementAndGet();
                    throw new IllegalStateException("a secure kind's bug: its round-end hook throws");
                }));
        MqttAgent agent = new MqttAgent(a[0], new URI("tcp://127.0.0.1:9"), Collections.<String, TaskHandler>emptyMap(), o);
        System.out.println("READY");
        System.out.flush();
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
        for (String line; (line = in.readLine()) != null; ) {
            agent.turn(Base64.getDecoder().decode(line.trim()));
            System.out.println("ENDED " + ended.get());
            System.out.flush();
        }
    }
}
