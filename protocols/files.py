"""Checksums of files both sides exchange or pin (bundles, programs, pretrained networks)."""

from __future__ import annotations

import hashlib
from pathlib import Path

_BLOCK = 1 << 20


def file_sha256(path: str | Path) -> str:
    """The hex sha256 of a file, read in 1 MiB blocks (bundles can be larger than memory allows)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def check_sha256(data: bytes, expected: str, what: str) -> None:
    """Refuse ``data`` (a file's bytes, read once) whose sha256 is not ``expected`` ("" accepts any):
    the bytes checked are the bytes then used, so a file swapped after the check is never loaded."""
    if expected and hashlib.sha256(data).hexdigest() != expected:
        raise ValueError(f"{what}: sha256 does not match {expected[:16]}…")
