"""A LADD job (spec §2): styles once, clustering, server pre-training, then cluster-aware rounds.

Pure logic (no MQTT, no clock), driven by ``aggregator.service.loop`` like the other jobs. The job
has two kinds of rounds, so its ``kind`` is the kind of the round it opened last:

``ladd.style`` rounds
    Every online device without a style is asked for it; the styles in are screened, clustered and
    the network pre-trained; a late device joins the nearest centroid (``ladd_styles.py``, in full).

``ladd.train`` rounds (t = 1 .. ``rounds``)
    κ devices with a cluster are drawn (seeded). Device k of cluster c gets φ ∪ θ_c, the
    cluster teacher g_c when it differs from that model, and the KD teacher (the pre-trained
    w) until it confirms holding it. At closing, φ ← mean over all participants, θ_c ← mean
    over c's participants (weights n_k, after the norm and weight bounds, each slot's
    limits from its own updates, a small cluster's from every cluster's θ updates, a round of
    fewer than three updates' within earlier rounds' too: ``LaddSmallRounds``, checkpointed);
    a cluster without participants keeps θ_c. The means are
    summed in canonical order up the bucket tree, as K shards sum them, so a sharded job gives
    the same bits (``aggregator/shards/ladd_sums.py``); a robust rule or the direction screen
    combines every update at once (``RobustClusterAveraging``), DP-LADD clips and noises
    (``aggregator/strategies/dp_ladd.py``). Then, if t mod ω = 0, every cluster teacher
    becomes g_c ← w_c (t < t_START) or the running mean of the w_c it has seen (t ≥ t_START,
    SWA). ``swa_start = 0`` disables SWA. Each cluster has its own teacher (the authors' code
    shares one; spec §6.9a/b).

``clustering = "none"`` gives FedAvg + self-training: one cluster, every tensor global.

The job's phase (:class:`LaddPhase`: styles, train, done) moves only by :data:`LADD_TABLE`, fired
where a phase can end (construction, a round's close, scheduling that finds nobody left to ask);
``python -m aggregator.jobs.ladd`` prints the table docs/ladd.md shows (a test keeps the two equal).

The server never needs the network itself, only named arrays: pre-training is injected
(``pretrainer``), so this module does not import ``edge_client``. An optional ``evaluator``
(job -> dict of metrics) is called after each training round for the history.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protocols.envelope import Envelope, EnvelopeError, body_field
from protocols.payloads.ladd import (KIND_STYLE, KIND_TRAIN, LaddTrainParams, Layout, ModelUpdate, StyleParams,
                                     StyleResult, layout_digest, make_layout, pack, packed_digest, parse_style,
                                     parse_update, train_task_tensors)
from protocols.rounds import RoundClosed
from protocols.transition_table import Transition, TransitionTable

from aggregator.shards.ladd_sums import CanonicalClusterAveraging
from aggregator.strategies.dp_fedavg import ClippedGaussianSum
from aggregator.strategies.ladd_small_rounds import LaddSmallRounds
from aggregator.strategies.robust_ladd import RobustClusterAveraging
from aggregator.strategies.ladd import ClusterAveraging, StyleClustering, SwaTeacher, cluster_specific_predicate
from aggregator.jobs.base import Job
from aggregator.jobs.ladd_checkpoint import LaddCheckpoint
from aggregator.jobs.ladd_config import LaddConfig
from aggregator.jobs.ladd_initial_model import (load_initial_model, save_initial_model,  # noqa: F401 (re-exported)
                                               trainable_in_layout_order)
from aggregator.jobs.ladd_phases import Created, LaddPhase, NobodyLeftToAsk, StyleRoundClosed, TrainRoundClosed
from aggregator.jobs.ladd_styles import LaddStyles
from aggregator.jobs.recent_log import RecentLog

log = logging.getLogger("fedfleet.aggregator")

Arrays = dict[str, np.ndarray]
# style bank (n, 3, 2b+1, 2b+1) -> (pre-trained exchanged state, names of the trainable tensors)
Pretrainer = Callable[[np.ndarray], tuple[Arrays, list[str]]]


@dataclass(frozen=True)
class RoundPayload:
    round: int
    kind: str
    payload: StyleResult | ModelUpdate | tuple      # tuple: a shard coordinator's (message id, receipt)


@dataclass
class LaddJob(LaddStyles, LaddCheckpoint, Job):
    # hooks for variants (jobs/secure_ladd.py): the kind of training rounds, their smallest size
    train_kind = KIND_TRAIN
    # the model moves only when a round closes: evaluated then (per contribution, the job's last
    # evaluation would predate its last round's close, and its reported model and privacy with it)
    evaluate_at_round_close = True
    min_train_participants = 1
    central_dp = True          # False: the devices add the noise (distributed DP, jobs/secure_ladd.py)

    config: LaddConfig
    pretrainer: Pretrainer | None = None
    initial: tuple[Arrays, list[str]] | None = None       # skip pre-training: (w, trainable names)
    evaluator: Callable[["LaddJob"], dict] | None = None
    contributed: dict[str, int] = field(default_factory=dict)
    round: int = 0

    load_initial = staticmethod(load_initial_model)     # the pretrained network a stored config names

    def __post_init__(self):
        c = self.config
        if self.initial is None and self.pretrainer is None:
            raise ValueError("LaddJob needs a pretrainer or an initial model")
        self.is_theta = cluster_specific_predicate(c.cluster_scope if c.clustering == "styles" else "head")
        self._rng = c.participant_draw()       # secret when DP counts on sampling
        self.kind = KIND_STYLE
        self.phase = LaddPhase.STYLES
        self.train_round = 0
        self.styles: dict[str, np.ndarray] = {}
        self.style_attempts: dict[str, int] = {}
        self.assignment: dict[str, int] = {}
        self.clustering: StyleClustering | None = None
        self.clustering_fallback: str | None = None     # why the styles became one cluster, if they did
        self.styles_screened: dict[str, str] = {}       # device -> why its style was left out of the clustering
        self.pretrained: Arrays | None = None
        self.trainable: list[str] = []
        self.phi: Arrays = {}
        self.theta: dict[int, Arrays] = {}
        self.teachers: dict[int, SwaTeacher] = {}
        self.kd_confirmed: set[str] = set()
        self.round_log = RecentLog()
        self.late_discarded = 0
        self.kd_sha256 = ""                         # the KD teacher's digest, once training starts
        self.aggregate_s = 0.0                      # server time in aggregation + teacher updates
        self.last_metrics: dict = {}
        self._open = False
        self._participants: frozenset[str] = frozenset()
        self._applied: set[str] = set()
        self._agg: ClusterAveraging | None = None
        self._taken: tuple | None = None            # a coordinator's: the round's model, summed by its shards
        self._initial_layout: Layout | None = None  # the layout of updates before training starts (a shard's job)
        # Central DP (aggregator/strategies/dp_ladd.py): DP-FedAvg's mechanism over LADD's slots
        self.dp = ClippedGaussianSum(c.dp_noise_multiplier, c.clip_rule()) if c.dp and self.central_dp else None
        self.small_rounds = LaddSmallRounds.of(c)   # what rounds of fewer than 3 updates are bounded by (too)
        LADD_TABLE.fire(self, Created())

    # ------------------------------------------------------------------ phases (LADD_TABLE's guards and effects)
    @property
    def state(self) -> LaddPhase:
        """What LADD_TABLE reads: the phase."""
        return self.phase

    @property
    def n_clusters(self) -> int:
        return len(self.theta) if self.theta else 0

    def _training_over(self, _event=None) -> bool:
        """No training round is left: ``rounds`` opened, or one more would exceed the privacy budget."""
        return self.train_round >= self.config.rounds or self.budget_exhausted

    def _stay(self, _event) -> list:
        return []

    def _nobody_left_to_ask(self) -> None:
        """Scheduling found nobody to ask for a style (or a restart, a training round opened)."""
        LADD_TABLE.fire(self, NobodyLeftToAsk())

    def _start_with_initial(self, _event: Created) -> list:
        self._begin_training(*self.initial)
        return []

    def _close_last_train_round(self, event: TrainRoundClosed) -> list:
        self._close_train_round(event)
        self.phase = LaddPhase.DONE
        return []

    def _begin_training(self, arrays: Arrays, trainable: list[str], n_clusters: int = 1) -> None:
        self._start_training(arrays, trainable, n_clusters)
        self.phase = LaddPhase.DONE if self._training_over() else LaddPhase.TRAIN     # rounds = 0: nothing to train

    def _start_training(self, arrays: Arrays, trainable: list[str], n_clusters: int = 1) -> None:
        arrays = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in arrays.items()}
        unknown = set(trainable) - set(arrays)
        if not trainable or unknown:
            raise ValueError(f"trainable names must be a non-empty subset of the model, unknown: {sorted(unknown)[:3]}")
        self.pretrained = arrays
        self.layout = make_layout(arrays)
        self.trainable, self.trainable_layout = trainable_in_layout_order(arrays, self.layout, trainable)
        self.kd_flat = pack(arrays, self.layout)
        self.kd_sha256 = packed_digest(self.kd_flat)
        self.phi = {k: v.copy() for k, v in arrays.items() if not self.is_theta(k)}
        self.theta = {c: {k: v.copy() for k, v in arrays.items() if self.is_theta(k)} for c in range(n_clusters)}
        self.teachers = {c: SwaTeacher(arrays) for c in range(n_clusters)}

    def cluster_model(self, cluster: int) -> Arrays:
        """w_c = φ ∪ θ_c."""
        return {**self.phi, **self.theta[cluster]}

    # ------------------------------------------------------------------ scheduling
    def next_participants(self, online: set[str]) -> list[str]:
        c = self.config
        if self._open or self.phase is LaddPhase.DONE:      # no waiting reason is shown then (reporting.py)
            return []
        if self.phase is LaddPhase.STYLES or c.clustering == "styles":
            pool = self._ask_for_styles(online)
            if pool:
                return self._open_round(KIND_STYLE, pool)
            if self.phase is LaddPhase.STYLES:
                self._nobody_left_to_ask()      # the silent went offline
        if self.phase is not LaddPhase.TRAIN:       # TRAIN: a training round is left (DONE otherwise)
            return []
        pool = sorted(d for d in online if d in self.assignment or c.clustering == "none")
        self.waiting = c.pool_too_small(len(pool)) if pool else None
        k = c.round_size(len(pool), self._rng)
        if k < max(1, self.min_train_participants):
            return []
        chosen = sorted(self._rng.sample(pool, k))
        if c.clustering == "none":
            for d in chosen:
                self.assignment.setdefault(d, 0)
        self.train_round += 1
        chosen = self._open_round(self.train_kind, chosen)
        self._agg = self._new_aggregation()
        return chosen

    def _new_aggregation(self) -> ClusterAveraging:
        c = self.config
        if self.dp is None and c.needs_every_update():      # a robust rule, the direction screen
            return RobustClusterAveraging(self.is_theta, c.robust_aggregation(), self.small_rounds)
        # the mean with its bound layers, or DP-LADD's clipped sums: added as K shards add them, bit for bit
        return CanonicalClusterAveraging(self)

    def selected_clusters(self) -> Counter:
        """cluster -> the open round's devices selected in it (DP-LADD's m_c; "none": all in 0)."""
        return Counter(self.assignment.get(d, 0) for d in sorted(self._participants))

    def _open_round(self, kind: str, chosen: list[str]) -> list[str]:
        self.kind = kind
        self.round += 1
        self._open = True
        self._participants = frozenset(chosen)
        self._applied = set()
        return chosen

    def finished(self, online: set[str], known: set[str]) -> bool:
        return self.phase is LaddPhase.DONE

    @property
    def budget_exhausted(self) -> bool:
        """Whether one more training round would exceed the job's privacy budget (it then stops)."""
        return self.config.budget_exhausted(self.train_round)

    def privacy_entry(self) -> dict:
        """{"privacy": ε(δ) after the training rounds closed so far, ...} under DP, else {}: each
        training round is one release (aggregator/strategies/dp_ladd.py), style rounds none."""
        releases = self.train_round - (1 if self._open and self.kind == self.train_kind else 0)
        clip_norm = self.dp.clip.value if self.dp is not None else self.config.dp_clip_norm
        return self.config.privacy_entry(releases, self.train_round, clip_norm=clip_norm)

    @property
    def contributions(self) -> int:
        return sum(self.contributed.values())

    def task_for(self, device: str) -> tuple[dict, dict[str, np.ndarray]]:
        if self.kind == KIND_STYLE:
            return StyleParams(self.config.style_b, self.config.image_size).to_params(), {}
        params, tensors = self.train_task(device)
        return params.to_params(), tensors

    def train_task(self, device: str) -> tuple[LaddTrainParams, dict[str, np.ndarray]]:
        """A ``ladd.train`` task's params and tensors for ``device``."""
        c = self.config
        cluster = self.assignment[device]
        model = self.cluster_model(cluster)
        teacher = self.teachers[cluster].params
        same = all(np.array_equal(teacher[k], model[k]) for k in model)
        send_kd = c.kd_lambda > 0 and device not in self.kd_confirmed
        params = LaddTrainParams(
            dict(c.model), cluster, tuple((name, tuple(shape)) for name, shape in self.layout),
            layout_digest(self.layout), tuple(self.trainable), teacher="model" if same else "tensor",
            weights_sha256=c.weights_sha256, kd_sha256=self.kd_sha256 if c.kd_lambda > 0 else "",
            recipe=c.recipe(zlib.crc32(f"{c.seed}:{self.round}:{device}".encode())))
        tensors = train_task_tensors(pack(model, self.layout), None if same else pack(teacher, self.layout),
                                     self.kd_flat if send_kd else None)
        return params, tensors

    # ------------------------------------------------------------------ results
    def parse_result(self, env: Envelope) -> RoundPayload:
        round_ = body_field(env, "round", int)
        if self.kind == KIND_STYLE:
            return RoundPayload(round_, KIND_STYLE, parse_style(env, self.config.style_b, self.config.image_size))
        cluster = self.assignment.get(env.sender)
        if cluster is None:
            raise EnvelopeError(f"{KIND_TRAIN}: {env.sender} has no cluster")
        return RoundPayload(round_, KIND_TRAIN, parse_update(env, self.trainable_layout, cluster))

    def parse_accepted(self, env: Envelope) -> RoundPayload:
        """A ``ladd.train`` result checked against the cluster it names and the update layout the
        config gives, not the assignment: a shard's job holds none (its coordinator checks the
        cluster, aggregator/shards/ladd_sums.py); other results as :meth:`parse_result`."""
        if env.body.get("kind") != KIND_TRAIN:
            return self.parse_result(env)
        cluster = body_field(env, "cluster", int)
        return RoundPayload(body_field(env, "round", int), KIND_TRAIN, parse_update(env, self.update_layout(), cluster))

    def update_layout(self) -> Layout:
        """The layout of a ``ladd.train`` update: the trained tensors', known from the initial
        model before the styles are clustered."""
        if self.trainable:
            return self.trainable_layout
        if self._initial_layout is None:
            if self.initial is None:
                raise EnvelopeError(f"{KIND_TRAIN}: the job pretrains after clustering: no update layout yet")
            arrays, trainable = self.initial
            if not trainable or set(trainable) - set(arrays):
                raise EnvelopeError(f"{KIND_TRAIN}: the initial model's trainable names are not its tensors'")
            self._initial_layout = trainable_in_layout_order(arrays, make_layout(arrays), trainable)[1]
        return self._initial_layout

    def admits(self, device: str, round_: int, kind: str) -> bool:
        """Whether a ``kind`` result of ``device`` naming ``round_`` belongs to the open round;
        counted in ``late_discarded`` when it does not."""
        if (self._open and round_ == self.round and kind == self.kind and device in self._participants
                and device not in self._applied):
            return True
        self.late_discarded += 1      # the round machine answers these before; never mix rounds
        log.warning("discarded %s result from %s for round %d", kind, device, round_)
        return False

    def apply(self, device: str, result: RoundPayload) -> None:
        if not self.admits(device, result.round, result.kind):
            return
        if result.kind == KIND_STYLE:
            self.styles[device] = result.payload.style
            self._applied.add(device)
            self.contributed[device] = self.contributed.get(device, 0) + 1
        else:
            update: ModelUpdate = result.payload
            self._agg.add(update.cluster, update.tensors, update.n, device=device)
            self.record_train_update(device, update.kd_sha256)

    def record_train_update(self, device: str, kd_sha256: str) -> None:
        """What the job keeps of an admitted training update besides its tensors (a coordinator's
        job: all it keeps, the shards holding the tensors)."""
        if kd_sha256 and kd_sha256 == self.kd_sha256:
            self.kd_confirmed.add(device)
        self._applied.add(device)
        self.contributed[device] = self.contributed.get(device, 0) + 1

    def take_round_model(self, model: tuple[Arrays, dict[int, Arrays]] | None, per_cluster: dict[int, int]) -> None:
        """A shard coordinator's: the closing training round's new (φ, {c: θ_c}) (None: unchanged)
        and its updates per cluster, summed by its shards; the round's close takes these."""
        self._taken = (model, dict(per_cluster))

    def closes(self, round_: int) -> bool:
        """Whether closing ``round_`` closes the open round (else it changes nothing)."""
        return self._open and round_ == self.round

    def close_round(self, closed: RoundClosed) -> None:
        if not self.closes(closed.round):
            return
        self._open = False
        entry = {"round": self.round, "kind": self.kind, "accepted": len(self._applied),
                 "dropped": len(closed.dropped), "declined": len(closed.declined)}
        self.kd_confirmed -= set(closed.declined)     # e.g. "kd model missing": send it again
        LADD_TABLE.fire(self, StyleRoundClosed(entry) if self.kind == KIND_STYLE else TrainRoundClosed(entry))
        self.round_log.append(entry)

    def _round_aggregate(self) -> tuple[tuple[Arrays, dict[int, Arrays]] | None, dict[int, int]]:
        """The closing training round's new (φ, {c: θ_c}) (None: unchanged) and its updates per cluster."""
        if self._taken is not None:
            taken, self._taken = self._taken, None
            return taken
        agg = self._agg
        if agg is None:
            return None, {}
        released = agg.count or self.dp is not None      # under DP every round releases
        return (agg.result(self.phi, self.theta) if released else None), dict(sorted(agg.participants.items()))

    def _close_train_round(self, event: TrainRoundClosed) -> list:
        c, entry = self.config, event.entry
        t0 = time.perf_counter()
        new_model, per_cluster = self._round_aggregate()
        if new_model is not None:
            self.phi, self.theta = new_model
        entry.update({"train_round": self.train_round, "per_cluster": per_cluster})
        if self.train_round % c.teacher_every == 0:
            for cluster, teacher in self.teachers.items():
                model = self.cluster_model(cluster)
                if c.swa_start and self.train_round >= c.swa_start:
                    teacher.average_in(model)
                else:
                    teacher.copy_from(model)
        self._agg = None
        entry["aggregate_s"] = time.perf_counter() - t0
        self.aggregate_s += entry["aggregate_s"]
        if self.evaluator is not None:
            self.last_metrics = {"train_round": self.train_round, **self.evaluator(self)}
        return []

    # ------------------------------------------------------------------ model and reports
    def evaluate(self, features: np.ndarray | None, labels: np.ndarray | None) -> dict:
        out: dict[str, Any] = {"round": self.round, "train_round": self.train_round, "phase": self.phase,
                               "contributions": self.contributions, "styles": len(self.styles),
                               "clusters": self.n_clusters, "late_discarded": self.late_discarded}
        out.update(self.last_metrics)
        if "miou" in self.last_metrics:
            out["accuracy"] = self.last_metrics["miou"]       # what the status topic shows
        return {**out, **self.privacy_entry()}

    def model_arrays(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for k, v in self.phi.items():
            out[f"phi.{k}"] = v.copy()
        for cluster, params in self.theta.items():
            for k, v in params.items():
                out[f"theta.{cluster}.{k}"] = v.copy()
        if self.clustering is not None:
            out["style_centroids"] = self.clustering.cluster_centers_.copy()
        return out

    def report(self) -> dict:
        """JSON-able summary: clustering, assignment, rounds."""
        cl = self.clustering
        return {"phase": self.phase, "train_rounds": self.train_round, "n_clusters": self.n_clusters,
                "silhouette_scores": {str(k): v for k, v in (cl.silhouette_scores_ if cl else {}).items()},
                "styles_screened": dict(self.styles_screened), "assignment": dict(self.assignment),
                "round_log": list(self.round_log), "trainable": list(self.trainable), "kd_sha256": self.kd_sha256}


_J, _P = LaddJob, LaddPhase
LADD_TABLE = TransitionTable(LaddPhase, [
    Transition(_P.STYLES, Created, 'clustering "none", an initial model', _J._start_with_initial,
               goes_to=(_P.TRAIN, _P.DONE), note="no style round: train from the initial model", guard=_J._skips_styles),
    Transition(_P.STYLES, Created, "", _J._stay, note="ask the online devices for their styles"),
    Transition(_P.STYLES, StyleRoundClosed, "the styles are in", _J._cluster_closing_round, goes_to=(_P.TRAIN, _P.DONE),
               note="cluster the styles (KMeans, k by silhouette), pre-train", guard=_J._styles_complete),
    Transition(_P.STYLES, StyleRoundClosed, "", _J._stay, note="ask again whoever has attempts left"),
    Transition(_P.STYLES, NobodyLeftToAsk, "styles in, min_styles = 0", _J._cluster_what_is_in,
               goes_to=(_P.TRAIN, _P.DONE), note="cluster without the silent ones, pre-train",
               guard=_J._can_cluster_now),
    Transition(_P.STYLES, NobodyLeftToAsk, "", _J._stay, note="wait for min_styles styles"),
    Transition((_P.TRAIN, _P.DONE), StyleRoundClosed, "", _J._route_late_styles,
               note="late devices: nearest centroid, no refit"),
    Transition(_P.TRAIN, TrainRoundClosed, "t = rounds or the budget allows no more", _J._close_last_train_round,
               goes_to=(_P.DONE,), note="aggregate, update the teachers; the job is finished",
               guard=_J._training_over),
    Transition(_P.TRAIN, TrainRoundClosed, "", _J._close_train_round, note="aggregate; every ω rounds the teachers"),
])


def render_table() -> str:
    return LADD_TABLE.render()


if __name__ == "__main__":
    print(render_table())
