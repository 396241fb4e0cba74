"""How a device handler reads a task's params: as the task kind's declared type, or declines.

Every handler parses with the type ``protocols/payloads/task_kinds.py`` names for its kind;
params the type refuses (a missing or malformed field, a version the device does not speak)
decline the task with the type's reason, through the agent's usual decline path.
"""

from __future__ import annotations

from typing import Any, TypeVar

from protocols.payloads.task_params import WireParams

from ..agent import TaskDeclined

T = TypeVar("T", bound=WireParams)


def read_params(params_type: type[T], params: Any, kind: str | None = None) -> T:
    """``params`` as ``params_type`` (already one: as is); TaskDeclined with the reason otherwise."""
    if isinstance(params, params_type):
        return params
    try:
        return params_type.from_params(params)
    except ValueError as exc:
        raise TaskDeclined(f"bad {kind or getattr(params_type, 'KIND', '') or 'task'} params: {exc}") from exc
