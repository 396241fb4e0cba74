// Drives the Java library's ModelSlot for tests/test_java_deployment.py: opens a slot directory
// (optionally personalising with local labels), applies a deploy message (verified with the
// aggregator's key unless "-") and its head file, then prints what it runs and predicts.
// Usage: java SlotRunner <slot dir> <aggregator key hex | -> <features file> [<local labels a,b,..> | -]
//                        [<assignment.bin> [<head.npz>]]
// The assignment must name the device -Ddevice=<id> (default jdev) and a sequence not below the slot's.
// Prints "REFUSED <why>" (nothing changed; "REASON <class>" after a refusal of ModelSlot.admit),
// "SWAPPED <sha>", "REVERTED true|false"; then "CURRENT <sha>|none", "PREVIOUS <sha>|none", "SEQ <held>", and with a current head "CORRECT <n>" (on the
// features file's labels) and "PREDICT <class ids>".
import java.nio.file.*;
import java.util.Arrays;
import org.fedfleet.device.*;
import org.fedfleet.wire.Envelope;

public final class SlotRunner {
    public static void main(String[] args) throws Exception {
        int[] local = args.length > 3 && !args[3].equals("-") ? Arrays.stream(args[3].split(",")).mapToInt(Integer::parseInt).toArray() : null;
        ModelSlot slot = new ModelSlot(new java.io.File(args[0]), local);
        byte[] key = args[1].equals("-") ? null : Envelope.unhex(args[1]);
        if (args.length > 4) {
            slot.bindKey(key);      // what a DeploymentFollower does first: its key's sequence only binds it
            try {
                ModelSlot.Assignment a = ModelSlot.assignment(Files.readAllBytes(Paths.get(args[4])), key);
                slot.admit(a, System.getProperty("device", "jdev"));
                if (a.action.equals(ModelSlot.ROLLBACK)) {
                    System.out.println("REVERTED " + slot.revert(a.deployment));
                } else {
                    byte[] head = Files.readAllBytes(Paths.get(args[5]));
                    System.out.println("SWAPPED " + slot.swap(head, a.sha256, a.deployment, a.bundleSha256).sha256);
                }
            } catch (ModelSlot.Refusal e) {
                System.out.println("REFUSED " + e.getMessage());
                System.out.println("REASON " + e.reason);
            } catch (Envelope.EnvelopeError | java.io.IOException | IllegalArgumentException e) {
                System.out.println("REFUSED " + e.getMessage());
            }
        }
        ModelSlot.Version cur = slot.current(), prev = slot.previous();
        System.out.println("CURRENT " + (cur == null ? "none" : cur.sha256));
        System.out.println("PREVIOUS " + (prev == null ? "none" : prev.sha256));
        System.out.println("SEQ " + slot.seq());
        if (cur != null) {
            FeatureFile f = FeatureFile.read(args[2]);
            float[][] rows = new float[f.n][];
            int[] labels = new int[f.n];
            for (int i = 0; i < f.n; i++) { rows[i] = f.input(i); labels[i] = f.label(i); }
            System.out.println("CORRECT " + slot.correct(cur.head, rows, labels));
            StringBuilder out = new StringBuilder("PREDICT");
            for (int c : slot.predict(rows)) out.append(' ').append(c);
            System.out.println(out);
        }
    }
}
