// A small state file's text (the Java side of protocols/regular_file.py read_small_file with
// parse_strict_json's decoding): at most maxBytes read, so a file grown huge (or /dev/zero in its
// place) costs no memory, and strict UTF-8, as either device writes it (a byte order mark, UTF-16,
// an encoded surrogate or an overlong form refused). What the sample-window ledger and the session
// memory read. java.io only (Android), as the rest of the library.
package org.fedfleet.device;

import java.io.File;
import java.io.FileInputStream;
import java.io.IOException;
import java.io.InputStream;
import java.nio.ByteBuffer;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.CodingErrorAction;
import java.nio.charset.StandardCharsets;

final class SmallTextFile {
    private SmallTextFile() {}

    /** `path`'s text; IOException when it is larger than `maxBytes` or not UTF-8. */
    static String read(File path, int maxBytes) throws IOException {
        byte[] data = new byte[maxBytes + 1];
        int at = 0;
        try (InputStream in = new FileInputStream(path)) {
            for (int n; at < data.length && (n = in.read(data, at, data.length - at)) > 0; ) at += n;
        }
        if (at > maxBytes) throw new IOException("larger than " + maxBytes + " bytes");
        try {
            return StandardCharsets.UTF_8.newDecoder().onMalformedInput(CodingErrorAction.REPORT)
                    .onUnmappableCharacter(CodingErrorAction.REPORT).decode(ByteBuffer.wrap(data, 0, at)).toString();
        } catch (CharacterCodingException e) {
            throw new IOException("not UTF-8 text");
        }
    }
}
