"""How many members of a secure round may be uploading their masked input at once.

A member sends its masked input (a whole vector: 6.7 MB for Fed3R-Sync's statistics at
d = 1,280) as soon as it receives its forwarded shares, and the server sends every member's
shares together when the shares phase closes. With κ = 1,000 members, 6.7 GB of chunks arrived
interleaved; the aggregator's reassembly buffer (1 GiB) refused chunks once full, every refused
chunk cost its sender the whole message, the round fell below its threshold and failed, and the
device hosts' MQTT loops, busy pushing gigabytes, missed their devices' keepalives.

:class:`MaskedUploadWindow` holds the forwarded-shares messages back and releases them so that
at most ``size`` members are uploading: one more each time a member's masked input arrives or it
goes offline. ``size`` comes from a byte budget (``SecureAggregationFields.upload_window_bytes``)
divided by one masked input's size, so a small vector (a FedAvg(ψ) head: 100 KB) is not paced at
all. Nothing about the protocol changes: a member still gets exactly its own shares, only later;
the masked phase's timer restarts at every answer (``SecureGroupRounds._feed``), so paced members
are not timed out while others upload. If the phase ends anyway (its timeout), the members still
held are dropouts, as they would have been had their upload been lost.

A slot is a lease: a member that has not uploaded ``lease_s`` after its shares went out (counted
from the first tick that sees it, :meth:`MaskedUploadWindow.expire`) no longer holds its slot,
which goes to the next member held; its upload is still taken when it comes. Without it, members
that stay online and never upload (stuck, or a handful of hostile devices, one window's worth)
held every slot, nobody else was asked, and the phase timed out with everyone behind them dropped.
"""

from __future__ import annotations

from collections import deque

from protocols.secagg import ForwardedShares, Message

# one masked input's envelope beyond its vector: header, signature, chunk headers (generous)
MASKED_INPUT_OVERHEAD_BYTES = 64 * 1024
MIN_WINDOW = 8           # below this the aggregator would idle between uploads


def window_size(budget_bytes: int, vector_length: int, word_bytes: int = 8) -> int:
    """Members uploading at once: the budget over one masked input (``vector_length`` ring words of
    ``word_bytes`` each), at least MIN_WINDOW."""
    return max(MIN_WINDOW, int(budget_bytes) // (word_bytes * int(vector_length) + MASKED_INPUT_OVERHEAD_BYTES))


class MaskedUploadWindow:
    def __init__(self, size: int, lease_s: float = float("inf")):
        if size < 1 or not lease_s > 0:
            raise ValueError(f"window size must be >= 1 and the lease positive, got {size}, {lease_s}")
        self.size, self.lease_s = size, lease_s
        self._held: deque[Message] = deque()
        self._uploading: dict[str, float | None] = {}   # member -> first tick seen uploading
        self.most_held = 0                     # members held back at once, at most: for the phase's summary
        self.overdue = 0                       # slots taken back from members that did not upload
        self._summarised = False

    def admit(self, outputs: list) -> list:
        """``outputs`` of the server machine with the forwarded shares beyond the window held back."""
        kept = []
        for o in outputs:
            if isinstance(o, ForwardedShares):
                self._held.append(o)
            else:
                kept.append(o)
        released = self._release()
        self.most_held = max(self.most_held, len(self._held))
        return kept + released

    def answered(self, device: str) -> list[Message]:
        """``device`` uploaded its masked input or went away: the next held members' shares."""
        self._uploading.pop(device, None)
        self._held = deque(m for m in self._held if m.recipient != device)    # gone before its turn
        return self._release()

    def expire(self, now: float) -> list[Message]:
        """Slots held ``lease_s`` without an upload go to the next members held (their shares)."""
        for device, since in list(self._uploading.items()):
            if since is None:
                self._uploading[device] = now
            elif now - since >= self.lease_s:
                del self._uploading[device]
                self.overdue += 1
        return self._release()

    def clear(self) -> str | None:
        """The masked phase is over: members still held will not be asked any more. Returns, the
        first time and only if anyone was held back, a line saying how the phase was paced."""
        self._held.clear()
        self._uploading.clear()
        if self._summarised or self.most_held == 0:
            return None
        self._summarised = True
        return (f"masked inputs asked {self.size} at a time: at most {self.most_held} member(s) held back, "
                f"{self.overdue} slot(s) taken back")

    @property
    def held(self) -> int:
        return len(self._held)

    def _release(self) -> list[Message]:
        out = []
        while self._held and len(self._uploading) < self.size:
            message = self._held.popleft()
            self._uploading[message.recipient] = None
            out.append(message)
        return out
