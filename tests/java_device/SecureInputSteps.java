// The Java device's secure-input ledger (SecureInputLedger) driven over standard input/output, for
// tests/test_secure_inputs_across_sdks.py. One command a line, one answer a line:
//   golden <file>       the digests of protocols/golden/secure_inputs.json's cases as this library
//                       computes them, the file a ledger writes for the golden "file" bindings, the
//                       refusal words and bounds: one canonical JSON line
//   open <folder>       a ledger kept in <folder>/secure_inputs.json          -> OK
//   release <key>       the release guard of one round carrying <key>           -> OK
//   switch <n>          the n-th guard released (from 0) is the one asked next  -> OK
//   masked <a,b,...>    its masked input, participants a, b, ...                -> OK | REFUSED <reason>
//   unmask <a,b,...>    its unmask answer, survivors a, b, ...                  -> OK | REFUSED <reason>
//   lost                why the ledger's file cannot be read                    -> LOST <why> | LOST none
import java.io.*;
import java.math.BigInteger;
import java.nio.charset.StandardCharsets;
import java.nio.file.*;
import java.util.*;
import org.fedfleet.device.SecureInputLedger;
import org.fedfleet.secagg.ReleaseGuard;
import org.fedfleet.wire.Envelope;
import org.fedfleet.wire.Json;

public final class SecureInputSteps {
    public static void main(String[] a) throws Exception {
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        PrintStream out = new PrintStream(System.out, true, "UTF-8");
        SecureInputLedger ledger = null;
        ReleaseGuard guard = null;
        List<ReleaseGuard> released = new ArrayList<>();        // two rounds of one input at once
        for (String line; (line = in.readLine()) != null; ) {
            String[] w = line.trim().split(" ", 2);
            String arg = w.length > 1 ? w[1] : "";
            switch (w[0]) {
                case "golden": out.println(new String(Json.canonical(golden(Paths.get(arg))), StandardCharsets.UTF_8)); break;
                case "open": ledger = new SecureInputLedger(new File(arg, SecureInputLedger.NAME)); out.println("OK"); break;
                case "release": guard = ledger.release(arg); released.add(guard); out.println("OK"); break;
                case "switch": guard = released.get(Integer.parseInt(arg)); out.println("OK"); break;
                case "masked": out.println(answer(guard.maskedInput(members(arg)))); break;
                case "unmask": out.println(answer(guard.unmask(members(arg)))); break;
                case "lost": out.println("LOST " + (ledger.lost() == null ? "none" : ledger.lost())); break;
                default: throw new IllegalArgumentException("unknown command " + w[0]);
            }
        }
    }

    private static String answer(String refusal) { return refusal == null ? "OK" : "REFUSED " + refusal; }

    private static Set<String> members(String commaSeparated) { return new HashSet<>(Arrays.asList(commaSeparated.split(","))); }

    @SuppressWarnings("unchecked")
    private static Map<String, Object> golden(Path file) throws Exception {
        Map<String, Object> doc = (Map<String, Object>) Json.parse(new String(Files.readAllBytes(file), StandardCharsets.UTF_8));
        List<Object> inputKeys = new ArrayList<>(), vectorKeys = new ArrayList<>(), memberDigests = new ArrayList<>();
        for (Object o : (List<Object>) doc.get("input_keys")) {
            Map<String, Object> c = (Map<String, Object>) o;
            List<Envelope.Tensor> tensors = new ArrayList<>();
            List<Object> listed = new ArrayList<>((List<Object>) c.get("tensors"));
            Collections.reverse(listed);                 // the key orders them itself
            for (Object t : listed) {
                Map<String, Object> m = (Map<String, Object>) t;
                List<Object> dims = (List<Object>) m.get("shape");
                long[] shape = new long[dims.size()];
                for (int i = 0; i < shape.length; i++) shape[i] = ((BigInteger) dims.get(i)).longValue();
                tensors.add(new Envelope.Tensor((String) m.get("name"), (String) m.get("dtype"), shape, Envelope.unhex((String) m.get("hex"))));
            }
            inputKeys.add(SecureInputLedger.inputKey((String) c.get("kind"), (Map<String, Object>) c.get("params"), tensors));
        }
        for (Object o : (List<Object>) doc.get("vector_keys")) {
            Map<String, Object> c = (Map<String, Object>) o;
            List<Object> values = (List<Object>) c.get("vector");
            double[] v = new double[values.size()];
            for (int i = 0; i < v.length; i++) v[i] = (Double) values.get(i);
            vectorKeys.add(SecureInputLedger.vectorKey((String) c.get("kind"), v));
        }
        List<Set<String>> sets = new ArrayList<>();
        for (Object o : (List<Object>) doc.get("member_digests")) {
            Set<String> set = new HashSet<>((List<String>) ((Map<String, Object>) o).get("members"));
            sets.add(set);
            memberDigests.add(SecureInputLedger.memberDigest(set));
        }
        Path folder = Files.createTempDirectory("secure-inputs");
        SecureInputLedger written = new SecureInputLedger(new File(folder.toFile(), SecureInputLedger.NAME));
        if (written.release((String) inputKeys.get(0)).maskedInput(sets.get(0)) != null
                || written.release((String) vectorKeys.get(0)).maskedInput(sets.get(1)) != null)
            throw new IllegalStateException("a fresh ledger refused an input");
        Path kept = folder.resolve(SecureInputLedger.NAME);
        Map<String, Object> result = new LinkedHashMap<>();
        result.put("input_keys", inputKeys);
        result.put("vector_keys", vectorKeys);
        result.put("member_digests", memberDigests);
        result.put("file", new String(Files.readAllBytes(kept), StandardCharsets.UTF_8));
        result.put("other_members", SecureInputLedger.OTHER_MEMBERS_REASON);
        result.put("lost", SecureInputLedger.LOST_REASON);
        result.put("max_inputs", SecureInputLedger.MAX_INPUTS);
        result.put("max_file_bytes", SecureInputLedger.MAX_FILE_BYTES);
        Files.delete(kept);
        Files.delete(folder);
        return result;
    }
}
