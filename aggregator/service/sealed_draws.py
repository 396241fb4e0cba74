"""A job's bookkeeping as the store keeps it: a keyed participant draw sealed.

A sampled DP job draws its rounds with :class:`~aggregator.jobs.participant_draw.KeyedDraw`, whose
saved state is its secret key and a block counter; each round's bookkeeping (the ``rounds`` row the
service writes as the round opens) carries it, so a restart draws on where the job was. Stored as
the job gives it, anyone reading the store file or a backup of it learnt the key, and with it every
later draw (a review's finding). So the service stores it sealed under the aggregator's
:class:`~aggregator.security.sealing_key.SealingKey` (kept outside the store), the job id as the
associated data: a row copied into another job, a value altered, or a store opened with another
key folder does not open, and the job stops with that reason (``recovery.restorable``).

Bookkeeping of an earlier version holds the key in the clear. It still resumes, but that key is
spent (the store's readers, its old backups, hold it): the draw goes on under a new key, sealed
from the next round on, as one from before keyed draws goes on keyed (``resumed_draw``). The rounds
it drew are no secret to the store's readers anyway: the store lists each round's participants.
"""

from __future__ import annotations

import json
import logging

from aggregator.jobs.participant_draw import KeyedDraw, draw_state, restored_draw
from aggregator.security.sealing_key import SealingKey

log = logging.getLogger("fedfleet.aggregator")

SEALED = KeyedDraw.VERSION + "-sealed"      # [SEALED, the sealed [VERSION, words, None] as text, None]


class SealedDraws:
    def __init__(self, key: SealingKey):
        self.key = key
        self._rekeyed: set[str] = set()         # jobs told their clear key was replaced (said once)

    def sealed(self, bookkeeping: dict, job_id: str) -> dict:
        """``bookkeeping`` with each keyed draw's state sealed for ``job_id``."""
        return {name: [SEALED, self.key.seal(json.dumps(value).encode(), _context(job_id)), None]
                if _is(value, KeyedDraw.VERSION) else value for name, value in bookkeeping.items()}

    def opened(self, bookkeeping: dict, job_id: str) -> dict:
        """The stored ``bookkeeping`` of ``job_id`` as the job restores it: each sealed draw opened
        (:class:`~aggregator.security.sealing_key.SealError` when it does not open), a clear
        keyed draw (checked, ``ValueError`` when it is not one) replaced by a new key's."""
        return {name: self._opened(value, job_id) for name, value in bookkeeping.items()}

    def _opened(self, value, job_id: str):
        if _is(value, SEALED):
            state = json.loads(self.key.open(value[1], _context(job_id)))
            restored_draw(state)                # what the key sealed is a keyed draw's state
            return state
        if _is(value, KeyedDraw.VERSION):
            restored_draw(value)                # a damaged one is said as such, not replaced
            if job_id not in self._rekeyed:
                self._rekeyed.add(job_id)
                log.warning("job %s: its participant draw's key was stored in the clear by an earlier version: "
                            "drawn under a new key from now on, stored sealed", job_id)
            return draw_state(KeyedDraw.fresh())
        return value


def _is(value, version: str) -> bool:
    return isinstance(value, list) and len(value) == 3 and value[0] == version


def _context(job_id: str) -> bytes:
    return b"fedfleet participant draw\x00" + job_id.encode("utf-8")
