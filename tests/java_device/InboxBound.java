// Drives the Java device's inbox queue (org.fedfleet.device.InboxQueue) through offers and takes,
// so tests/test_java_inbox_bound.py can hold its decisions against the Python device's message
// loop (protocols/message_loop.py) on the same operations.
// One JSON line per case on stdin: {"topic_bytes": n, "total_bytes": n, "ops": [["offer", topic, bytes] | ["take"], ...]}.
// Prints one line per case: {"out": [true | false (an offer kept or dropped) | the taken item's index or null, ...],
// "dropped": n}; and first a line {"agent": [topic bytes, total bytes], "message": n, "overhead": n}:
// MqttAgent's default bound, the largest message it takes, and what a message costs beyond its payload, then {"waited_ms", "got", "left"}: a take that
// waited for another thread's offer.
import java.util.*;
import org.fedfleet.device.InboxQueue;
import org.fedfleet.device.MqttAgent;

public final class InboxBound {
    public static void main(String[] args) throws Exception {
        MqttAgent.Options defaults = new MqttAgent.Options();
        System.out.println("{\"agent\": [" + defaults.maxQueuedTopicBytes + ", " + defaults.maxQueuedBytes + "], \"message\": "
                + defaults.maxMessageBytes + ", \"overhead\": "
                + InboxQueue.MESSAGE_OVERHEAD_BYTES + "}");
        // a take that waits: another thread offers 200 ms later, as the connection's thread would
        InboxQueue<Integer> waiting = new InboxQueue<>("wait", 1 << 20, 1 << 20);
        Thread offerer = new Thread(() -> {
            try { Thread.sleep(200); } catch (InterruptedException e) { return; }
            waiting.offer("t", 1, 3);
        });
        long t0 = System.nanoTime();
        offerer.start();
        Integer got = waiting.poll(5000);
        System.out.println("{\"waited_ms\": " + (System.nanoTime() - t0) / 1_000_000 + ", \"got\": " + got
                + ", \"left\": " + waiting.queuedBytes() + "}");
        offerer.join();
        StdinCases.eachJsonObject(InboxBound::run);
    }

    /** One case's offers and takes on a fresh queue, answered as {"out": [...], "dropped": n}. */
    @SuppressWarnings("unchecked")
    private static String run(Map<String, Object> c) throws InterruptedException {
        InboxQueue<Integer> q = new InboxQueue<>("test", ((Number) c.get("topic_bytes")).longValue(),
                ((Number) c.get("total_bytes")).longValue());
        StringBuilder out = new StringBuilder();
        int k = 0;
        for (Object o : (List<Object>) c.get("ops")) {
            List<Object> op = (List<Object>) o;
            if (out.length() > 0) out.append(", ");
            if ("offer".equals(op.get(0)))
                out.append(q.offer((String) op.get(1), k, ((Number) op.get(2)).longValue()));
            else
                out.append(q.poll(0));
            k++;
        }
        return "{\"out\": [" + out + "], \"dropped\": " + q.dropped() + "}";
    }
}
