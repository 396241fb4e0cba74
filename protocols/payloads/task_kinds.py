"""Every task kind a device may be sent, and the one type that declares its params.

The device's handlers parse a task's params with the type named here (declining a task whose
params it refuses), the JSON Schema in ``protocols/schema/task_params/`` and the parameter
tables in ``docs/protocol.md`` are rendered from it (``protocols/task_params_schema.py``), and
the aggregator's job kinds name the task kinds they send (``aggregator/jobs/registry.py``).
"""

from __future__ import annotations

from .ditto import DittoParams
from .fed3r import Fed3RStatsParams
from .fedavg import HeadTrainingParams, TailTrainingParams
from .fedgloss import FedGlossParams
from .ladd import LaddTrainParams, StyleParams
from .partial import PartialParams
from .personalize import PersonalizeParams
from .scaffold import ScaffoldParams, ScaffoldTailParams
from .secure_tasks import (SecureDittoParams, SecureFed3RParams, SecureFedAvgParams, SecureLaddParams,
                           SecurePartialParams, SecureScaffoldParams, SecureTailParams)
from .task_params import TaskParams

TASK_PARAMS: dict[str, type[TaskParams]] = {t.KIND: t for t in (
    Fed3RStatsParams, HeadTrainingParams, TailTrainingParams, PersonalizeParams, StyleParams, LaddTrainParams,
    PartialParams, ScaffoldParams, ScaffoldTailParams, FedGlossParams, DittoParams,
    SecureFed3RParams, SecureFedAvgParams, SecureTailParams, SecureLaddParams, SecurePartialParams,
    SecureScaffoldParams, SecureDittoParams,
)}


# The plain kinds whose result is the device's own update or statistics, as the aggregator reads
# them (what secure aggregation exists to hide). A device run secure-only (``fedfleet device
# --secure-only``, the Java HeadlessDevices' ``--secure-only``) declines these: an aggregator that
# turned against its fleet, or an operator's mistake, could otherwise ask any device of a secure
# job for the same training in the clear and read its update whole. The others stay: the secure
# kinds, ``oll.personalize`` (held-out counts only) and ``ladd.style`` (the style secure LADD
# itself clusters in the clear).
UPDATES_IN_THE_CLEAR = frozenset(t.KIND for t in (
    Fed3RStatsParams, HeadTrainingParams, TailTrainingParams, LaddTrainParams, PartialParams, ScaffoldParams,
    ScaffoldTailParams, FedGlossParams, DittoParams))
SECURE_ONLY_DECLINE = ("{kind} would send this device's update in the clear, and it runs secure-only: its updates go "
                       "only through secure aggregation")


def params_type(kind: str) -> type[TaskParams]:
    if kind not in TASK_PARAMS:
        raise ValueError(f"unknown task kind {kind!r} (known: {', '.join(sorted(TASK_PARAMS))})")
    return TASK_PARAMS[kind]
