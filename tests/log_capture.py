"""A process's log as every fedfleet process sets it up (``protocols.log_text.log_to_stderr``: the
one-line formatter), read back by a test, and the logging set-up as it was before, afterwards."""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import threading

from protocols.log_text import log_to_stderr


@contextlib.contextmanager
def logging_restored():
    """The root logger's handlers and level, and the exception hooks ``log_to_stderr`` sets, as they
    were before, afterwards."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level, sys.excepthook, threading.excepthook
    try:
        yield root
    finally:
        root.handlers[:], root.level, sys.excepthook, threading.excepthook = saved


@contextlib.contextmanager
def process_log(level: int = logging.INFO):
    """Logging set up by ``log_to_stderr`` at ``level``, its handler's stream read back: yields a
    function that returns what was written (a StringIO in place of stderr: pytest swaps stderr
    between a test's phases)."""
    with logging_restored() as root:
        log_to_stderr(level=level, force=True)
        stream = io.StringIO()
        root.handlers[0].setStream(stream)
        yield stream.getvalue
