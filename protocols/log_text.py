"""Text that others wrote (a device's decline reason or refusal, its presence profile, an error that
quotes them) made safe to show a person: in one line of a log, or in a terminal.

The one escape (``escaped_controls``): every character that is not printable -- C0 and C1 controls
(ESC, CSI, BEL), line and paragraph separators, the bidirectional controls (U+202A-U+202E,
U+2066-U+2069, U+200E/F, U+061C) and every other invisible format character (zero-width space and
joiners, U+FEFF), spaces other than U+0020 -- is written as its Python escape (``\\u202e``), and
a backslash as ``\\\\``, so the escapes are the only single backslashes shown: without it a device
that sent the printable text ``\\u202e`` or ``\\n`` showed exactly what an escaped control shows (the
reader could not tell which was sent, and a device could forge what read as an escaped newline
in the middle of a record). The text shown is the text sent read as a Python string literal.
Unescaped, a newline in a device's decline reason wrote a second log record of the attacker's
choosing under the aggregator's timestamp, an ESC sequence drove the terminal that tails the log
(clear it, retitle it, write the clipboard with OSC 52), and a right-to-left override showed the
rest of a line reversed (a device id or a reason reading as another). ``one_line`` also cuts: a
value, or a whole record, of a megabyte that a peer chose fills no log.

The rule is the Unicode categories Python's ``str.isprintable`` refuses (Cc, Cf, Cs, Co, Cn, Zl,
Zp, Zs but the space). The Java device escapes by the same rule (``org.fedfleet.wire.LogText``) and
the dashboard too (``aggregator/api/static/app.js``, ``shown``); ``tests/test_log_text_java.py``
holds the Java one to this one on every code point.

``OneLineFormatter`` is the logging side: a record's message is one line whatever it quotes, and
a traceback's lines (an exception's message may quote a device too) are each indented, so only a
record starts a line at column 0. ``log_to_stderr`` is what every fedfleet process's logging
starts with (the devices' hosts too); it writes an exception nobody caught the same way.
"""

from __future__ import annotations

import logging
import sys
import threading

LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
TRACE_INDENT = "    "       # before each line of a traceback: no forged record at column 0
MAX_RECORD_CHARS = 4000     # a record's message, a traceback's line: far above any our own code writes
CUT_MARK = "\u2026"         # "…": where one_line cut


def escaped_controls(text: str, keep: str = "") -> str:
    """``text`` with each non-printable character and each backslash not in ``keep`` as its escape
    (``\\n``, ``\\x1b``, ``\\\\``): as Python's ``repr`` writes them, so the result read as a string
    literal is ``text`` again. ``keep``'s characters are left as they are (a layout's own newlines;
    the backslashes of text already escaped, which must not be doubled)."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(c if c in keep or (c.isprintable() and c != "\\") else repr(c)[1:-1] for c in text)


def one_line(value, max_chars: int = MAX_RECORD_CHARS) -> str:
    """``str(value)`` cut to ``max_chars`` characters (the last one ``…`` where it was cut), then
    every non-printable character and every backslash escaped, newlines too: cut first, so an
    escape is never split."""
    return escaped_controls(cut(str(value), max_chars))


def cut(text: str, max_chars: int) -> str:
    """``text`` cut to ``max_chars`` characters, the last one ``…`` where it was cut."""
    return text if len(text) <= max_chars else text[:max_chars - 1] + CUT_MARK


class OneLineFormatter(logging.Formatter):
    """A log record whose message is one line of printable text of at most ``MAX_RECORD_CHARS``
    characters before escaping, its traceback indented, each of its lines cut alike (an exception's
    message may quote a peer's text whole: a task's parameter of a megabyte)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = one_line(record.message)
        return super().formatMessage(record)

    def formatException(self, ei) -> str:
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _indented(super().formatStack(stack_info))


def _indented(text: str) -> str:
    return "\n".join(TRACE_INDENT + one_line(line) for line in text.splitlines())


def log_to_stderr(fmt: str = LOG_FORMAT, level: int = logging.WARNING, force: bool = False) -> None:
    """``logging.basicConfig`` with records written by ``OneLineFormatter`` (``force``: replace a
    handler the process inherited, as a fork does); an exception nobody caught, in the main thread
    or another, written the same way (Python's own hooks wrote its message raw: a device's text
    that an error quoted, on its way out of an aggregator or a device host)."""
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter(fmt))
    logging.basicConfig(level=level, handlers=[handler], force=force)
    sys.excepthook = write_uncaught
    threading.excepthook = _write_uncaught_in_thread


def _write_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    """``write_uncaught`` for a thread's exception; a thread's SystemExit is silent, as Python's own
    hook keeps it (it is how a thread chose to end, no error)."""
    if not issubclass(args.exc_type, SystemExit):
        write_uncaught(args.exc_type, args.exc_value, args.exc_traceback)


def write_uncaught(kind, value, tb) -> None:
    """An exception nobody caught, on stderr as a log writes a traceback: indented, escaped, cut."""
    if sys.stderr is not None:
        sys.stderr.write(f"uncaught {kind.__name__}:\n{OneLineFormatter().formatException((kind, value, tb))}\n")
        sys.stderr.flush()
