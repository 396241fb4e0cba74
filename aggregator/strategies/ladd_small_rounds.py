"""Bounds for LADD's training rounds of fewer than three updates: the reference of earlier rounds
that bounds φ's slot, and the one that bounds the θ slots, kept across rounds and checkpointed by
the job (docs/algorithms.md, "Bounded influence")."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from aggregator.strategies.ladd_slot_limits import PHI, slot_limits
from aggregator.strategies.small_round_reference import SmallRoundReference

log = logging.getLogger("fedfleet.aggregator")

Measured = Sequence[Mapping[str, Mapping[str, float]]]     # per bound layer: device -> {slot: its statistic}


def _of_phi(slot: str) -> bool:
    return slot == PHI


def _of_theta(slot: str) -> bool:
    return slot != PHI


class LaddSmallRounds:
    """A :class:`SmallRoundReference` for φ's slot and one for the θ slots (``phi``, ``theta``).

    Why: a LADD round bounds φ's updates by a multiple of their median statistic and θ_c's by its
    cluster's, or, for a cluster of fewer than three, by every cluster's θ updates (``slot_limits``).
    In a round of one update each of those medians is that update's own: one device alone in a
    training round (the job's first, or any round only one device answers) set φ and its cluster's
    θ_c to whatever it sent within the parser's bound, 9·10^3 in every entry in
    ``tests/test_ladd_small_rounds.py``.

    The φ reference is the FedAvg family's on φ's slot: the limits of the latest round of >= 3
    updates, or of >= 3 devices' statistics from smaller rounds. The θ reference takes, from each
    round, the limits on every θ update of the round (what a cluster of fewer than three takes) and
    each device's θ statistics: all clusters' heads have one shape and one recipe, and a round of
    fewer than three updates has fewer than three θ updates in all, so no cluster's own statistics
    can bound it, however its devices spread over the clusters. Each slot of a round takes, layer by
    layer, the smaller positive one of its own limit and its reference's when its kind of slot
    (φ, θ) has fewer than three updates in the round; with one update and no usable reference the
    slot moves nothing. Rounds of >= 3 updates are bounded exactly as without the references.

    The job checkpoints both (unpublished); each step is a function of the round's statistics,
    which shards report, so a coordinator and one aggregator reach the same bytes."""

    PHI_KEY, THETA_KEY = "ladd.phi_bounds", "ladd.theta_bounds"     # their names in the checkpoint

    def __init__(self, phi: SmallRoundReference, theta: SmallRoundReference):
        self.phi, self.theta = phi, theta

    @classmethod
    def of(cls, config) -> "LaddSmallRounds":
        """The config's (``small_round_reference``; off under DP and with every bound layer off)."""
        return cls(config.small_rounds(cls.PHI_KEY), config.small_rounds(cls.THETA_KEY))

    def _kinds(self):
        return ((self.phi, _of_phi), (self.theta, _of_theta))

    def limits(self, index: int, layer, by_slot: Mapping[str, list[float]]) -> dict[str, float]:
        """Each slot's limit for ``layer``, the ``index``-th bound layer, from the statistics of the
        round's updates in it (``by_slot``): ``slot_limits``'s, within its reference's in a small round."""
        own = slot_limits(layer, by_slot)
        counts = {of: sum(len(values) for slot, values in by_slot.items() if of(slot)) for _, of in self._kinds()}
        return {slot: reference.limit(index, own[slot], counts[of])
                for reference, of in self._kinds() for slot in own if of(slot)}

    def close(self, measured: Measured) -> set[str]:
        """Take a closed round (``measured``: each bound layer's statistics, device -> {slot: value},
        as the round's limits were decided on them); the slots it leaves where they were. Each
        reference closes the round as the FedAvg family's does (``SmallRoundReference.close``) on its
        kind of slot: the limits its layers decide on every update of that kind, and each device's
        statistic of that kind in each layer."""
        held: set[str] = set()
        first = measured[0] if measured else {}
        for reference, of in self._kinds():
            # a device sends one φ slot and its cluster's one θ slot: one statistic of each kind per layer
            of_kind = [{device: value for device, slots in layer.items() for slot, value in slots.items() if of(slot)}
                       for layer in measured]
            limits = tuple(layer.limit(list(values.values())) for layer, values in zip(reference.layers, of_kind)
                           if values)             # none where no update is of this kind (no median of nothing)
            if reference.close(limits, of_kind):
                held.update(slot for slots in first.values() for slot in slots if of(slot))
        if held:
            log.warning("LADD slots %s: %s", sorted(held), SmallRoundReference.HELD)
        return held

    def state_dict(self) -> dict:
        return {**self.phi.state_dict(), **self.theta.state_dict()}

    def load_state_dict(self, state: Mapping) -> None:
        """Back to a checkpoint (one taken before either reference existed, or by a job before LADD took them, has none)."""
        self.phi.load_state_dict(state)
        self.theta.load_state_dict(state)
