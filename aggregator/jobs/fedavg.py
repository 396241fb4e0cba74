"""A FedAvg(ψ) job: rounds of local head training on κ sampled devices, averaged by a strategy.

Pure logic (no MQTT, no clock), driven by ``aggregator.service.loop`` like the Fed3R job. Life of
a round:

1. ``next_participants(online)`` draws κ of the online devices (the config's participant draw over
   the sorted pool: seeded, so a seed fixes the whole participation schedule, or secret under
   sampled DP, ``participant_draw.py``) and opens round t.
2. ``task_for(device)`` sends the global head *as of the opening* ({"weight" (C, d),
   "bias" (C,)} float32) and the local recipe (epochs, batch, lr, wd, T, a per-device seed, the
   local step rule: SGD, FedProx, FedSAM or FedASAM).
3. ``apply`` keeps each accepted update for the round (its tensors and weight n_k).
   An update is applied only if it names the open round and comes from one of its
   participants; anything else (a late result of a closed round that slipped past the round
   machine, a stranger) is discarded and counted in ``late_discarded``: a late update never
   reaches a later round's average.
4. ``close_round`` (all answered, or the deadline passed: stragglers are simply missing)
   bounds each update's norm and weight (a round of fewer than three updates by the limits of
   earlier rounds too; one of one update moves nothing before there are any), screens updates
   that oppose the round's median,
   combines the rest with the job's rule (the weighted mean, or a robust one), steps along the
   round history's momentum (``aggregator/strategies/robust_fedavg.py``) and takes one server
   step with the strategy (FedAvg / FedAvgM, or FedOpt's Adam / Yogi / Adagrad:
   ``server_optimizer``). A round with no update leaves the head, the history and the server
   optimizer's state unchanged.

Initialisation (``init``): "random" (nn.Linear's U(±1/√d), seeded), "zeros", or "fed3r": the
normalised Fed3R classifier, bias included (:meth:`FedAvgJob.from_fed3r`), i.e. Fed3R+FT(ψ).
Learning-rate rule (spec §4): devices get ``client_lr`` × 0.1 when the head is Fed3R-initialised.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import zlib
from dataclasses import dataclass, field

import numpy as np

from protocols.device_inbox import TensorShape
from protocols.envelope import Envelope, body_field
from protocols.payloads.fedavg import (KIND, HeadTrainingParams, HeadUpdate, LocalTraining, ModelUpdate, head_tensors,
                                      parse_head_update)
from protocols.rounds import RoundClosed

from aggregator.compute.evaluation import head_accuracy
from aggregator.strategies.dp_fedavg import DPFedAvg
from aggregator.strategies.fedavg import ServerOptimizer
from aggregator.jobs.base import Job
from aggregator.jobs.input_files import read_job_arrays
from aggregator.jobs.config_limits import (BATCH_SIZE, LOCAL_EPOCHS, PATH, ROUNDS, TEMPERATURE, WEIGHT_DECAY, OneOf,
                                           Range, limited)
from aggregator.jobs.model_fields import ModelFields
from aggregator.jobs.optimizer_fields import LocalRuleFields, ServedModelFields, ServerOptimizerFields
from aggregator.jobs.participant_draw import draw_state, resumed_draw
from aggregator.jobs.privacy_fields import UpdateClippingFields
from aggregator.jobs.recent_log import RecentLog
from aggregator.jobs.robustness_fields import FedAvgRobustnessFields
from aggregator.shards.fedavg_sums import local_dp_round_step, local_round_mean

log = logging.getLogger("fedfleet.aggregator")

INITS = ("random", "zeros", "fed3r")
FED3R_INIT_LR_FACTOR = 0.1


@dataclass
class FedAvgConfig(ServerOptimizerFields, LocalRuleFields, ServedModelFields, FedAvgRobustnessFields, UpdateClippingFields, ModelFields):
    job_id: str = "fedavg"
    rounds: int = limited(100, ROUNDS)
    local_epochs: int = limited(1, LOCAL_EPOCHS)
    batch_size: int = limited(50, BATCH_SIZE)
    client_lr: float = limited(0.1, Range(1e-12, 100))  # base local LR (× 0.1 when init == "fed3r"); > 0 as the task's
    weight_decay: float = limited(4e-5, WEIGHT_DECAY)
    temperature: float = limited(0.1, TEMPERATURE)
    init: str = limited("random", OneOf(INITS))
    initial_head_file: str = limited("", PATH)   # init == "fed3r": a Fed3R job's model.npz (coef, intercept)
    # init == "fed3r": the starting head × this. The same predictions, with logit margins this many
    # times wider at T: unit-norm Fed3R columns leave small margins, and the first label-skewed
    # rounds then flip many predictions (bench/ft_init_scale.py: on the demo's data 30 rounds end
    # -1.16 points below Fed3R at 1, +0.01 at 10)
    init_scale: float = limited(1.0, Range(1e-3, 1e3))

    def __post_init__(self):
        super().__post_init__()
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")
        if isinstance(self.init_scale, bool) or not isinstance(self.init_scale, (int, float)) \
                or not math.isfinite(self.init_scale) or not 1e-3 <= self.init_scale <= 1e3:
            raise ValueError(f"init_scale must be a number in [0.001, 1000], got {self.init_scale!r}")
        if self.rounds < 1 or self.clients_per_round < 1:
            raise ValueError("rounds and clients_per_round must be >= 1")
        self.check_update_clipping()
        self.check_robust_aggregation()
        self.check_server_optimizer()
        self.local_rule_recipe()
        self.served_model_rule()
        self.check_served_model_memory(self.num_classes * self.head_inputs)

    def check_stored(self) -> None:
        super().check_stored()
        if self.init == "fed3r" and not self.initial_head_file:   # from_fed3r hands the head itself
            raise ValueError("init 'fed3r' needs initial_head_file (a Fed3R job's model.npz)")

    def task_tensors(self) -> dict[str, TensorShape]:
        return self.head_task_tensors()         # FedAvgJob.task_for: the head (a tail kind's tail besides)

    def trained_shapes(self) -> dict[str, tuple[int, ...]] | None:
        """The tensors a device trains and sends back, in wire order, with their shapes
        (``FedAvgJob.trained_shapes``): the head's, from the config alone, so a secure kind's vector
        is known before its job is built; None where the initial model says (a tail program)."""
        return {name: shape for name, (_, shape) in self.head_task_tensors().items()}

    @property
    def device_lr(self) -> float:
        return self.client_lr * self.device_lr_factor

    @property
    def device_lr_factor(self) -> float:
        return FED3R_INIT_LR_FACTOR if self.init == "fed3r" else 1.0

    def device_params(self, seed: int, client_lr: float | None = None) -> HeadTrainingParams:
        """A task's params: the model, the local recipe (with this device's batch seed and the round's
        client LR, default ``client_lr``; × 0.1 after a Fed3R init) and step rule."""
        lr = self.device_lr if client_lr is None else client_lr * self.device_lr_factor
        return HeadTrainingParams(self.model_spec(), self.feature_dim, LocalTraining(
            self.local_epochs, self.batch_size, lr, self.weight_decay, self.temperature, seed,
            self.local_rule_recipe()))


@dataclass(frozen=True)
class RoundUpdate:
    """A validated update plus the round its message names (checked again in ``apply``)."""

    round: int
    update: HeadUpdate | ModelUpdate


def random_head(num_classes: int, feature_dim: int, seed: int) -> dict[str, np.ndarray]:
    """nn.Linear's default init, U(−1/√d, 1/√d) for weight and bias, from a numpy seed."""
    rng = np.random.default_rng(seed)
    bound = 1.0 / np.sqrt(feature_dim)
    return {"weight": rng.uniform(-bound, bound, (num_classes, feature_dim)).astype(np.float32),
            "bias": rng.uniform(-bound, bound, num_classes).astype(np.float32)}


@dataclass
class FedAvgJob(Job):
    config: FedAvgConfig
    initial_head: dict[str, np.ndarray] | None = None
    strategy: ServerOptimizer | None = None
    contributed: dict[str, int] = field(default_factory=dict)     # device -> accepted updates
    round: int = 0
    kind: str = KIND
    # The server step happens at round close: evaluations taken per contribution would all see
    # the previous round's model, so the service evaluates after each close as well.
    evaluate_at_round_close = True

    def __post_init__(self):
        c = self.config
        if self.strategy is None:
            self.strategy = c.server_step()
        # Central DP (DP-FedAvg) wraps the server step; the secure variant gets its noise from the devices.
        self.dp: DPFedAvg | None = None
        if c.dp:
            self.dp = DPFedAvg(self.strategy, c.dp_noise_multiplier, c.clip_rule(), c.clients_per_round)
        if c.init == "fed3r" and self.initial_head is None and c.initial_head_file:
            # A finished Fed3R job's output: the normalised classifier, bias included ([P] §III-D).
            fed3r_model = read_job_arrays(c.initial_head_file, "initial_head_file")
            self.initial_head = {"weight": fed3r_model["coef"], "bias": fed3r_model["intercept"]}
        if c.init == "fed3r" and self.initial_head is None:
            raise ValueError("init='fed3r' needs initial_head_file (a Fed3R model.npz) or FedAvgJob.from_fed3r")
        if self.initial_head is not None:
            scale = c.init_scale if c.init == "fed3r" else 1.0
            head = head_tensors(np.asarray(self.initial_head["weight"]) * scale,
                                np.asarray(self.initial_head["bias"]) * scale)
            if head["weight"].shape != (c.num_classes, c.feature_dim):
                raise ValueError(f"initial head is {head['weight'].shape}, job is ({c.num_classes}, {c.feature_dim})")
        elif c.init == "zeros":
            head = head_tensors(np.zeros((c.num_classes, c.feature_dim)), np.zeros(c.num_classes))
        else:
            head = random_head(c.num_classes, c.feature_dim, c.seed)
        self.params: dict[str, np.ndarray] = head
        self.served = c.served_model_rule()      # what is evaluated, reported, saved: w^t, SWA or WiMA
        self.history = c.round_history()      # bounded influence's state across rounds (checkpointed)
        self.small_rounds = c.small_rounds()  # the reference rounds of fewer than 3 updates are bounded by (too)
        self._rng = c.participant_draw()       # secret when DP counts on sampling
        self._open = False
        self._participants: frozenset[str] = frozenset()
        self._updates: dict[str, tuple[dict[str, np.ndarray], int]] = {}   # this round's, by device
        self.late_discarded = 0
        self.samples = 0                  # Σ n_k over applied updates (all rounds)
        self.round_log = RecentLog()

    @classmethod
    def from_fed3r(cls, config: FedAvgConfig, ridge_model) -> "FedAvgJob":
        """Fed3R+FT(ψ): start from a fitted ``ClosedFormRidge`` (normalised coef_ (C, d), intercept_ (C,))."""
        if ridge_model.coef_.shape != (config.num_classes, config.feature_dim):
            raise ValueError(f"Fed3R classifier is {ridge_model.coef_.shape}, job needs "
                             f"({config.num_classes}, {config.feature_dim}); fit with fit_intercept and "
                             "without random features")
        if config.init != "fed3r":
            config = dataclasses.replace(config, init="fed3r")      # keeps a subclass's fields
        return cls(config, initial_head={"weight": ridge_model.coef_, "bias": ridge_model.intercept_})

    # ------------------------------------------------------------------ scheduling
    @property
    def budget_exhausted(self) -> bool:
        """Whether one more round would exceed the job's privacy budget (it then stops, done)."""
        return self.config.budget_exhausted(self.round)

    def next_participants(self, online: set[str]) -> list[str]:
        """Seeded sample of up to κ online devices (fewer under DP with sampling: ``round_size``);
        opens the next round. [] when done or nobody is there."""
        self.waiting = None
        if self._open or self.round >= self.config.rounds or self.budget_exhausted:
            return []
        pool = sorted(online)
        self.waiting = self.config.pool_too_small(len(pool)) if pool else None
        k = self.config.round_size(len(pool), self._rng)
        if not k:
            return []
        chosen = sorted(self._rng.sample(pool, k))
        self.round += 1
        self._open = True
        self._participants = frozenset(chosen)
        self._updates = {}
        return chosen

    def finished(self, online: set[str], known: set[str]) -> bool:
        return (self.round >= self.config.rounds or self.budget_exhausted) and not self._open

    @property
    def contributions(self) -> int:
        return sum(self.contributed.values())

    def task_params(self, device: str) -> HeadTrainingParams:
        """What ``task_for`` sends as params (subclasses extend it with their kind's fields)."""
        c = self.config
        seed = zlib.crc32(f"{c.seed}:{self.round}:{device}".encode())
        return c.device_params(seed, self.served.client_lr(self.round, c.client_lr))

    def task_for(self, device: str) -> tuple[dict, dict[str, np.ndarray]]:
        return self.task_params(device).to_params(), {k: v.copy() for k, v in self.params.items()}

    # ------------------------------------------------------------------ results
    def trained_shapes(self) -> dict[str, tuple[int, ...]]:
        """The tensors a device trains and sends back, in wire order, with their shapes (the
        config's: the head built here has its shape)."""
        return self.config.trained_shapes()

    def parse_result(self, env: Envelope) -> RoundUpdate:
        update = parse_head_update(env, self.config.num_classes, self.config.feature_dim)
        return RoundUpdate(body_field(env, "round", int), update)

    def apply(self, device: str, payload: RoundUpdate) -> None:
        if self.admits(device, payload.round, self._updates):
            self._updates[device] = (payload.update.tensors(), payload.update.n)
            self.record_update(device, payload.update.n)

    def admits(self, device: str, round_: int, applied) -> bool:
        """Whether an update of ``device`` naming ``round_`` belongs to the open round (``applied``:
        the devices it holds already); counted in ``late_discarded`` when it does not."""
        if self._open and round_ == self.round and device in self._participants and device not in applied:
            return True
        # The round machine answers these `late`/`duplicate` before they get here; if one
        # slips through anyway it is dropped, never averaged into another round.
        self.late_discarded += 1
        log.warning("discarded update from %s for round %d (open round: %s)", device, round_,
                    self.round if self._open else "none")
        return False

    def record_update(self, device: str, n: int) -> None:
        """What the job keeps of an admitted update besides its tensors (reports, DP accounting)."""
        self.contributed[device] = self.contributed.get(device, 0) + 1
        self.samples += n

    def round_mean(self) -> tuple[dict[str, np.ndarray] | None, int, int]:
        """(the round's combined tensors or None, updates, Σ n_k) of the round being closed:
        Σ n_k θ_k / Σ n_k with every bounded-influence layer off. The layers measure each update
        from the point the devices trained from (:meth:`round_start`)."""
        # Bounded influence (aggregator/strategies/robust_fedavg.py): the norm and contribution
        # bounds, the direction screen, then the job's rule.
        # A round of fewer than three updates is bounded by the reference of earlier rounds too, and
        # the round's limits and statistics go to it (SmallRoundReference): this is the round's close.
        devices, current, updates = self._round_updates()
        if not updates:
            return None, 0, 0
        samples = sum(n for _, n in updates)
        if not self.config.needs_every_update():
            # sums that shards can split: added up the canonical bucket tree, as K shards would
            # add them (aggregator/shards/fedavg_sums.py), so one aggregator's bits are theirs
            held = self.small_rounds.holds(len(updates))
            combined = local_round_mean(self.config, current, self._updates, self.small_rounds)
            if held:
                log.warning("round %d: %s", self.round, self.small_rounds.HELD)
            return combined, (len(updates) if combined is not None else 0), samples
        combined, report, (limits, statistics) = self.config.robust_aggregation().aggregate_measured(
            current, updates, self.small_rounds)
        self.small_rounds.observe(len(updates), limits, None if statistics is None else dict(zip(devices, statistics)))
        if report.get("skipped") or report.get("norm_bounded") or report.get("screened"):
            log.warning("round %d: %s", self.round, report)
        return combined, (len(updates) if combined is not None else 0), samples

    def _round_updates(self) -> tuple[list[str], dict[str, np.ndarray], list]:
        """(devices, the tensors they trained from, their updates) of the round being closed, in
        device-id order: the result depends on which updates arrived, never on their arrival order
        (a restarted aggregator reproduces the model bit for bit)."""
        devices = sorted(self._updates)
        updates = [self._updates[d] for d in devices]
        start = self.round_start() if updates else {}
        return devices, ({name: start[name] for name in updates[0][0]} if updates else {}), updates

    def left_out(self) -> set[str]:
        """The devices of the round being closed whose update does not reach the rule (the direction
        screen's, or all of them when the round has too few for the rule): what a round also sums of
        its devices follows (Scaffold's Δc). Only where the round is combined whole (a config that
        needs every update, which shards refuse), or a round of one that moves nothing for want of
        a reference (``SmallRoundReference``; a sharded round leaves it out the same way); none otherwise."""
        if self.small_rounds.holds(len(self._updates)):
            return set(self._updates)
        if not self.config.needs_every_update():
            return set()
        devices, current, updates = self._round_updates()
        if not updates:
            return set()
        kept = self.config.robust_aggregation().kept(current, updates, self.small_rounds)
        return {d for d, k in zip(devices, kept) if not k}

    def round_step(self) -> tuple[dict[str, np.ndarray] | None, int, int]:
        """(the moved tensors or None, updates, Σ n_k) of the round being closed. The strategy moves
        the tensors devices trained (all of them, or FT(φ)'s tail only); under DP every round
        moves (a round without updates still releases noise, as the accountant counts it)."""
        if self.dp is not None:         # clipped and added up the bucket tree as shards add it, noised once
            trained = {name: self.params[name] for name in self.trained_shapes()}
            return (local_dp_round_step(self.dp, trained, self._updates), len(self._updates),
                    sum(n for _, n in self._updates.values()))
        return self.server_step(*self.round_mean())

    def round_start(self) -> dict[str, np.ndarray]:
        """The tensors the open round's devices trained from (the bound layers measure updates
        from them): the global model; FedGloSS's perturbed w̃."""
        return self.params

    def server_step(self, mean: dict[str, np.ndarray] | None, updates: int, samples: int):
        """(the moved tensors or None, updates, Σ n_k) from the round's combined tensors: the round
        history, then the strategy's step (a sharded job's coordinator takes it on the shards' sums)."""
        if mean is None:
            return None, 0, 0
        current = {name: self.params[name] for name in mean}
        return self.strategy.step(current, self.history.step(current, mean)), updates, samples

    def closes(self, round_: int) -> bool:
        """Whether closing ``round_`` closes the open round (else it changes nothing)."""
        return self._open and round_ == self.round

    def close_round(self, closed: RoundClosed) -> None:
        if self.closes(closed.round):
            self.finish_round(closed, self.round_step())

    def finish_round(self, closed: RoundClosed, stepped: tuple[dict[str, np.ndarray] | None, int, int]) -> None:
        """Move to the round's stepped tensors (None: nothing moves), log it and close it."""
        moved, updates, samples = stepped
        if moved is not None:
            self.params = {**self.params, **moved}
        self.served.observe(self.round, self.params)
        self.round_log.append({"round": self.round, "updates": updates, "samples": samples,
                               "dropped": len(closed.dropped), "declined": len(closed.declined),
                               "rejected": len(closed.rejected)})
        self._open = False
        self._updates = {}

    # ------------------------------------------------------------------ model
    def evaluate(self, features: np.ndarray | None, labels: np.ndarray | None) -> dict:
        out = {"round": self.round, "contributions": self.contributions, "samples": self.samples,
               "server_steps": self.strategy.steps, "late_discarded": self.late_discarded}
        if features is not None:
            served = self.served_params()
            out["accuracy"] = head_accuracy(served["weight"], served["bias"], features, labels)
        return {**out, **self.privacy_entry()}

    def privacy_entry(self) -> dict:
        """{"privacy": ε(δ) after the rounds closed so far, ...} under DP, else {}."""
        extra = {"clip_norm": self.dp.clip.value} if self.dp is not None else {}
        return self.config.privacy_entry(self.round - (1 if self._open else 0), self.round, **extra)

    def served_params(self) -> dict[str, np.ndarray]:
        """The model the job serves: the last global model, its SWA or its window average."""
        return self.served.served(self.params)

    def model_arrays(self) -> dict[str, np.ndarray]:
        return self.served_params()

    def state_dict(self) -> dict[str, np.ndarray]:
        server = self.dp if self.dp is not None else self.strategy
        return {**{k: v.copy() for k, v in self.params.items()}, **server.state_dict(), **self.history.state_dict(),
                **self.small_rounds.state_dict(), **self.served.state_dict(),
                "round": np.array([self.round], dtype=np.int64),
                "counts": np.array([self.samples, self.late_discarded], dtype=np.int64)}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """The model, server-optimizer state and sample counts as of the last closed round."""
        self.params = head_tensors(state["weight"], state["bias"])
        (self.dp if self.dp is not None else self.strategy).load_state_dict(state)
        self.history.load_state_dict(state)
        self.small_rounds.load_state_dict(state)
        self.served.load_state_dict(state)
        self.round = int(state["round"][0])
        self.samples, self.late_discarded = (int(x) for x in state["counts"])
        self._open = False

    def bookkeeping(self) -> dict:
        """JSON-able scheduling state as of the round just opened (the service stores it with the round)."""
        return {"round": self.round, "open": self._open, "participants": sorted(self._participants),
                "rng": draw_state(self._rng)}

    def restore_bookkeeping(self, state: dict) -> None:
        """Enter the round this bookkeeping was taken at (right after it opened), unless the job is
        already in or past it (restored from a checkpoint, or replayed up to it): then only the
        sampler is restored, and the updates already replayed into an open round stay."""
        self._rng = resumed_draw(state["rng"], self.config.participant_draw())
        if int(state["round"]) <= self.round:
            return
        self.round = int(state["round"])
        self._open = bool(state["open"])
        self._participants = frozenset(state["participants"])
        self._updates = {}
