// Feeds raw MQTT payloads to the Java device's receive path and prints its decision on each, so
// tests/test_java_wire_edges.py can hold it against the Python device's on the same bytes.
// One JSON line per case on stdin: {"msgs": [hex...], "now": [seconds...], "key": hex or null,
// "reassembler": null or [ttl, max_message_bytes, max_pending_per_sender, max_pending_bytes],
// "bare": whether chunks of any sender go straight to that Reassembler}.
// Without "reassembler" the payloads go through MqttAgent's own inbox reader (default Options, the
// given aggregator key); with it, through an InboxReader over a Reassembler of those limits, or
// (bare) through the Reassembler alone, as a receiver of many senders would use it.
// Prints one line per case: {"out": ["PENDING" | "ACCEPT <type> <id>" | "REFUSE <why>" | "CRASH <what>", ...]}.
import java.math.BigInteger;
import java.util.*;
import org.fedfleet.device.InboxReader;
import org.fedfleet.device.MqttAgent;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Reassembler;

public final class WireEdges {
    public static void main(String[] args) throws Exception {
        StdinCases.eachJsonObject(c -> StdinCases.outLine(decide(c)));
    }

    /** The receive path's decision on each payload of one case, in order. */
    @SuppressWarnings("unchecked")
    private static List<Object> decide(Map<String, Object> c) {
        List<Object> msgs = (List<Object>) c.get("msgs"), nows = (List<Object>) c.get("now");
        MqttAgent.Options o = new MqttAgent.Options();
        if (c.get("key") instanceof String) o.aggregatorKey = Envelope.unhex((String) c.get("key"));
        InboxReader reader = MqttAgent.reader(o);
        Reassembler bare = null;
        if (c.get("reassembler") instanceof List) {
            List<Object> r = (List<Object>) c.get("reassembler");
            long max = number(r.get(1)).longValue();
            bare = new Reassembler(number(r.get(0)).doubleValue(), max, number(r.get(2)).intValue(), number(r.get(3)).longValue());
            reader = new InboxReader(o.aggregatorKey, max, bare);
        }
        if (!Boolean.TRUE.equals(c.get("bare"))) bare = null;
        List<Object> out = new ArrayList<>();
        for (int k = 0; k < msgs.size(); k++) {
            double now = number(nows.get(k)).doubleValue();
            String decision;
            try {
                byte[] payload = Envelope.unhex((String) msgs.get(k));
                Envelope.Message whole;
                if (bare != null) {
                    bare.expire(now);
                    byte[] bytes = bare.add(Envelope.decode(payload), now);
                    whole = bytes == null ? null : Envelope.decode(bytes);
                } else {
                    reader.expire(now);
                    InboxReader.Whole got = reader.receive(payload, now);
                    whole = got == null ? null : got.message;
                }
                decision = whole == null ? "PENDING" : "ACCEPT " + whole.type() + " " + whole.header.get("id");
            } catch (Envelope.EnvelopeError e) {
                decision = "REFUSE " + e.getMessage();
            } catch (RuntimeException e) {            // what Envelope.decode must never throw
                decision = "CRASH " + e;
            }
            out.add(decision);
        }
        return out;
    }

    private static Number number(Object v) { return v instanceof BigInteger ? (BigInteger) v : (Double) v; }
}
