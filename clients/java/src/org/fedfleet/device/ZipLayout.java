// The one zip layout both device SDKs take for a file they both read (a deployed head), and its members
// as both read them: protocols/zip_layout.py's rules, checked on the same bytes in the same order, its
// members read here (never through ZipInputStream, whose tolerances differ from zipfile's: files crafted
// on the difference were one head to one device and another head, or a refusal, to the other).
package org.fedfleet.device;

import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.regex.Pattern;
import java.util.zip.CRC32;
import java.util.zip.DataFormatException;
import java.util.zip.Inflater;

final class ZipLayout {
    private static final long MARK = 0xFFFFFFFFL;
    private static final int FLAGS = 0x0806;                        // deflate options, UTF-8
    private static final Pattern NAME = Pattern.compile("[A-Za-z0-9_.-]{1,255}");

    private ZipLayout() {}

    /** name -> bytes of every member, in order, when the layout follows the rules and they hold at most
     *  ``maxBytes`` together; IOException naming the first rule ``zip`` breaks. */
    static Map<String, byte[]> members(byte[] zip, long maxBytes) throws IOException {
        ByteBuffer b = ByteBuffer.wrap(zip).order(ByteOrder.LITTLE_ENDIAN);
        int end = endRecord(zip, b);
        int count = u16(b, end + 10);
        long directorySize = u32(b, end + 12), directoryAt = u32(b, end + 16);
        if (u16(b, end + 4) != 0 || u16(b, end + 6) != 0 || u16(b, end + 8) != count || directoryAt + directorySize != end)
            throw new IOException("the zip's end record does not close its directory (or names another disk)");
        List<long[]> entries = new ArrayList<>();           // {method, size, crc, start, compressed, name at, name length}
        long localAt = 0, total = 0;
        int at = (int) directoryAt;
        for (int i = 0; i < count; i++) {
            if (at + 46 > end || b.getInt(at) != 0x02014b50) throw new IOException("the zip's directory is cut short");
            int flags = u16(b, at + 8), method = u16(b, at + 10), nameLength = u16(b, at + 28), extraLength = u16(b, at + 30);
            long crc = u32(b, at + 16), compressed = u32(b, at + 20), size = u32(b, at + 24), offset = u32(b, at + 42);
            int next = at + 46 + nameLength + extraLength + u16(b, at + 32);
            if (next > end || compressed == MARK || size == MARK || offset == MARK || u16(b, at + 32) != 0)
                throw new IOException("a zip directory entry is cut short, has a comment, or holds its sizes in a zip64 field");
            byte[] name = Arrays.copyOfRange(zip, at + 46, at + 46 + nameLength);
            fields(b, at + 46 + nameLength, extraLength, name);
            long start = localEntry(zip, b, localAt, offset, flags, method, crc, compressed, size, name);
            entries.add(new long[]{method, size, crc, start, compressed, at + 46, nameLength});
            localAt = start + compressed;
            total += size;
            at = next;
        }
        if (at != end || localAt != directoryAt) throw new IOException("the zip holds more than its directory lists");
        if (total > maxBytes) throw new IOException("the zip's members hold " + total + " bytes, more than " + maxBytes);
        Map<String, byte[]> out = new LinkedHashMap<>();
        for (long[] e : entries) {
            String name = new String(zip, (int) e[5], (int) e[6], StandardCharsets.US_ASCII);
            if (out.containsKey(name)) throw new IOException("zip entry '" + name + "' named twice");
            out.put(name, content(zip, (int) e[3], (int) e[4], (int) e[0], (int) e[1], e[2], name));
        }
        return out;
    }

    /** Where the end record is: the file's last 22 bytes, with no comment. */
    private static int endRecord(byte[] zip, ByteBuffer b) throws IOException {
        int end = zip.length - 22;
        if (end < 0 || b.getInt(end) != 0x06054b50 || u16(b, end + 20) != 0)
            throw new IOException("the zip does not end with an end record without a comment");
        return end;
    }

    /** Checks the entry whose local header must start at ``at`` against its directory entry; where its data starts. */
    private static long localEntry(byte[] zip, ByteBuffer b, long at, long offset, int flags, int method, long crc,
                                   long compressed, long size, byte[] name) throws IOException {
        String shown = new String(name, StandardCharsets.ISO_8859_1);
        if (offset != at || at + 30 > zip.length || b.getInt((int) at) != 0x04034b50)
            throw new IOException("zip entry '" + shown + "' does not follow the one before it");
        int p = (int) at, nameLength = u16(b, p + 26), extraLength = u16(b, p + 28);
        long localCompressed = u32(b, p + 18), localSize = u32(b, p + 22);
        if (p + 30L + nameLength + extraLength > zip.length)
            throw new IOException("zip entry '" + shown + "': its local header is cut short");
        List<int[]> fields = fields(b, p + 30 + nameLength, extraLength, name);      // {id, at, length}
        if (localCompressed == MARK && localSize == MARK) {
            int[] zip64 = null;
            int found = 0;
            for (int[] f : fields) if (f[0] == 1) { zip64 = f; found++; }
            if (found != 1 || zip64[2] < 16)
                throw new IOException("zip entry '" + shown + "': its sizes are marked as in its zip64 field, which is not one of 16 bytes or more");
            localSize = b.getLong(zip64[1]);
            localCompressed = b.getLong(zip64[1] + 8);
        } else if (localCompressed == MARK || localSize == MARK) {
            throw new IOException("zip entry '" + shown + "': one size in its zip64 field, the other not");
        }
        byte[] localName = Arrays.copyOfRange(zip, p + 30, p + 30 + nameLength);
        long start = p + 30L + nameLength + extraLength;
        if (u16(b, p + 6) != flags || (flags & ~FLAGS) != 0 || u16(b, p + 8) != method || (method != 0 && method != 8)
                || u32(b, p + 14) != crc || localCompressed != compressed || localSize != size
                || (method == 0 && compressed != size) || !Arrays.equals(localName, name)
                || !NAME.matcher(shown).matches() || start + compressed > zip.length)
            throw new IOException("zip entry '" + shown + "': its local header and the zip's directory disagree, or it is "
                    + "encrypted, has a data descriptor, is neither stored nor deflated, or has a name of other characters "
                    + "than A-Z a-z 0-9 _ . -");
        return start;
    }

    /** The {id, value at, value length} fields of an extra block that they fill exactly. */
    private static List<int[]> fields(ByteBuffer b, int from, int length, byte[] name) throws IOException {
        List<int[]> out = new ArrayList<>();
        for (int at = from; at < from + length; ) {
            if (at + 4 > from + length || at + 4 + u16(b, at + 2) > from + length)
                throw new IOException("zip entry '" + new String(name, StandardCharsets.ISO_8859_1) + "': an extra field runs past its block");
            out.add(new int[]{u16(b, at), at + 4, u16(b, at + 2)});
            at += 4 + u16(b, at + 2);
        }
        return out;
    }

    /** The member's bytes: stored, or inflated from a stream that ends at its compressed size and inflates to ``size``
     *  bytes; they hash to its CRC. */
    private static byte[] content(byte[] zip, int start, int compressed, int method, int size, long crc, String name)
            throws IOException {
        byte[] out;
        if (method == 0) {
            out = Arrays.copyOfRange(zip, start, start + compressed);
        } else {
            out = new byte[size];
            Inflater inflater = new Inflater(true);
            try {
                inflater.setInput(zip, start, compressed);
                int n = 0;
                while (n < size && !inflater.finished()) {
                    int got = inflater.inflate(out, n, size - n);
                    if (got == 0 && (inflater.needsInput() || inflater.needsDictionary())) break;
                    n += got;
                }
                byte[] probe = new byte[1];
                if (n != size || (!inflater.finished() && inflater.inflate(probe) != 0) || !inflater.finished()
                        || inflater.getRemaining() != 0)
                    throw new IOException("zip entry '" + name + "': its deflate stream does not end at its compressed size "
                            + "and inflate to its " + size + " bytes");
            } catch (DataFormatException e) {
                throw new IOException("zip entry '" + name + "' does not inflate: " + e.getMessage());
            } finally {
                inflater.end();
            }
        }
        CRC32 check = new CRC32();
        check.update(out, 0, out.length);
        if (check.getValue() != crc) throw new IOException("zip entry '" + name + "': its bytes do not hash to its CRC");
        return out;
    }

    private static int u16(ByteBuffer b, int at) { return Short.toUnsignedInt(b.getShort(at)); }

    private static long u32(ByteBuffer b, int at) { return Integer.toUnsignedLong(b.getInt(at)); }
}
