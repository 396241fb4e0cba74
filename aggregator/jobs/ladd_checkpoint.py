"""What a LADD job (:class:`~aggregator.jobs.ladd.LaddJob`) keeps across a restart
(:class:`LaddCheckpoint`): its checkpoint as of a round's close (``state_dict``: models, teachers, the
pretrained network, styles; what is not an array as JSON under ``meta``) and its scheduling bookkeeping
as of a round's open (``bookkeeping``), each with its way back."""

from __future__ import annotations

import json

import numpy as np

from protocols.payloads.ladd import KIND_STYLE

from aggregator.jobs.ladd_phases import LaddPhase
from aggregator.jobs.participant_draw import draw_state, resumed_draw
from aggregator.strategies.ladd import StyleClustering


class LaddCheckpoint:
    """LaddJob's checkpoint and bookkeeping, on the job's state."""

    def state_dict(self) -> dict[str, np.ndarray]:
        """The job as of a round close (the service's checkpoint): models, teachers, the pretrained
        network, styles, and what is not an array (phase, assignment, ...) as JSON under ``meta``."""
        out = self.model_arrays()
        for cluster, teacher in self.teachers.items():
            for k, v in teacher.params.items():
                out[f"teacher.{cluster}.{k}"] = v.copy()
        for k, v in (self.pretrained or {}).items():
            out[f"pretrained.{k}"] = v.copy()
        devices = sorted(self.styles)
        if devices:
            out["styles"] = np.stack([self.styles[d] for d in devices])
        out["round"] = np.array([self.round, self.train_round], dtype=np.int64)
        if self.dp is not None:
            out.update(self.dp.state_dict())
        out.update(self.small_rounds.state_dict())
        cl = self.clustering
        meta = {"phase": self.phase, "kind": self.kind, "style_devices": devices, "assignment": self.assignment,
                "trainable": self.trainable, "kd_confirmed": sorted(self.kd_confirmed),
                "teachers": {str(c): [t.averaged, t.version] for c, t in self.teachers.items()},
                "silhouette_scores": {str(k): v for k, v in (cl.silhouette_scores_ if cl else {}).items()},
                "styles_screened": self.styles_screened, "late_discarded": self.late_discarded}
        out["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8).copy()
        return out

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Back to a checkpoint of :meth:`state_dict` (a restart); no round is open."""
        meta = json.loads(state["meta"].tobytes())
        self.round, self.train_round = (int(x) for x in state["round"])
        if self.dp is not None:
            self.dp.load_state_dict(state)
        self.small_rounds.load_state_dict(state)
        phase, self.kind = LaddPhase(meta["phase"]), meta["kind"]
        self.styles = dict(zip(meta["style_devices"], state["styles"])) if meta["style_devices"] else {}
        self.assignment = {d: int(c) for d, c in meta["assignment"].items()}
        self.late_discarded = int(meta["late_discarded"])
        self.styles_screened = dict(meta.get("styles_screened", {}))     # absent from checkpoints before the screen
        if "style_centroids" in state:
            self.clustering = StyleClustering.from_centroids(state["style_centroids"])
            self.clustering.silhouette_scores_ = {int(k): v for k, v in meta["silhouette_scores"].items()}
        if phase is not LaddPhase.STYLES:
            pretrained = {k.removeprefix("pretrained."): v for k, v in state.items() if k.startswith("pretrained.")}
            self._start_training(pretrained, meta["trainable"], n_clusters=len(meta["teachers"]))
            self.phi = {k.removeprefix("phi."): v.copy() for k, v in state.items() if k.startswith("phi.")}
            for c, teacher in self.teachers.items():
                self.theta[c] = {k.removeprefix(f"theta.{c}."): v.copy() for k, v in state.items()
                                 if k.startswith(f"theta.{c}.")}
                teacher.params = {k.removeprefix(f"teacher.{c}."): v.copy() for k, v in state.items()
                                  if k.startswith(f"teacher.{c}.")}
                teacher.averaged, teacher.version = meta["teachers"][str(c)]
        self.kd_confirmed = set(meta["kd_confirmed"])
        self._open, self._agg, self._taken = False, None, None
        # a checkpoint written before DONE existed says "train" after the last round: it meant DONE
        self.phase = LaddPhase.DONE if phase is LaddPhase.TRAIN and self._training_over() else phase

    def bookkeeping(self) -> dict:
        """JSON-able scheduling state as of the round just opened (the service stores it with the round)."""
        return {"round": self.round, "train_round": self.train_round, "phase": self.phase, "kind": self.kind,
                "open": self._open, "participants": sorted(self._participants),
                "style_attempts": dict(self.style_attempts), "rng": draw_state(self._rng)}

    def restore_bookkeeping(self, state: dict) -> None:
        """Enter the round this bookkeeping was taken at (right after it opened), unless the job is
        already in or past it (a checkpoint, or replayed up to it): then only the sampler and the
        style attempts are restored, and what was replayed into an open round stays."""
        self.style_attempts = {d: int(n) for d, n in state["style_attempts"].items()}
        self._rng = resumed_draw(state["rng"], self.config.participant_draw())
        if int(state["round"]) <= self.round:
            return
        if state["kind"] != KIND_STYLE and self.phase is LaddPhase.STYLES:
            # a training round opened in the style phase: scheduling ended that phase (nobody left to ask)
            self._nobody_left_to_ask()
        self.round, self.train_round, self.kind = int(state["round"]), int(state["train_round"]), state["kind"]
        self._open, self._participants, self._applied = bool(state["open"]), frozenset(state["participants"]), set()
        if self.config.clustering == "none":     # a device's cluster is given when it is first chosen
            for d in self._participants:
                self.assignment.setdefault(d, 0)
        self._agg = self._new_aggregation() if self.kind != KIND_STYLE else None
