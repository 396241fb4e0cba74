"""Exported model bundles for devices: made once by ``export``, then loaded by each device.

The emulated fleet and ``fedfleet device`` turn a (backbone, image size) into a feature
extractor: ``eager`` runs the torch model (development), ``executorch`` / ``onnxruntime`` run
the exported program from a bundle under ``bundle_root`` (exported on first use, parity-checked
against eager, sha256-verified on every load). Bundles are keyed by backbone, image size, the
weights' sha256 and the exporter's revision, so new weights or a changed exporter never reuse a
stale program.
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from export import EXPORTER_REVISION

# the models (torch) are imported where they are used: the simulate command's config check reads
# RUNTIMES, and must not pay torch's import (~1.3 s) to report a mistake
if TYPE_CHECKING:
    from edge_client.features import FeatureExtractor

log = logging.getLogger(__name__)

DEFAULT_BUNDLE_ROOT = Path(".cache/bundles")
# "executorch-int8": the bundle's ExecuTorch program quantized to int8 (export --quantize int8);
# "auto": the fastest of the bundle's programs that keeps parity, measured here (edge_client.runtime.auto)
RUNTIMES = ("eager", "executorch", "executorch-int8", "onnxruntime", "auto")


def bundle_dir(backbone: str, image_size: int, root: Path = DEFAULT_BUNDLE_ROOT) -> Path:
    from edge_client.models import weights_sha256

    return Path(root) / f"{backbone}-{image_size}px-{weights_sha256(backbone)[:12]}-r{EXPORTER_REVISION}"


def ensure_bundle(backbone: str, image_size: int, root: Path = DEFAULT_BUNDLE_ROOT,
                  quantize: str | None = None) -> Path:
    """The manifest of the feature-extractor bundle, exporting it first when missing; with
    ``quantize="int8"`` a bundle of its own holding the int8 ExecuTorch program."""
    if quantize is None:
        return _exported_once(bundle_dir(backbone, image_size, root), dict(
            backbone=backbone, num_classes=10, image_size=image_size,
            inference_runtimes=("executorch", "onnxruntime"), training=False))
    return _exported_once(Path(root) / f"{bundle_dir(backbone, image_size, root).name}-{quantize}", dict(
        backbone=backbone, num_classes=10, image_size=image_size, inference_runtimes=("executorch",),
        training=False, quantize=quantize))


def ensure_training_bundle(backbone: str, image_size: int, num_classes: int,
                           root: Path = DEFAULT_BUNDLE_ROOT) -> Path:
    """The manifest of a bundle holding only the head's training program (C classes on the
    backbone's features), exporting it first when missing. Devices train FedAvg(ψ) rounds with it."""
    out = Path(root) / f"{bundle_dir(backbone, image_size, root).name}-head{num_classes}-training"
    return _exported_once(out, dict(backbone=backbone, num_classes=num_classes, image_size=image_size,
                                    inference_runtimes=(), training=True))


def ensure_tail_bundle(backbone: str, image_size: int, num_classes: int, tail_stages: int,
                       root: Path = DEFAULT_BUNDLE_ROOT) -> Path:
    """The manifest of a bundle for FT(φ)/FT(M): the trunk (images -> activations before the
    last ``tail_stages`` stages) and the tail + head training program, exporting it when missing."""
    out = Path(root) / f"{bundle_dir(backbone, image_size, root).name}-head{num_classes}-tail{tail_stages}"
    return _exported_once(out, dict(backbone=backbone, num_classes=num_classes, image_size=image_size,
                                    inference_runtimes=("executorch",), training=True,
                                    tail_stages=tail_stages))


def _exported_once(out: Path, export_args: dict) -> Path:
    """``out``'s manifest; exported under a file lock when missing (one exporter at a time)."""
    manifest = out / "manifest.json"
    if manifest.exists():
        return manifest
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not manifest.exists():
            from export import export_bundle

            _set_aside_what_is_no_bundle(out)
            export_bundle(out_dir=out, **export_args)
    return manifest


def _set_aside_what_is_no_bundle(out: Path) -> None:
    """Move whatever stands under the bundle's name without a manifest (a non-empty folder, a file,
    a link) aside, to a hidden ``.{name}.stale-*`` folder beside it, and say where: the export
    refuses a non-empty folder, so one left there (a manifest deleted, a copy cut short) failed
    every later run after a whole export (a review's finding). It is kept, not deleted: the cache
    cannot tell whose files those are. An empty folder stays (the export writes into it)."""
    if not os.path.lexists(out) or (out.is_dir() and not out.is_symlink() and not any(out.iterdir())):
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.stale-", dir=out.parent))
    os.replace(out, aside / out.name)
    log.warning("%s held no bundle (no manifest.json): moved to %s and exported again; delete it once you "
                "know nothing in it is needed", out, aside / out.name)


def make_extractor(backbone: str, image_size: int, cache_dir: str | None, runtime: str = "eager",
                   threads: int | None = 1, bundle_root: Path = DEFAULT_BUNDLE_ROOT) -> FeatureExtractor:
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r} (one of {RUNTIMES})")
    if runtime == "eager":
        from edge_client.features import FeatureExtractor

        return FeatureExtractor.eager(backbone, image_size=image_size, cache_dir=cache_dir, threads=threads)
    import torch

    quantize = "int8" if runtime == "executorch-int8" else None
    program_runtime = "executorch" if quantize else runtime
    if threads is not None:
        torch.set_num_threads(threads)
        if program_runtime in ("executorch", "auto"):  # XNNPACK runs on ExecuTorch's own pool, not torch's
            from edge_client.runtime.executorch_runtime import set_executorch_threads

            set_executorch_threads(threads)
    return extractor_from_manifest(ensure_bundle(backbone, image_size, bundle_root, quantize), program_runtime,
                                   cache_dir)


def extractor_from_manifest(manifest: Path, runtime: str, cache_dir: str | None,
                            expected_manifest_sha256: str | None = None) -> FeatureExtractor:
    """A feature extractor running a bundle's program (verified against its manifest)."""
    from edge_client.features import FeatureExtractor

    return FeatureExtractor.from_bundle(manifest, runtime, cache_dir, expected_manifest_sha256)
