// Every secure-aggregation error (docs/secure-aggregation.md "Errors"): the message that caused
// it changes nothing, except a ProtocolViolation or a ReleaseRefused, which abort the round and erase
// the secrets.
package org.fedfleet.secagg;

public class SecAggException extends Exception {
    public SecAggException(String message) { super(message); }

    /** The server asked for something forbidden (both shares of a peer, a survivor set without us...). */
    public static final class ProtocolViolation extends SecAggException {
        public ProtocolViolation(String message) { super(message); }
    }

    /** The device's own rule forbids its input to leave in this round (its ReleaseGuard: e.g. the same
     *  input already went to a round of other members, whose sums could be differenced); like
     *  ProtocolViolation, this aborts the round (protocols/secagg/errors.py ReleaseRefused). */
    public static final class ReleaseRefused extends SecAggException {
        public ReleaseRefused(String message) { super(message); }
    }

    /** The round's config, checked and signed by the aggregator, has no room for this device's input
     *  (not encodable: non-finite, beyond the bound, another length; or a ring other than the input
     *  needs): thrown at the RoundStart, once it is authenticated, changing nothing
     *  (protocols/secagg/errors.py InputError and ConfigError). SecAggSessions then leaves the round. */
    public static final class InputRefused extends SecAggException {
        public InputRefused(String message) { super(message); }
    }
}
