"""Our own log lines show what they quote escaped once: the one-line formatter every process logs
through (``protocols/log_text.py``) escapes a record's message, backslashes too, so a line that put
a value in as its ``repr`` (``%r``, ``!r``), which escapes backslashes and controls already, showed
each escape twice (a ``\\`` as four backslashes, a newline as ``\\\\n``). Read here through the real
logging set-up (``log_to_stderr``)."""

from __future__ import annotations

import ast
from types import SimpleNamespace

import pytest

from aggregator.service.job_runner import JobRunner
from log_capture import process_log
from test_code_shape import PRODUCT_PACKAGES, ROOT

LOGGERS = {"log", "logger", "logging"}
LOG_METHODS = {"debug", "info", "warning", "error", "exception", "critical", "log"}

# a store's error quoting a Windows path and a name with a newline and an é in it
WHY = "No space left on device: D:\\fleet\\ops\nnext café"
# written out by hand: each backslash two, the newline \n, the é as it is
SHOWN = r"OSError: No space left on device: D:\\fleet\\ops\nnext café"


def test_a_contribution_not_stored_is_logged_with_its_error_escaped_once():
    """The writer's error was logged as ``%r`` (``OSError('...D:\\\\\\\\fleet...')`` once the
    formatter had escaped repr's escapes) and the job's stop reason kept its repr too."""
    runner = JobRunner.__new__(JobRunner)         # only what on_stored reads of a runner
    reasons = []
    runner.a = SimpleNamespace(job_id="ops")
    runner.writer = SimpleNamespace(completed=lambda: [("0f" * 16, OSError(WHY))])
    runner._held_acks = {}
    runner.on_fatal = lambda reason, stop=False: reasons.append(reason)
    with process_log() as read:
        runner.on_stored()
    lines = [line for line in read().splitlines() if "not stored" in line]
    assert [line.split(" ERROR ", 1)[1] for line in lines] == \
        [f"job ops: contribution {'0f' * 16} not stored: {SHOWN}"], lines
    # the reason as it is: the log that writes it and the admin CLI that shows it escape it, once
    assert reasons == [f"a contribution could not be stored: OSError: {WHY}"] and runner.rebuilt


def reprs_in_log_calls(source: str, name: str = "<source>") -> list[str]:
    """``name:line`` of each ``%r``, ``!r`` or ``repr(...)`` in the arguments of a ``log.info(...)``
    (``logger.``, ``logging.``; every level) call in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source, name)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LOG_METHODS
                and isinstance(node.func.value, ast.Name) and node.func.value.id in LOGGERS):
            continue
        for part in (sub for arg in node.args for sub in ast.walk(arg)):
            if (isinstance(part, ast.Constant) and isinstance(part.value, str) and "%r" in part.value
                    or isinstance(part, ast.FormattedValue) and part.conversion == ord("r")
                    or isinstance(part, ast.Call) and isinstance(part.func, ast.Name) and part.func.id == "repr"):
                out.append(f"{name}:{part.lineno}")
    return out


@pytest.mark.parametrize("package", PRODUCT_PACKAGES)
def test_no_log_line_puts_a_value_in_as_its_repr(package):
    """``%s``: the formatter escapes the value once (a string's controls and backslashes; a number
    or a list reads as with ``%r``). Five did (a device's envelope sender and type, a deployment id,
    a job id, a store's error)."""
    found = [hit for path in sorted((ROOT / package).rglob("*.py"))
             for hit in reprs_in_log_calls(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == []


def test_the_repr_check_finds_each_form():
    wrong = """log.warning("from %r refused", sender)
logger.info(f"type {kind!r} ignored")
logging.error("not stored: %s", repr(error))
log.info("job %s: round %d", job, n)
"""
    assert reprs_in_log_calls(wrong) == ["<source>:1", "<source>:2", "<source>:3"]
