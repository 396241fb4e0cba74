"""A job's privacy budget: ε(δ) after its noisy releases, from Google's ``dp-accounting``.

Nothing here computes a privacy bound by hand: the job says what one release is (the Gaussian
mechanism with noise multiplier z = σ / Δ, on a Poisson sample of rate q of the population) and
how many it made; the library's Rényi-DP accountant composes them and converts to (ε, δ).

- FedAvg family: one release per round, ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``
  composed over the rounds, q = κ / ``dp_population``. The scheduler draws q·|pool| of the online
  devices in expectation (``UpdateClippingFields.round_size``), so each is sampled with probability
  at most q however many are online; a draw of that size, not a Poisson sample, is the usual
  approximation of DP-FedAvg (McMahan et al. 2018). Without a population (0) no amplification is
  claimed: q = 1.
- Fed3R: each device's statistics enter exactly one noisy round sum and every later model is a
  function of those sums, so by parallel composition the whole job is one Gaussian release
  (``releases=1`` whatever the number of rounds).

Two of the library's accountants: ``"rdp"`` (Rényi DP, the default: fast for many sampled
rounds, but its conversion to (ε, δ) is loose) and ``"pld"`` (privacy loss distributions:
near-exact, pessimistic only by its discretisation). For one unsampled Gaussian release (Fed3R)
PLD is what the mechanism really costs: at δ = 1e-5 it allows z = 3.73 for ε = 1 where RDP asks
4.05 (1.08 against 1.16 at ε = 4), the same guarantee with 8 % less noise.
"""

from __future__ import annotations

import functools
import logging
import math
import sys

# State entries under this prefix are what a job holds but has not released (DP Fed3R's exact sums
# of closed rounds, held until the job ends): checkpointed in the store, never in the job's files.
UNPUBLISHED_PREFIX = "unreleased_"


def published_state(state: dict) -> dict:
    """``state`` less its unreleased entries: what a job's output files may hold."""
    return {k: v for k, v in state.items() if not k.startswith(UNPUBLISHED_PREFIX)}


class _SkippedOrders(logging.Filter):
    """The RDP accountant warns, through absl, for every Rényi order whose series does not converge
    at small sampling rates; it then leaves that order out of the minimum, which keeps ε an upper
    bound. Dozens of these per ε would flood the service's log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


@functools.cache
def _accounting():
    """dp-accounting, imported the first time a budget is computed: it costs ~0.5 s, and most
    aggregator processes (every job without DP) never need it."""
    import dp_accounting
    from absl import logging as absl_logging
    from dp_accounting import rdp

    logging.getLogger("absl").addFilter(_SkippedOrders())
    # absl's handler keeps the sys.stderr of its import time and closes it when logging shuts its
    # handlers down (``logging.config.dictConfig`` does, e.g. uvicorn's) unless it is the process's
    # own stderr: a stream swapped in at import time (a test's capture, a CLI's redirection) would
    # be closed under its owner.
    absl_logging.get_absl_handler().python_handler.stream = sys.__stderr__
    return dp_accounting, rdp


# The PLD accountant's grid for the privacy loss: coarser than its default (1e-4) is pessimistic,
# never optimistic, and one Gaussian release comes out the same to 5 digits ten times faster
# (0.06 s instead of 0.6 s at z = 1), which a job pays when it is built.
PLD_DISCRETIZATION = 1e-3


class PrivacyAccountant:
    """ε(δ) of ``releases`` compositions of a (sub)sampled Gaussian mechanism."""

    ACCOUNTING = ("rdp", "pld")

    def __init__(self, noise_multiplier: float, delta: float, sampling_rate: float = 1.0,
                 accounting: str = "rdp"):
        if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
            raise ValueError(f"noise_multiplier must be a positive finite number, got {noise_multiplier}")
        if not 0 < delta < 1:
            raise ValueError(f"delta must lie in (0, 1), got {delta}")
        if not 0 < sampling_rate <= 1:
            raise ValueError(f"sampling rate must lie in (0, 1], got {sampling_rate}")
        if accounting not in self.ACCOUNTING:
            raise ValueError(f"accounting must be one of {self.ACCOUNTING}, got {accounting!r}")
        self.accounting = accounting
        self.noise_multiplier, self.delta, self.sampling_rate = float(noise_multiplier), float(delta), float(sampling_rate)
        self._cache: dict[int, float] = {0: 0.0}

    def event(self):
        """One release, as the library describes it (a ``dp_accounting.DpEvent``)."""
        dp_accounting, _ = _accounting()
        gaussian = dp_accounting.GaussianDpEvent(self.noise_multiplier)
        if self.sampling_rate == 1.0:
            return gaussian
        return dp_accounting.PoissonSampledDpEvent(self.sampling_rate, gaussian)

    def epsilon(self, releases: int) -> float:
        """ε at the job's δ after ``releases`` releases (0 for none)."""
        if releases < 0:
            raise ValueError("releases must be >= 0")
        if releases not in self._cache:
            dp_accounting, rdp = _accounting()
            accountant = rdp.RdpAccountant() if self.accounting == "rdp" else \
                dp_accounting.pld.PLDAccountant(value_discretization_interval=PLD_DISCRETIZATION)
            accountant.compose(self.event(), releases)
            self._cache[releases] = float(accountant.get_epsilon(self.delta))
        return self._cache[releases]

    def affordable(self, releases: int, target_epsilon: float) -> bool:
        """Whether ``releases`` releases stay within ``target_epsilon`` (0: no budget set)."""
        return target_epsilon <= 0 or self.epsilon(releases) <= target_epsilon


def noise_multiplier_for(target_epsilon: float, delta: float, releases: int, sampling_rate: float = 1.0,
                         accounting: str = "rdp") -> float:
    """The smallest z (to 0.1 %) whose accountant keeps ``releases`` within ``target_epsilon``:
    bisection over the library's ε, used to calibrate benches and examples."""
    lo, hi = 1e-3, 1.0
    account = lambda z: PrivacyAccountant(z, delta, sampling_rate, accounting)   # noqa: E731
    while not account(hi).affordable(releases, target_epsilon):
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise ValueError(f"no noise multiplier reaches ε={target_epsilon}")
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2
        if account(mid).affordable(releases, target_epsilon):
            hi = mid
        else:
            lo = mid
    return hi
