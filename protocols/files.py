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


def check_file_sha256(path: str | Path, expected: str, what: str) -> None:
    """Refuse a file whose sha256 is not ``expected`` ("" accepts any file)."""
    if expected and file_sha256(path) != expected:
        raise ValueError(f"{what} {path}: sha256 does not match {expected[:16]}…")
