// Feeds message bodies and settings to the Java device's parsers and prints its decision on each,
// so tests/test_java_body_edges.py can hold it against the Python device's on the same input.
// One JSON line per case on stdin: {"op": "assignment" | "job.ended", "hex": an encoded envelope},
// {"op": "artifact", "hex": an encoded artifact, "sha256": the digest asked for} (a refusal prints its class),
// {"op": "round_config", "text": the config's JSON} or {"op": "topic_root", "root": a string}.
// Prints one line per case: {"out": "ACCEPT <what was read, canonical JSON>" | "REFUSE <why>" | "CRASH <what>"}.
import java.math.BigInteger;
import java.nio.charset.StandardCharsets;
import java.util.*;
import org.fedfleet.device.JobEnded;
import org.fedfleet.device.ModelSlot;
import org.fedfleet.device.Topics;
import org.fedfleet.secagg.RoundConfig;
import org.fedfleet.secagg.SecAggException;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Json;

public final class BodyEdges {
    public static void main(String[] args) throws Exception {
        StdinCases.eachJsonObject(c -> StdinCases.outLine(decide(c)));
    }

    /** The device's decision on one case: "ACCEPT <what was read>", "REFUSE <why>" or "CRASH <what>". */
    private static String decide(Map<String, Object> c) throws Exception {
        try {
            return "ACCEPT " + new String(Json.canonical(read(c)), StandardCharsets.UTF_8);
        } catch (Envelope.EnvelopeError | SecAggException | Json.JsonError | IllegalArgumentException e) {
            return "REFUSE " + e.getMessage();
        } catch (ModelSlot.Refusal e) {
            return "REFUSE " + e.reason + " " + e.getMessage();
        } catch (RuntimeException e) {
            return "CRASH " + e;
        }
    }

    /** What the parser read, as JSON (the test compares it with what the Python parser read). */
    private static Object read(Map<String, Object> c) throws Exception {
        switch ((String) c.get("op")) {
            case "assignment": {
                ModelSlot.Assignment a = ModelSlot.assignment(Envelope.unhex((String) c.get("hex")), null);
                Map<String, Object> m = new LinkedHashMap<>();
                m.put("deployment", a.deployment); m.put("device", a.device); m.put("seq", BigInteger.valueOf(a.seq));
                m.put("action", a.action);
                if (a.action.equals(ModelSlot.RUN)) {
                    m.put("sha256", a.sha256); m.put("nbytes", BigInteger.valueOf(a.nbytes)); m.put("bundle_sha256", a.bundleSha256);
                } else {
                    m.put("reason", a.reason);
                }
                return m;
            }
            case "job.ended": {
                List<Object> jobs = new ArrayList<>();
                for (JobEnded n : JobEnded.parse(Envelope.decode(Envelope.unhex((String) c.get("hex"))))) jobs.add(n.job);
                return jobs;
            }
            case "round_config": {
                RoundConfig config = RoundConfig.fromMap(Json.parse((String) c.get("text")));
                return new ArrayList<Object>(config.members);
            }
            case "artifact": {
                byte[] file = ModelSlot.artifactBytes(Envelope.decode(Envelope.unhex((String) c.get("hex"))), (String) c.get("sha256"));
                return Envelope.hex(Envelope.sha256(file));
            }
            case "topic_root":
                return new Topics((String) c.get("root")).root;
            default:
                throw new IllegalStateException("unknown op " + c.get("op"));
        }
    }
}
