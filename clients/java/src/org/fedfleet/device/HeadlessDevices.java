// Runs one or more Java devices in one process (a Linux board, a gateway, the test suite): each
// answers fed3r.stats and fedavg.head over its precomputed features (and fed3r.secure, Fed3R-Sync,
// and fedavg.secure when it has an identity and the aggregator's key; oll.personalize when it is
// given a held-out split with --holdout; the stateful head tasks scaffold.head, ditto.head and
// pp.head when given a state folder with --state-dir, each device keeping its DeviceStateStore in
// <folder>/<id>, within --state-budget-mb MB each, default 16; its replay guard is kept there too:
// SessionMemoryFile, and the windows of samples its Fed3R answers covered: SampleWindows).
//
//   java -cp fedfleet-device.jar:<Debian jars> org.fedfleet.device.HeadlessDevices \
//        --broker mqtt://127.0.0.1:1883 [--root fedfleet] [--aggregator-key HEX] [--retry-after S] \
//        [--tick S] [--chunk-size BYTES] [--holdout ID HELD_OUT_FEATURES_FILE ...] [--state-dir DIR] \
//        [--state-budget-mb MB] [--stop-on-stdin-eof] --device ID FEATURES_FILE [SEED_HEX|-] [--device ...]
//   --secure-only: every task that would send a device's update or statistics in the clear is
//   declined (SecureOnly); its updates go only through the secure kinds (needs --aggregator-key and seeds).
//   ... --state-dir DIR --forget-state --device ID ...: removes each device's kept state (the
//   operator forgot the device; `fedfleet device --forget-state`), prints "FORGOT <id> <files>", exits.
//
// Runs until SIGTERM/SIGINT (a systemd service), or with --stop-on-stdin-eof until standard input
// closes (the tests). Prints "ONLINE <id>" once a device has announced itself, and "STATS <id>
// done=.. declined=.. accepted=.. reconnects=.. skipped=.. stopped=.." at exit, after each device
// said offline (stopped: tasks whose work stopped when their round was over, nothing sent).
package org.fedfleet.device;

import java.net.URI;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import org.fedfleet.wire.Envelope;

public final class HeadlessDevices {
    public static void main(String[] args) throws Exception {
        URI broker = null;
        boolean stdinStops = false;
        MqttAgent.Options base = new MqttAgent.Options();
        List<String[]> devices = new ArrayList<>();
        Map<String, String> holdout = new LinkedHashMap<>();
        java.io.File stateDir = null;
        long stateBudget = DeviceStateStore.DEFAULT_BUDGET_BYTES;
        boolean forgetState = false, secureOnly = false;
        for (int k = 0; k < args.length; k++) {
            switch (args[k]) {
                case "--broker": broker = new URI(args[++k]); break;
                case "--root": base.topics = new Topics(args[++k]); break;
                case "--aggregator-key": base.aggregatorKey = Envelope.unhex(args[++k]); break;
                case "--retry-after": base.retryAfterS = Double.parseDouble(args[++k]); break;
                case "--tick": base.tickS = Double.parseDouble(args[++k]); break;
                case "--chunk-size": base.chunkSize = Integer.parseInt(args[++k]); break;
                case "--device": devices.add(new String[] {args[++k], args[++k], args[++k]}); break;
                case "--holdout": holdout.put(args[++k], args[++k]); break;
                case "--state-dir": stateDir = new java.io.File(args[++k]); break;
                case "--state-budget-mb": stateBudget = (long) (Double.parseDouble(args[++k]) * (1 << 20)); break;
                case "--forget-state": forgetState = true; break;
                case "--secure-only": secureOnly = true; break;
                case "--stop-on-stdin-eof": stdinStops = true; break;
                default: throw new IllegalArgumentException("unknown argument " + args[k]);
            }
        }
        if (forgetState) {
            if (stateDir == null) throw new IllegalArgumentException("--forget-state needs --state-dir");
            for (String[] d : devices) {
                java.io.File folder = new java.io.File(stateDir, d[0]);
                System.out.println("FORGOT " + d[0] + " " + (folder.isDirectory() ? store(folder, stateBudget).forget() : 0));
            }
            return;
        }
        if (broker == null || devices.isEmpty()) throw new IllegalArgumentException("need --broker and at least one --device");
        if (secureOnly && (base.aggregatorKey == null || devices.stream().anyMatch(d -> d[2].equals("-"))))
            throw new IllegalArgumentException("--secure-only answers only secure rounds, which need --aggregator-key and each device's seed");
        List<MqttAgent> agents = new ArrayList<>();
        for (String[] d : devices) {
            FeatureFile data = FeatureFile.read(d[1]);
            Map<String, TaskHandler> handlers = new LinkedHashMap<>();
            DeviceStateStore state = stateDir == null ? null : store(new java.io.File(stateDir, d[0]), stateBudget);
            // the windows of samples Fed3R answered: in the device's state folder when it has one (without
            // one the device answers only windows of all its samples: SampleWindows, "unkept")
            SampleWindows windows = state == null ? new SampleWindows()
                    : new SampleWindows(new java.io.File(state.root(), SampleWindows.NAME), SampleWindows.MIN_DIFFERENCE);
            handlers.put(Fed3RStatsTask.KIND, new Fed3RStatsTask(data, new PrecomputedFeatures(data.dim),
                    Fed3RStatsTask.DEFAULT_MEMORY_BUDGET, windows));
            handlers.put(FedAvgHeadTask.KIND, new FedAvgHeadTask(data, new PrecomputedFeatures(data.dim)));
            if (holdout.containsKey(d[0]))
                handlers.put(PersonalizeTask.KIND, new PersonalizeTask(data, FeatureFile.read(holdout.get(d[0])), new PrecomputedFeatures(data.dim)));
            if (state != null) {
                FeatureFile heldOut = holdout.containsKey(d[0]) ? FeatureFile.read(holdout.get(d[0])) : null;
                handlers.put(ScaffoldTask.KIND, new ScaffoldTask(data, new PrecomputedFeatures(data.dim), state));
                handlers.put(DittoTask.KIND, new DittoTask(data, heldOut, new PrecomputedFeatures(data.dim), state));
                handlers.put(PartialTask.KIND, new PartialTask(data, heldOut, new PrecomputedFeatures(data.dim), state));
            }
            MqttAgent.Options o = copy(base);
            if (state != null) o.state = state;
            if (!d[2].equals("-")) {
                o.signer = Identity.fromSeed(d[0], Envelope.unhex(d[2]));
                if (o.aggregatorKey != null) {    // enrolled and trusting the aggregator: Fed3R-Sync and secure FedAvg too
                    o.secure.put(SecureFed3RTask.KIND, new SecureFed3RTask((Fed3RStatsTask) handlers.get(Fed3RStatsTask.KIND)));
                    o.secure.put(SecureFedAvgTask.KIND, new SecureFedAvgTask((FedAvgHeadTask) handlers.get(FedAvgHeadTask.KIND)));
                    if (stateDir != null) {     // and the stateful heads' secure kinds, over the same store
                        o.secure.put(SecureStatefulHeadTask.SCAFFOLD_KIND, SecureStatefulHeadTask.scaffold((ScaffoldTask) handlers.get(ScaffoldTask.KIND)));
                        o.secure.put(SecureStatefulHeadTask.DITTO_KIND, SecureStatefulHeadTask.ditto((DittoTask) handlers.get(DittoTask.KIND)));
                    }
                }
            }
            o.info.put("sdk", "java");
            agents.add(new MqttAgent(d[0], broker, secureOnly ? SecureOnly.apply(handlers) : handlers, o).start());
        }
        for (MqttAgent a : agents) {
            if (a.awaitConnected(30)) System.out.println("ONLINE " + a.deviceId);
            else System.out.println("NOT-ONLINE " + a.deviceId);
        }
        System.out.flush();
        Thread stop = new Thread(() -> stopAll(agents));
        if (!stdinStops) {
            Runtime.getRuntime().addShutdownHook(stop);
            Thread.currentThread().join();       // until SIGTERM / SIGINT runs the hook
        }
        while (System.in.read() != -1) { /* run until stdin closes */ }
        stopAll(agents);
        System.exit(0);
    }

    private static DeviceStateStore store(java.io.File folder, long budgetBytes) throws java.io.IOException {
        return new DeviceStateStore(folder, budgetBytes, () -> System.currentTimeMillis() / 1000.0);
    }

    private static void stopAll(List<MqttAgent> agents) {
        for (MqttAgent a : agents) {
            a.close();
            System.out.println("STATS " + a.deviceId + " done=" + a.tasksDone + " declined=" + a.tasksDeclined
                    + " accepted=" + a.acks.getOrDefault("accepted", 0) + " reconnects=" + a.reconnects
                    + " skipped=" + a.tasksSkipped + " stopped=" + a.tasksStopped);
        }
        System.out.flush();
    }

    private static MqttAgent.Options copy(MqttAgent.Options b) {
        MqttAgent.Options o = new MqttAgent.Options();
        o.topics = b.topics; o.aggregatorKey = b.aggregatorKey; o.retryAfterS = b.retryAfterS; o.tickS = b.tickS;
        o.chunkSize = b.chunkSize;
        return o;
    }
}
