"""Frozen-backbone feature extraction on the device, with an optional on-disk cache.

A :class:`FeatureExtractor` owns the preprocessing (resize + normalise, see
``edge_client.preprocess``) and the batching; the model itself is any callable that
maps a normalised float32 (n, 3, S, S) batch to (n, d) features. That callable is the eager
torch backbone (:meth:`FeatureExtractor.eager`) or an exported program run by ExecuTorch or
ONNX Runtime (``edge_client.runtime``), so every runtime shares one preprocessing path.

Features of a frozen backbone never change for a given image set, and a device re-uses them
every round (Fed3R statistics, OLL, evaluation), so :meth:`FeatureExtractor.extract` can cache
them. The cache key covers the model (``cache_key``: backbone, weights digest, runtime), the
preprocessing (image size, mean, std) and the exact images (dtype, shape and bytes). A file is
the .npy of the features followed by the sha256 of that .npy (``CHECKSUM_BYTES``, which np.load
ignores), checked on every load: a bit flipped on disk, or a file of the right size zero-filled by
a crash, loaded as valid features and poisoned Fed3R's statistics. Files are written whole under a
temp name and renamed (``protocols.files.write_atomic``, not synced: the checksum catches what a
power cut leaves), so a concurrent writer never leaves a half-written file under the final name; an unreadable or mismatching cache
file is treated as a miss (recomputed and rewritten), and a cache that cannot be written leaves
the features uncached (never fails the extraction). A hit
touches its file, so a disk budget on the folder (``edge_client/disk_budget.py``, the device's
``--feature-cache-mb``) removes the files least recently used first.
"""

from __future__ import annotations

import hashlib
import io
import logging
import math
import os
import pathlib
from collections.abc import Callable, Sequence

import numpy as np

# torch is imported by the eager path only: a torch-free device (fedfleet[device]) extracts
# features with an exported program (FeatureExtractor.from_bundle).
from edge_client.disk_budget import touch
from edge_client.preprocess import to_model_input, validate_images
from protocols.files import read_npy_header, write_atomic
from protocols.regular_file import open_regular

__all__ = ["FeatureExtractor"]

log = logging.getLogger("fedfleet.device")

MAX_BATCH_PIXELS = 64 * 224 * 224       # 64 images at the backbones' usual 224 px
CHECKSUM_BYTES = hashlib.sha256().digest_size   # the trailer of a cache file: sha256 of the .npy before it

ForwardFn = Callable[[np.ndarray], np.ndarray]


class FeatureExtractor:
    """Images -> float32 (N, d) features, in batches of ``batch_size`` (fewer when ``image_size`` is
    large, or the images are: a batch holds at most ``MAX_BATCH_PIXELS`` pixels, in and out).

    ``forward`` must accept any batch size from 1 to ``batch_size`` (the last batch is
    smaller) and return an (n, d) array. ``feature_dim`` is given, or found by running
    ``forward`` once on a one-image batch the first time it is needed.
    """

    def __init__(self, forward: ForwardFn, *, image_size: int, mean: Sequence[float],
                 std: Sequence[float], batch_size: int = 64,
                 cache_dir: str | os.PathLike[str] | None = None, cache_key: str = "",
                 feature_dim: int | None = None) -> None:
        if not callable(forward):
            raise ValueError("forward must be callable: normalised (n,3,S,S) float32 -> (n,d)")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if cache_dir is not None and not cache_key:
            raise ValueError(
                "cache_key must name the model (backbone, weights digest, runtime) when "
                "cache_dir is set, otherwise features of different models would collide")
        # Fails early on a bad image_size, mean or std, instead of at the first batch.
        to_model_input(np.zeros((1, 1, 1), np.uint8), image_size, mean, std)
        self._forward = forward
        self.image_size = int(image_size)
        self.mean = tuple(float(value) for value in mean)
        self.std = tuple(float(value) for value in std)
        # a batch holds at most MAX_BATCH_PIXELS: its activations grow with its pixels, so a large
        # image_size runs in smaller batches (the same features: every image is its own row)
        self.batch_size = max(1, min(int(batch_size), MAX_BATCH_PIXELS // (self.image_size * self.image_size)))
        self.cache_dir = pathlib.Path(cache_dir) if cache_dir is not None else None
        self.cache_key = cache_key
        self._feature_dim = feature_dim

    @classmethod
    def eager(cls, backbone_name: str, image_size: int = 64, batch_size: int = 64,
              cache_dir: str | os.PathLike[str] | None = None,
              threads: int | None = None) -> FeatureExtractor:
        """Extractor running the pretrained torch backbone eagerly on the CPU.

        ``threads`` calls ``torch.set_num_threads``, which is process-wide.
        """
        import torch

        from edge_client.models import pretrained_backbone

        if threads is not None:
            torch.set_num_threads(threads)
        # the weights file read once: the cache key names the digest of the very bytes loaded
        backbone, digest = pretrained_backbone(backbone_name)

        def forward(batch: np.ndarray) -> np.ndarray:
            with torch.inference_mode():
                return backbone(torch.from_numpy(batch)).numpy()

        cache_key = f"{backbone_name}:{digest}:{image_size}:eager"
        return cls(forward, image_size=image_size, mean=backbone.mean, std=backbone.std,
                   batch_size=batch_size, cache_dir=cache_dir, cache_key=cache_key,
                   feature_dim=backbone.feature_dim)

    @classmethod
    def from_bundle(cls, manifest: str | os.PathLike[str], runtime: str, cache_dir: str | os.PathLike[str] | None,
                    expected_manifest_sha256: str | None = None) -> FeatureExtractor:
        """Extractor running an exported bundle's inference program in ``runtime`` (verified
        against its manifest), with the preprocessing the program was exported with. ``"auto"``:
        the fastest installed runtime that keeps parity (``edge_client.runtime.auto``)."""
        from edge_client.runtime import load_inference
        from edge_client.runtime.auto import load_fastest

        if runtime == "auto":
            program = load_fastest(manifest, expected_manifest_sha256)
        else:
            program = load_inference(manifest, prefer=(runtime,), expected_manifest_sha256=expected_manifest_sha256)
        m = program.manifest
        norm = m.input
        # cached features belong to this very program (an int8 and an fp32 .pte give different ones)
        artifact = m.find("inference", program.runtime).sha256
        extractor = cls(program.run, image_size=norm.image_size, mean=norm.mean, std=norm.std, batch_size=32,
                        cache_dir=cache_dir, feature_dim=m.feature_dim,
                        cache_key=f"{m.backbone}:{m.weights_sha256}:{norm.image_size}:{program.runtime}:{artifact[:16]}")
        extractor.runtime = program.runtime                             # what ran (the choice, with "auto")
        extractor.weights_sha256 = m.weights_sha256                     # from the manifest that was verified
        extractor.calibration = getattr(program, "calibration", None)   # "auto": every runtime's trial
        return extractor

    @property
    def feature_dim(self) -> int:
        if self._feature_dim is None:  # the first batch run fixes it
            self._run_batch(np.zeros((1, self.image_size, self.image_size), np.uint8))
        return self._feature_dim

    def extract(self, images: np.ndarray) -> np.ndarray:
        """Features of ``images`` (see ``validate_images`` for accepted inputs), float32 (N, d)."""
        images = validate_images(images)
        cache_file = self._cache_file(images) if self.cache_dir is not None else None
        if cache_file is not None:
            cached = self._load_cached(cache_file, len(images))
            if cached is not None:
                return cached
        if len(images) == 0:
            features = np.zeros((0, self.feature_dim), np.float32)
        else:
            # and at most MAX_BATCH_PIXELS of the images as they come: a batch is made float32 at their
            # size before it is resized (64 photos of 12 MP were 9 GB for a 224 px backbone)
            batch = max(1, min(self.batch_size, MAX_BATCH_PIXELS // (images.shape[1] * images.shape[2])))
            features = np.concatenate([
                self._run_batch(images[start:start + batch]) for start in range(0, len(images), batch)])
        if cache_file is not None:
            self._store(cache_file, features)
        return features

    def _run_batch(self, images: np.ndarray) -> np.ndarray:
        batch = to_model_input(images, self.image_size, self.mean, self.std)
        features = np.asarray(self._forward(batch))
        if features.ndim != 2 or features.shape[0] != len(images):
            raise ValueError(
                f"forward returned shape {features.shape} for a batch of {len(images)} "
                f"images; expected ({len(images)}, d)")
        if self._feature_dim is None:
            self._feature_dim = features.shape[1]
        elif features.shape[1] != self._feature_dim:
            raise ValueError(
                f"forward returned {features.shape[1]} features per image, expected "
                f"{self._feature_dim}")
        if not np.isfinite(features).all():
            raise ValueError("forward returned NaN or infinite features")
        return np.ascontiguousarray(features, dtype=np.float32)

    # -- cache ------------------------------------------------------------------------------

    def _cache_file(self, images: np.ndarray) -> pathlib.Path:
        digest = hashlib.sha256()
        header = (f"{self.cache_key}|size={self.image_size}|mean={self.mean}|std={self.std}"
                  f"|dtype={images.dtype.str}|shape={images.shape}|")
        digest.update(header.encode())
        digest.update(np.ascontiguousarray(images).data)
        return self.cache_dir / f"features-{digest.hexdigest()}.npy"

    def _load_cached(self, path: pathlib.Path, count: int) -> np.ndarray | None:
        """The cached (count, d) float32 features at ``path``, or None: what is there is judged by its
        header and size before any array is made (a header declaring 2^40 rows allocated them: a
        MemoryError failed every extraction of these images), and only a regular file is opened (a
        FIFO at the name waited for a writer for ever)."""
        expected_dim = self._feature_dim
        try:
            with open_regular(path) as f:           # the header under the lock, the data outside it
                shape, fortran_order, dtype = read_npy_header(f)
                data_bytes = math.prod(shape) * dtype.itemsize
                if (fortran_order or dtype != np.dtype("<f4") or len(shape) != 2 or shape[0] != count
                        or (expected_dim is not None and shape[1] != expected_dim)
                        or os.fstat(f.fileno()).st_size - f.tell() != data_bytes + CHECKSUM_BYTES):
                    return None
                header_bytes = f.tell()
                f.seek(0)
                npy = bytearray(header_bytes + data_bytes)     # the features' own buffer: no copy
                read = f.readinto(npy)
                stored_checksum = f.read(CHECKSUM_BYTES)
        except (OSError, ValueError, EOFError):
            return None  # gone, not a regular file, corrupt or truncated: recompute and overwrite
        if read != len(npy) or hashlib.sha256(npy).digest() != stored_checksum:
            log.warning("feature cache: %s does not match its checksum (damaged on disk); recomputing", path.name)
            return None
        features = np.frombuffer(npy, dtype=dtype, offset=header_bytes).reshape(shape)
        touch(path)         # used: the last a disk budget on the cache folder removes (disk_budget.py)
        return features

    def _store(self, path: pathlib.Path, features: np.ndarray) -> None:
        """Keep ``features`` under ``path``, or leave them uncached: the cache only saves work, and a
        folder it cannot write (a full disk, read-only, a folder at the file's name) failed the
        extraction whose features were already computed, and every later one of those images."""
        npy = io.BytesIO()
        np.save(npy, features, allow_pickle=False)
        npy = npy.getvalue()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # renamed whole, not synced: a file a power cut left zero-filled fails its checksum (a miss),
            # and a sync per file would cost an emulated fleet's thousands of first extractions
            write_atomic(path, npy + hashlib.sha256(npy).digest(), temp_prefix=f".{path.stem}.", mode=0o644,
                         durable=False)
        except OSError as exc:
            log.warning("feature cache: cannot write %s (%s); features not cached", path, exc)
