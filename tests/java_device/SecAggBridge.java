// One Java SecAgg client driven over standard input/output, so a test can put it in a round run
// by the Python server (protocols/secagg/driver.py) and play a hostile server against it.
// Usage: java SecAggBridge <device> <seed hex> <aggregator key hex> <job> <round> <group> <input file (float64 LE)> [dp] [ledger=<folder>]
// ("dp": the input carries a distributed-DP noise share, as a secure task's with dp would; "ledger=":
// the device's secure-input ledger kept in that state folder guards its rounds, the input named as
// a Fed3R-Sync device names its vector, SecureInputLedger.vectorKey)
// Each input line is a base64 `secagg` envelope from the aggregator; the bridge answers with
// "REPLY <base64 envelope>" lines, an "ERROR <kind> <message>" line when the client refused the
// message, and a final "STATE <client state>" line. A "RETASK" line opens the round again with a
// fresh client, as a re-sent task does on a device (SecAggSessions: the live round is kept). A
// "TASK <job> <round> <group>" line opens that round for the same input (the device asked into
// another group) and messages go to it from then on. A round the ledger refused: "ERROR ReleaseRefused".
// "ends=<unix s>": the rounds are opened to end then (a secure task's deadline plus the grace); the
// sessions' clock is the bridge's, 0 until a "CLOCK <unix s>" line sets it and ticks the sessions
// (SecAggSessions.expire, as MqttAgent's tick), answered "HELD <secrets held> <rounds open>" and
// the STATE line.
// "chunk=<bytes>": each message goes through the sessions as on a device (SecAggSessions.onMessage, the
// replies encoded by the device's OutboxParts with payloads of at most that many bytes: a "REPLY" line
// per payload, chunks included), and the rounds are opened with a RoundEnd: "ENDED <summed>" lines
// before the STATE line say what it was told.
// "task=<id>": the rounds are opened as a secure task of that id opens them
// (SecureRounds), and each message goes through SecAggSessions.onMessage as on MqttAgent: a round
// left at its start is answered "DECLINE <job> <round> <task id> <reason>" (SecAggSessions.Leaving),
// and a refusal is logged there, not answered with an ERROR line.
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
        List<String> options = Arrays.asList(a).subList(7, a.length);
        boolean dp = options.contains("dp");
        SecureInputLedger ledger = null;
        Double ends = null;
        OutboxParts outbox = null;
        String task = null;
        for (String o : options) {
            if (o.startsWith("ledger=")) ledger = new SecureInputLedger(new File(o.substring(7), SecureInputLedger.NAME));
            if (o.startsWith("ends=")) ends = Double.parseDouble(o.substring(5));
            if (o.startsWith("chunk=")) outbox = new OutboxParts(a[0], Integer.parseInt(o.substring(6)), id);
            if (o.startsWith("task=")) task = o.substring(5);
        }
        List<Boolean> ended = new ArrayList<>();
        SecAggSessions.RoundEnd roundEnd = outbox == null ? null : ended::add;
        double[] now = {0.0};
        ReleaseGuard guard = null;
        String job = a[3], group = a[5];
        long round = Long.parseLong(a[4]);
        PrintStream out = System.out;
        SecAggSessions sessions = new SecAggSessions(a[0], 4, () -> now[0],
                (leftJob, leftRound, leftTask, reason) -> out.println("DECLINE " + leftJob + " " + leftRound + " " + leftTask + " " + reason));
        if (ledger != null) guard = ledger.release(SecureInputLedger.vectorKey(SecureFed3RTask.KIND, input));
        sessions.open(job, round, group, task, new ClientSecAgg(a[0], id, id.publicKey(), "aggregator", aggregatorKey, job, round, group, input, dp, guard), ends, roundEnd);
        ClientSecAgg client = sessions.session(job, round, group);
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
        for (String line; (line = in.readLine()) != null; ) {
            String[] words = line.trim().split(" ");
            if (words[0].equals("RETASK") || words[0].equals("TASK")) {
                if (words[0].equals("TASK")) {
                    job = words[1];
                    round = Long.parseLong(words[2]);
                    group = words[3];
                }
                if (ledger != null) guard = ledger.release(SecureInputLedger.vectorKey(SecureFed3RTask.KIND, input));
                sessions.open(job, round, group, new ClientSecAgg(a[0], id, id.publicKey(), "aggregator", aggregatorKey, job, round, group, input, dp, guard), ends, roundEnd);
                client = sessions.session(job, round, group);
                state(out, ended, client);
                continue;
            }
            if (words[0].equals("CLOCK")) {
                now[0] = Double.parseDouble(words[1]);
                sessions.expire();
                out.println("HELD " + client.holdsSecrets() + " " + sessions.open());
                state(out, ended, client);
                continue;
            }
            try {
                Envelope.Message env = Envelope.decode(Base64.getDecoder().decode(line.trim()), aggregatorKey, Envelope.MAX_MESSAGE_BYTES);
                if (outbox != null) {
                    for (List<byte[]> parts : sessions.onMessage(env, outbox::secagg))
                        for (byte[] part : parts) out.println("REPLY " + Base64.getEncoder().encodeToString(part));
                    state(out, ended, client);
                    continue;
                }
                for (SecAggMessage r : task != null ? sessions.onMessage(env) : client.handle(SecAggMessage.fromEnvelope(env))) {
                    Map<String, Object> h = Messages.header(SecAggMessage.ENVELOPE_TYPE, a[0], r.envelopeBody(), Messages.newId(), Messages.now());
                    out.println("REPLY " + Base64.getEncoder().encodeToString(Envelope.encode(h, r.tensors(), id)));
                }
            } catch (SecAggException.ProtocolViolation e) {
                out.println("ERROR ProtocolViolation " + e.getMessage());
            } catch (SecAggException.ReleaseRefused e) {
                out.println("ERROR ReleaseRefused " + e.getMessage());
            } catch (SecAggException | Envelope.EnvelopeError e) {
                out.println("ERROR SecAggError " + e.getMessage());
            }
            state(out, ended, client);
        }
    }

    /** The round ends told since the last answer, then the client's state. */
    private static void state(PrintStream out, List<Boolean> ended, ClientSecAgg client) {
        for (boolean summed : ended) out.println("ENDED " + summed);
        ended.clear();
        out.println("STATE " + client.state());
        out.flush();
    }
}
