"""Differential-privacy settings of a job's config, and the budget rule every DP job follows.

``dp_noise_multiplier`` z > 0 turns DP on (0: off, the job is unchanged). ``dp_target_epsilon``
with ``dp_delta`` is the budget: a job whose first release alone would exceed it refuses to be
built (the admin API answers 422), and a job stops before a round that would exceed it. The
accountant is ``aggregator.compute.privacy`` (Google's dp-accounting); what one release is depends on
the job kind (a FedAvg round; the whole of Fed3R, see ``aggregator/strategies/dp_fed3r.py``).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from aggregator.compute.privacy import PrivacyAccountant
from aggregator.jobs.base import JobConfig
from aggregator.jobs.config_limits import COUNT, FLAG, Range, limited
from aggregator.jobs.participant_draw import KeyedDraw
from aggregator.strategies.dp_fedavg import AdaptiveClipNorm, ClipNorm, FixedClipNorm
from aggregator.strategies.dp_noise import seeded_noise_warning


@functools.lru_cache(maxsize=64)
def _accountant(noise_multiplier: float, delta: float, sampling_rate: float, accounting: str) -> PrivacyAccountant:
    """One accountant per setting, so its ε cache lives as long as the process (asked every round)."""
    return PrivacyAccountant(noise_multiplier, delta, sampling_rate, accounting)


# the smallest z each accountant accounts one release of: PLD's time grows without bound below
# 0.1 (z = 0.01: 12 s; z = 0.002 did not finish) on the thread that starts the job, and ε there is
# already in the hundreds (z = 0.1: ε ≈ 92 at δ = 1e-5); RDP's ε ∝ 1/z² overflows to infinity (a
# report JSON cannot hold) only far below any z with meaning (tests use 1e-12 to see the clipping)
MIN_NOISE_MULTIPLIER = {"pld": 0.1, "rdp": 1e-100}


@dataclass
class PrivacyBudgetFields(JobConfig):
    dp_noise_multiplier: float = limited(0.0, Range(0, 1e4))   # z = σ / Δ; 0: no differential privacy
    # the job's budget at dp_delta; 0: no budget (ε is still reported)
    dp_target_epsilon: float = limited(0.0, Range(0, 1e4))
    dp_delta: float = limited(1e-5, Range(1e-15, 0.1))

    def __post_init__(self):
        super().__post_init__()
        least = MIN_NOISE_MULTIPLIER[self.accounting()] if self.dp_noise_multiplier > 0 else 0.0
        if self.dp_noise_multiplier < least:
            raise ValueError(f"dp_noise_multiplier must be 0 (no DP) or at least {least:g} ({self.accounting()} "
                             f"accounting), got {self.dp_noise_multiplier}")

    @property
    def dp(self) -> bool:
        return self.dp_noise_multiplier > 0

    def sampling_rate(self) -> float:
        return 1.0

    def accounting(self) -> str:
        """Which of dp-accounting's accountants (``aggregator.compute.privacy``): RDP unless the job's
        mechanism is one release, where PLD is exact."""
        return "rdp"

    def accountant(self) -> PrivacyAccountant | None:
        if not self.dp:
            return None
        return _accountant(self.dp_noise_multiplier, self.dp_delta, self.sampling_rate(), self.accounting())

    def refuse_over_budget(self, releases: int) -> None:
        """ValueError when even ``releases`` releases would exceed the budget (the job must not start)."""
        accountant = self.accountant()
        if accountant is not None and not accountant.affordable(releases, self.dp_target_epsilon):
            raise ValueError(f"privacy budget ε={self.dp_target_epsilon} (δ={self.dp_delta}) is exceeded by "
                             f"{releases} release(s) at noise multiplier {self.dp_noise_multiplier}: "
                             f"ε={accountant.epsilon(releases):.4g}; raise dp_noise_multiplier or the budget")

    def privacy_report(self, releases: int) -> dict | None:
        """What the job reports after ``releases`` releases (None without DP)."""
        accountant = self.accountant()
        if accountant is None:
            return None
        return {"epsilon": accountant.epsilon(releases), "delta": self.dp_delta, "releases": releases,
                "noise_multiplier": self.dp_noise_multiplier, "sampling_rate": accountant.sampling_rate,
                "accounting": accountant.accounting,
                "target_epsilon": self.dp_target_epsilon or None, **seeded_noise_warning()}

    def budget_exhausted(self, opened: int) -> bool:
        """Whether one more release after ``opened`` would exceed the budget (the job then stops)."""
        accountant = self.accountant()
        return accountant is not None and not accountant.affordable(opened + 1, self.dp_target_epsilon)

    def privacy_entry(self, releases: int, opened: int, **extra) -> dict:
        """{"privacy": ε(δ) after ``releases`` closed releases, ...} under DP, else {} (``opened``
        counts an open one too: what the budget check sees)."""
        report = self.privacy_report(releases)
        if report is None:
            return {}
        return {"privacy": {**report, **extra, "budget_exhausted": self.budget_exhausted(opened)}}


@dataclass
class UpdateClippingFields(PrivacyBudgetFields):
    """DP-FedAvg: per-device update clipping (fixed or adaptive) and the sampling the accountant assumes."""

    dp_clip_norm: float = limited(1.0, Range(1e-9, 1e9))       # C (the initial C with adaptive clipping)
    dp_adaptive_clip: bool = limited(False, FLAG)    # Andrew et al. 2021: C follows the γ-quantile of update norms
    dp_target_quantile: float = limited(0.5, Range(1e-3, 0.999))   # γ
    dp_clip_lr: float = limited(0.2, Range(1e-6, 10))              # η
    # σ_b of the clipped-count noise; 0: max(κ/20, z) (see count_stddev)
    dp_count_stddev: float = limited(0.0, Range(0, 1e6))
    # eligible devices the κ are drawn from; 0: no amplification (q = 1)
    dp_population: int = limited(0, COUNT)

    def sampling_rate(self) -> float:
        if self.dp_population <= 0:
            return 1.0
        return min(1.0, self.clients_per_round / self.dp_population)

    def round_size(self, pool: int, rng) -> int:
        """How many of ``pool`` eligible online devices a round samples: κ (at most all of them),
        and under DP with sampling (q < 1) q·pool in expectation — its integer part, plus one with
        probability its fraction (``rng``: the job's participant draw) — so that every online device
        is in a round with probability at most the q its ε is computed with. While q·pool < 1 the
        round waits (0): a draw of nobody opens no round and the next tick draws again, so rounds
        drawn that way would all hold a device, each with probability 1/pool, not q (the last
        review's finding: 0.19–0.21 per round at q = 0.1 with 5 online). Before any of this, a
        fleet smaller than the declared ``dp_population`` spent far more than reported: 10 devices
        online of a declared 1,000 at κ = 10 were each in every round while ε counted q = 0.01
        (after 100 rounds at z = 1, δ = 1e-5: 1.2 reported against 96 spent)."""
        k = min(self.clients_per_round, pool)
        if self.dp and self.sampling_rate() < 1.0:
            whole, part = divmod(self.clients_per_round * pool, self.dp_population)     # q·pool, exactly
            if not whole:
                return 0                    # why, in the job's status: pool_too_small
            k = min(k, whole + (part > 0 and rng.randrange(self.dp_population) < part))   # no draw when exact
        return k

    def pool_too_small(self, pool: int) -> str | None:
        """Why no round opens on ``pool`` eligible online devices (``round_size`` waits while
        q·pool < 1), for the job's status; None when one can."""
        if not self.dp or self.sampling_rate() >= 1.0 or self.clients_per_round * pool >= self.dp_population:
            return None
        need = -(-self.dp_population // self.clients_per_round)
        return (f"waiting for devices: a DP round samples q·pool = {self.clients_per_round * pool}/{self.dp_population}"
                f" < 1 device in expectation (q = κ/dp_population = {self.clients_per_round}/{self.dp_population},"
                f" {pool} eligible online); it opens with {need} online")

    def participant_draw(self) -> random.Random:
        """The job's participant draw: seeded with the config's seed, unless the accountant counts on
        sampling (q < 1) — amplification holds only while nobody can tell who was sampled, and
        anyone holding the config could redraw a seeded sample (a review's finding: ε understated
        several-fold). Then a :class:`KeyedDraw` under a secret key of this job's own (stored with
        the draw's state, sealed: ``aggregator/service/sealed_draws.py``; never published:
        ``participant_draw.py`` says why not a Mersenne Twister); the config's seed only while the
        noise is seeded for tests."""
        if not self.dp or self.sampling_rate() >= 1.0 or seeded_noise_warning():
            return random.Random(self.seed)
        return KeyedDraw.fresh()

    def check_update_clipping(self) -> None:
        """Refuse (ValueError) a DP setting that cannot run or whose first round exceeds the budget."""
        if not self.dp:
            return
        if self.dp_adaptive_clip and self.count_stddev() <= self.dp_noise_multiplier / 2:
            raise ValueError(f"dp_count_stddev {self.count_stddev()} must exceed dp_noise_multiplier / 2")
        self.refuse_over_budget(1)

    def clip_rule(self) -> ClipNorm:
        """The clipping norm C the job starts from: fixed, or adaptive (Andrew et al. 2021)."""
        if self.dp_adaptive_clip:
            return AdaptiveClipNorm(self.dp_clip_norm, self.dp_target_quantile, self.dp_clip_lr, self.count_stddev())
        return FixedClipNorm(self.dp_clip_norm)

    def count_stddev(self) -> float:
        """σ_b: the paper's κ/20, but at least z, so the count takes at most a quarter of the budget
        (z_Δ ≤ 1.155 z) even for small κ, where κ/20 would not even be allowed (σ_b must exceed z/2)."""
        return self.dp_count_stddev or max(self.clients_per_round / 20, self.dp_noise_multiplier)
