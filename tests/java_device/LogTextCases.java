// Feeds text to the Java device's log escaping (org.fedfleet.wire.LogText) and prints what it made,
// so tests/test_log_text_java.py can hold it against the Python device's (protocols/log_text.py).
// One JSON line per case on stdin:
//   {"op": "sweep", "lo": N, "hi": M}: prints {"escaped": [[start, end], ...], "unassigned": [...]},
//     the ranges of code points in [lo, hi) that escapedControls escapes (each code point alone, lone
//     surrogates too), and those the JVM's Unicode version has unassigned;
//   {"op": "text", "cps": [code points], "max": N}: the text those code points make (a surrogate's
//     code point alone is a lone surrogate), printed as {"escaped": escapedControls, "one_line":
//     oneLine(text, N), "record": the message a handler of a oneLineLogger got when text was logged,
//     "thrown": the exception that handler got (an IllegalStateException(text)), as it prints it}.
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.*;
import java.util.logging.Handler;
import java.util.logging.Level;
import java.util.logging.LogRecord;
import java.util.logging.Logger;
import org.fedfleet.wire.Json;
import org.fedfleet.wire.LogText;

public final class LogTextCases {
    /** The last record a logger's handler was given. */
    static final class LastRecord extends Handler {
        LogRecord last;
        @Override public void publish(LogRecord record) { last = record; }
        @Override public void flush() {}
        @Override public void close() {}
    }

    @SuppressWarnings("unchecked")
    public static void main(String[] args) throws Exception {
        Logger logger = LogText.oneLineLogger("fedfleet.test.logtext");
        logger.setUseParentHandlers(false);
        LastRecord handler = new LastRecord();
        logger.addHandler(handler);
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        for (String line; (line = in.readLine()) != null; ) {
            if (line.isEmpty()) continue;
            Map<String, Object> c = (Map<String, Object>) Json.parse(line);
            Map<String, Object> reply = new LinkedHashMap<>();
            if (c.get("op").equals("sweep")) {
                int lo = ((Number) c.get("lo")).intValue(), hi = ((Number) c.get("hi")).intValue();
                reply.put("escaped", ranges(lo, hi, cp -> !LogText.escapedControls(alone(cp)).equals(alone(cp))));
                reply.put("unassigned", ranges(lo, hi, cp -> Character.getType(cp) == Character.UNASSIGNED));
            } else {
                StringBuilder b = new StringBuilder();
                for (Object cp : (List<Object>) c.get("cps")) b.appendCodePoint(((Number) cp).intValue());
                String text = b.toString();
                reply.put("escaped", LogText.escapedControls(text));
                reply.put("one_line", LogText.oneLine(text, ((Number) c.get("max")).intValue()));
                logger.log(Level.WARNING, text, new IllegalStateException(text));
                reply.put("record", handler.last.getMessage());
                reply.put("thrown", handler.last.getThrown().toString());
            }
            System.out.println(new String(Json.canonicalAscii(reply), StandardCharsets.US_ASCII));
        }
    }

    private static String alone(int cp) { return new String(Character.toChars(cp)); }

    /** The ranges [start, end) of the code points in [lo, hi) that are in. */
    private static List<Object> ranges(int lo, int hi, java.util.function.IntPredicate in) {
        List<Object> ranges = new ArrayList<>();
        int start = -1;
        for (int cp = lo; cp <= hi; cp++) {
            boolean inside = cp < hi && in.test(cp);
            if (inside && start < 0) start = cp;
            if (!inside && start >= 0) {
                ranges.add(Arrays.<Object>asList(start, cp));
                start = -1;
            }
        }
        return ranges;
    }
}
