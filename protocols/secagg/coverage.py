"""Whether a round can still unmask its sum, known as soon as a phase's survivors are.

The unmasking needs, from the members still able to answer it (the responders: U3, or the
signers U4 with the consistency check), t' shares of every secret it removes: b_u of each survivor
u (held by u and its graph neighbours) and s_v^SK of each dropped v with a surviving neighbour
(held by v's neighbours; v is gone). A holder that accused the owner's share row does not hold it
(its row did not decrypt; one that lied can withhold its share all the same). And every honest
member refuses survivors whose graph falls apart (SecAgg+: the server would learn each part's sum).

When any of this fails, no answer can save the round: :class:`UnmaskCoverage` says why, so the
server fails it when the phase closes instead of asking for answers it cannot use, or waiting a
phase timeout for members who all refused.
"""

from __future__ import annotations

from typing import Collection, Mapping

from .graph import NeighbourGraph


class UnmaskCoverage:
    """The live share holders of every secret the unmasking needs, against the share threshold."""

    def __init__(self, graph: NeighbourGraph, share_threshold: int,
                 accusers_of: Mapping[str, Collection[str]]) -> None:
        self.graph = graph
        self.share_threshold = share_threshold
        self.accusers_of = accusers_of          # owner -> holders that could not decrypt its share row

    def shortfall(self, survivors: Collection[str], dropped: Collection[str],
                  responders: Collection[str]) -> str | None:
        """Why no unmasking by ``responders`` can remove the masks of ``survivors`` and of the
        ``dropped`` (None: it can, if they all answer)."""
        parts = self.graph.parts(survivors)
        if parts > 1:
            return (f"the survivors' graph falls apart into {parts} parts: every member refuses to unmask "
                    "(the server would learn each part's sum)")
        live = frozenset(responders)
        alive = frozenset(survivors)
        needed = [(owner, self._live_holders(owner, live, owner in alive)) for owner in sorted(alive)]
        needed += [(owner, self._live_holders(owner, live, False)) for owner in sorted(dropped)
                   if self._masked_with(owner, alive)]
        if not needed:
            return None
        owner, count = min(needed, key=lambda pair: pair[1])
        if count >= self.share_threshold:
            return None
        short = sum(c < self.share_threshold for _, c in needed)
        secret = "self-mask seed" if owner in alive else "mask key"
        return (f"the {secret} of {owner!r} has {count} live share holders < share threshold "
                f"{self.share_threshold} ({short} secret{'s' if short > 1 else ''} short)")

    def _live_holders(self, owner: str, live: frozenset[str], holds_own: bool) -> int:
        if self.graph.is_complete:              # every member holds a share (a survivor its own): no n-wide sets
            holders = len(live)
        else:
            holders = len(self.graph.neighbours(owner) & live) + (holds_own and owner in live)
        return holders - len(set(self.accusers_of.get(owner, ())) & live)

    def _masked_with(self, dropped: str, alive: frozenset[str]) -> bool:
        """Whether some survivor added a pair mask with ``dropped`` (its mask key is then needed)."""
        if self.graph.is_complete:
            return bool(alive - {dropped})
        return not self.graph.neighbours(dropped).isdisjoint(alive)
