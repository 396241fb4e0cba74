"""Ordinary mistakes get one line saying what is wrong and what to do, and a non-zero exit; a
traceback only with ``--debug``. :func:`run_reporting_errors` is the one place that turns the
exceptions a user can cause (a missing file, bad JSON, an unknown config field, a bad broker
address, an unreachable broker, a bundle that cannot be used) into that line, for every command line of the project:
``fedfleet ...`` (``fedfleet/errors.py``) and ``python -m aggregator``, which may not import
``fedfleet`` (docs/architecture.md), hence here, below both."""

from __future__ import annotations

import json
import re
import sys
from typing import Callable


class UserError(Exception):
    """A mistake in what the user asked for; the message says what is wrong and what to do."""


USER_MISTAKES = (UserError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
                 PermissionError, json.JSONDecodeError, ConnectionError, ValueError, KeyError, TypeError)


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


def is_user_mistake(exc: BaseException) -> bool:
    """One of USER_MISTAKES, an OSError that names its file (a read-only file system, a full disk, a
    name too long where the user pointed: what the user can mend, reported with the file), or an
    ``ArtifactError``: a bundle the user named that cannot be used (a file missing or altered, a
    program no runtime here loads), whose message names the file and what to install or re-export.
    The bundle module (and jsonschema, 90 ms) is imported only then."""
    if isinstance(exc, USER_MISTAKES) or isinstance(exc, OSError) and exc.filename:
        return True
    from protocols.bundle_manifest import ArtifactError

    return isinstance(exc, ArtifactError)


def describe(exc: BaseException) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
    if isinstance(exc, OSError) and exc.filename:
        return f"{exc.strerror or type(exc).__name__}: {exc.filename}"
    if isinstance(exc, KeyError):
        return f"missing {exc.args[0]!r}" if exc.args else "missing key"
    text = " ".join(str(exc).split()) or type(exc).__name__
    return redact_passwords(text)


def redact_passwords(text: str) -> str:
    """``text`` with the password of every URL in it (``scheme://user:password@host``) replaced:
    an error about a broker address must not print the enrolled device's MQTT password."""
    return re.sub(r"([A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)[^@\s/]*@", r"\1***@", text)


def run_reporting_errors(command: str, fn: Callable[[], int], debug: bool) -> int:
    """Run a command; a user's mistake is printed as ``fedfleet COMMAND: error: ...`` (exit 2)."""
    try:
        return fn()
    except KeyboardInterrupt:
        print(f"fedfleet {command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug or not is_user_mistake(exc):
            raise
        hint = "  (fedfleet --debug shows where)" if isinstance(exc, (KeyError, TypeError)) else ""
        print(f"fedfleet {command}: error: {describe(exc)}{hint}", file=sys.stderr)
        return 2
