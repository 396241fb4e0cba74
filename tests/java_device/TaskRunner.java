// Runs the Java device's handler of a task message's kind (fedavg.head, fed3r.stats,
// oll.personalize) on a FeatureFile (and a held-out one), so tests/test_java_tasks.py can compare
// its result with the Python device's on the same inputs.
// Usage: java TaskRunner <task.bin> <features file> <result.bin> [<held-out features file>]
//        java TaskRunner --skellam <stddev> <count>   (prints "NOISE ...": Skellam draws, scale_bits 0)
//        java TaskRunner --sample-order <protocols/golden/sample_order.json>  (prints "ORDER <i> ok|differs")
// fedavg.secure, fed3r.secure: prints "VECTOR ..." (what the device would sum under SecAgg). Otherwise prints "DONE", with "STEPS <steps> LOSS <mean loss of the last epoch>" for fedavg.head, or
// "DECLINED <reason>"; for oll.personalize also the personalised head ("OLL_WEIGHT ...",
// "OLL_BIAS ...", float32 values) and the cross-validated accuracies ("CV ...").
import java.math.BigInteger;
import java.nio.file.*;
import java.util.*;
import org.fedfleet.device.*;
import org.fedfleet.wire.*;

public final class TaskRunner {
    public static void main(String[] args) throws Exception {
        if (args[0].equals("--skellam")) {        // draws of the DP noise on the integer grid
            Map<String, Object> dp = new LinkedHashMap<>();
            dp.put("stddev", Double.parseDouble(args[1]));
            dp.put("scale_bits", BigInteger.ZERO);
            int count = Integer.parseInt(args[2]);
            StringBuilder out = new StringBuilder("NOISE");
            for (double x : new SkellamNoise().add(new double[count], dp, count)) out.append(' ').append((long) x);
            System.out.println(out);
            return;
        }
        if (args[0].equals("--sample-order")) {
            List<?> cases = (List<?>) Json.parse(new String(Files.readAllBytes(Paths.get(args[1])), "UTF-8"));
            for (int i = 0; i < cases.size(); i++) {
                @SuppressWarnings("unchecked") Map<String, Object> c = (Map<String, Object>) cases.get(i);
                List<int[]> got = LocalTraining.fromParams(c).batchSchedule(((BigInteger) c.get("rows")).intValue());
                List<?> want = (List<?>) c.get("batches");
                boolean same = got.size() == want.size();
                for (int b = 0; same && b < got.size(); b++) {
                    List<?> w = (List<?>) want.get(b);
                    same = w.size() == got.get(b).length;
                    for (int k = 0; same && k < w.size(); k++) same = ((BigInteger) w.get(k)).intValue() == got.get(b)[k];
                }
                System.out.println("ORDER " + i + (same ? " ok" : " differs"));
            }
            return;
        }
        Envelope.Message msg = Envelope.decode(Files.readAllBytes(Paths.get(args[0])));
        Messages.Task task = Messages.parseTask(msg);
        FeatureFile data = FeatureFile.read(args[1]);
        FedAvgHeadTask head = new FedAvgHeadTask(data, new PrecomputedFeatures(data.dim));
        Map<String, TaskHandler> handlers = new HashMap<>();
        handlers.put(FedAvgHeadTask.KIND, head);
        handlers.put(Fed3RStatsTask.KIND, new Fed3RStatsTask(data, new PrecomputedFeatures(data.dim)));
        PersonalizeTask personalize = null;
        if (args.length > 3) {
            personalize = new PersonalizeTask(data, FeatureFile.read(args[3]), new PrecomputedFeatures(data.dim));
            handlers.put(PersonalizeTask.KIND, personalize);
        }
        try {
            Map<String, SecureTask> secure = new HashMap<>();
            secure.put(SecureFedAvgTask.KIND, new SecureFedAvgTask(head));
            secure.put(SecureFed3RTask.KIND, new SecureFed3RTask((Fed3RStatsTask) handlers.get(Fed3RStatsTask.KIND)));
            if (secure.containsKey(task.kind)) {      // the vector it would mask
                StringBuilder v = new StringBuilder("VECTOR");
                for (double x : secure.get(task.kind).vector(task.params, msg.tensors)) v.append(' ').append(x);
                System.out.println(v);
                return;
            }
            TaskHandler.Result r = handlers.get(task.kind).run(task.params, msg.tensors);
            Files.write(Paths.get(args[2]), Envelope.encode(
                    Messages.result("java0", task.ref, task.kind, r.body, Messages.newId(), Messages.now()), r.tensors, null));
            System.out.println("DONE");
            if (head.last != null) System.out.println("STEPS " + head.last.steps + " LOSS " + head.last.meanLoss);
            if (personalize != null && personalize.head != null) {
                System.out.println(line("OLL_WEIGHT", personalize.head.weight()));
                System.out.println(line("OLL_BIAS", personalize.head.bias()));
                StringBuilder cv = new StringBuilder("CV");
                if (personalize.lastChoice != null) for (double s : personalize.lastChoice.scores) cv.append(' ').append(s);
                System.out.println(cv);
            }
        } catch (TaskDeclined e) {
            System.out.println("DECLINED " + e.getMessage());
        }
    }

    static String line(String tag, float[] values) {
        StringBuilder s = new StringBuilder(tag);
        for (float v : values) s.append(' ').append(v);
        return s.toString();
    }
}
