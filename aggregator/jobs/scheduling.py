"""Scheduling for jobs that need each device once: Fed3R statistics, personalization reports.

A job mixing in :class:`OncePerDevice` keeps ``contributed`` (device -> what it gave),
``attempts`` (device -> times asked), ``round`` and a seeded ``random.Random`` in ``_rng``, and
has a config with ``clients_per_round`` (κ) and ``max_attempts``. Each round draws κ of the
online devices that have neither contributed nor used up their attempts (a device that dropped
out or timed out is asked again later); the job is finished when no known device is left to
ask. The sampler state is part of the bookkeeping, so a restarted service draws the same rounds.
"""

from __future__ import annotations

from aggregator.jobs.participant_draw import draw_state, restored_draw


class OncePerDevice:
    def eligible(self, online: set[str]) -> list[str]:
        return sorted(d for d in online
                      if d not in self.contributed and self.attempts.get(d, 0) < self.config.max_attempts)

    def next_participants(self, online: set[str], size: int | None = None) -> list[str]:
        """Seeded sample of up to κ (or ``size``) eligible devices; [] when nobody is left to ask."""
        pool = self.eligible(online)
        k = min(size or self.config.clients_per_round, len(pool))
        chosen = sorted(self._rng.sample(pool, k)) if k else []
        if chosen:
            self.round += 1
            for d in chosen:
                self.attempts[d] = self.attempts.get(d, 0) + 1
        return chosen

    def finished(self, online: set[str], known: set[str]) -> bool:
        """Done when no known device can still contribute (all did, or exhausted their attempts)."""
        return not self.eligible(known | online)

    def bookkeeping(self) -> dict:
        """JSON-able scheduling state (round, attempts, sampler), so a restarted service resumes it."""
        return {"round": self.round, "attempts": dict(self.attempts), "rng": draw_state(self._rng)}

    def restore_bookkeeping(self, state: dict) -> None:
        self.round = int(state["round"])
        self.attempts = {device: int(n) for device, n in state["attempts"].items()}
        self._rng = restored_draw(state["rng"])
