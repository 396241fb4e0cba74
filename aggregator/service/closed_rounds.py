"""What a job remembers of its closed rounds once their round machines are let go.

A :class:`~protocols.rounds.RoundCoordinator` that has closed answers only two things: a result
whose message id it saw before is a ``duplicate`` (a device whose ack was lost resends its
accepted result: it must learn that the result counted), any other result is ``late``; a decline
is ignored. Keeping every closed coordinator for that grew the service by ~2 KB per round, with
the round's task ids, deadline and byte count beside it: without bound for an asynchronous job,
whose every dispatch is a round (a week of FedBuff at 100 dispatches a second is 60 million).

So a round's machine and bookkeeping are let go once its close is committed, and this keeps
what answering needs: each message id the round saw, for ``RETENTION_S`` after the close (longer
than a device keeps resending: ``DeviceSession`` retries 5 times from 10 s, doubling, 310 s in
all), and the highest round let go (any result for a round up to it that is not open is late).
A job without a store also keeps each device's last decline or rejection reason, which the job's
failure report quotes (``job_outcome``); with a store those are its durable round events.
"""

from __future__ import annotations

import collections
import math

from protocols.rounds import RoundCoordinator, RoundState

RETENTION_S = 900.0


class ClosedRounds:
    def __init__(self) -> None:
        self.highest = 0                                  # the highest round let go
        self._ids: dict[str, int] = {}                    # message id -> its round
        self._expiry: collections.deque[tuple[float, list[str]]] = collections.deque()
        self.answers: dict[str, tuple[str, str]] = {}     # device -> (declined | rejected, reason)

    def let_go(self, coord: RoundCoordinator, now: float) -> None:
        """Remember what ``coord`` (closed) answers with; the caller drops the machine itself."""
        self.expire(now)
        ids = list(coord.seen_ids)
        self._ids.update(dict.fromkeys(ids, coord.round))
        self._expiry.append((now + RETENTION_S, ids))
        self.highest = max(self.highest, coord.round)
        self.answers.update({d: ("declined", why) for d, why in coord.declined.items()})
        self.answers.update({d: ("rejected", why) for d, why in coord.rejected.items()})

    def knows(self, round_: int) -> bool:
        """Whether ``round_`` (not open now) is one this job closed and let go."""
        return 1 <= round_ <= self.highest

    def machine(self, round_: int, message_id: str, now: float) -> RoundCoordinator:
        """A closed machine for ``round_`` that saw ``message_id`` if that round did: fed the
        message, its transition table answers as the round's own machine would have (one rule)."""
        self.expire(now)
        coord = RoundCoordinator(round_, frozenset(), -math.inf, state=RoundState.CLOSED)
        if self._ids.get(message_id) == round_:
            coord.seen_ids.add(message_id)
        return coord

    def expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            for message_id in self._expiry.popleft()[1]:
                self._ids.pop(message_id, None)

    def __len__(self) -> int:
        """Message ids remembered now (what the retention bounds)."""
        return len(self._ids)
