"""FT(φ) / FT(M): FedAvg rounds that fine-tune the backbone's last stages on device.

Everything is :class:`~aggregator.jobs.fedavg.FedAvgJob`'s (sampling κ devices, deadlines,
late updates, FedAvg/FedAvgM server step, Fed3R initialisation of the head, persistence);
what differs is the model. The global model is the tail of the backbone (the last
``tail_stages`` stages, BatchNorm frozen; tensors ``tail.<...>``) plus the linear head,
and a round's task carries all of it (wire kind ``fedavg.tail``,
``protocols.payloads.fedavg``). ``train`` says what devices train and send back:

* ``"tail"``, FT(φ) of the Fed3R paper: the feature extractor (here its tail) is
  fine-tuned against the frozen Fed3R classifier, which never moves;
* ``"tail+head"``, FT(M): tail and head together.

The pretrained tail and the evaluation come from the devices' bundle: its ``tail_eval.pt2``
(``aggregator.compute.tail_program``). The evaluation set is the trunk's activations of the test
images (flattened rows), so an evaluation runs only the tail and the head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protocols.envelope import Envelope, body_field
from protocols.payloads.fedavg import KIND_TAIL, TAIL_TRAIN_MODES, TailTrainingParams, head_tensors, parse_model_update

from aggregator.compute.tail_program import TailProgram
from aggregator.jobs.config_limits import PATH, SHA256_OR_EMPTY, TAIL_STAGES, OneOf, check_whole_number, limited
from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob, RoundUpdate


@dataclass
class TailFedAvgConfig(FedAvgConfig):
    job_id: str = "fedavg-tail"
    # FT(φ)/FT(M) keep the first bound, 3x the median norm, and nothing else: FedAvg(ψ)'s
    # defaults were measured on a linear head, not on a backbone's tail.
    norm_bound_multiplier: float = 3.0
    contribution_bound_multiplier: float = 0.0
    direction_screen: bool = False
    history_momentum: float = 0.0
    tail_stages: int = limited(1, TAIL_STAGES)         # the bundle's split (devices check theirs matches)
    train: str = limited("tail", OneOf(tuple(TAIL_TRAIN_MODES)))   # "tail": FT(φ), head frozen; "tail+head": FT(M)
    tail_program_file: str = limited("", PATH)     # the bundle's tail_eval.pt2 (pretrained tail + evaluation)
    tail_program_sha256: str = limited("", SHA256_OR_EMPTY)   # its sha256 from the bundle manifest ("" = not checked)

    def __post_init__(self):
        super().__post_init__()
        if self.train not in TAIL_TRAIN_MODES:
            raise ValueError(f"train must be one of {sorted(TAIL_TRAIN_MODES)}, got {self.train!r}")
        check_whole_number(self, "tail_stages", 1)
        if not self.tail_program_file:
            raise ValueError("a fedavg-tail job needs tail_program_file (the bundle's tail_eval.pt2)")

    def trained_shapes(self) -> None:
        """The tail's tensors are the tail program's (``TailFedAvgJob.trained_shapes``, once it is read)."""
        return None


class TailFedAvgJob(FedAvgJob):
    """FT(φ)/FT(M) (see the module docstring); ``kind``: the wire kind of its tasks (Scaffold on
    the tail sends ``scaffold.tail``)."""

    def __init__(self, config: TailFedAvgConfig, initial_head: dict[str, np.ndarray] | None = None,
                 strategy=None, program: TailProgram | None = None, kind: str = KIND_TAIL):
        self.program = program or TailProgram(config.tail_program_file, config.tail_program_sha256)
        super().__init__(config, initial_head=initial_head, strategy=strategy, kind=kind)
        shapes = self.program.shapes()
        if shapes["weight"] != self.params["weight"].shape:
            raise ValueError(f"the tail program's head is {shapes['weight']}, the job's is {self.params['weight'].shape}")
        self.params = {**self.program.tail_parameters, **self.params}
        self.trained = tuple(name for name in self.params
                             if name.startswith("tail.") or TAIL_TRAIN_MODES[config.train])

    def task_params(self, device: str) -> TailTrainingParams:
        return TailTrainingParams.extending(super().task_params(device), tail_stages=self.config.tail_stages,
                                            train=self.config.train)

    def trained_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: self.params[name].shape for name in self.trained}

    def parse_result(self, env: Envelope) -> RoundUpdate:
        update = parse_model_update(env, self.trained_shapes())
        return RoundUpdate(body_field(env, "round", int), update)

    def evaluate(self, features: np.ndarray | None, labels: np.ndarray | None) -> dict:
        out = super().evaluate(None, None)
        if features is not None:
            out["accuracy"] = self.program.accuracy(self.served_params(), features, labels)
        return out

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        head = head_tensors(state["weight"], state["bias"])
        tail = {name: np.asarray(state[name], dtype=np.float32) for name in self.params if name.startswith("tail.")}
        super().load_state_dict(state)
        self.params = {**tail, **head}

