// What the Java device makes of a model slot's folder (org.fedfleet.device.ModelSlot, opened as a
// device opens it at start), for tests/test_slot_files.py to hold against the Python device's
// (edge_client.deployment.ModelSlot) on the same files. One folder per line on stdin; prints one
// line per folder: "OK <seq> <labels> <current sha256 | none>" or "REFUSED <why>" ("CRASH <what>":
// anything else escaping, a bug).
import java.io.File;
import java.util.Arrays;
import org.fedfleet.device.ModelSlot;

public final class SlotFiles {
    public static void main(String[] args) throws Exception {
        StdinCases.eachPath(folder -> {
            ModelSlot slot = new ModelSlot(new File(folder));
            int[] labels = slot.localLabels();
            return "OK " + slot.seq() + " " + (labels == null ? "none" : Arrays.toString(labels).replace(" ", ""))
                    + " " + (slot.current() == null ? "none" : slot.current().sha256);
        });
    }
}
