// Runs a script of device state store operations (DeviceStateStore) on a folder, so
// tests/test_java_state.py can run the same script through the Python device's store
// (edge_client/state.py) and compare what each answers, and each library can open the other's files.
// Usage: java StateRunner <folder> <script>; one operation per line, one answer line each:
//   clock <t>                                   the store's clock (seconds); answers "OK"
//   open <budget bytes>                         a new store on the folder (sweeps); "JOBS <sorted job ids>"
//   save <job> <run> <round> <ttl_s> <n>        arrays x = k/2 + round (k < n, float32, shape (n,)) and
//                                               y = -x (shape (1, n)); "SAVED" or "BUDGET <reason>"
//   load <job> <run|-> <round|-> <staleness|->  "NONE" or "ENTRY <run> <round> <x values> | <y shape>"
//   drop <job> | forget | used                  "DROPPED true|false", "FORGOT <n>", "USED <bytes>"
//   ended <file> <aggregator key hex>           a `job.ended` message (JobEnded) verified with the key and
//                                               applied: "ENDED <jobs whose state went>" or "REFUSED <why>"
import java.io.File;
import java.nio.file.*;
import java.util.*;
import org.fedfleet.device.*;

public final class StateRunner {
    private static double now = 0;

    public static void main(String[] args) throws Exception {
        File folder = new File(args[0]);
        DeviceStateStore store = null;
        for (String line : Files.readAllLines(Paths.get(args[1]))) {
            String[] a = line.trim().split(" ");
            switch (a[0]) {
                case "clock": now = Double.parseDouble(a[1]); System.out.println("OK"); break;
                case "open":
                    store = new DeviceStateStore(folder, Long.parseLong(a[1]), () -> now);
                    List<String> jobs = new ArrayList<>(store.jobs());
                    Collections.sort(jobs);
                    System.out.println("JOBS " + String.join(",", jobs));
                    break;
                case "save":
                    try {
                        store.save(a[1], a[2], Long.parseLong(a[3]), arrays(Long.parseLong(a[3]), Integer.parseInt(a[5])),
                                Double.parseDouble(a[4]));
                        System.out.println("SAVED");
                    } catch (DeviceStateStore.BudgetExceeded e) {
                        System.out.println("BUDGET " + e.getMessage());
                    }
                    break;
                case "load": System.out.println(load(store, a)); break;
                case "drop": System.out.println("DROPPED " + store.drop(a[1])); break;
                case "forget": System.out.println("FORGOT " + store.forget()); break;
                case "ended": System.out.println(ended(store, a[1], a[2])); break;
                case "used": System.out.println("USED " + store.usedBytes(null)); break;
                default: throw new IllegalArgumentException(line);
            }
        }
    }

    private static Map<String, Npz.Array> arrays(long round, int n) {
        float[] x = new float[n], y = new float[n];
        for (int k = 0; k < n; k++) { x[k] = k / 2f + round; y[k] = -x[k]; }
        Map<String, Npz.Array> out = new LinkedHashMap<>();
        out.put("x", Npz.float32(new long[] {n}, x));
        out.put("y", Npz.float32(new long[] {1, n}, y));
        return out;
    }

    private static String load(DeviceStateStore store, String[] a) {
        DeviceStateStore.Entry e = store.load(a[1], opt(a[2]), a[3].equals("-") ? null : Long.valueOf(a[3]),
                a[4].equals("-") ? null : Long.valueOf(a[4]));
        if (e == null) return "NONE";
        StringBuilder s = new StringBuilder("ENTRY " + e.run + " " + e.round);
        for (float v : e.arrays.get("x").floats()) s.append(' ').append(v);
        return s.append(" | ").append(Arrays.toString(e.arrays.get("y").shape)).toString();
    }

    private static String ended(DeviceStateStore store, String file, String keyHex) throws Exception {
        try {
            org.fedfleet.wire.Envelope.Message env = org.fedfleet.wire.Envelope.decode(
                    Files.readAllBytes(Paths.get(file)), org.fedfleet.wire.Envelope.unhex(keyHex), 1 << 20);
            List<String> jobs = new ArrayList<>();
            for (JobEnded n : JobEnded.apply(JobEnded.parse(env), store)) jobs.add(n.job);
            return "ENDED " + String.join(",", jobs);
        } catch (org.fedfleet.wire.Envelope.EnvelopeError e) {
            return "REFUSED " + e.getMessage();
        }
    }

    private static String opt(String v) { return v.equals("-") ? null : v; }
}
