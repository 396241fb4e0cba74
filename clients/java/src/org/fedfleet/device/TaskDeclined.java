// Thrown by a task handler that cannot do a task (wrong backbone, no data, unsupported option):
// the device answers `decline` with the message as the reason, which the aggregator records.
package org.fedfleet.device;

public class TaskDeclined extends Exception {
    public TaskDeclined(String reason) { super(reason); }
}
