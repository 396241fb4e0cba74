// The one zip layout both device SDKs take for a file they both read (a deployed head): the rules of
// protocols/zip_layout.py, checked on the same bytes in the same order. ZipInputStream (Npz) reads the
// local headers front to back, the Python device's zipfile the end record and the central directory;
// a zip in which the two disagree was one head to one device and another head (or a refusal) to the
// other under one sha256. The stream's own checks hold the fifth rule (a deflate stream ends at its
// entry's compressed size and inflates to its size: ZipException otherwise).
package org.fedfleet.device;

import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;

final class ZipLayout {
    private static final long MARK = 0xFFFFFFFFL;
    private static final int ENCRYPTED = 0x0001, DESCRIPTOR = 0x0008;

    private ZipLayout() {}

    /** IOException naming the first rule ``zip`` breaks. */
    static void check(byte[] zip) throws IOException {
        ByteBuffer b = ByteBuffer.wrap(zip).order(ByteOrder.LITTLE_ENDIAN);
        int end = endRecord(zip, b);
        int count = u16(b, end + 10);
        long directorySize = u32(b, end + 12), directoryAt = u32(b, end + 16);
        if (u16(b, end + 4) != 0 || u16(b, end + 6) != 0 || u16(b, end + 8) != count || directoryAt + directorySize != end)
            throw new IOException("the zip's end record does not close its directory (or names another disk)");
        long localAt = 0;
        int at = (int) directoryAt;
        for (int i = 0; i < count; i++) {
            if (at + 46 > end || b.getInt(at) != 0x02014b50) throw new IOException("the zip's directory is cut short");
            int flags = u16(b, at + 8), method = u16(b, at + 10), nameLength = u16(b, at + 28);
            long crc = u32(b, at + 16), compressed = u32(b, at + 20), size = u32(b, at + 24), offset = u32(b, at + 42);
            int next = at + 46 + nameLength + u16(b, at + 30) + u16(b, at + 32);
            if (next > end || compressed == MARK || size == MARK || offset == MARK)
                throw new IOException("a zip directory entry is cut short, or holds its sizes in a zip64 field");
            byte[] name = java.util.Arrays.copyOfRange(zip, at + 46, at + 46 + nameLength);
            localAt = localEntry(zip, b, localAt, offset, flags, method, crc, compressed, size, name);
            at = next;
        }
        if (at != end || localAt != directoryAt) throw new IOException("the zip holds more than its directory lists");
    }

    /** Where the end record is: the last whose comment reaches the file's end exactly. */
    private static int endRecord(byte[] zip, ByteBuffer b) throws IOException {
        for (int end = zip.length - 22; end >= Math.max(0, zip.length - 22 - 0xffff); end--)
            if (b.getInt(end) == 0x06054b50 && u16(b, end + 20) == zip.length - end - 22) return end;
        throw new IOException("no zip end record closes the file");
    }

    /** Checks the entry whose local header must start at ``at``; where the next one starts. */
    private static long localEntry(byte[] zip, ByteBuffer b, long at, long offset, int flags, int method, long crc,
                                   long compressed, long size, byte[] name) throws IOException {
        String shown = new String(name, java.nio.charset.StandardCharsets.ISO_8859_1);
        if (offset != at || at + 30 > zip.length || b.getInt((int) at) != 0x04034b50)
            throw new IOException("zip entry '" + shown + "' does not follow the one before it");
        int p = (int) at, nameLength = u16(b, p + 26), extraLength = u16(b, p + 28);
        long localCompressed = u32(b, p + 18), localSize = u32(b, p + 22);
        if (p + 30L + nameLength + extraLength > zip.length)
            throw new IOException("zip entry '" + shown + "': its local header is cut short");
        if (localCompressed == MARK && localSize == MARK) {
            long[] sizes = zip64Sizes(b, p + 30 + nameLength, extraLength);
            localSize = sizes[0];
            localCompressed = sizes[1];
        } else if (localCompressed == MARK || localSize == MARK) {
            throw new IOException("zip entry '" + shown + "': one size in its zip64 field, the other not");
        }
        byte[] localName = java.util.Arrays.copyOfRange(zip, p + 30, p + 30 + nameLength);
        long start = p + 30L + nameLength + extraLength;
        boolean ascii = true;
        for (byte c : name) ascii &= c >= 0;
        if (u16(b, p + 6) != flags || (flags & (ENCRYPTED | DESCRIPTOR)) != 0 || u16(b, p + 8) != method
                || (method != 0 && method != 8) || u32(b, p + 14) != crc || localCompressed != compressed || localSize != size
                || (method == 0 && compressed != size) || !java.util.Arrays.equals(localName, name) || !ascii
                || start + compressed > zip.length)
            throw new IOException("zip entry '" + shown + "': its local header and the zip's directory disagree, or it is "
                    + "encrypted, has a data descriptor, is neither stored nor deflated, or has a name not ASCII");
        return start + compressed;
    }

    /** {size, compressed size} of a local header's one zip64 field (id 1, at least 16 bytes). */
    private static long[] zip64Sizes(ByteBuffer b, int from, int length) throws IOException {
        long[] found = null;
        int fields = 0;
        for (int at = from; at + 4 <= from + length; ) {
            int id = u16(b, at), size = u16(b, at + 2);
            if (id == 1) {
                fields++;
                if (size >= 16 && at + 4 + 16 <= from + length) found = new long[]{b.getLong(at + 4), b.getLong(at + 12)};
                else found = null;
            }
            at += 4 + size;
        }
        if (fields != 1 || found == null || found[0] < 0 || found[1] < 0)
            throw new IOException("a zip entry's sizes are marked as in its zip64 field, which is not one of 16 bytes or more");
        return found;
    }

    private static int u16(ByteBuffer b, int at) { return Short.toUnsignedInt(b.getShort(at)); }

    private static long u32(ByteBuffer b, int at) { return Integer.toUnsignedLong(b.getInt(at)); }
}
