"""A Fed3R job: which devices to ask next, what to do with their statistics, when it is done.

Pure logic (no MQTT, no clock): the service feeds it presence changes, validated results and
round outcomes; it answers with the next round's participants and task parameters. Each device
contributes at most once (Fed3R samples every client once, [P] §III-B); a device that dropped
out or timed out may be asked again up to ``max_attempts`` times. Rounds of κ devices follow the
paper's simulation of Fed3R "rounds"; after ⌈K/κ⌉ successful rounds the solution is final.

Streaming (``streaming``): a device that gathers new data contributes again. Its task says how
many of its samples the job holds (``from_sample`` = Σ n of its applied increments), and the
device sends the statistics of the samples after those only; a result whose ``from_sample``
is not exactly that count is refused (a retry of a counted increment, a gap), so no sample is
ever counted twice or skipped. Because the statistics are sums, the model after each increment
is exactly the ridge solution on every sample received so far. A device that delivered is asked
again in a later round; one that answers "no new samples" (a decline) or fails ``max_attempts``
times in a row is not, and the job is done when no device is left to ask.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import numpy as np

from protocols.device_inbox import TensorShape
from protocols.envelope import Envelope, EnvelopeError, body_field
from protocols.payloads.fed3r import (B_FORMATS, CENTER_TENSOR, KIND, STATS_DTYPES, Fed3RStats, Fed3RStatsParams,
                                      RandomFeaturesSpec, parse_stats)
from protocols.rounds import RoundClosed

from aggregator.strategies.dp_fed3r import (DP_RELEASES, MECHANISMS, CalibratedSSP, Fed3RMechanism, Fed3RSensitivity, NoisyFed3R,
                                            check_bounded)
from aggregator.strategies.dp_center import PrivateFeatureCenter
from aggregator.strategies.fed3r import Fed3R
from aggregator.jobs.base import SplitValidation
from aggregator.jobs.config_limits import FLAG, MAX_ATTEMPTS, MAX_SAMPLES, Fields, OneOf, Range, limited
from aggregator.jobs.model_fields import ModelFields
from aggregator.jobs.privacy_fields import PrivacyBudgetFields
from aggregator.jobs.robustness_fields import Fed3RRobustnessFields
from aggregator.strategies.robust_fed3r import dominant_class, energy_per_sample
from aggregator.jobs.scheduling import OncePerDevice


RANDOM_FEATURES = Fields({"seed": (int, Range(0, 2 ** 32 - 1)), "dim": (int, Range(1, 8192)),
                          "sigma": (float, Range(1e-12, 1e12))})


@dataclass
class Fed3RConfig(Fed3RRobustnessFields, PrivacyBudgetFields, ModelFields):
    job_id: str = "fed3r"
    lam: float = limited(0.01, Range(1e-12, 1e12))
    fit_intercept: bool = limited(True, FLAG)
    normalize_columns: bool = limited(True, FLAG)
    random_features: dict | None = limited(None, RANDOM_FEATURES)     # {"seed": int, "dim": D, "sigma": float}
    max_attempts: int = limited(3, MAX_ATTEMPTS)
    b_format: str = limited("sparse", OneOf(B_FORMATS))
    stats_dtype: str = limited("float64", OneOf(STATS_DTYPES))
    # devices with fewer samples than features may send R (exact, smaller)
    factor_uploads: bool = limited(True, FLAG)
    streaming: bool = limited(False, FLAG)   # ask devices again: each sends only the samples the job lacks
    # devices clip each feature row to this L2 norm (0: no clipping; DP needs it)
    feature_clip_norm: float = limited(0.0, Range(0, 1e6))
    # per device: the samples a clipped (DP) device's statistics weigh at most (``weighs_samples``)
    max_samples: int = limited(10_000, MAX_SAMPLES)
    # aggregator/strategies/dp_fed3r.py: "ssp" or "gaussian"
    dp_mechanism: str = limited("ssp", OneOf(tuple(MECHANISMS)))
    dp_b_share: float = limited(0.2, Range(1e-3, 0.999))   # ssp: the share of the release's budget spent on B
    # > 0: a first round of this many devices releases the features' mean; later devices centre on it
    # (aggregator/strategies/dp_center.py)
    dp_center_devices: int = limited(0, Range(0, 10_000_000))
    dp_center_clip_norm: float = limited(0.0, Range(0, 1e6))   # F_c: the clip of the centred rows (> 0 when centring)
    # > 0: a round of the model opens only with this many devices; each round is a release with noise
    # of its own, so a late round of a few devices would cost more accuracy than they add
    dp_min_round_devices: int = limited(0, Range(0, 10_000_000))
    # "round": each round's sum is released (noised) at its close; "end": closed rounds' sums are held
    # exactly and released once, when the job ends: one release's noise however many rounds ran, no
    # model before the end (aggregator/strategies/dp_fed3r.py, NoisyFed3R)
    dp_release: str = limited("round", OneOf(DP_RELEASES))

    def __post_init__(self):
        super().__post_init__()
        self.check_robustness()
        if self.dp:
            if self.streaming:
                raise ValueError("a DP Fed3R job cannot stream: each increment would be another release of a device")
            if self.feature_clip_norm <= 0:
                raise ValueError("a DP Fed3R job needs feature_clip_norm > 0 (it bounds each device's statistics)")
            if self.dp_mechanism not in MECHANISMS:
                raise ValueError(f"dp_mechanism must be one of {sorted(MECHANISMS)}, got {self.dp_mechanism!r}")
            self.check_centering()
            self.mechanism()                 # refuses a bad dp_b_share before anything runs
            self.refuse_over_budget(1)       # every device is in one noisy round sum: one release in all
        elif self.dp_center_devices or self.dp_min_round_devices or self.dp_release != "round":
            raise ValueError("dp_center_devices, dp_min_round_devices and dp_release need DP (dp_noise_multiplier > 0)")

    def check_centering(self) -> None:
        if not self.dp_center_devices:
            return
        if not self.fit_intercept or self.random_features:
            raise ValueError("dp_center_devices needs fit_intercept (the bias absorbs the shift) and no "
                             "random_features (the center shifts the backbone's features)")
        if self.dp_center_clip_norm <= 0:
            raise ValueError("dp_center_devices needs dp_center_clip_norm > 0: the clip of the centred rows, "
                             "about the median distance of a feature row from the mean")
        if self.dp_center_clip_norm > self.feature_clip_norm:
            # a round's sum (the service's or a shard's) re-reads its stored results under the loose
            # clip F; centring only takes the shared mean out of a row, so F_c > F would buy nothing
            raise ValueError(f"dp_center_clip_norm {self.dp_center_clip_norm} must not exceed feature_clip_norm "
                             f"{self.feature_clip_norm}: the centred rows' clip is the tighter one")

    def task_tensors(self) -> dict[str, TensorShape]:
        """A centred round's task carries the released feature center (``dp_center.py``: float64)."""
        return {CENTER_TENSOR: ("float64", (self.feature_dim,))} if self.dp_center_devices else {}

    @property
    def weighs_samples(self) -> bool:
        """Whether devices cap their samples by weight (``cap_by_weight``): a clipped job's devices
        weigh each of their n samples min(1, max_samples/n) rather than keeping their first
        max_samples, the same bound on what one device adds with none of its data left out (about
        0.2 points at ε = 1 on 100,000 devices, ``bench/dp_fleet_scale.py``). Not when streaming:
        the job counts the samples it holds of a device to ask for the next ones."""
        return self.feature_clip_norm > 0 and not self.streaming

    @property
    def row_clip_norm(self) -> float:
        """The clip of the rows the model's released sums hold: F_c when centring, else F."""
        return self.dp_center_clip_norm if self.dp_center_devices else self.feature_clip_norm

    def accounting(self) -> str:
        return MECHANISMS[self.dp_mechanism].accounting

    def mechanism(self) -> Fed3RMechanism:
        """The DP mechanism of the job's one release (``aggregator.strategies.dp_fed3r``)."""
        sensitivity = Fed3RSensitivity.of(self.max_samples, self.row_clip_norm, self.fit_intercept)
        if self.dp_mechanism == CalibratedSSP.name:
            return CalibratedSSP(self.dp_noise_multiplier, sensitivity, self.dp_b_share)
        return MECHANISMS[self.dp_mechanism](self.dp_noise_multiplier, sensitivity)

    @property
    def p(self) -> int:
        base = self.random_features["dim"] if self.random_features else self.feature_dim
        return base + (1 if self.fit_intercept else 0)

    @property
    def head_inputs(self) -> int:
        # the strategy's B is (p x C): with random features p is their dim, whatever feature_dim says
        return max(self.p, self.feature_dim + 1)

    @property
    def head_inputs_field(self) -> str:
        return "random_features.dim" if self.random_features else "feature_dim"

    def task_params(self) -> Fed3RStatsParams:
        rf = self.random_features
        clipped = self.feature_clip_norm > 0
        return Fed3RStatsParams(
            self.model_spec(), self.fit_intercept, None if rf is None else RandomFeaturesSpec(rf["dim"], rf["sigma"], rf["seed"]),
            self.b_format, self.stats_dtype, self.factor_uploads and self.b_format == "sparse",
            feature_clip_norm=self.feature_clip_norm if clipped else None,
            max_samples=self.max_samples if clipped else None, cap_samples=True if clipped else None,
            cap_by_weight=True if self.weighs_samples else None)


@dataclass
class Fed3RJob(OncePerDevice, SplitValidation):
    config: Fed3RConfig
    strategy: Fed3R = None
    contributed: dict[str, int] = field(default_factory=dict)      # device -> n samples
    attempts: dict[str, int] = field(default_factory=dict)
    round: int = 0
    kind: str = KIND
    energies: dict[str, float] = field(default_factory=dict)     # device -> energy per sample (the screen's input)
    classes: dict[str, int | None] = field(default_factory=dict)  # device -> its dominant class (the screen's groups)
    screened_out: dict[str, str] = field(default_factory=dict)   # device -> why, at the last round close

    @property
    def order_free(self) -> bool:
        """The model depends only on *which* statistics were summed, not on their order; under DP it
        moves only when a round's noisy sum is released, which is never re-summed without noise."""
        return not self.config.dp

    @property
    def evaluate_at_round_close(self) -> bool:
        return self.config.dp           # the noisy round sum is released at round close

    @property
    def canonical_round_sums(self) -> bool:
        """Each round's sum is noised at its close: the service hands it the round's stored statistics
        summed up the canonical bucket tree first (:meth:`take_round_sum`), as a sharded job's
        coordinator hands it its shards' sums, so the release is the same bits either way."""
        return self.config.dp

    @property
    def model_held(self) -> bool:
        return isinstance(self.strategy, NoisyFed3R) and self.strategy.unreleased

    def take_round_sum(self, state: dict[str, np.ndarray] | None) -> None:
        """The closing round's statistics as one Fed3R state (None: none), in place of their arrival-order sum."""
        self.strategy.take_round_sum(state)

    def expect_round_sums(self) -> None:
        self._sums_handed = True        # apply() records a contribution without adding it twice

    def __post_init__(self):
        c = self.config
        self._bound, self._screen = c.feature_bound(), c.energy_screen()
        if self.strategy is None and c.dp:
            # a center round of fewer than half its m devices is dropped, not released (dp_center.py)
            center = None if not c.dp_center_devices else PrivateFeatureCenter(
                c.num_classes, c.p, c.dp_noise_multiplier, c.max_samples, c.feature_clip_norm,
                min_devices=(c.dp_center_devices + 1) // 2)
            self.strategy = NoisyFed3R(c.num_classes, c.p, c.lam, c.fit_intercept, c.normalize_columns, c.mechanism(),
                                       center=center, release_at_end=c.dp_release == "end")
        elif self.strategy is None:
            self.strategy = Fed3R(c.num_classes, c.p, c.lam, c.fit_intercept, c.normalize_columns)
        self._rng = random.Random(self.config.seed)
        self._sums_handed = False

    @property
    def contributions(self) -> int:
        return self.strategy.n_contributions

    def eligible(self, online: set[str]) -> list[str]:
        if not self.config.streaming:
            return super().eligible(online)
        return sorted(d for d in online if self.attempts.get(d, 0) < self.config.max_attempts)

    @property
    def centering(self) -> bool:
        """The round in progress is DP's center round (``dp_center.py``): its sum releases the center only."""
        return isinstance(self.strategy, NoisyFed3R) and self.strategy.centering

    @property
    def _centred(self) -> bool:
        """Devices now centre their rows on the released feature center (``dp_center.py``)."""
        return isinstance(self.strategy, NoisyFed3R) and self.strategy.center is not None and not self.strategy.centering

    def next_participants(self, online: set[str], size: int | None = None) -> list[str]:
        if self.centering:
            # the center round: the operator's m devices, not whoever is online first (a center of a
            # few devices would be mostly noise, and the job's one release of them cannot be redone)
            if len(self.eligible(online)) < self.config.dp_center_devices:
                return []
            size = self.config.dp_center_devices
        elif min(size or self.config.clients_per_round, len(self.eligible(online))) < self.config.dp_min_round_devices:
            return []           # a release this small would add a release's noise for a few devices' signal
        return super().next_participants(online, size)

    def finished(self, online: set[str], known: set[str]) -> bool:
        """No known device left to ask, or (``dp_min_round_devices``) too few for a round of the model."""
        left = len(self.eligible(known | online))
        if self.config.dp_min_round_devices and not self.centering:
            return left < self.config.dp_min_round_devices
        return left == 0

    def task_for(self, device: str) -> tuple[dict, dict[str, np.ndarray]]:
        params, tensors = self.stats_task(device)
        return params.to_params(), tensors

    def stats_task(self, device: str) -> tuple[Fed3RStatsParams, dict[str, np.ndarray]]:
        """The statistics ``device`` computes now: the job's, from where the job holds its samples
        (streaming), centred on the released feature center with its clip F_c (DP with a center)."""
        params = self.config.task_params()
        if self.config.streaming:
            params = dataclasses.replace(params, from_sample=self.contributed.get(device, 0))
        if self._centred:
            params = dataclasses.replace(params, centered=True, feature_clip_norm=self.config.dp_center_clip_norm)
            return params, {CENTER_TENSOR: self.strategy.center.value}
        return params, {}

    def parse_result(self, env: Envelope) -> Fed3RStats:
        return self._check_increment(env, self.check_payload(env))

    def check_payload(self, env: Envelope) -> Fed3RStats:
        """Every check that depends on the message alone, none on the job's state: what an ingest
        worker (a copy of the job built from its config) runs."""
        c = self.config
        stats = parse_stats(env, c.p, c.num_classes, fit_intercept=c.fit_intercept,
                            positive_definite=self.strategy.positive_definite, weighed=c.weighs_samples)
        try:
            if c.dp:                            # the clipping the privacy guarantee rests on: said first
                # (the loosest of the job's two clips here; the centred rounds' own below, in _check_increment)
                check_bounded(stats, c.max_samples, max(c.feature_clip_norm, c.row_clip_norm), c.fit_intercept)
            self._bound.check(stats)            # bounded influence (aggregator/strategies/robust_fed3r.py)
        except ValueError as exc:
            raise EnvelopeError(f"{KIND}: {exc}") from None
        return stats

    def _check_increment(self, env: Envelope, stats: Fed3RStats) -> Fed3RStats:
        """Streaming: an increment must start exactly at the samples the job holds of its device.
        Centring: a result of the centred rounds is within their clip, one of the center round
        within the first clip."""
        c = self.config
        if c.dp and c.dp_center_devices and self._centred:
            self.check_centred_clip(self.centred_clip_breach(stats))
        if self.config.streaming:
            self.check_increment_start(env.sender, body_field(env, "from_sample", int), stats.n)
        return stats

    def centred_clip_breach(self, stats: Fed3RStats) -> str:
        """DP with a center: why ``stats`` break the centred rounds' clip F_c ("": within it). What a
        shard's receipt carries (which round takes the result is the job's state); the center
        round's clip F is ``check_payload``'s (F_c ≤ F)."""
        c = self.config
        try:
            check_bounded(stats, c.max_samples, c.dp_center_clip_norm, c.fit_intercept)
        except ValueError as exc:
            return str(exc)
        return ""

    def check_centred_clip(self, breach: str) -> None:
        """A centred round's result must be within F_c (``centred_clip_breach``)."""
        if self._centred and breach:
            raise EnvelopeError(f"{KIND}: {breach}")

    def check_increment_start(self, device: str, start: int, n: int) -> None:
        """Streaming: an increment of ``n`` samples must start exactly at the samples the job holds of
        ``device`` (here, and on a shard coordinator for the increment a receipt names), and the
        device's samples in all stay within the per-device cap (a review's finding: each increment
        was capped alone, so a device claiming the cap every round grew its weight without end)."""
        held = self.contributed.get(device, 0)
        if start != held:
            raise EnvelopeError(f"{KIND}: increment from sample {start}, the job holds {held} samples of "
                                f"{device} (already counted, or a gap)")
        if held + n > self._bound.max_samples:
            raise EnvelopeError(f"{KIND}: {held} + {n} samples of {device} exceed the job's cap of "
                                f"{self._bound.max_samples} per device")

    def parse_accepted(self, env: Envelope) -> Fed3RStats:
        """A result whose bytes passed ``check_payload`` before (in an ingest worker, or when the
        store kept them): ``parse_result`` without the Gram matrix's Cholesky factorisation, which
        costs more than everything else together. Checks against the job's state belong here too."""
        c = self.config
        return self._check_increment(env, parse_stats(env, c.p, c.num_classes, fit_intercept=c.fit_intercept,
                                                      checked=True, weighed=c.weighs_samples))

    def close_round(self, closed: RoundClosed) -> None:
        if self.config.dp:
            self.strategy.release()   # the round's sum, noised, joins the released sums
        # without DP Fed3R is purely additive; the fleet screen runs over every device seen so far,
        # and the service quarantines what it names (the job is rebuilt from the store without it)
        self.screened_out = self._screen.outliers(self.energies, self.contributed, self.classes)

    def finalize(self) -> bool:
        """``dp_release`` "end": the held sums of every closed round are released now, noised once."""
        return isinstance(self.strategy, NoisyFed3R) and self.strategy.release_held()

    def model_arrays(self) -> dict[str, np.ndarray]:
        m = self.strategy.solve()
        return {"coef": m.coef_, "intercept": m.intercept_, "raw_weights": m.raw_weights_}

    def state_dict(self) -> dict[str, np.ndarray]:
        return self.strategy.state_dict()

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        self.strategy.load_state_dict(state)

    def apply(self, device: str, stats: Fed3RStats) -> None:
        self._check_may_contribute(device)
        if not self._sums_handed:        # DP under a service with a store: the round's sum comes at its close
            self.strategy.add(stats)
        intercept = self.config.fit_intercept
        if self._screen.active:
            self.record_contribution(device, stats.n, energy_per_sample(stats, intercept),
                                     dominant_class(stats, intercept))
        else:
            self.record_contribution(device, stats.n, None)

    def record_contribution(self, device: str, n: int, energy: float | None, dominant: int | None = None) -> None:
        """What the job keeps of a device's applied contribution besides its sums: its samples, its
        energy per sample and dominant class (for the fleet screen), its attempts (a shard
        coordinator's receipts too)."""
        self._check_may_contribute(device)
        self.contributed[device] = self.contributed.get(device, 0) + n
        if energy is not None and self._screen.active:
            self.energies[device] = energy
            self.classes[device] = dominant
        if self.config.streaming:
            self.attempts[device] = 0       # delivered: it may be asked again for what it gathers next

    def _check_may_contribute(self, device: str) -> None:
        if device in self.contributed and not self.config.streaming:
            raise ValueError(f"{device} already contributed")  # the round machine prevents this

    def evaluate(self, features: np.ndarray | None, labels: np.ndarray | None) -> dict:
        out = {"round": self.round, "contributions": self.contributions,
               "samples": self.strategy.n_samples}
        if self.model_held:
            out["held_until_job_end"] = True        # dp_release "end": no model is released before it
        elif features is not None:
            model = self.strategy.solve()
            Z = features
            if self.config.random_features:
                Z = _rf_for(self.config).transform(Z)
            out["accuracy"] = model.score(Z, labels)
        # the center round is a release too (of other devices: parallel composition keeps it one in all)
        report = self.config.privacy_report(1 if self.contributions or self._centred else 0)
        if report is not None:
            # ... but each round's (group's) sum carries noise of its own: the model holds this many
            # releases' noise variance, which is what more rounds or retries cost in accuracy
            out["privacy"] = {**report, "noisy_sums": self.strategy.releases}
        return out

    def model(self):
        return self.strategy.solve()

    def screened_devices(self) -> dict[str, str]:
        return self.screened_out

    def bookkeeping(self) -> dict:
        return {**super().bookkeeping(), "energies": dict(self.energies), "classes": dict(self.classes)}

    def restore_bookkeeping(self, state: dict) -> None:
        super().restore_bookkeeping(state)
        # merged with what the replay re-applied (and re-measured); a device whose contribution the
        # job no longer holds (quarantined since) is no longer part of the fleet
        kept = {d: float(e) for d, e in state.get("energies", {}).items() if d in self.contributed}
        self.energies = {**kept, **self.energies}
        classes = {d: None if c is None else int(c) for d, c in state.get("classes", {}).items() if d in kept}
        self.classes = {**classes, **self.classes}


_RF_CACHE: dict = {}


def _rf_for(cfg: Fed3RConfig):
    from protocols.random_features import RandomFourierFeatures

    rf = cfg.random_features
    key = (rf["seed"], rf["dim"], rf["sigma"], cfg.feature_dim)
    if key not in _RF_CACHE:
        _RF_CACHE[key] = RandomFourierFeatures(rf["dim"], rf["sigma"], rf["seed"]).fit(n_features=cfg.feature_dim)
    return _RF_CACHE[key]
