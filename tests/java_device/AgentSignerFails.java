// A Java device's MqttAgent on a broker whose signer (an application's) throws an AssertionError on
// its first N signings of the presence `online`, for tests/test_java_client_thread_errors.py: the
// agent signs it on the MQTT client's thread, once its subscription is granted (the last will,
// `offline`, is signed before it connects, and every other message as usual).
// Usage: java AgentSignerFails <broker mqtt://host:port> <device id> <topic root> <failed signs>
// It answers the plain kind "test.echo" with {}. Prints "READY" once started; when standard input
// ends it closes the agent and prints "STOPPED <class>|-" (MqttAgent.stoppedBy).
import java.net.URI;
import java.nio.charset.StandardCharsets;
import java.util.Collections;
import org.fedfleet.device.*;
import org.fedfleet.wire.Envelope;

public final class AgentSignerFails {
    public static void main(String[] args) throws Exception {
        Identity identity = Identity.generate(args[1]);
        int[] failuresLeft = {Integer.parseInt(args[3])};
        MqttAgent.Options o = new MqttAgent.Options();
        o.topics = new Topics(args[2]);
        o.signer = data -> {
            boolean online = new String(data, StandardCharsets.UTF_8).contains("\"online\"");
            if (online && failuresLeft[0]-- > 0) throw new AssertionError("the application's signer failed");
            return identity.sign(data);
        };
        TaskHandler echo = (params, tensors) -> new TaskHandler.Result(Collections.<String, Object>emptyMap(),
                Collections.<Envelope.Tensor>emptyList());
        MqttAgent agent = new MqttAgent(args[1], new URI(args[0]), Collections.singletonMap("test.echo", echo), o).start();
        System.out.println("READY");
        System.out.flush();
        while (System.in.read() != -1) { }
        agent.close();
        System.out.println("STOPPED " + (agent.stoppedBy() == null ? "-" : agent.stoppedBy().getClass().getName()));
    }
}
