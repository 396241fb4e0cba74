"""Bounds for the FedAvg family's rounds of fewer than three updates (``robust_fedavg.py``'s layers
take a limit from the round's own median, which in a round of one update is that update's): the
reference of earlier rounds that bounds them, kept across rounds and checkpointed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from aggregator.compute.privacy import UNPUBLISHED_PREFIX


class SmallRoundReference:
    """Limits for a round of fewer than ``MIN_UPDATES`` updates that do not come from its own
    updates (on with ``enabled``; ``layers``: the job's bound layers that are on, in their order).

    Why: every bound layer's limit is a multiple of the round's median statistic, and in a round of
    one update that median is the update's own, so nothing was bounded. A job starts as soon as one
    device is online, and any round only one device answers is such a round: one device sending an
    ordinary head with every entry moved by 10^5 (within the wire's 2^20) and n = 10^9 moved the
    model 0 -> 10^5, and the round history carried it on through the honest rounds after (a
    review's finding). In a round of two, the smaller device's statistic bounds both.

    The *reference* is the limits of the latest round of >= ``MIN_UPDATES`` updates or, where rounds
    of fewer updates have since brought the statistics of >= ``MIN_DEVICES`` distinct devices (each
    device's latest, as its round measured them), the limits the layers decide on those, as on a
    round of theirs: a lower median of three or more devices, which no one device sets (and which
    only tightens a reference already usable: two devices would set it). A small
    round takes, layer by layer, the smaller positive one of its own limit and the reference's (a
    limit of 0 bounds nothing: most devices of its round did not move).

    Without a reference (none yet, or one holding a 0: its devices did not move) a round of one
    update moves nothing: any limit drawn from that round is its device's own, and one relative to
    the model (‖x_t‖) is 0 at a zeros init and lets one device double the model round after round.
    Its statistics still count towards a reference, so a job of κ = 1 moves once three devices have
    answered. A round of two without a reference is bounded as before, by the smaller device's
    statistics (docs/algorithms.md, "Bounded influence"). Rounds of >= ``MIN_UPDATES`` updates are
    combined exactly as before; their limits only become the reference.

    State across rounds, which the job checkpoints (unpublished: the pool names devices beside
    their claimed counts). Every step is a function of each round's set of updates, taken in
    round order, so shards, a restart and one aggregator reach the same bytes. ``key`` names its
    entries in the checkpoint: the class's names below are the FedAvg family's (``key`` "bounds"); a
    job with more than one reference names each its own (LADD: φ's and the θ slots',
    ``aggregator/strategies/ladd_small_rounds.py``; Scaffold: its Δc bound's, "scaffold.control_bounds",
    ``aggregator/jobs/scaffold.py``)."""

    MIN_UPDATES = 3         # a round with fewer is small
    MIN_DEVICES = 3         # small rounds' statistics make a reference once this many devices sent them
    # a reference's checkpoint entries, under its key: the limits (float64, one per layer), the pool's
    # devices (str, sorted) and their statistics (float64, a row per device)
    PARTS = ("reference", "pool_devices", "pool")
    LIMITS, POOL_DEVICES, POOL = (f"{UNPUBLISHED_PREFIX}bounds.{part}" for part in PARTS)   # the FedAvg family's
    HELD = "a round of one update moves nothing before a reference exists (SmallRoundReference)"

    def __init__(self, enabled: bool, layers: Sequence, key: str = "bounds"):
        self.layers = list(layers)
        self.keys = tuple(f"{UNPUBLISHED_PREFIX}{key}.{part}" for part in self.PARTS)
        self.enabled = bool(enabled) and bool(self.layers)
        self.limits: np.ndarray | None = None
        self.pool: dict[str, np.ndarray] = {}

    def small(self, updates: int) -> bool:
        """Whether a round of ``updates`` is bounded by the reference too."""
        return self.enabled and 0 < updates < self.MIN_UPDATES

    def usable(self) -> bool:
        return self.limits is not None and bool((self.limits > 0).all())

    def holds(self, updates: int) -> bool:
        """Whether a round of ``updates`` moves nothing: one update, no reference."""
        return self.small(updates) and updates == 1 and not self.usable()

    def limit(self, layer: int, own: float, updates: int) -> float:
        """The limit of the ``layer``-th of the reference's layers in a round of ``updates`` whose
        own statistics give ``own`` (``own`` itself unless the round is small and a reference exists)."""
        if not self.small(updates) or not self.usable():
            return own
        reference = float(self.limits[layer])
        return min(own, reference) if own > 0 else reference

    def observe(self, updates: int, limits: Sequence[float],
                statistics: Mapping[str, Sequence[float]] | None) -> None:
        """Take a closed round of ``updates``: ``limits``, its layers' (the reference's first), become
        the reference when it had >= MIN_UPDATES; else ``statistics`` (device -> its statistic of each
        layer) join the pool, which becomes the reference once it holds MIN_DEVICES devices."""
        if not self.enabled or not updates:
            return
        if updates >= self.MIN_UPDATES:
            self.limits = np.array(limits[:len(self.layers)], dtype=np.float64)
            self.pool = {}
            return
        for device, row in (statistics or {}).items():
            self.pool[device] = np.array(row[:len(self.layers)], dtype=np.float64)
        if len(self.pool) >= self.MIN_DEVICES:
            rows = np.stack([self.pool[d] for d in sorted(self.pool)])
            pooled = np.array([layer.limit(rows[:, i]) for i, layer in enumerate(self.layers)], dtype=np.float64)
            # pooled limits only tighten a usable reference: two devices make the lower median of three,
            # and two lone attackers' rounds loosened it back to their own (a review's finding)
            self.limits = np.minimum(self.limits, pooled) if self.usable() else pooled
            self.pool = {}

    def close(self, limits: Sequence[float], measured: Sequence[Mapping[str, float]]) -> bool:
        """Take a closed round: ``limits``, its layers' (this reference's, in order), and ``measured``,
        each of those layers' statistics (device -> value, every device of the round in each); whether
        it held the round (``holds``, decided on the reference the round was bounded by)."""
        updates = len(measured[0]) if measured else 0
        held = self.holds(updates)
        self.observe(updates, limits, {d: tuple(values[d] for values in measured) for d in measured[0]}
                     if self.small(updates) else None)
        return held

    def state_dict(self) -> dict[str, np.ndarray]:
        limits_key, devices_key, pool_key = self.keys
        out = {} if self.limits is None else {limits_key: self.limits.copy()}
        if self.pool:
            devices = sorted(self.pool)
            out[devices_key] = np.array(devices, dtype=str)
            out[pool_key] = np.stack([self.pool[d] for d in devices])
        return out

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        """Back to a checkpoint (one taken before any round, or before the reference existed, has
        none). ValueError naming the entry for one this job could not have written (a store damaged
        or tampered with): a reference of another number of layers was taken in silently and failed
        the job's next small round at its close, one that is not finite bounded nothing."""
        limits_key, devices_key, pool_key = self.keys
        self.limits = self._entry(state, limits_key, (len(self.layers),)) if limits_key in state else None
        devices = [str(d) for d in np.asarray(state.get(devices_key, [])).reshape(-1)]
        if len(set(devices)) != len(devices):
            raise ValueError(f"checkpoint entry {devices_key} names a device twice")
        if devices and pool_key not in state:
            raise ValueError(f"checkpoint entry {pool_key} is missing for the {len(devices)} devices of {devices_key}")
        rows = self._entry(state, pool_key, (len(devices), len(self.layers))) if devices else np.zeros((0, 0))
        self.pool = {d: rows[i].copy() for i, d in enumerate(devices)}

    @staticmethod
    def _entry(state: Mapping[str, np.ndarray], key: str, shape: tuple[int, ...]) -> np.ndarray:
        """``state[key]`` as float64 if it has ``shape`` and only finite values >= 0 (what limits and
        statistics are), else ValueError naming it."""
        value = np.asarray(state[key])
        if value.shape != shape or value.dtype.kind not in "fiu" or not (np.isfinite(value) & (value >= 0)).all():
            raise ValueError(f"checkpoint entry {key} is not {shape} finite values >= 0 "
                             f"(got {value.dtype} of shape {value.shape})")
        return value.astype(np.float64)
