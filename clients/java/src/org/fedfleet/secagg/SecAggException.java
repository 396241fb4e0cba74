// Every secure-aggregation error (docs/secure-aggregation.md "Errors"): the message that caused
// it changes nothing, except a ProtocolViolation, which aborts the round and erases the secrets.
package org.fedfleet.secagg;

public class SecAggException extends Exception {
    public SecAggException(String message) { super(message); }

    /** The server asked for something forbidden (both shares of a peer, a survivor set without us...). */
    public static final class ProtocolViolation extends SecAggException {
        public ProtocolViolation(String message) { super(message); }
    }
}
