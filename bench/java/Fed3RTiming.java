// Times the Java device's Fed3R statistics and SecAgg mask expansion for bench/java_device.py.
// Usage: java Fed3RTiming <features file> <num classes> <mask words> <repeats>
// Prints "STATS_MS <best of repeats>" and "MASK_MS <best>" (one PRG expansion of <mask words> words),
// in CPU time of this thread, which other load on a shared machine does not inflate.
import java.lang.management.ManagementFactory;
import java.lang.management.ThreadMXBean;
import java.util.*;
import org.fedfleet.device.*;
import org.fedfleet.secagg.Crypto;

public final class Fed3RTiming {
    public static void main(String[] a) throws Exception {
        FeatureFile data = FeatureFile.read(a[0]);
        int classes = Integer.parseInt(a[1]), words = Integer.parseInt(a[2]), repeats = Integer.parseInt(a[3]);
        ThreadMXBean cpu = ManagementFactory.getThreadMXBean();
        double best = Double.MAX_VALUE;
        for (int r = 0; r < repeats; r++) {        // the first runs warm the JIT up, as on a device after a few tasks
            long t0 = cpu.getCurrentThreadCpuTime();
            Fed3RAccumulator acc = new Fed3RAccumulator(classes, data.dim, true);
            for (int i = 0; i < data.size(); i++) acc.add(data.input(i), data.label(i));
            best = Math.min(best, (cpu.getCurrentThreadCpuTime() - t0) / 1e6);
        }
        System.out.println("STATS_MS " + best);
        byte[] seed = new byte[32];
        long[] target = new long[words];
        best = Double.MAX_VALUE;
        for (int r = 0; r < repeats; r++) {
            long t0 = cpu.getCurrentThreadCpuTime();
            Crypto.addMask(target, seed, 1);
            best = Math.min(best, (cpu.getCurrentThreadCpuTime() - t0) / 1e6);
        }
        System.out.println("MASK_MS " + best);
    }
}
