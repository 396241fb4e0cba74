"""Choosing a runtime: the first of the caller's preferences that the bundle offers and
this machine can run. Each candidate's file is verified before its runtime sees it; a
tampered file stops the search (it is never silently replaced by another runtime's file),
while a runtime that is not installed just moves on to the next preference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from edge_client.runtime.base import PIP_PACKAGES
from edge_client.runtime.errors import RuntimeUnavailableError
from protocols.bundle_manifest import RUNTIME_NAMES, ArtifactSpec, Manifest
from edge_client.runtime.verification import read_verified

__all__ = ["check_preferences", "open_first_available"]

logger = logging.getLogger(__name__)

# factory(file bytes, artifact spec, manifest) -> backend object
Factory = Callable[[bytes, ArtifactSpec, Manifest], Any]


def check_preferences(prefer: Sequence[str], allowed: Sequence[str] = RUNTIME_NAMES) -> tuple[str, ...]:
    if isinstance(prefer, str) or not isinstance(prefer, Sequence) or not prefer:
        raise TypeError(f"prefer must be a non-empty sequence of runtime names, got {prefer!r}")
    unknown = [name for name in prefer if name not in allowed]
    if unknown:
        raise ValueError(f"unknown runtime(s) {unknown}; choose from {list(allowed)}")
    return tuple(prefer)


def _install_hint(manifest: Manifest, kind: str) -> str:
    hints = []
    for runtime in manifest.runtimes_for(kind):
        spec = manifest.find(kind, runtime)
        release = spec.runtime_version.split("+")[0]  # "1.5.1+cpu" -> "1.5.1"
        package = PIP_PACKAGES[runtime].format(version=release)
        hints.append(f"{runtime} (`pip install {package}`)")
    return ", ".join(hints)


def open_first_available(manifest: Manifest, kind: str, prefer: Sequence[str],
                         factories: dict[str, Factory]) -> Any:
    """Build the backend for the first usable runtime in ``prefer`` (see module docstring)."""
    prefer = check_preferences(prefer, tuple(factories))
    reasons = []
    for runtime in prefer:
        spec = manifest.find(kind, runtime)
        if spec is None:
            reasons.append(f"{runtime}: the bundle has no {kind} artifact for it")
            continue
        data = read_verified(manifest, spec)
        try:
            backend = factories[runtime](data, spec, manifest)
        except RuntimeUnavailableError as error:
            reasons.append(f"{runtime}: {error}")
            logger.info("runtime %s unavailable for %s, trying the next preference: %s",
                        runtime, spec.file, error)
            continue
        if reasons:
            logger.info("using %s for %s (%s)", runtime, kind, "; ".join(reasons))
        return backend
    offered = manifest.runtimes_for(kind) or ["none"]
    alternatives = [name for name in manifest.runtimes_for(kind) if name not in prefer]
    alternative_note = (
        f" The bundle also offers {alternatives}: pass them in prefer=." if alternatives else "")
    raise RuntimeUnavailableError(
        f"no usable runtime for the {kind} artifacts in {manifest.directory} "
        f"(tried {list(prefer)}): " + "; ".join(reasons) + "."
        f" The bundle offers {offered}; install one of: {_install_hint(manifest, kind)}."
        + alternative_note)
