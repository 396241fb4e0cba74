// What the Java device makes of a model slot's folder (org.fedfleet.device.ModelSlot, opened as a
// device opens it at start), for tests/test_slot_files.py to hold against the Python device's
// (edge_client.deployment.ModelSlot) on the same files. One folder per line on stdin; prints one
// line per folder: "OK <seq> <labels> <current sha256 | none>" or "REFUSED <why>" ("CRASH <what>":
// anything else escaping, a bug).
import java.io.BufferedReader;
import java.io.File;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.Arrays;
import org.fedfleet.device.ModelSlot;

public final class SlotFiles {
    public static void main(String[] args) throws Exception {
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        for (String line; (line = in.readLine()) != null; ) {
            if (line.isEmpty()) continue;
            try {
                ModelSlot slot = new ModelSlot(new File(line));
                int[] labels = slot.localLabels();
                System.out.println("OK " + slot.seq() + " " + (labels == null ? "none" : Arrays.toString(labels).replace(" ", ""))
                        + " " + (slot.current() == null ? "none" : slot.current().sha256));
            } catch (java.io.IOException e) {
                System.out.println("REFUSED " + e.getMessage());
            } catch (RuntimeException e) {
                System.out.println("CRASH " + e);
            }
        }
    }
}
