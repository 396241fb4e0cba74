// Runs the Java device's handler of a task message's kind (fedavg.head, fed3r.stats,
// oll.personalize) on a FeatureFile (and a held-out one), so the tests through tests/java_tasks.py
// (run_java_task) can compare its result with the Python device's on the same inputs.
// Usage: java TaskRunner <task.bin> <features file> <result.bin> [<held-out features file> [<state folder> [<budget bytes>]]]
//        (scaffold.head, ditto.head, pp.head: with a state folder, their DeviceStateStore; fed3r.stats:
//        its SampleWindows there; the held-out file "-" for none)
//        java TaskRunner --skellam <stddev> <count>   (prints "NOISE ...": Skellam draws, scale_bits 0)
//        java TaskRunner --sample-order <protocols/golden/sample_order.json>  (prints "ORDER <i> ok|differs")
//        java TaskRunner --windows <ledger file or "-"> <step>...  (one device's ledger through refusals,
//          records, restarts and the operator's repairs: windowsScript)
//        java TaskRunner --retask <task.bin> <features> <held-out features or "-"> <state folder> [<ledger file>]:
//          one device (SecureRounds over its SecAggSessions, its secure-input ledger kept in the file,
//          default in memory) given a scaffold.head.secure or ditto.head.secure task twice, its state
//          store's clock an hour later the second time; prints "START <opened> TRAINED <contributions
//          computed so far>" per delivery, or "DECLINED TRAINED <so far> <reason>" (retask)
//        java TaskRunner --noise-fails <task.bin> <features> <held-out features or "-"> <state folder>: a
//          ditto.head.secure task under DP whose noise source throws an AssertionError: "FAILED <it>"
//        java TaskRunner --leave <task.bin> <features> <held-out features or "-"> <state folder>: one device
//          (SecureRounds) given a scaffold.head.secure or ditto.head.secure task, run until an hour on, whose
//          round is then over before it finished (the agent's tick past its end); prints "START <opened>"
//          and "LEFT <rounds still open>" (leave)
//        java TaskRunner --batch <cases file> <aggregator public key hex> <device seed hex>: one JVM for
//          many cases (tests/test_differential_fuzz.py), each line of the file "<task.bin> <features>
//          <result.bin> [<held-out features>]"; each task's signature is verified under the aggregator's
//          key, each result signed as device "java0"; prints "CASE <i>" and then what a single run prints
//          (or "REFUSED <why>" for a task the codec refuses), per case. A secure kind's line is
//          "<task.bin> <features> <result> <round config JSON>" (runSecure). Each fed3r.stats and
//          fed3r.secure case is a fresh device with a kept sample-window ledger (freshWindows).
//        java TaskRunner --serve: one JVM for a test worker's single runs (tests/java_tasks.py java()):
//          each line of stdin is one run's arguments, tab-separated; each answer on stdout is
//          "OK <n>" or "FAILED <n>" and then n bytes (UTF-8) of what that run prints, or of its stack
//          trace. A JVM per run cost its start and warm-up, ~0.08 CPU-s a run (bench/java_task_runs.py),
//          ~90 runs a suite.
// fedavg.secure, fed3r.secure, scaffold.head.secure, ditto.head.secure: prints "VECTOR ..." (what the device would sum under SecAgg). Otherwise prints "DONE", with "STEPS <steps> LOSS <mean loss of the last epoch>" for fedavg.head, or
// "DECLINED <reason>"; for oll.personalize also the personalised head ("OLL_WEIGHT ...",
// "OLL_BIAS ...", float32 values) and the cross-validated accuracies ("CV ...").
import java.math.BigInteger;
import java.nio.file.*;
import java.util.*;
import org.fedfleet.device.*;
import org.fedfleet.secagg.RingVector;
import org.fedfleet.secagg.RoundConfig;
import org.fedfleet.secagg.SecAggException;
import org.fedfleet.wire.*;

public final class TaskRunner {
    public static void main(String[] args) throws Exception {
        if (args.length == 1 && args[0].equals("--serve")) {
            serve();
            return;
        }
        System.out.print(run(args));
    }

    /** --serve: one run per line of stdin (its arguments tab-separated), each answer framed by its
     *  byte count. What the library writes to System.out meanwhile goes to stderr: stdout carries
     *  the frames only. */
    static void serve() throws java.io.IOException {
        java.io.PrintStream frames = System.out;
        System.setOut(System.err);
        java.io.BufferedReader in = new java.io.BufferedReader(new java.io.InputStreamReader(System.in, "UTF-8"));
        for (String line; (line = in.readLine()) != null; ) {
            String status = "OK", text;
            try {
                text = run(line.split("\t", -1));
            } catch (Throwable e) {
                java.io.StringWriter trace = new java.io.StringWriter();
                e.printStackTrace(new java.io.PrintWriter(trace));
                status = "FAILED";
                text = trace.toString();
            }
            byte[] bytes = text.getBytes("UTF-8");
            frames.print(status + " " + bytes.length + "\n");
            frames.write(bytes, 0, bytes.length);
            frames.flush();
        }
    }

    /** One run (main's arguments): what it prints. */
    static String run(String[] args) throws Exception {
        if (args[0].equals("--skellam")) {        // draws of the DP noise on the integer grid
            DpRound dp = DpRound.of(Double.parseDouble(args[1]), 0);
            int count = Integer.parseInt(args[2]);
            StringBuilder out = new StringBuilder("NOISE");
            for (double x : new SkellamNoise().add(new double[count], dp, count)) out.append(' ').append((long) x);
            return out.append('\n').toString();
        }
        if (args[0].equals("--windows")) {        // one ledger through a script of steps (tests/test_sample_windows_closed.py)
            return windowsScript(args);
        }
        if (args[0].equals("--sample-order")) {
            StringBuilder out = new StringBuilder();
            List<?> cases = (List<?>) Json.parse(new String(Files.readAllBytes(Paths.get(args[1])), "UTF-8"));
            for (int i = 0; i < cases.size(); i++) {
                @SuppressWarnings("unchecked") Map<String, Object> c = (Map<String, Object>) cases.get(i);
                List<int[]> got = new ArrayList<>();
                for (int[] batch : LocalTraining.fromParams(c).batchSchedule(((BigInteger) c.get("rows")).intValue())) got.add(batch);
                List<?> want = (List<?>) c.get("batches");
                boolean same = got.size() == want.size();
                for (int b = 0; same && b < got.size(); b++) {
                    List<?> w = (List<?>) want.get(b);
                    same = w.size() == got.get(b).length;
                    for (int k = 0; same && k < w.size(); k++) same = ((BigInteger) w.get(k)).intValue() == got.get(b)[k];
                }
                out.append("ORDER ").append(i).append(same ? " ok" : " differs").append('\n');
            }
            return out.toString();
        }
        if (args[0].equals("--retask")) {
            return retask(args);
        }
        if (args[0].equals("--leave")) {
            return leave(args);
        }
        if (args[0].equals("--noise-fails")) {
            return noiseFails(args);
        }
        if (args[0].equals("--batch")) {
            byte[] aggregatorKey = Envelope.unhex(args[2]);
            Identity device = Identity.fromSeed("java0", Envelope.unhex(args[3]));
            List<String> lines = Files.readAllLines(Paths.get(args[1]));
            StringBuilder out = new StringBuilder();
            for (int i = 0; i < lines.size(); i++) {
                String[] c = lines.get(i).split(" ");
                out.append("CASE ").append(i).append('\n');
                Envelope.Message msg;
                try {
                    msg = Envelope.decode(Files.readAllBytes(Paths.get(c[0])), aggregatorKey, Envelope.MAX_MESSAGE_BYTES);
                } catch (Envelope.EnvelopeError e) {
                    out.append("REFUSED ").append(e.getMessage()).append('\n');
                    continue;
                }
                String kind = Messages.parseTask(msg).kind;
                boolean secure = kind.equals(SecureFedAvgTask.KIND) || kind.equals(SecureFed3RTask.KIND)
                        || kind.equals(SecureStatefulHeadTask.SCAFFOLD_KIND) || kind.equals(SecureStatefulHeadTask.DITTO_KIND);
                out.append(secure ? runSecure(msg, c) : runTask(msg, c, device));
            }
            return out.toString();
        }
        return runTask(Envelope.decode(Files.readAllBytes(Paths.get(args[0]))), args, null);
    }

    /** The handler of the task's kind on the features args[1] (held-out args[3]); the result goes
     *  to args[2], signed when a signer is given; returns what main prints. */
    static String runTask(Envelope.Message msg, String[] args, Envelope.Signer signer) throws Exception {
        StringBuilder printed = new StringBuilder();
        Messages.Task task = Messages.parseTask(msg);
        FeatureFile data = FeatureFile.read(args[1]);
        FedAvgHeadTask head = new FedAvgHeadTask(data, new PrecomputedFeatures(data.dim));
        Map<String, TaskHandler> handlers = new HashMap<>();
        handlers.put(FedAvgHeadTask.KIND, head);
        PersonalizeTask personalize = null;
        // the stateful head tasks, on a store kept across runs (none without a state folder: they decline)
        DeviceStateStore store = args.length > 4 ? new DeviceStateStore(new java.io.File(args[4]),
                args.length > 5 ? Long.parseLong(args[5]) : DeviceStateStore.DEFAULT_BUDGET_BYTES, () -> System.currentTimeMillis() / 1000.0) : null;
        // Fed3R's sample windows, kept in the state folder across runs as a device keeps them across restarts;
        // a batch's fed3r.stats case (signed) is a fresh device with a kept ledger (freshWindows)
        SampleWindows windows = store != null
                ? new SampleWindows(new java.io.File(store.root(), SampleWindows.NAME), SampleWindows.MIN_DIFFERENCE)
                : signer != null && task.kind.equals(Fed3RStatsTask.KIND) ? freshWindows() : new SampleWindows();
        handlers.put(Fed3RStatsTask.KIND, new Fed3RStatsTask(data, new PrecomputedFeatures(data.dim),
                Fed3RStatsTask.DEFAULT_MEMORY_BUDGET, windows));
        FeatureFile heldOut = args.length > 3 && !args[3].equals("-") ? FeatureFile.read(args[3]) : null;
        handlers.put(ScaffoldTask.KIND, new ScaffoldTask(data, new PrecomputedFeatures(data.dim), store));
        handlers.put(DittoTask.KIND, new DittoTask(data, heldOut, new PrecomputedFeatures(data.dim), store));
        handlers.put(PartialTask.KIND, new PartialTask(data, heldOut, new PrecomputedFeatures(data.dim), store));
        if (args.length == 4) {
            personalize = new PersonalizeTask(data, FeatureFile.read(args[3]), new PrecomputedFeatures(data.dim));
            handlers.put(PersonalizeTask.KIND, personalize);
        }
        try {
            Map<String, SecureTask> secure = new HashMap<>();
            secure.put(SecureFedAvgTask.KIND, new SecureFedAvgTask(head));
            secure.put(SecureFed3RTask.KIND, new SecureFed3RTask((Fed3RStatsTask) handlers.get(Fed3RStatsTask.KIND)));
            secure.put(SecureStatefulHeadTask.SCAFFOLD_KIND, SecureStatefulHeadTask.scaffold((ScaffoldTask) handlers.get(ScaffoldTask.KIND)));
            secure.put(SecureStatefulHeadTask.DITTO_KIND, SecureStatefulHeadTask.ditto((DittoTask) handlers.get(DittoTask.KIND)));
            if (secure.containsKey(task.kind)) {      // the vector it would mask
                StringBuilder v = new StringBuilder("VECTOR");
                for (double x : secure.get(task.kind).contribute(task.params, msg.tensors).vector) v.append(' ').append(x);
                return v.append('\n').toString();
            }
            TaskHandler.Result r = handlers.get(task.kind).run(task.params, msg.tensors);
            Files.write(Paths.get(args[2]), Envelope.encode(
                    Messages.result("java0", task.ref, task.kind, r.body, Messages.newId(), Messages.now()), r.tensors, signer));
            printed.append("DONE\n");
            if (head.last != null) printed.append("STEPS " + head.last.steps + " LOSS " + head.last.meanLoss + "\n");
            if (personalize != null && personalize.head != null) {
                printed.append(line("OLL_WEIGHT", personalize.head.weight())).append('\n');
                printed.append(line("OLL_BIAS", personalize.head.bias())).append('\n');
                StringBuilder cv = new StringBuilder("CV");
                if (personalize.lastChoice != null) for (double s : personalize.lastChoice.scores) cv.append(' ').append(s);
                printed.append(cv).append('\n');
            }
        } catch (TaskDeclined e) {
            printed.append("DECLINED " + e.getMessage() + "\n");
        }
        return printed.toString();
    }

    /** --windows FILE STEP...: one SampleWindows on FILE (a running device; "-": none, a device without a
     *  state folder), through steps each printed as a line: "refusal:S:E:N" and "record:S:E:N" (what it
     *  says: "OK" or the reason), "write:TEXT" (the operator writes the file), "move" (the operator moves
     *  it aside), "restart" (the device restarted: a fresh SampleWindows on the file;
     *  tests/test_sample_windows_fuzz.py). */
    static String windowsScript(String[] args) throws Exception {
        java.io.File file = args[1].equals("-") ? null : new java.io.File(args[1]);
        SampleWindows windows = startedLedger(file);
        StringBuilder out = new StringBuilder();
        for (int i = 2; i < args.length; i++) {
            String[] step = args[i].split(":", 2);
            if (step[0].equals("restart")) {
                windows = startedLedger(file);
            } else if (step[0].equals("write")) {
                Files.write(file.toPath(), step[1].getBytes("UTF-8"));
            } else if (step[0].equals("move")) {
                Files.move(file.toPath(), Paths.get(file.getPath() + ".damaged"));
            } else {
                String[] w = step[1].split(":");
                long s = Long.parseLong(w[0]), e = Long.parseLong(w[1]), n = Long.parseLong(w[2]);
                String said = step[0].equals("record") ? windows.record(s, e, n) : windows.refusal(s, e, n);
                out.append(said == null ? "OK" : said).append('\n');
            }
        }
        return out.toString();
    }

    /** The ledger a device builds at start: kept in file, or none (null: no state folder). */
    static SampleWindows startedLedger(java.io.File file) {
        return file == null ? new SampleWindows() : new SampleWindows(file, SampleWindows.MIN_DIFFERENCE);
    }

    /** A fresh device's kept sample windows, one per fed3r.stats or fed3r.secure case (tests/fuzz_device.py
     *  fresh_windows): without a state folder a device answers only all its samples, so a case's cap or
     *  from_sample would be declined by every device alike and compared nowhere
     *  (tests/test_fuzz_capped_fed3r.py, tests/fuzz_windows.py). Removed when the JVM ends. */
    static SampleWindows freshWindows() throws java.io.IOException {
        java.io.File folder = Files.createTempDirectory("fuzz-sample-windows-").toFile();
        java.io.File file = new java.io.File(folder, SampleWindows.NAME);
        folder.deleteOnExit();          // deleted in the reverse order: the file, then its folder
        file.deleteOnExit();
        return new SampleWindows(file, SampleWindows.MIN_DIFFERENCE);
    }

    /** --retask: a secure stateful task delivered twice to one device while its round is live (the
     *  aggregator re-sent it): the second is a duplicate and computes nothing; with args[5], the
     *  device's ledger file (an unreadable one declines both) (tests/test_java_stateful.py). */
    static String retask(String[] args) throws Exception {
        Envelope.Message msg = Envelope.decode(Files.readAllBytes(Paths.get(args[1])));
        Messages.Task task = Messages.parseTask(msg);
        FeatureFile data = FeatureFile.read(args[2]);
        FeatureFile heldOut = args[3].equals("-") ? null : FeatureFile.read(args[3]);
        double[] now = {1.7e9};
        DeviceStateStore store = new DeviceStateStore(new java.io.File(args[4]), DeviceStateStore.DEFAULT_BUDGET_BYTES, () -> now[0]);
        SecureTask training = task.kind.equals(SecureStatefulHeadTask.SCAFFOLD_KIND)
                ? SecureStatefulHeadTask.scaffold(new ScaffoldTask(data, new PrecomputedFeatures(data.dim), store))
                : SecureStatefulHeadTask.ditto(new DittoTask(data, heldOut, new PrecomputedFeatures(data.dim), store), zeroNoise());
        int[] trained = {0};
        SecureTask counted = (params, tensors) -> { trained[0]++; return training.contribute(params, tensors); };
        SecureInputLedger ledger = new SecureInputLedger(args.length > 5 ? new java.io.File(args[5]) : null);
        SecureRounds device = new SecureRounds("java0", Identity.fromSeed("java0", new byte[32]), new byte[32],
                new org.fedfleet.secagg.SecAggSessions("java0", 4), ledger);
        StringBuilder out = new StringBuilder();
        for (int delivery = 0; delivery < 2; delivery++, now[0] += 3600) {
            try {
                boolean opened = device.start(task.ref, task.kind, task.params, msg.tensors, counted);
                out.append("START ").append(opened).append(" TRAINED ").append(trained[0]).append('\n');
            } catch (TaskDeclined declined) {
                out.append("DECLINED TRAINED ").append(trained[0]).append(' ').append(declined.getMessage()).append('\n');
            }
        }
        return out.toString();
    }

    /** --leave: a secure stateful task whose SecAgg round ends at its deadline, never finished here
     *  (tests/test_java_stateful.py: Scaffold's c_k goes back to the round's start, Ditto's v_k stays). */
    static String leave(String[] args) throws Exception {
        Envelope.Message msg = Envelope.decode(Files.readAllBytes(Paths.get(args[1])));
        Messages.Task task = Messages.parseTask(msg);
        FeatureFile data = FeatureFile.read(args[2]);
        FeatureFile heldOut = args[3].equals("-") ? null : FeatureFile.read(args[3]);
        double now = System.currentTimeMillis() / 1000.0;      // the training checks its deadline on the wall clock
        DeviceStateStore store = new DeviceStateStore(new java.io.File(args[4]), DeviceStateStore.DEFAULT_BUDGET_BYTES, () -> now);
        SecureTask training = task.kind.equals(SecureStatefulHeadTask.SCAFFOLD_KIND)
                ? SecureStatefulHeadTask.scaffold(new ScaffoldTask(data, new PrecomputedFeatures(data.dim), store))
                : SecureStatefulHeadTask.ditto(new DittoTask(data, heldOut, new PrecomputedFeatures(data.dim), store), zeroNoise());
        org.fedfleet.secagg.SecAggSessions sessions = new org.fedfleet.secagg.SecAggSessions("java0", 4, () -> now);
        SecureRounds device = new SecureRounds("java0", Identity.fromSeed("java0", new byte[32]), new byte[32],
                sessions, new SecureInputLedger(null));
        boolean opened;
        WorkDeadline.Scope until = WorkDeadline.until(now + 3600);
        try {
            opened = device.start(task.ref, task.kind, task.params, msg.tensors, training);
        } finally {
            until.close();
        }
        sessions.expire(now + 3601);
        return "START " + opened + "\nLEFT " + sessions.open() + "\n";
    }

    /** --noise-fails: a ditto.head.secure task under distributed DP whose noise source throws an
     *  Error (an AssertionError) after the plain handler kept the round's v_k: prints "FAILED <it>"
     *  (the agent declines the task and goes on: MqttAgent.endsTheLoop), the state folder left as
     *  the device left it (tests/test_java_stateful.py). */
    static String noiseFails(String[] args) throws Exception {
        Envelope.Message msg = Envelope.decode(Files.readAllBytes(Paths.get(args[1])));
        Messages.Task task = Messages.parseTask(msg);
        FeatureFile data = FeatureFile.read(args[2]);
        FeatureFile heldOut = args[3].equals("-") ? null : FeatureFile.read(args[3]);
        DeviceStateStore store = new DeviceStateStore(new java.io.File(args[4]), DeviceStateStore.DEFAULT_BUDGET_BYTES,
                () -> System.currentTimeMillis() / 1000.0);
        java.lang.reflect.Constructor<SkellamNoise> make = SkellamNoise.class.getDeclaredConstructor(Random.class);
        make.setAccessible(true);
        SkellamNoise failing = make.newInstance(new Random() {
            @Override public double nextDouble() { throw new AssertionError("the noise source failed"); }
        });
        SecureTask training = SecureStatefulHeadTask.ditto(new DittoTask(data, heldOut, new PrecomputedFeatures(data.dim), store), failing);
        try {
            training.contribute(task.params, msg.tensors);
            return "CONTRIBUTED\n";
        } catch (TaskDeclined declined) {
            return "DECLINED " + declined.getMessage() + "\n";
        } catch (Throwable e) {
            return "FAILED " + e + "\n";
        }
    }

    /** A secure kind in the batch (args: task, features, result, round config JSON[, held-out
     *  features or "-", state folder] for scaffold.head.secure and ditto.head.secure): the vector the
     *  device would mask (float64 LE to result + ".vector") and the words SecAgg masks, its fixed-point
     *  encoding under the round's config (its ring's words, uint64 or uint32 LE, to result); prints "DONE" (with "STEPS" for
     *  fedavg.secure), "DECLINED <why>" (the task refused) or "OUT_OF_RANGE <why>" (the encoder refused
     *  the vector at the round's start). Distributed DP's noise is drawn as zero (zeroNoise). */
    static String runSecure(Envelope.Message msg, String[] args) throws Exception {
        Messages.Task task = Messages.parseTask(msg);
        FeatureFile data = FeatureFile.read(args[1]);
        FedAvgHeadTask head = new FedAvgHeadTask(data, new PrecomputedFeatures(data.dim));
        SecureTask secure;
        if (task.kind.equals(SecureStatefulHeadTask.SCAFFOLD_KIND) || task.kind.equals(SecureStatefulHeadTask.DITTO_KIND)) {
            // args[4]: held-out features ("-": none), args[5]: the case's state folder
            DeviceStateStore store = new DeviceStateStore(new java.io.File(args[5]), DeviceStateStore.DEFAULT_BUDGET_BYTES,
                    () -> System.currentTimeMillis() / 1000.0);
            FeatureFile heldOut = args[4].equals("-") ? null : FeatureFile.read(args[4]);
            secure = task.kind.equals(SecureStatefulHeadTask.SCAFFOLD_KIND)
                    ? SecureStatefulHeadTask.scaffold(new ScaffoldTask(data, new PrecomputedFeatures(data.dim), store))
                    : SecureStatefulHeadTask.ditto(new DittoTask(data, heldOut, new PrecomputedFeatures(data.dim), store), zeroNoise());
        } else {
            secure = task.kind.equals(SecureFedAvgTask.KIND) ? new SecureFedAvgTask(head, zeroNoise())
                    : new SecureFed3RTask(new Fed3RStatsTask(data, new PrecomputedFeatures(data.dim),
                            Fed3RStatsTask.DEFAULT_MEMORY_BUDGET, freshWindows()), zeroNoise());
        }
        double[] v;
        try {
            v = secure.contribute(task.params, msg.tensors).vector;
        } catch (TaskDeclined e) {
            return "DECLINED " + e.getMessage() + "\n";
        }
        String steps = head.last != null ? "STEPS " + head.last.steps + "\n" : "";
        java.nio.ByteBuffer raw = java.nio.ByteBuffer.allocate(8 * v.length).order(java.nio.ByteOrder.LITTLE_ENDIAN);
        for (double x : v) raw.putDouble(x);
        Files.write(Paths.get(args[2] + ".vector"), raw.array());
        RingVector words;
        try {
            RoundConfig config = RoundConfig.fromMap(Json.parse(new String(Files.readAllBytes(Paths.get(args[3])), "UTF-8")));
            words = config.encode(v);
        } catch (SecAggException e) {
            return "OUT_OF_RANGE " + e.getMessage() + "\n" + steps;
        }
        Files.write(Paths.get(args[2]), words.toLittleEndian());
        return "DONE\n" + steps;
    }

    /** Distributed DP's Skellam noise drawn as zero, so the vector is the device's rounding to the
     *  round's grid alone (the draws are checked by --skellam): a Random whose every double is 0.3
     *  gives both Poisson draws of an entry the same value (the multiplication method is deterministic;
     *  PTRS accepts its first candidate, u = -0.2, v = 0.3 <= v_r for every μ >= 10). */
    static SkellamNoise zeroNoise() throws Exception {
        java.lang.reflect.Constructor<SkellamNoise> make = SkellamNoise.class.getDeclaredConstructor(Random.class);
        make.setAccessible(true);
        return make.newInstance(new Random() {
            @Override public double nextDouble() { return 0.3; }
        });
    }

    static String line(String tag, float[] values) {
        StringBuilder s = new StringBuilder(tag);
        for (float v : values) s.append(' ').append(v);
        return s.toString();
    }
}
