// Encodes one message whose tensors hold the byte counts given as arguments (uint8, zeros) with the
// Java device's Envelope.encode, and prints "OK <bytes>" or "REFUSED <why>": tests/test_java_wire_limits.py
// holds it against protocols/envelope.py's encode, which refuses a message over MAX_MESSAGE_BYTES.
import java.util.*;
import org.fedfleet.wire.Envelope;

public final class EncodeLimit {
    public static void main(String[] args) {
        List<Envelope.Tensor> tensors = new ArrayList<>();
        for (int k = 0; k < args.length; k++) {
            int n = Integer.parseInt(args[k]);
            tensors.add(new Envelope.Tensor("t" + k, "uint8", new long[] {n}, new byte[n]));
        }
        Map<String, Object> h = new LinkedHashMap<>();
        h.put("v", java.math.BigInteger.ONE); h.put("type", "result"); h.put("id", "0123456789abcdef0123456789abcdef");
        h.put("sender", "dev"); h.put("ts", 1.5); h.put("body", new LinkedHashMap<String, Object>());
        try {
            System.out.println("OK " + Envelope.encode(h, tensors, null).length);
        } catch (Envelope.EnvelopeError e) {
            System.out.println("REFUSED " + e.getMessage());
        }
    }
}
