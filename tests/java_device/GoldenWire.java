// Writes what the Java device library puts on the wire for the golden vectors' content, so
// tests/test_java_device.py can compare the bytes with protocols/golden/:
//   result_fed3r_stats.bin      the fed3r.stats result of the golden task over the golden features
//   presence_online.bin         the device's presence
//   chunk_<i>_of_result.bin     chunked_whole.bin cut into 200-byte chunks
//   result_signed_edge_cases.bin  the signed vector re-signed by the library's Identity
//   result_fed3r_increment.bin  a streaming fed3r.stats task (from_sample 3) over 3 older + the golden samples
//   result_fed3r_factor.bin, result_fed3r_factor_zero_columns.bin, result_fed3r_factor_signed_zero.bin  the exact factor form of the
//                               golden task (with "factor": true) over the two samples each vector holds
//   result_fedavg_head.bin, result_fedavg_async.bin  the fedavg.head update format (golden head values,
//                               the async task's model_version echoed)
// Usage: java GoldenWire <golden dir> <features file> <out dir>
import java.math.BigInteger;
import java.nio.file.*;
import java.util.*;
import org.fedfleet.device.*;
import org.fedfleet.wire.*;

public final class GoldenWire {
    static final double TS = 1767225600.0;

    public static void main(String[] args) throws Exception {
        Path golden = Paths.get(args[0]), out = Paths.get(args[2]);
        FeatureFile features = FeatureFile.read(args[1]);

        Envelope.Message taskMsg = Envelope.decode(Files.readAllBytes(golden.resolve("task_fed3r.bin")));
        Messages.Task task = Messages.parseTask(taskMsg);
        TaskHandler.Result r = new Fed3RStatsTask(features, new PrecomputedFeatures(features.dim)).run(task.params, taskMsg.tensors);
        write(out, "result_fed3r_stats", Envelope.encode(
                Messages.result("dev0001", task.ref, task.kind, r.body, rep("11"), TS + 5), r.tensors, null));

        // streaming: the device holds 3 samples the job already has, then the golden ones (an
        // increment of 3: these bytes check the encoding, so its sample-window rule is the smallest, 1,
        // kept in a file under the out dir: a device without a state folder answers no increment)
        Map<String, Object> incrementParams = new LinkedHashMap<>(task.params);
        incrementParams.put("from_sample", BigInteger.valueOf(3));
        SampleWindows windows = new SampleWindows(out.resolve("golden_" + SampleWindows.NAME).toFile(), 1);
        TaskHandler.Result inc = new Fed3RStatsTask(new AfterOlderSamples(features, 3), new PrecomputedFeatures(features.dim),
                Fed3RStatsTask.DEFAULT_MEMORY_BUDGET, windows).run(incrementParams, taskMsg.tensors);
        write(out, "result_fed3r_increment", Envelope.encode(Messages.result("dev0001",
                new TaskRef(task.ref.job, 2, task.ref.task), task.kind, inc.body, rep("c2"), TS + 5), inc.tensors, null));

        // the factor form: Z = R, Q = I (class 0 then class 2); and a zero and a dependent column
        Map<String, Object> factorParams = new LinkedHashMap<>(task.params);
        factorParams.put("factor", Boolean.TRUE);
        // and one whose QtY holds a zero the pivot's sign flip makes -0.0: sent as +0.0
        float[][][] factorRows = {{{2f, 1f, 0.5f}, {0f, 1.5f, 0.25f}}, {{2f, 0f, 1f, 0.5f}, {0f, 0f, 0f, 1.5f}},
                {{0f, 1f}, {0.5f, 1f}}};
        String[][] factorVectors = {{"result_fed3r_factor", "dev0002", "12"}, {"result_fed3r_factor_zero_columns", "dev0003", "13"},
                {"result_fed3r_factor_signed_zero", "dev0004", "14"}};
        for (int k = 0; k < factorRows.length; k++) {
            LocalData rows = new Rows(factorRows[k], new int[] {0, 2});
            TaskHandler.Result f = new Fed3RStatsTask(rows, new PrecomputedFeatures(factorRows[k][0].length)).run(factorParams, taskMsg.tensors);
            write(out, factorVectors[k][0], Envelope.encode(Messages.result(factorVectors[k][1], task.ref, task.kind, f.body,
                    rep(factorVectors[k][2]), TS + 5), f.tensors, null));
        }

        for (String[] v : new String[][] {{"task_fedavg_head", "result_fedavg_head", "77"}, {"task_fedavg_async", "result_fedavg_async", "c1"}}) {
            Envelope.Message headMsg = Envelope.decode(Files.readAllBytes(golden.resolve(v[0] + ".bin")));
            Messages.Task headTask = Messages.parseTask(headMsg);
            float[] w = floats(tensor(headMsg, "weight")), b = floats(tensor(headMsg, "bias"));
            for (int k = 0; k < w.length; k++) w[k] *= 0.5f;           // the golden update: weight * 0.5, bias + 0.25
            for (int k = 0; k < b.length; k++) b[k] += 0.25f;
            Object version = headTask.params.get("model_version");
            TaskHandler.Result head = FedAvgHeadTask.encode(w, b, b.length, w.length / b.length, 40,
                    version == null ? null : ((BigInteger) version).longValue());
            write(out, v[1], Envelope.encode(Messages.result("dev0001", headTask.ref, headTask.kind, head.body, rep(v[2]), TS + 5),
                    head.tensors, null));
        }

        Map<String, Object> info = new LinkedHashMap<>();
        info.put("kinds", new ArrayList<Object>(Collections.singletonList("fed3r.stats")));
        write(out, "presence_online", Envelope.encode(Messages.presence("dev0001", true, info, rep("33"), TS),
                Collections.<Envelope.Tensor>emptyList(), null));

        byte[] whole = Files.readAllBytes(golden.resolve("chunked_whole.bin"));
        List<byte[]> chunks = new Chunker(200, null).split(whole, rep("44"), "dev0001", new Chunker.Stamps() {
            @Override public String id(int index) { return rep(String.format("%02x", index + 0x55)); }
            @Override public double ts() { return TS + 7; }
        });
        for (int i = 0; i < chunks.size(); i++) write(out, "chunk_" + i + "_of_result", chunks.get(i));

        byte[] seed = new byte[32];
        for (int i = 0; i < 32; i++) seed[i] = (byte) i;
        Identity id = Identity.fromSeed("dev0001", seed);
        Envelope.Message signed = Envelope.decode(Files.readAllBytes(golden.resolve("result_signed_edge_cases.bin")));
        write(out, "result_signed_edge_cases", Envelope.encode(signed.header, signed.tensors, id));
        System.out.println("PUBLIC_KEY " + Envelope.hex(id.publicKey()));

        String[] ack = Messages.parseAck(Envelope.decode(Files.readAllBytes(golden.resolve("ack_accepted.bin"))));
        System.out.println("ACK " + ack[0] + " " + ack[1]);
        System.out.println("TASK " + task.ref + " " + task.kind + " " + new BigInteger(String.valueOf((long) task.deadline)));
    }

    /** `older` zero-feature samples of class 0, then the samples of `data`. */
    static final class AfterOlderSamples implements LocalData {
        final FeatureFile data;
        final int older;
        AfterOlderSamples(FeatureFile data, int older) { this.data = data; this.older = older; }
        @Override public int size() { return older + data.size(); }
        @Override public float[] input(int i) { return i < older ? new float[data.dim] : data.input(i - older); }
        @Override public int label(int i) { return i < older ? 0 : data.label(i - older); }
    }

    static final class Rows implements LocalData {
        final float[][] rows;
        final int[] labels;
        Rows(float[][] rows, int[] labels) { this.rows = rows; this.labels = labels; }
        @Override public int size() { return rows.length; }
        @Override public float[] input(int i) { return rows[i]; }
        @Override public int label(int i) { return labels[i]; }
    }

    static Envelope.Tensor tensor(Envelope.Message m, String name) {
        for (Envelope.Tensor t : m.tensors) if (t.name.equals(name)) return t;
        throw new IllegalArgumentException("no tensor " + name);
    }

    static float[] floats(Envelope.Tensor t) throws Exception {
        double[] d = Tensors.doubles(t);
        float[] f = new float[d.length];
        for (int k = 0; k < d.length; k++) f[k] = (float) d[k];
        return f;
    }

    static String rep(String two) {
        StringBuilder s = new StringBuilder();
        for (int i = 0; i < 16; i++) s.append(two);
        return s.toString();
    }

    static void write(Path out, String name, byte[] data) throws Exception {
        Files.write(out.resolve(name + ".bin"), data);
    }
}
