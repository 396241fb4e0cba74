"""Text that others wrote (a device's decline reason or refusal, its presence profile, an error that
quotes them) made safe to show a person: in one line of a log, or in a terminal.

The one escape (``escaped_controls``): every character that is not printable -- C0 and C1 controls
(ESC, CSI, BEL), line and paragraph separators, bidirectional overrides -- is written as its Python
escape. Unescaped, a newline in a device's decline reason wrote a second log record of the
attacker's choosing under the aggregator's timestamp, and an ESC sequence drove the terminal that
tails the log (clear it, retitle it, write the clipboard with OSC 52).

``OneLineFormatter`` is the logging side: a record's message is one line whatever it quotes, and
a traceback's lines (an exception's message may quote a device too) are each indented, so only a
record starts a line at column 0. ``log_to_stderr`` is what every fedfleet process's logging
starts with.
"""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
TRACE_INDENT = "    "       # before each line of a traceback: no forged record at column 0


def escaped_controls(text: str, keep: str = "") -> str:
    """``text`` with each non-printable character not in ``keep`` as its escape (``\\n``, ``\\x1b``)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)


class OneLineFormatter(logging.Formatter):
    """A log record whose message is one line of printable text, its traceback indented."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escaped_controls(record.message)
        return super().formatMessage(record)

    def formatException(self, ei) -> str:
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _indented(super().formatStack(stack_info))


def _indented(text: str) -> str:
    return "\n".join(TRACE_INDENT + escaped_controls(line) for line in text.splitlines())


def log_to_stderr(fmt: str = LOG_FORMAT, level: int = logging.WARNING, force: bool = False) -> None:
    """``logging.basicConfig`` with records written by ``OneLineFormatter`` (``force``: replace a
    handler the process inherited, as a fork does)."""
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter(fmt))
    logging.basicConfig(level=level, handlers=[handler], force=force)
