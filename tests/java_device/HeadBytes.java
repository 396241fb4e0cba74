// What the Java device makes of head files (org.fedfleet.device.HeadFile.parse), for
// tests/test_head_bytes.py to hold against the Python device's (protocols.payloads.deployment
// head_from_npz) on the same bytes. One file path per line on stdin; prints one line per file:
// "OK <classes> <dim>" or "REFUSED <why>" ("CRASH <what>": anything else escaping, a bug).
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Paths;
import org.fedfleet.device.HeadFile;

public final class HeadBytes {
    public static void main(String[] args) throws Exception {
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        for (String line; (line = in.readLine()) != null; ) {
            if (line.isEmpty()) continue;
            try {
                HeadFile h = HeadFile.parse(Files.readAllBytes(Paths.get(line)));
                System.out.println("OK " + h.classes + " " + h.dim);
            } catch (java.io.IOException e) {
                System.out.println("REFUSED " + e.getMessage());
            } catch (RuntimeException e) {
                System.out.println("CRASH " + e);
            }
        }
    }
}
