"""Scaffold on the backbone's tail: Scaffold(φ) and Scaffold(M), i.e. FT(φ)/FT(M) corrected by
control variates (wire kind ``scaffold.tail``, ``protocols.payloads.scaffold``).

The model, the tail program, the rounds and the server step are
:class:`~aggregator.jobs.fedavg_tail.TailFedAvgJob`'s; the server control c, its update
c ← c + (|S| / K) · mean(clipped Δc), its checkpoint and the devices' state binding are
:class:`~aggregator.jobs.scaffold.ScaffoldControls`'s, over the tensors the devices train
(``tail.*`` for ``train = "tail"``, FT(φ); ``tail.*``, ``weight`` and ``bias`` for
``"tail+head"``, FT(M)). The device side is ``edge_client/tasks/scaffold_tail.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protocols.device_inbox import TensorShape
from protocols.payloads.fedavg import TAIL_TRAIN_MODES
from protocols.payloads.scaffold import HEAD, KIND_TAIL, ScaffoldTailParams

from aggregator.compute.tail_program import TailProgram
from aggregator.jobs.fedavg_tail import TailFedAvgConfig, TailFedAvgJob
from aggregator.jobs.scaffold import ScaffoldConfig, ScaffoldControls, with_controls


@dataclass
class ScaffoldTailConfig(TailFedAvgConfig, ScaffoldConfig):
    job_id: str = "scaffold-tail"

    def task_tensors(self) -> dict[str, TensorShape]:
        """The head, and its control when the devices train it (FT(M)); the tail's tensors and
        their controls come from the tail program, not the config."""
        return with_controls(self.head_task_tensors(), HEAD if TAIL_TRAIN_MODES[self.train] else ())


class ScaffoldTailJob(ScaffoldControls, TailFedAvgJob):
    """TailFedAvgJob plus the server control c over the trained tensors (see the module docstring)."""

    params_type = ScaffoldTailParams

    def __init__(self, config: ScaffoldTailConfig, initial_head: dict[str, np.ndarray] | None = None,
                 strategy=None, program: TailProgram | None = None):
        super().__init__(config, initial_head=initial_head, strategy=strategy, program=program, kind=KIND_TAIL)
        self.init_controls(self.trained)
