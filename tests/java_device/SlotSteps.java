// A Java device's model slot driven step by step from stdin, for tests/test_slot_shared_across_sdks.py
// to interleave with a Python slot on the same folder. Usage: java SlotSteps <slot dir> [<labels a,b,..>]
// Opens the slot (printing "OPENED" once it has), then per stdin line:
//   swap <head file> <sha256> <deployment>  -> "SWAPPED <sha256>"
//   state                                   -> "STATE <seq> <labels | none> <current sha256 | none>"
// An IOException is printed as "FAILED <why>", a head refused (IllegalArgumentException) as "REFUSED <why>".
import java.io.File;
import java.nio.file.Files;
import java.nio.file.Paths;
import java.util.Arrays;
import org.fedfleet.device.ModelSlot;

public final class SlotSteps {
    public static void main(String[] args) throws Exception {
        int[] labels = args.length > 1 ? Arrays.stream(args[1].split(",")).mapToInt(Integer::parseInt).toArray() : null;
        ModelSlot slot = new ModelSlot(new File(args[0]), labels);
        System.out.println("OPENED");
        StdinCases.eachLine(line -> step(slot, line.trim().split(" ")));
    }

    /** One step's answer line, or null for a line that names no step (answered with nothing). */
    private static String step(ModelSlot slot, String[] step) {
        try {
            if (step[0].equals("swap"))
                return "SWAPPED " + slot.swap(Files.readAllBytes(Paths.get(step[1])), step[2], step[3], "").sha256;
            if (step[0].equals("state")) {
                int[] kept = slot.localLabels();
                return "STATE " + slot.seq() + " " + (kept == null ? "none" : Arrays.toString(kept).replace(" ", ""))
                        + " " + (slot.current() == null ? "none" : slot.current().sha256);
            }
            return null;
        } catch (java.io.IOException e) {
            return "FAILED " + e.getMessage();
        } catch (IllegalArgumentException e) {
            return "REFUSED " + e.getMessage();
        }
    }
}
