// The stdin loop the line-driven test drivers share (BodyEdges, WireEdges, InboxBound, HeadBytes, FeatureFileBytes,
// SlotFiles, SlotSteps): each non-empty line of standard input (UTF-8) is one case, and its answer is
// printed as one line and flushed before the next case is read, so a test that writes a step and
// waits for its answer (tests/test_slot_shared_across_sdks.py) never waits on a buffer.
import java.io.BufferedReader;
import java.io.IOException;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.LinkedHashMap;
import java.util.Map;
import org.fedfleet.wire.Json;

final class StdinCases {
    private StdinCases() { }

    /** A driver's answer to one case: the line to print, or null to print nothing. */
    interface Answer<T> {
        String to(T input) throws Exception;
    }

    /** Each non-empty line through {@code answer}, until stdin closes. */
    static void eachLine(Answer<String> answer) throws Exception {
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        for (String line; (line = in.readLine()) != null; ) {
            if (line.isEmpty()) continue;
            String reply = answer.to(line);
            if (reply == null) continue;
            System.out.println(reply);
            System.out.flush();
        }
    }

    /** What the device makes of the file or folder a line names; an IOException is its refusal. */
    interface PathReader {
        String read(String path) throws IOException;
    }

    /** Each non-empty line a path through {@code reader}: its answer, "REFUSED <why>" where it refuses,
     *  or "CRASH <what>" for anything else escaping it (a bug: the device must refuse, never crash). */
    static void eachPath(PathReader reader) throws Exception {
        eachLine(path -> {
            try {
                return reader.read(path);
            } catch (IOException e) {
                return "REFUSED " + e.getMessage();
            } catch (RuntimeException e) {
                return "CRASH " + e;
            }
        });
    }

    /** Each non-empty line a JSON object, read by the device's own parser (one that is not JSON stops
     *  the driver with that error: the test wrote it, so a bug of the test's). */
    @SuppressWarnings("unchecked")
    static void eachJsonObject(Answer<Map<String, Object>> answer) throws Exception {
        eachLine(line -> answer.to((Map<String, Object>) Json.parse(line)));
    }

    /** {"out": out} as one canonical ASCII JSON line: what the edge drivers answer a case with,
     *  whatever stdout's charset. */
    static String outLine(Object out) throws Json.JsonError {
        Map<String, Object> reply = new LinkedHashMap<>();
        reply.put("out", out);
        return new String(Json.canonicalAscii(reply), StandardCharsets.US_ASCII);
    }
}
