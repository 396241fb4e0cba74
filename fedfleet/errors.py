"""Ordinary mistakes get one line saying what is wrong and what to do, and a non-zero exit; a
traceback only with ``fedfleet --debug``. :func:`run_reporting_errors` is the one place that turns
the exceptions a user can cause (a missing file, bad JSON, an unknown config field, a bad broker
address, an unreachable broker) into that line; it lives in ``protocols/command_errors.py``, where
``python -m aggregator`` reports the same way."""

from __future__ import annotations

from protocols.command_errors import (USER_MISTAKES, UserError, describe, load_json_file,  # noqa: F401 (fedfleet's names)
                                      redact_passwords, run_reporting_errors)


def reported_config(cfg) -> dict:
    """A run's config (a dataclass) as a report shows it: the broker URL without its password."""
    import dataclasses

    out = dataclasses.asdict(cfg)
    if isinstance(out.get("broker"), str):
        out["broker"] = redact_passwords(out["broker"])
    return out
