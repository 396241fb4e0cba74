"""A personalization job: push the global head to every device, collect held-out accuracy counts.

The last phase of the Fed3R → FedAvg-FT → OLL pipeline ([P] Algorithm 2, Fed3R spec §2). Each
device is asked once (``OncePerDevice``; a device that drops out is asked again, up to
``max_attempts``) to personalise the global head with OLL, optionally fine-tune it locally
(FP(ψ)), and report how many of its held-out samples the global head, the OLL head and the
OLL+FP head get right (``protocols.payloads.personalize``). The personalised heads stay on the
devices; the aggregator only learns counts, and reports the sample-weighted mean accuracy
WMA = Σ_k correct_k / Σ_k n_k of each method over the devices that answered, each device's count
n_k weighing at most ``weight_bound_multiplier`` × the median count (a device's own claim).

The global head comes from a finished job's ``model.npz``: a FedAvg job's (``weight``,
``bias``) or a Fed3R job's normalised classifier (``coef``, ``intercept``). After FT(φ)/FT(M)
(a ``fedavg-tail`` job's model) the backbone's tail was fine-tuned too: ``tail_stages`` must
then say how many stages, the task carries the ``tail.*`` tensors with the head, and devices
personalise on the fine-tuned backbone's features.

FP(ψ) learning rate: the spec's rule gives 0.1 (base) × 0.1 (Fed3R init) × 0.1 (OLL) = 1e-3,
which the spec itself calls ambiguous (§7.8). The job offers the devices candidate rates
(``fp_lrs``: a tenth of the rule, then the rule); each device picks one by cross-validation on
its own training split (``edge_client.oll.choose_fp_lr``), ties to the first. A single
candidate means "use exactly this rate".
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from protocols.device_inbox import TensorShape
from protocols.envelope import Envelope
from protocols.payloads.fedavg import TAIL_PREFIX, head_tensors
from protocols.payloads.personalize import (FALLBACKS, FP_PARTS, KIND, METHODS, PERSONAL, PersonalizationReport,
                                            PersonalizeParams, parse_report)
from protocols.rounds import RoundClosed

from aggregator.compute.evaluation import head_accuracy
from aggregator.jobs.base import Job
from aggregator.jobs.input_files import read_job_arrays
from aggregator.jobs.config_limits import (BATCH_SIZE, JOB_ID, MAX_ATTEMPTS, PATH, TAIL_STAGES, TEMPERATURE,
                                           WEIGHT_DECAY, Items, OneOf, Pattern, Range, check_whole_number, limited)
from aggregator.jobs.model_fields import ModelFields
from aggregator.jobs.personal_wma import bounded_weights, bounded_wma
from aggregator.jobs.scheduling import OncePerDevice


@dataclass
class PersonalizeConfig(ModelFields):
    job_id: str = "personalize"
    # model.npz of a finished FedAvg (weight, bias) or Fed3R (coef, intercept) job
    head_file: str = limited("", PATH)
    # > 0: head_file is a fedavg-tail model with this many fine-tuned stages
    tail_stages: int = limited(0, TAIL_STAGES)
    # held-out labels outside the local training labels: "error" | "global"
    fallback: str = limited("global", OneOf(FALLBACKS))
    fp_epochs: int = limited(25, Range(0, 10_000))       # FP(ψ) local epochs; 0: OLL only
    batch_size: int = limited(64, BATCH_SIZE)
    # preferred (on ties) first
    fp_lrs: list[float] = limited(limit=Items(Range(1e-9, 10), 16), default_factory=lambda: [1e-4, 1e-3])
    fp_folds: int = limited(5, Range(2, 100))   # cross-validation folds for the device's choice among fp_lrs
    weight_decay: float = limited(4e-5, WEIGHT_DECAY)
    temperature: float = limited(0.1, TEMPERATURE)
    max_attempts: int = limited(3, MAX_ATTEMPTS)
    # a pp/ditto job whose personal part (bias; head) each device kept: evaluated too ("": none)
    personal_job: str = limited("", Pattern(r"^(" + JOB_ID.regex.strip("^$") + r")?$"))
    # what FP fine-tunes: the head (psi), the backbone's tail (phi), both (M)
    fp_part: str = limited("psi", OneOf(FP_PARTS))
    # a device's held-out count weighs at most this x the reports' median in the WMA (0: off): the
    # counts are the devices' own claims, and one claiming n_test = 10^9 made every WMA its own
    weight_bound_multiplier: float = limited(10.0, Range(0, 1e6))

    def task_tensors(self) -> dict[str, TensorShape]:
        return self.head_task_tensors()         # with a fine-tuned tail's tensors from head_file besides

    def __post_init__(self):
        super().__post_init__()
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {self.fallback!r}")
        if self.fp_epochs < 0:
            raise ValueError("fp_epochs must be >= 0")
        if self.fp_epochs and (not self.fp_lrs or any(isinstance(lr, bool) or not isinstance(lr, (int, float))
                                                      or not np.isfinite(lr) or lr <= 0 for lr in self.fp_lrs)):
            raise ValueError(f"fp_lrs must be finite positive learning rates, got {self.fp_lrs}")
        if isinstance(self.fp_folds, bool) or not isinstance(self.fp_folds, int) or not 2 <= self.fp_folds <= 20:
            raise ValueError("fp_folds must be an integer in [2, 20]")
        check_whole_number(self, "tail_stages", 0)
        if self.clients_per_round < 1 or self.max_attempts < 1:
            raise ValueError("clients_per_round and max_attempts must be >= 1")
        if self.fp_part not in FP_PARTS:
            raise ValueError(f"fp_part must be one of {FP_PARTS}, got {self.fp_part!r}")
        if self.personal_job and self.tail_stages:
            raise ValueError("personal_job (a head-level pp or ditto job) cannot follow a fine-tuned backbone tail")


def load_model(path: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(head, tail) of a finished job's model.npz: the head is FedAvg's weight/bias or Fed3R's
    coef/intercept; the tail, the fine-tuned ``tail.*`` tensors of a fedavg-tail model (empty
    for a head-only model)."""
    model = read_job_arrays(path, "model file")
    tail = {name: array.astype(np.float32) for name, array in model.items() if name.startswith(TAIL_PREFIX)}
    for w, b in (("weight", "bias"), ("coef", "intercept")):
        if w in model and b in model:
            return head_tensors(model[w], model[b]), tail
    raise ValueError(f"{path}: no head in it (expected weight/bias or coef/intercept, found {sorted(model)})")


def load_head(path: str, what: str) -> dict[str, np.ndarray]:
    """The head of a head-only model.npz: a Fed3R model or a fine-tuned head (``what``, a job that
    trains the head alone, cannot start from a fine-tuned backbone tail)."""
    head, tail = load_model(path)
    if tail:
        raise ValueError(f"{what} of the head cannot start from a fine-tuned backbone tail")
    return head


def report_entry(report: PersonalizationReport) -> dict:
    """What a personalization job keeps of a device's report (JSON-able)."""
    return {"n_train": report.n_train, "n_test": report.n_test, "local_classes": report.local_classes,
            "correct": dict(report.correct), "fallback": report.fallback, "fp_lr": report.fp_lr}


@dataclass
class PersonalizeJob(OncePerDevice, Job):
    config: PersonalizeConfig
    head: dict[str, np.ndarray] | None = None
    tail: dict[str, np.ndarray] | None = None      # fine-tuned backbone tail (FT(φ)/FT(M)), sent with the head
    contributed: dict[str, dict] = field(default_factory=dict)      # device -> its report (JSON-able)
    attempts: dict[str, int] = field(default_factory=dict)
    round: int = 0
    kind: str = KIND
    order_free = True    # the summary depends only on which reports arrived

    def __post_init__(self):
        c = self.config
        if self.head is None:
            if not c.head_file:
                raise ValueError("a personalization job needs head_file (a finished job's model.npz) or a head")
            self.head, loaded_tail = load_model(c.head_file)
            if self.tail is None:
                self.tail = loaded_tail
        self.tail = dict(self.tail or {})
        if bool(self.tail) != bool(c.tail_stages):
            raise ValueError("the model has a fine-tuned backbone tail: set tail_stages" if self.tail else
                             f"tail_stages = {c.tail_stages} but the model has no tail.* tensors")
        self.head = head_tensors(self.head["weight"], self.head["bias"])
        if self.head["weight"].shape != (c.num_classes, c.feature_dim):
            raise ValueError(f"head is {self.head['weight'].shape}, job is ({c.num_classes}, {c.feature_dim})")
        if not all(np.isfinite(t).all() for t in (*self.head.values(), *self.tail.values())):
            raise ValueError("the global model contains NaN or Inf")
        self._rng = random.Random(c.seed)

    @property
    def contributions(self) -> int:
        return len(self.contributed)

    def task_for(self, device: str) -> tuple[dict, dict[str, np.ndarray]]:
        c = self.config
        params = PersonalizeParams(c.model_spec(), c.feature_dim, c.fallback, c.fp_epochs, c.batch_size,
                                   tuple(c.fp_lrs), c.fp_folds, c.weight_decay, c.temperature, c.seed, c.tail_stages,
                                   personal_job=c.personal_job or None, fp_part=c.fp_part)
        return params.to_params(), self.model_arrays()

    def parse_result(self, env: Envelope) -> PersonalizationReport:
        return parse_report(env, self.config.num_classes, with_fp=self.config.fp_epochs > 0,
                            with_personal=bool(self.config.personal_job), fp_lrs=tuple(self.config.fp_lrs))

    def apply(self, device: str, report: PersonalizationReport) -> None:
        self.record_report(device, report_entry(report))

    def record_report(self, device: str, entry: dict) -> None:
        """Keep a device's report (:func:`report_entry`: all the job keeps of it; a shard
        coordinator's job gets it in the shard's receipt)."""
        if device in self.contributed:
            raise ValueError(f"{device} already reported")   # the round machine prevents this
        self.contributed[device] = entry

    def close_round(self, closed: RoundClosed) -> None:
        pass   # reports are independent: nothing happens at round boundaries

    def methods(self) -> tuple[str, ...]:
        methods = METHODS if self.config.fp_epochs else tuple(m for m in METHODS if m != "oll_fp")
        return methods[:1] + (PERSONAL,) + methods[1:] if self.config.personal_job else methods

    def summary(self) -> dict:
        """WMA per method over the devices that reported, and how the devices chose FP learning rates."""
        reports = [self.contributed[d] for d in sorted(self.contributed)]
        if not reports:
            return {}
        totals = [r["n_test"] for r in reports]
        weights = bounded_weights(totals, self.config.weight_bound_multiplier)
        out = {"wma": {m: bounded_wma([r["correct"][m] for r in reports], totals, weights)
                       for m in self.methods()},
               "test_samples": int(sum(totals)), "fallback_samples": int(sum(r["fallback"] for r in reports)),
               "mean_local_classes": float(np.mean([r["local_classes"] for r in reports]))}
        if weights is not None:
            out["heldout_counts_bounded"] = int(sum(w < n for w, n in zip(weights, totals)))
        if self.config.fp_epochs:
            chosen = [r["fp_lr"] for r in reports]
            out["fp_lr_chosen"] = {f"{lr:g}": chosen.count(lr) for lr in sorted(set(chosen), reverse=True)}
        return out

    def evaluate(self, features: np.ndarray | None, labels: np.ndarray | None) -> dict:
        out = {"round": self.round, "contributions": self.contributions, **self.summary()}
        if "wma" in out:
            # the headline: what a device gets from the full personalization the job asked for
            out["accuracy"] = out["wma"][self.methods()[-1]]
        if features is not None and not self.tail:   # evaluation features are the frozen backbone's
            out["global_accuracy"] = head_accuracy(self.head["weight"], self.head["bias"], features, labels)
        return out

    def model_arrays(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in {**self.tail, **self.head}.items()}   # the model the devices personalised

    def state_dict(self) -> dict[str, np.ndarray]:
        return {}    # everything is in ``contributed`` (JSON, checkpointed by the service)

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        pass
