// The device's say over whether its input may leave in one round (protocols/secagg/client.py
// ReleaseGuard): a reason to refuse, or null. ClientSecAgg asks maskedInput once every check of the
// forwarded shares has passed, before its masked input leaves (with the key directory's participants
// U1: any sum revealing it is over a subset of them), and unmask before its unmask shares leave (with
// the survivors U3: the sum revealed). A reason aborts the round (SecAggException.ReleaseRefused),
// erasing its secrets. Each is asked at most once per round, last, so null means the message leaves.
// The device's secure-input ledger (org.fedfleet.device.SecureInputLedger) is one, against
// multi-round differencing; this package keeps no memory across rounds.
package org.fedfleet.secagg;

import java.util.Set;

public interface ReleaseGuard {
    String maskedInput(Set<String> participants);

    String unmask(Set<String> survivors);
}
