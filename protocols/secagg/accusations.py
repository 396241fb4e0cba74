"""Share accusations (:class:`ShareAccusations`): who the members of U2 say sent them share rows that
do not decrypt, what an accusation may say, and who the accusations make a culprit. The server
(server.py) keeps them while the masked phase is open and names the culprits when it closes;
docs/secure-aggregation.md, "Malicious devices"."""

from __future__ import annotations

from collections.abc import Callable, Collection

from .errors import MalformedMessage, ReplayedMessage, UnexpectedMessage
from .events import Phase
from .messages import ShareAccusation

# distinct accusers a culprit needs at least (all of them where it sent fewer rows): a colluding
# pair frames nobody who sent three rows or more; in a group of three, where two members learn the
# third's input from the sum anyway, both must accuse (else a sender of bad rows fails every round
# it is drawn into, unnamed)
MIN_ACCUSERS = 3


class ShareAccusations:
    """Each accuser's accused senders, kept once per accuser."""

    def __init__(self) -> None:
        self._accused_by: dict[str, frozenset[str]] = {}    # member -> senders of rows it could not decrypt

    def __contains__(self, accuser: str) -> bool:
        return accuser in self._accused_by

    def __len__(self) -> int:
        return len(self._accused_by)

    def note(self, accusation: ShareAccusation, awaited: bool, forwarded: Collection[str]) -> None:
        """Keep ``accusation``, once per member: its sender's masked input must still be ``awaited``,
        and it may accuse only neighbours whose rows it was ``forwarded``."""
        accuser = accusation.sender
        if accuser in self._accused_by:
            raise ReplayedMessage(f"{ShareAccusation.TYPE} from {accuser!r} already received")
        if not awaited:
            raise UnexpectedMessage(f"{accuser!r} may not accuse now: it is not waited for in phase "
                                    f"{Phase.MASKED_INPUT.value}")
        if not accusation.accused or not set(accusation.accused) <= forwarded:
            raise MalformedMessage(f"{accuser!r} accuses devices whose rows it was not forwarded")
        self._accused_by[accuser] = frozenset(accusation.accused)     # one accuser counts once per device

    def accusers_of(self) -> dict[str, set[str]]:
        """Accused sender -> the members that could not decrypt its rows (so hold none of its shares)."""
        accusers: dict[str, set[str]] = {}
        for accuser, accused in self._accused_by.items():
            for device in accused:
                accusers.setdefault(device, set()).add(accuser)
        return accusers

    def culprits(self, recipients: Callable[[str], int]) -> set[str]:
        """The senders accused by a strict majority of the ``recipients(sender)`` neighbours they sent
        share rows to, and by at least MIN_ACCUSERS of them (all, where they sent fewer). A member
        cannot prove a row bad without revealing its cipher key, which would open every row it holds,
        so the count is all there is: fewer lying members than half a device's neighbours cannot make
        it one, nor can a pair (2 of 3 recipients are a majority in a group of 4)."""
        culprits = set()
        for device, accusers in self.accusers_of().items():
            sent_to = recipients(device)
            if len(accusers) >= min(MIN_ACCUSERS, sent_to) and 2 * len(accusers) > sent_to:
                culprits.add(device)
        return culprits
