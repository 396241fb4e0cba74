"""Artifacts the tests build once per pytest run (exported bundles, the compiled Java library) and
every pytest-xdist worker of that run reuses.

Each xdist worker is its own process with its own session fixtures, so a session fixture alone
would export the same bundle once per worker. Here the first worker to ask builds the artifact
under a file lock in a folder all workers of the run share; the others wait for the lock, see
the artifact is complete and use it. A build that failed leaves no completion mark, so the next
worker to ask builds again (and reports the failure itself)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock

if TYPE_CHECKING:
    import pytest


def run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder private to this pytest run: the parent of the workers' base temporary folders
    under xdist (pytest-of-USER/pytest-N, which pytest's retention policy cleans up like any
    tmp_path), the run's own base temporary folder otherwise."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_once(folder: Path, build: Callable[[Path], object]) -> Path:
    """``folder``, built by ``build(folder)`` unless a process of this run already built it.
    ``build`` must write only inside ``folder`` (created for it, empty). The completion mark
    lives beside the folder, so the artifact's own listing is exactly what ``build`` wrote."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    done = folder.with_name(folder.name + ".built")
    with FileLock(folder.with_name(folder.name + ".lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)       # a build that failed half-way
            folder.mkdir()
            build(folder)
            done.touch()
    return folder
