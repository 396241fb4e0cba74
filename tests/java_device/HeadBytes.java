// What the Java device makes of head files (org.fedfleet.device.HeadFile.parse), for
// tests/test_head_bytes.py to hold against the Python device's (protocols.payloads.deployment
// head_from_npz) on the same bytes. One file path per line on stdin; prints one line per file:
// "OK <classes> <dim>" or "REFUSED <why>" ("CRASH <what>": anything else escaping, a bug).
import java.nio.file.Files;
import java.nio.file.Paths;
import org.fedfleet.device.HeadFile;

public final class HeadBytes {
    public static void main(String[] args) throws Exception {
        StdinCases.eachPath(path -> {
            HeadFile h = HeadFile.parse(Files.readAllBytes(Paths.get(path)));
            return "OK " + h.classes + " " + h.dim;
        });
    }
}
