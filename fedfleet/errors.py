"""Ordinary mistakes get one line saying what is wrong and what to do, and a non-zero exit; a
traceback only with ``fedfleet --debug``. :func:`run_reporting_errors` is the one place that turns
the exceptions a user can cause (a missing file, bad JSON, an unknown config field, a bad broker
address, an unreachable broker) into that line; it lives in ``protocols/command_errors.py``, where
``python -m aggregator`` reports the same way."""

from __future__ import annotations

import json

from protocols.command_errors import (USER_MISTAKES, UserError, describe, redact_passwords,  # noqa: F401 (fedfleet's names)
                                      run_reporting_errors)


def load_json_file(path, what: str, max_bytes: int | None = None) -> object:
    """A JSON file a user named, with one clear error for a missing file or bad JSON: read only if
    it is a regular file of at most ``max_bytes`` (default ``OPTION_FILE_BYTES``; a FIFO blocked,
    /dev/zero filled memory), JSON nested too deeply or naming a key twice refused (a RecursionError
    traceback; the last value kept)."""
    from pathlib import Path

    from protocols.envelope import DuplicateKeyError, object_without_duplicates
    from protocols.regular_file import OPTION_FILE_BYTES, read_regular_file

    p = Path(path)
    if not p.exists():
        raise UserError(f"{what} {p} does not exist (check the path)")
    try:
        data = read_regular_file(p, what, max_bytes or OPTION_FILE_BYTES)
    except ValueError as exc:                      # not a regular file, or too large: the error names both
        raise UserError(str(exc)) from None
    try:
        return json.loads(data, object_pairs_hook=object_without_duplicates)
    except json.JSONDecodeError as exc:
        raise UserError(f"{what} {p} is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    except (DuplicateKeyError, UnicodeDecodeError, RecursionError) as exc:
        why = "its JSON is nested too deeply" if isinstance(exc, RecursionError) else f"its JSON has a {exc}" \
            if isinstance(exc, DuplicateKeyError) else "not UTF-8 text"
        raise UserError(f"{what} {p}: {why}") from None


def reported_config(cfg) -> dict:
    """A run's config (a dataclass) as a report shows it: the broker URL without its password."""
    import dataclasses

    out = dataclasses.asdict(cfg)
    if isinstance(out.get("broker"), str):
        out["broker"] = redact_passwords(out["broker"])
    return out
