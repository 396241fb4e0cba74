// A file replaced whole (the Java side of protocols/files.py write_atomic): written to a temporary
// file beside it, synced, renamed over it (rename(2), atomic within one folder), so a crash leaves
// the old file or the new one, never part of either. Unlike the Python helper the folder itself is
// not synced (java.io cannot open a folder): after a power cut right after the rename the old file
// may be found. What the device's state store, its model slot and its session memory write.
// java.io only (Android), as the rest of the library.
package org.fedfleet.device;

import java.io.File;
import java.io.FileOutputStream;
import java.io.IOException;

final class AtomicFile {
    private AtomicFile() {}

    /** Replace `target` with `data`, the temporary file named `"." + target's name + "."`…`".tmp"`. */
    static void write(File target, byte[] data) throws IOException {
        write(target, data, "." + target.getName() + ".", ".tmp");
    }

    /** Replace `target` with `data` through a temporary file named tempPrefix…tempSuffix in its folder
     *  (a store that sweeps leftovers of a crash by name chooses them). A failed write removes its
     *  temporary file: on a full disk a partial one would keep the space a retry needs. */
    static void write(File target, byte[] data, String tempPrefix, String tempSuffix) throws IOException {
        File tmp = File.createTempFile(tempPrefix, tempSuffix, target.getAbsoluteFile().getParentFile());
        boolean replaced = false;
        try {
            try (FileOutputStream out = new FileOutputStream(tmp)) {
                out.write(data);
                out.getFD().sync();
            }
            if (!tmp.renameTo(target)) throw new IOException("cannot replace " + target);
            replaced = true;
        } finally {
            if (!replaced) tmp.delete();
        }
    }
}
