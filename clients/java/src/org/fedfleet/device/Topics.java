// MQTT topics of docs/protocol.md "Transport" under a root (default "fedfleet").
package org.fedfleet.device;

import java.util.regex.Pattern;

public final class Topics {
    public static final String AGGREGATOR_ID = "aggregator";
    private static final Pattern DEVICE_ID = Pattern.compile("[A-Za-z0-9_.-]{1,64}");
    /** protocols/topics.py TOPIC_ROOT_PATTERN: no MQTT wildcard, no leading "/", no control
     *  character, at most 128 characters (code points: Java's regex counts them so too). */
    private static final Pattern ROOT = Pattern.compile("[^/+#\\x00-\\x1f][^+#\\x00-\\x1f]{0,127}");
    public final String root;

    public Topics(String root) {
        if (root == null || !ROOT.matcher(root).matches())
            throw new IllegalArgumentException("invalid topic root '" + root + "'");
        this.root = root;
    }

    public Topics() { this("fedfleet"); }

    public static String checkDeviceId(String id) {
        if (id == null || !DEVICE_ID.matcher(id).matches() || id.equals(AGGREGATOR_ID))
            throw new IllegalArgumentException("device id must be 1-64 characters of [A-Za-z0-9_.-] and not 'aggregator': " + id);
        return id;
    }

    public String inbox(String device) { return root + "/v1/dev/" + checkDeviceId(device) + "/in"; }
    public String outbox(String device) { return root + "/v1/dev/" + checkDeviceId(device) + "/out"; }
    public String presence(String device) { return root + "/v1/presence/" + checkDeviceId(device); }
    /** Retained `job.ended` (JobEnded): every device reads it. */
    public String jobEnds() { return root + "/v1/jobs/ended"; }
}
