// One Java SecAgg client driven over standard input/output, so a test can put it in a round run
// by the Python server (protocols/secagg/driver.py) and play a hostile server against it.
// Usage: java SecAggBridge <device> <seed hex> <aggregator key hex> <job> <round> <group> <input file (float64 LE)> [dp]
// ("dp": the input carries a distributed-DP noise share, as a secure task's with dp would)
// Each input line is a base64 `secagg` envelope from the aggregator; the bridge answers with
// "REPLY <base64 envelope>" lines, an "ERROR <kind> <message>" line when the client refused the
// message, and a final "STATE <client state>" line. A "RETASK" line opens the round again with a
// fresh client, as a re-sent task does on a device (SecAggSessions: the live round is kept).
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.file.*;
import java.io.*;
import java.util.*;
import org.fedfleet.device.*;
import org.fedfleet.secagg.*;
import org.fedfleet.wire.*;

public final class SecAggBridge {
    public static void main(String[] a) throws Exception {
        Identity id = Identity.fromSeed(a[0], Envelope.unhex(a[1]));
        byte[] aggregatorKey = Envelope.unhex(a[2]);
        ByteBuffer raw = ByteBuffer.wrap(Files.readAllBytes(Paths.get(a[6]))).order(ByteOrder.LITTLE_ENDIAN);
        double[] input = new double[raw.remaining() / 8];
        for (int i = 0; i < input.length; i++) input[i] = raw.getDouble();
        boolean dp = a.length > 7 && a[7].equals("dp");
        long round = Long.parseLong(a[4]);
        SecAggSessions sessions = new SecAggSessions(a[0], 4);
        sessions.open(a[3], round, a[5], new ClientSecAgg(a[0], id, id.publicKey(), "aggregator", aggregatorKey, a[3], round, a[5], input, dp));
        ClientSecAgg client = sessions.session(a[3], round, a[5]);
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
        PrintStream out = System.out;
        for (String line; (line = in.readLine()) != null; ) {
            if (line.trim().equals("RETASK")) {
                sessions.open(a[3], round, a[5], new ClientSecAgg(a[0], id, id.publicKey(), "aggregator", aggregatorKey, a[3], round, a[5], input, dp));
                client = sessions.session(a[3], round, a[5]);
                out.println("STATE " + client.state());
                continue;
            }
            try {
                Envelope.Message env = Envelope.decode(Base64.getDecoder().decode(line.trim()), aggregatorKey, Envelope.MAX_MESSAGE_BYTES);
                for (SecAggMessage r : client.handle(SecAggMessage.fromEnvelope(env))) {
                    Map<String, Object> h = Messages.header(SecAggMessage.ENVELOPE_TYPE, a[0], r.envelopeBody(), Messages.newId(), Messages.now());
                    out.println("REPLY " + Base64.getEncoder().encodeToString(Envelope.encode(h, r.tensors(), id)));
                }
            } catch (SecAggException.ProtocolViolation e) {
                out.println("ERROR ProtocolViolation " + e.getMessage());
            } catch (SecAggException | Envelope.EnvelopeError e) {
                out.println("ERROR SecAggError " + e.getMessage());
            }
            out.println("STATE " + client.state());
            out.flush();
        }
    }
}
