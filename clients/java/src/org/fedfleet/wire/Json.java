// Strict JSON reader and the canonical writer of docs/protocol.md ("Canonical JSON"),
// written from the spec alone. Values: LinkedHashMap (object), ArrayList (array), String,
// BigInteger (a number without '.', 'e' or 'E'), Double (any other number), Boolean, NULL.
package org.fedfleet.wire;

import java.math.BigDecimal;
import java.math.BigInteger;
import java.math.MathContext;
import java.math.RoundingMode;
import java.nio.charset.StandardCharsets;
import java.util.*;

public final class Json {
    public static final Object NULL = new Object() { public String toString() { return "null"; } };

    public static final class JsonError extends Exception {
        public JsonError(String m) { super(m); }
    }

    // ---- reader: RFC 8259, no NaN/Infinity, no duplicate keys, no lone surrogates ----
    private final String s;
    private final boolean wire;     // a message header: integers within the contract's range
    private int i;

    private Json(String s, boolean wire) { this.s = s; this.wire = wire; }

    /** JSON as files hold it (golden vectors, state files): integers of any size. */
    public static Object parse(String text) throws JsonError { return parse(text, false); }

    /** A message header (docs/protocol.md): an integer outside -2^63 .. 2^64 - 1 is refused. */
    public static Object parseHeader(String text) throws JsonError { return parse(text, true); }

    private static Object parse(String text, boolean wire) throws JsonError {
        Json p = new Json(text, wire);
        p.ws();
        Object v = p.value(0);
        p.ws();
        if (p.i != text.length()) throw p.err("trailing characters after the JSON value");
        return v;
    }

    private JsonError err(String m) { return new JsonError(m + " at char " + i); }
    private void ws() { while (i < s.length() && " \t\r\n".indexOf(s.charAt(i)) >= 0) i++; }
    private char peek() throws JsonError {
        if (i >= s.length()) throw err("unexpected end of JSON");
        return s.charAt(i);
    }
    private void expect(char c) throws JsonError {
        if (peek() != c) throw err("expected '" + c + "'");
        i++;
    }

    /** Objects and arrays nested in one another, the outermost one counting 1 (protocols/envelope.py
     *  MAX_JSON_DEPTH and check_json_depth: the two devices refuse the same headers). */
    public static final int MAX_DEPTH = 32;

    /** depth: the containers around this value. */
    private Object value(int depth) throws JsonError {
        char c = peek();
        if ((c == '{' || c == '[') && depth + 1 > MAX_DEPTH) throw err("JSON nested deeper than " + MAX_DEPTH + " levels");
        if (c == '{') return object(depth);
        if (c == '[') return array(depth);
        if (c == '"') return string();
        if ((c == '-' && !s.startsWith("-Infinity", i)) || (c >= '0' && c <= '9')) return number();
        for (String lit : new String[] {"true", "false", "null"})
            if (s.startsWith(lit, i)) {
                i += lit.length();
                return lit.equals("null") ? NULL : Boolean.valueOf(lit.equals("true"));
            }
        if (s.startsWith("NaN", i) || s.startsWith("Infinity", i) || s.startsWith("-Infinity", i))
            throw err("NaN/Infinity are not JSON (the spec forbids them)");
        throw err("unexpected character '" + c + "'");
    }

    private Map<String, Object> object(int depth) throws JsonError {
        Map<String, Object> m = new LinkedHashMap<>();
        expect('{'); ws();
        if (peek() == '}') { i++; return m; }
        while (true) {
            ws();
            if (peek() != '"') throw err("object key must be a string");
            String k = string();
            if (m.containsKey(k)) throw err("duplicate key \"" + k + "\"");
            ws(); expect(':'); ws();
            m.put(k, value(depth + 1));
            ws();
            if (peek() == ',') { i++; continue; }
            expect('}');
            return m;
        }
    }

    private List<Object> array(int depth) throws JsonError {
        List<Object> a = new ArrayList<>();
        expect('['); ws();
        if (peek() == ']') { i++; return a; }
        while (true) {
            ws();
            a.add(value(depth + 1));
            ws();
            if (peek() == ',') { i++; continue; }
            expect(']');
            return a;
        }
    }

    private String string() throws JsonError {
        expect('"');
        StringBuilder b = new StringBuilder();
        while (true) {
            char c = peek();
            i++;
            if (c == '"') break;
            if (c < 0x20) throw err("raw control character in string");
            if (c != '\\') { b.append(c); continue; }
            char e = peek();
            i++;
            switch (e) {
                case '"': b.append('"'); break;
                case '\\': b.append('\\'); break;
                case '/': b.append('/'); break;
                case 'b': b.append('\b'); break;
                case 'f': b.append('\f'); break;
                case 'n': b.append('\n'); break;
                case 'r': b.append('\r'); break;
                case 't': b.append('\t'); break;
                case 'u':
                    // exactly four of [0-9a-fA-F]: Integer.parseInt(_, 16) also takes a sign ("+061")
                    // and other scripts' digits (four ARABIC-INDIC ones)
                    if (i + 4 > s.length()) throw err("truncated \\u escape");
                    int unit = 0;
                    for (int k = 0; k < 4; k++) {
                        char h = s.charAt(i + k);
                        int v = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10
                                : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
                        if (v < 0) throw err("bad \\u escape");
                        unit = unit * 16 + v;
                    }
                    b.append((char) unit);
                    i += 4;
                    break;
                default: throw err("bad escape \\" + e);
            }
        }
        String out = b.toString();
        for (int k = 0; k < out.length(); k++) {  // only whole Unicode scalar values
            char c = out.charAt(k);
            if (Character.isHighSurrogate(c) && k + 1 < out.length() && Character.isLowSurrogate(out.charAt(k + 1))) k++;
            else if (Character.isSurrogate(c)) throw err("lone UTF-16 surrogate in string");
        }
        return out;
    }

    static final BigInteger INT_MIN = BigInteger.ONE.shiftLeft(63).negate(), INT_MAX = BigInteger.ONE.shiftLeft(64).subtract(BigInteger.ONE);

    /** RFC 8259's DIGIT is '0'..'9' only: Character.isDigit also takes the other scripts' digits
     *  (U+0662, U+FF11), which BigInteger and Double.parseDouble then read or throw on. */
    private boolean digitAt(int at) { return at < s.length() && s.charAt(at) >= '0' && s.charAt(at) <= '9'; }

    private Object number() throws JsonError {
        int start = i;
        if (peek() == '-') i++;
        if (peek() == '0') i++;
        else if (peek() >= '1' && peek() <= '9') while (digitAt(i)) i++;
        else throw err("bad number");
        boolean isFloat = false;
        if (i < s.length() && s.charAt(i) == '.') {
            isFloat = true; i++;
            if (!digitAt(i)) throw err("bad fraction");
            while (digitAt(i)) i++;
        }
        if (i < s.length() && (s.charAt(i) == 'e' || s.charAt(i) == 'E')) {
            isFloat = true; i++;
            if (peek() == '+' || peek() == '-') i++;
            if (!digitAt(i)) throw err("bad exponent");
            while (digitAt(i)) i++;
        }
        String t = s.substring(start, i);
        if (!isFloat) {     // docs/protocol.md: integers within -2^63 .. 2^64 - 1; receivers refuse others
            // more than 2^64 - 1's 20 digits (JSON has no leading zeros): outside, without BigInteger's
            // quadratic parse (a 256 KiB integer took it a second; Python's int() stops at 4,300 digits)
            boolean tooLong = wire && t.length() - (t.charAt(0) == '-' ? 1 : 0) > 20;
            BigInteger v = tooLong ? null : new BigInteger(t);
            if (tooLong || wire && (v.compareTo(INT_MIN) < 0 || v.compareTo(INT_MAX) > 0))
                throw err("the integer " + t.substring(0, Math.min(40, t.length())) + " is outside -2^63 .. 2^64 - 1");
            return v;
        }
        double d = Double.parseDouble(t);
        if (Double.isInfinite(d)) throw err("number " + t + " overflows float64");
        return d;
    }

    /** A string's length as the protocol counts characters (docs/protocol.md "Canonical JSON"):
     *  Unicode code points, Python's len(). String.length() counts UTF-16 units, two for each
     *  character above U+FFFF, and refused ids of 65 to 128 such characters that Python takes. */
    public static int characters(String s) { return s.codePointCount(0, s.length()); }

    // ---- canonical writer ----
    public static byte[] canonical(Object v) throws JsonError {
        StringBuilder b = new StringBuilder();
        write(b, v, false);
        return b.toString().getBytes(StandardCharsets.UTF_8);
    }

    /** Python's json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=True): what the
     *  secure-aggregation messages sign (docs/secure-aggregation.md); everything outside
     *  U+0020..U+007E is escaped as a backslash-u sequence per UTF-16 unit (lowercase hex), U+007F included. */
    public static byte[] canonicalAscii(Object v) throws JsonError {
        StringBuilder b = new StringBuilder();
        write(b, v, true);
        return b.toString().getBytes(StandardCharsets.US_ASCII);
    }

    /** Keys in Unicode code point order (= UTF-8 byte order), not Java's UTF-16 order. */
    public static final Comparator<String> CODE_POINT_ORDER = (a, b) -> {
        int[] x = a.codePoints().toArray(), y = b.codePoints().toArray();
        for (int k = 0; k < Math.min(x.length, y.length); k++)
            if (x[k] != y[k]) return Integer.compare(x[k], y[k]);
        return Integer.compare(x.length, y.length);
    };

    @SuppressWarnings("unchecked")
    private static void write(StringBuilder b, Object v, boolean ascii) throws JsonError {
        if (v instanceof Map) {
            Map<String, Object> m = (Map<String, Object>) v;
            List<String> keys = new ArrayList<>(m.keySet());
            keys.sort(CODE_POINT_ORDER);
            b.append('{');
            for (int k = 0; k < keys.size(); k++) {
                if (k > 0) b.append(',');
                writeString(b, keys.get(k), ascii);
                b.append(':');
                write(b, m.get(keys.get(k)), ascii);
            }
            b.append('}');
        } else if (v instanceof List) {
            b.append('[');
            List<Object> a = (List<Object>) v;
            for (int k = 0; k < a.size(); k++) {
                if (k > 0) b.append(',');
                write(b, a.get(k), ascii);
            }
            b.append(']');
        } else if (v instanceof String) writeString(b, (String) v, ascii);
        else if (v instanceof BigInteger || v instanceof Boolean || v == NULL) b.append(v);
        else if (v instanceof Integer || v instanceof Long) b.append(v);   // integers built in Java code
        else if (v instanceof Double) b.append(formatFloat((Double) v));
        else throw new JsonError("not a JSON value: " + v);
    }

    private static void writeString(StringBuilder b, String v, boolean ascii) {
        b.append('"');
        for (char c : v.toCharArray()) {
            switch (c) {
                case '"': b.append("\\\""); break;
                case '\\': b.append("\\\\"); break;
                case '\b': b.append("\\b"); break;
                case '\f': b.append("\\f"); break;
                case '\n': b.append("\\n"); break;
                case '\r': b.append("\\r"); break;
                case '\t': b.append("\\t"); break;
                default:
                    if (c < 0x20 || (ascii && c > 0x7e)) b.append(String.format("\\u%04x", (int) c));
                    else b.append(c);  // everything else, non-ASCII included, as raw UTF-8
            }
        }
        b.append('"');
    }

    /** Python's repr(float): the shortest decimal that parses back to d, the nearer to d's exact
     *  value when both neighbours at that length do (docs/protocol.md "Canonical JSON"); fixed
     *  notation for exponents -4..15, else d.ddde±XX. Both neighbours are tried, not only the
     *  half-even rounding: at a power of two the gap below is half the gap above, so the rounding
     *  can miss while the neighbour away from zero parses back (2^-24: 5.960464477539063e-08). */
    public static String formatFloat(double d) throws JsonError {
        if (Double.isNaN(d) || Double.isInfinite(d)) throw new JsonError("NaN/Infinity cannot be encoded");
        if (d == 0) return (1 / d < 0) ? "-0.0" : "0.0";
        BigDecimal exact = new BigDecimal(d), r = exact;
        for (int p = 1; p <= 17; p++) {
            BigDecimal down = exact.round(new MathContext(p, RoundingMode.DOWN)),
                    up = exact.round(new MathContext(p, RoundingMode.UP));
            boolean downOk = Double.parseDouble(down.toString()) == d, upOk = Double.parseDouble(up.toString()) == d;
            if (downOk && upOk) {
                int cmp = exact.subtract(down).abs().compareTo(up.subtract(exact).abs());
                r = cmp < 0 ? down : cmp > 0 ? up : exact.round(new MathContext(p, RoundingMode.HALF_EVEN));
                break;
            }
            if (downOk || upOk) { r = downOk ? down : up; break; }
        }
        r = r.stripTrailingZeros();
        String digits = r.unscaledValue().abs().toString();
        int exp10 = digits.length() - 1 - r.scale();
        String sign = d < 0 ? "-" : "";
        if (exp10 >= -4 && exp10 < 16) {
            String plain = r.abs().toPlainString();
            return sign + (plain.contains(".") ? plain : plain + ".0");
        }
        String mant = digits.length() == 1 ? digits : digits.charAt(0) + "." + digits.substring(1);
        return sign + mant + "e" + (exp10 < 0 ? "-" : "+") + String.format("%02d", Math.abs(exp10));
    }

    /** Structural equality that also keeps integers and floats apart (1 != 1.0). */
    public static boolean same(Object a, Object b) {
        if (a instanceof Map && b instanceof Map) {
            Map<?, ?> x = (Map<?, ?>) a, y = (Map<?, ?>) b;
            if (!x.keySet().equals(y.keySet())) return false;
            for (Object k : x.keySet()) if (!same(x.get(k), y.get(k))) return false;
            return true;
        }
        if (a instanceof List && b instanceof List) {
            List<?> x = (List<?>) a, y = (List<?>) b;
            if (x.size() != y.size()) return false;
            for (int k = 0; k < x.size(); k++) if (!same(x.get(k), y.get(k))) return false;
            return true;
        }
        return a.equals(b);  // Double.equals compares bits: -0.0 != 0.0, as on the wire
    }
}
