"""Which files a piece of code opens: the paths of Python's "open" audit event (every open() / io.open
/ os.open, whoever calls it: torch.load, hashing, Path.read_bytes), recorded while a test asks.

Audit hooks cannot be removed, so the one hook stays installed and records nothing between tests."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

_recording: list[str] | None = None


def _record_opens(event: str, args: tuple) -> None:
    if event == "open" and _recording is not None and isinstance(args[0], (str, bytes, os.PathLike)):
        _recording.append(os.path.realpath(os.fsdecode(args[0])))


sys.addaudithook(_record_opens)


@contextlib.contextmanager
def opened_files() -> Iterator[list[str]]:
    """The real paths opened inside the ``with`` block, in order (one entry per open)."""
    global _recording
    opened: list[str] = []
    _recording = opened
    try:
        yield opened
    finally:
        _recording = None
