"""Text the admin CLI prints that the server passes on from devices (decline reasons, presence
profiles, refusals, failure summaries): every control character is written as an escape
(``protocols/log_text.py``), so a device cannot drive the operator's terminal (clear or retitle
it, write the clipboard with OSC 52) nor forge lines.

Two layers: ``one_line`` for each value put into a line (a table's cell, a log line's field, a
reason): its newlines too, since a newline in a profile or a refusal printed a table row or a
device of the device's choosing; ``terminal_safe`` over the whole text, whose own newlines and
tabs are the layout. A backslash is escaped (``\\\\``) by ``one_line`` only, so that a device's text
``\\n`` reads apart from an escaped newline: ``terminal_safe`` leaves backslashes as they are, since
the values in its text are already escaped and doubling their escapes (``\\\\u202e``) would show
every escaped control as a backslash and text. A value that is no string (a validation error's list)
is shown as its Python literal (``literal_line``), whose strings ``repr`` escapes by the same rule,
once: not its JSON text put through ``one_line``, which escaped them twice."""

from __future__ import annotations

import re

from protocols import log_text
from protocols.log_text import escaped_controls

MAX_VALUE_CHARS = 500       # one value as printed: a device's reason is at most 500 when it comes
# the end of an escape that a cut left half ("\u20", "\x1", an odd backslash) before the cut mark: the
# backslash pairs before it are whole escapes and stay (group 1)
HALF_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\(?:x[0-9a-f]?|u[0-9a-f]{0,3}|U[0-9a-f]{0,7})?(?=" +
                         log_text.CUT_MARK + r"\Z)")


def terminal_safe(text: str) -> str:
    """``text``'s controls escaped but its newlines and tabs (the layout) and its backslashes (the
    escapes ``one_line`` wrote into it)."""
    return escaped_controls(text, keep="\n\t\\")


def one_line(value, max_chars: int = MAX_VALUE_CHARS) -> str:
    """``str(value)`` cut to ``max_chars`` (… says so), every control character escaped, newlines
    too, bidirectional overrides and invisible format characters as well (``\\u202e``), and each
    backslash (``\\\\``): a device's text ``\\n`` is never read as an escaped newline."""
    return log_text.one_line(value, max_chars)


def literal_line(value, max_chars: int = MAX_VALUE_CHARS) -> str:
    """A JSON value that is no string (FastAPI's validation error: a list of objects quoting what
    was sent) on one line as its Python literal, cut to ``max_chars``. ``repr`` writes each string
    in it quoted, every non-printable character and each backslash as its escape: ``one_line``'s
    rule (``escaped_controls`` is ``repr``'s per character), so a person reads the text once
    escaped, as ``one_line`` shows a string. Its JSON text put through ``one_line`` showed each
    escape twice: a backslash as ``\\\\\\\\``, a newline as ``\\\\n``, an ``é`` as ``\\\\u00e9``.
    RecursionError for a value nested past what ``repr`` writes."""
    # cut after repr's escaping (one_line cuts before its own): an escape cut in two is dropped whole,
    # never shown as "\u20…" or as a lone backslash escaping the cut mark
    shown = HALF_ESCAPE.sub(r"\1", log_text.cut(repr(value), max_chars))
    # escaped_controls: nothing for repr's text; kept so that no value's repr could ever bring a control
    return escaped_controls(shown, keep="\\")
