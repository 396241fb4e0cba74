// Text others wrote (the aggregator's rejection reasons and rollback reasons, job ids, a SecAgg
// peer's ids, an error quoting a forged field) made safe for one line of the device's log: the
// Python device's rules (protocols/log_text.py), the same output for the same input
// (tests/test_log_text_java.py holds the two to each other on every code point).
//
// Unescaped, a newline in a reason wrote a log record of the sender's choosing, an ESC sequence
// drove the terminal tailing the log, and a right-to-left override (U+202E) showed the rest of
// the line reversed. Every code point of the Unicode categories Python's str.isprintable refuses
// (Cc, Cf, Cs, Co, Cn, Zl, Zp, Zs but the space) is written as Python's repr writes it: \n, \r,
// \t, \xhh below U+0100, \\uhhhh, \Uhhhhhhhh. The categories are the JVM's Unicode version's:
// a code point assigned in one version and not in the other is the only place the two may differ.
// A backslash is written \\ too, so the escapes are the only single backslashes in a line: a
// sender's printable text "\n" or "\x1b" otherwise read exactly as an escaped control (a forged
// escaped newline in the middle of a record, and no telling which was sent).
//
// In the wire package because the device (org.fedfleet.device) and the SecAgg client
// (org.fedfleet.secagg) both log through it and both use the wire package already.
package org.fedfleet.wire;

import java.util.logging.Filter;
import java.util.logging.LogRecord;
import java.util.logging.Logger;

public final class LogText {
    /** A record's message, or a traceback's line, at most (before escaping): protocols/log_text.py's. */
    public static final int MAX_RECORD_CHARS = 4000;
    /** Where oneLine cut: "…". */
    public static final String CUT_MARK = "\u2026";

    private LogText() {}

    /** text with every code point that is not printable, and every backslash, written as its Python escape. */
    public static String escapedControls(String text) {
        StringBuilder out = null;
        for (int i = 0; i < text.length(); ) {
            int cp = text.codePointAt(i);
            int next = i + Character.charCount(cp);
            if (!printable(cp) || cp == '\\') {
                if (out == null) out = new StringBuilder(text.length() + 16).append(text, 0, i);
                out.append(escape(cp));
            } else if (out != null) {
                out.append(text, i, next);
            }
            i = next;
        }
        return out == null ? text : out.toString();
    }

    /** text cut to maxChars code points (the last one "…" where it was cut), then escaped: cut
     *  first, so an escape is never split. Python's len counts code points, so these are counted too. */
    public static String oneLine(String text, int maxChars) {
        if (text == null) return "null";
        if (text.codePointCount(0, text.length()) > maxChars) {
            text = text.substring(0, text.offsetByCodePoints(0, maxChars - 1)) + CUT_MARK;
        }
        return escapedControls(text);
    }

    /** The logger named name, every record it is given made one line first (OneLineRecords). */
    public static Logger oneLineLogger(String name) {
        Logger logger = Logger.getLogger(name);
        if (!(logger.getFilter() instanceof OneLineRecords)) logger.setFilter(new OneLineRecords());
        return logger;
    }

    /**
     * A logger's filter that lets every record through made one line: its message (and each string
     * parameter) cut and escaped, its exception replaced by a copy whose messages are. A filter, not a
     * formatter, because the handlers belong to the application (a console, Android's logcat): the
     * logger is the one place the library owns that every record passes, whatever prints it.
     */
    public static final class OneLineRecords implements Filter {
        @Override public boolean isLoggable(LogRecord record) {
            if (record.getMessage() != null) record.setMessage(oneLine(record.getMessage(), MAX_RECORD_CHARS));
            Object[] params = record.getParameters();
            if (params != null) {
                Object[] safe = params.clone();
                for (int k = 0; k < safe.length; k++) {
                    if (safe[k] instanceof String) safe[k] = oneLine((String) safe[k], MAX_RECORD_CHARS);
                }
                record.setParameters(safe);
            }
            if (record.getThrown() != null && !(record.getThrown() instanceof Quoted)) {
                record.setThrown(Quoted.of(record.getThrown(), 0));
            }
            return true;
        }
    }

    /** An exception as a handler prints it (toString, stack, causes), its messages one line each. */
    static final class Quoted extends RuntimeException {
        private static final long serialVersionUID = 1L;
        private static final int MAX_CAUSES = 8;        // a cause chain is finite, but need not be short
        private final String shown;

        private Quoted(Throwable original, Throwable cause) {
            super(null, cause, false, true);
            this.shown = oneLine(String.valueOf(original), MAX_RECORD_CHARS);
            setStackTrace(original.getStackTrace());
        }

        static Quoted of(Throwable original, int depth) {
            Throwable cause = original.getCause();
            return new Quoted(original, cause == null || cause == original || depth >= MAX_CAUSES ? null : of(cause, depth + 1));
        }

        @Override public String toString() { return shown; }
        @Override public String getMessage() { return shown; }
    }

    private static boolean printable(int cp) {
        if (cp == ' ') return true;
        switch (Character.getType(cp)) {
            case Character.CONTROL: case Character.FORMAT: case Character.SURROGATE: case Character.PRIVATE_USE:
            case Character.UNASSIGNED: case Character.LINE_SEPARATOR: case Character.PARAGRAPH_SEPARATOR:
            case Character.SPACE_SEPARATOR:
                return false;
            default:
                return true;
        }
    }

    private static String escape(int cp) {
        switch (cp) {
            case '\n': return "\\n";
            case '\r': return "\\r";
            case '\t': return "\\t";
            case '\\': return "\\\\";
            default:
                if (cp < 0x100) return String.format("\\x%02x", cp);
                if (cp < 0x10000) return String.format("\\u%04x", cp);
                return String.format("\\U%08x", cp);
        }
    }
}
