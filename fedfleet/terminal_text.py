"""Text the admin CLI prints that the server passes on from devices (decline reasons, presence
profiles, refusals, failure summaries): every control character but newline and tab is written as
an escape, so a device cannot drive the operator's terminal (clear or retitle it, forge lines,
write the clipboard with OSC 52)."""

from __future__ import annotations


def terminal_safe(text: str) -> str:
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)
