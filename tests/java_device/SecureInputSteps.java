// The Java device's secure-input ledger (SecureInputLedger) driven over standard input/output, for
// tests/test_secure_inputs_across_sdks.py. One command a line, one answer a line:
//   golden <file>       the digests of protocols/golden/secure_inputs.json's cases as this library
//                       computes them, the file a ledger writes for the golden "file" bindings, the
//                       refusal words and bounds, the forgotten-inputs filter's positions and the
//                       file a ledger writes once it forgot the first case's key: one canonical JSON line
//   open <folder>       a ledger kept in <folder>/secure_inputs.json          -> OK
//   release <key>       the release guard of one round carrying <key>           -> OK
//   switch <n>          the n-th guard released (from 0) is the one asked next  -> OK
//   masked <a,b,...>    its masked input, participants a, b, ...                -> OK | REFUSED <reason>
//   unmask <a,b,...>    its unmask answer, survivors a, b, ...                  -> OK | REFUSED <reason>
//   push <n> <prefix>   n other inputs kept over a, b, c: keys the first 32 hex digits of SHA-256 of
//                       "<prefix> <i>", i = 0 .. n-1 (the oldest pushed out)   -> OK | REFUSED <reason>
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
                case "push": {
                    String[] np = arg.split(" ", 2);
                    out.println(answer(push(ledger, Integer.parseInt(np[0]), np[1], members("a,b,c"))));
                    break;
                }
                case "lost": out.println("LOST " + (ledger.lost() == null ? "none" : ledger.lost())); break;
                default: throw new IllegalArgumentException("unknown command " + w[0]);
            }
        }
    }

    /** Keeps n inputs named "prefix i" over members: the first refusal, or null. */
    static String push(SecureInputLedger ledger, int n, String prefix, Set<String> members) throws Exception {
        for (int i = 0; i < n; i++) {
            String refusal = ledger.release(sha256Of((prefix + " " + i).getBytes(StandardCharsets.UTF_8)).substring(0, 32)).maskedInput(members);
            if (refusal != null) return refusal;
        }
        return null;
    }

    private static String sha256Of(byte[] data) throws Exception {
        return String.format("%064x", new BigInteger(1, java.security.MessageDigest.getInstance("SHA-256").digest(data)));
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
        result.put("forgotten", SecureInputLedger.FORGOTTEN_REASON);
        Files.delete(kept);
        Map<String, Object> filter = (Map<String, Object>) doc.get("forgotten");
        List<Object> positions = new ArrayList<>();
        for (Object o : (List<Object>) filter.get("cases")) {
            List<Object> p = new ArrayList<>();
            for (int q : SecureInputLedger.forgottenPositions((String) ((Map<String, Object>) o).get("key"))) p.add(q);
            positions.add(p);
        }
        result.put("forgotten_positions", positions);
        String first = (String) ((Map<String, Object>) ((List<Object>) filter.get("cases")).get(0)).get("key");
        SecureInputLedger forgetting = new SecureInputLedger(kept.toFile());
        if (forgetting.release(first).maskedInput(sets.get(0)) != null
                || push(forgetting, ((BigInteger) filter.get("pushed")).intValue(), "push", sets.get(1)) != null)
            throw new IllegalStateException("a fresh ledger refused an input");
        byte[] forgottenFile = Files.readAllBytes(kept);
        result.put("forgotten_file_sha256", sha256Of(forgottenFile));
        byte[] bits = Base64.getDecoder().decode((String) ((Map<String, Object>) Json.parse(new String(forgottenFile, StandardCharsets.UTF_8))).get("forgotten"));
        List<Object> nonzero = new ArrayList<>();
        for (int i = 0; i < bits.length; i++) if (bits[i] != 0) nonzero.add(Arrays.<Object>asList(i, bits[i] & 0xff));
        result.put("forgotten_bytes", nonzero);
        result.put("forgotten_file_refuses_it", forgetting.release(first).maskedInput(sets.get(0)));
        Files.delete(kept);
        Files.delete(folder);
        return result;
    }
}
