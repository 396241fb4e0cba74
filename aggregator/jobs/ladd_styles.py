"""A LADD job's style phase (:class:`LaddStyles`, one part of :class:`~aggregator.jobs.ladd.LaddJob`):
who is asked for a style, when the styles are clustered, which are screened, where a late device goes.

``ladd.style`` rounds
    Every online device that has not sent its style yet (and has attempts left) is asked for
    it. When at least ``min_styles`` styles are in (all devices seen so far when 0), the
    style round's closing fits :class:`~aggregator.strategies.ladd.StyleClustering` (KMeans
    for k in [k_min, k_max], ``n_init`` restarts, k by silhouette), stores the centroids and
    calls the injected ``pretrainer(style_bank)``, which returns the pre-trained exchanged
    state w and the names of the trainable tensors. A device that comes online later is
    asked for its style in a style round of its own and routed to the nearest centroid
    (the clustering is not refitted). A style farther from every other than
    ``style_screen_multiple`` x the fleet's typical distance from the median style is screened
    first (``screen_styles``): left out of the fit and of the pretrainer's bank, its device
    routed to the nearest centroid as a late device is, the reason in ``styles_screened``
    (the round's entry, the report, the checkpoint).

The guards and effects below are rows of ``LADD_TABLE`` (aggregator/jobs/ladd.py); the training the
phase ends in is the job's (``_begin_training``).
"""

from __future__ import annotations

import logging

import numpy as np

from aggregator.jobs.ladd_phases import NobodyLeftToAsk, StyleRoundClosed
from aggregator.strategies.ladd import cluster_styles, screen_styles

log = logging.getLogger("fedfleet.aggregator")


class LaddStyles:
    """LaddJob's style phase, on the job's ``styles``, ``style_attempts``, ``styles_screened``,
    ``clustering`` and ``assignment``."""

    def _ask_for_styles(self, online: set[str]) -> list[str]:
        """The online devices to ask for their style now (none sent, attempts left), each one's
        attempt counted."""
        pool = sorted(d for d in online if d not in self.styles
                      and self.style_attempts.get(d, 0) < self.config.style_attempts)
        for d in pool:
            self.style_attempts[d] = self.style_attempts.get(d, 0) + 1
        return pool

    def _skips_styles(self, _event=None) -> bool:
        return self.initial is not None and self.config.clustering == "none"

    def _can_cluster_now(self, _event=None) -> bool:
        """Nobody is left to ask: with ``min_styles`` 0 the styles in are enough."""
        return bool(self.styles) and not self.config.min_styles

    def _styles_complete(self, _event=None) -> bool:
        """``min_styles`` styles are in, or (0) every device asked so far answered or gave up."""
        if not self.styles:
            return False
        if self.config.min_styles:
            return len(self.styles) >= self.config.min_styles
        return all(d in self.styles or n >= self.config.style_attempts for d, n in self.style_attempts.items())

    def _cluster_what_is_in(self, _event: NobodyLeftToAsk) -> list:
        self._finish_style_phase()
        return []

    def _cluster_closing_round(self, event: StyleRoundClosed) -> list:
        self._finish_style_phase()
        event.entry["clusters"] = self.n_clusters
        if self.clustering_fallback:
            event.entry["clustering_fallback"] = self.clustering_fallback
        if self.styles_screened:
            event.entry["styles_screened"] = dict(self.styles_screened)
        return []

    def _route_late_styles(self, _event: StyleRoundClosed) -> list:
        if self.clustering is not None and self._applied:
            new = sorted(self._applied)     # late devices: routed to the nearest centroid, no refit
            labels = self.clustering.predict(np.stack([self.styles[d] for d in new]))
            self.assignment.update({d: int(label) for d, label in zip(new, labels)})
        return []

    def _finish_style_phase(self) -> None:
        c = self.config
        devices = sorted(self.styles)           # a function of the set of styles: canonical order
        bank = np.stack([self.styles[d] for d in devices])
        if c.clustering == "styles":
            self.clustering, self.clustering_fallback = cluster_styles(bank, (c.k_min, c.k_max), c.n_init, c.seed,
                                                                       c.style_screen_multiple)
            screened = self.clustering.screened_
            if self.clustering_fallback:
                log.warning("LADD clustering: %s, for the %d styles in", self.clustering_fallback, len(devices))
            labels = self.clustering.labels_        # a screened device's: its nearest centroid
            log.info("LADD clustering: k=%d, silhouettes %s", self.clustering.n_clusters_,
                     {k: round(v, 3) for k, v in self.clustering.silhouette_scores_.items()})
        else:
            screened = screen_styles(bank, c.style_screen_multiple)      # pre-training's bank only
            labels = np.zeros(len(devices), np.int64)
        self.styles_screened = {devices[i]: why for i, why in sorted(screened.items())}
        for device, why in self.styles_screened.items():
            log.warning("LADD style of %s: %s", device, why)
        kept = np.stack([s for i, s in enumerate(bank) if i not in screened])
        arrays, trainable = self.initial if self.initial is not None else self.pretrainer(kept)
        self._begin_training(arrays, trainable, n_clusters=int(labels.max()) + 1)
        self.assignment = {d: int(label) for d, label in zip(devices, labels)}
