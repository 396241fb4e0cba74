"""The limits of a LADD round's slots (φ, θ_0, θ_1, ...): each bound layer's limit per slot, from
the statistics of the round's updates in it. Shared by the canonical sums (one aggregator's and
the shards', ``aggregator/shards/ladd_sums.py``), the whole-round robust path
(``robust_ladd.py``) and the small-round references (``ladd_small_rounds.py``)."""

from __future__ import annotations

from collections.abc import Mapping

PHI = "phi"                     # the shared part's slot; a cluster's is ``theta_slot(c)`` (ladd_sums.py)
MIN_OWN_UPDATES = 3             # a θ slot with fewer is bounded on the round's θ updates (slot_limits)


def slot_limits(layer, by_slot: Mapping[str, list[float]]) -> dict[str, float]:
    """Each slot's limit for ``layer`` from its updates' statistics; a cluster's θ slot with fewer
    than ``MIN_OWN_UPDATES`` updates takes the limit of every θ update of the round (all clusters'
    heads have one shape and one recipe): a median of one or two updates bounds neither of them, so
    a device alone in its cluster, or with one other, set its cluster's θ_c as far as it liked. In a
    round of two updates in two clusters that is the smaller device's, as in FedAvg's round of two;
    a round of fewer than three updates is bounded by earlier rounds too (``LaddSmallRounds``)."""
    pooled = [value for slot, values in by_slot.items() if slot != PHI for value in values]
    return {slot: layer.limit(pooled if slot != PHI and len(values) < MIN_OWN_UPDATES else values)
            for slot, values in by_slot.items()}
