// Runs the Java library's DeploymentFollower for tests/test_java_deployment.py until stdin closes.
// Usage: java FollowerRunner <broker mqtt://host:port> <device id> <topic root> <aggregator key hex | ->
//                            <slot dir> <held-out features file> [<local labels a,b,..>]
// Prints "READY" once started; on exit "REFUSALS <n>", "CURRENT <sha>|none" and "STOPPED <class>|-"
// (DeploymentFollower.stoppedBy). With FOLLOWER_FAILED_READS=N in the environment the first N reads
// of the held-out features fail (an application's store that is briefly unavailable), throwing what
// FOLLOWER_READ_FAILURE names: "io" (the default: an IOException), "assertion" (an application's
// AssertionError) or "internal" (an InternalError: the JVM in doubt). With FOLLOWER_FAILED_SIGNS=N
// the follower signs what it sends (a key of its own) with a signer whose first N calls throw an
// AssertionError (an application's signer).
import java.io.File;
import java.net.URI;
import java.util.Arrays;
import org.fedfleet.device.*;
import org.fedfleet.wire.Envelope;

public final class FollowerRunner {
    public static void main(String[] args) throws Exception {
        int[] local = args.length > 6 ? Arrays.stream(args[6].split(",")).mapToInt(Integer::parseInt).toArray() : null;
        ModelSlot slot = new ModelSlot(new File(args[4]), local);
        FeatureFile held = FeatureFile.read(args[5]);
        float[][] rows = new float[held.n][];
        int[] labels = new int[held.n];
        for (int i = 0; i < held.n; i++) { rows[i] = held.input(i); labels[i] = held.label(i); }
        DeploymentFollower.Options o = new DeploymentFollower.Options();
        o.topics = new Topics(args[2]);
        o.aggregatorKey = args[3].equals("-") ? null : Envelope.unhex(args[3]);
        o.retryS = 0.5;
        o.fetchTimeoutS = 20;
        String failing = System.getenv("FOLLOWER_FAILED_READS"), how = System.getenv("FOLLOWER_READ_FAILURE");
        int[] failuresLeft = {failing == null ? 0 : Integer.parseInt(failing)};
        String signs = System.getenv("FOLLOWER_FAILED_SIGNS");
        if (signs != null) {
            Identity identity = Identity.generate(args[1]);
            int[] signsLeft = {Integer.parseInt(signs)};
            o.signer = data -> {
                if (signsLeft[0]-- > 0) throw new AssertionError("the application's signer failed");
                return identity.sign(data);
            };
        }
        DeploymentFollower f = new DeploymentFollower(args[1], new URI(args[0]), slot, new DeploymentFollower.HeldOut() {
            @Override public float[][] features(String bundleSha256) throws java.io.IOException {
                if (failuresLeft[0]-- > 0) {
                    if ("assertion".equals(how)) throw new AssertionError("the application's held-out features failed");
                    if ("internal".equals(how)) throw new InternalError("the JVM's own error");
                    throw new java.io.IOException("held-out store unavailable");
                }
                return rows;
            }
            @Override public int[] labels() { return labels; }
        }, o).start();
        System.out.println("READY");
        System.out.flush();
        while (System.in.read() != -1) { }
        f.close();
        System.out.println("REFUSALS " + f.refusals.size());
        System.out.println("CURRENT " + (slot.current() == null ? "none" : slot.current().sha256));
        System.out.println("STOPPED " + (f.stoppedBy() == null ? "-" : f.stoppedBy().getClass().getName()));
    }
}
