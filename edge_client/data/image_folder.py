"""Reader for a class-per-subfolder image dataset: ``root/<class_name>/*.png|jpg|jpeg|ppm|pgm``.

Class ids are positions in the class list: the sorted subfolder names by default, so the
mapping is the same on every device that holds the same folder names, or an explicit list
the caller gives (the fleet's shared label space, where a device may lack some classes).
Within a class, files are read in sorted name order so the returned arrays are
deterministic. Every image is converted to 8-bit RGB (grayscale replicated, alpha dropped).

Decoding uses Pillow, imported on first use so that devices which only read IDX data do
not need it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".ppm", ".pgm"})


def _import_pillow():
    try:
        from PIL import Image
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "load_image_folder needs Pillow to decode images; install it with `pip install pillow`"
        ) from exc
    return Image


def _class_names(root: Path, classes: list[str] | None) -> list[str]:
    if classes is None:
        names = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        if not names:
            raise ValueError(f"{root} has no class subfolders (expected root/<class_name>/<image files>)")
        return names
    names = list(classes)
    if not names:
        raise ValueError("classes must not be empty")
    for name in names:          # a folder's name: "" or "." was the root itself, "../x" another folder
        if not name or name.startswith(".") or "/" in name or "\\" in name or "\0" in name:
            raise ValueError(f"class name {name[:100]!r} is no folder name (empty, starting with '.', or a path)")
    if len(set(names)) != len(names):
        raise ValueError(f"classes contains duplicates: {names}")
    # A device holds any subset of the job's classes: a declared class without a folder simply has
    # no images here; folders of undeclared classes are left out (their images would have no id).
    present = {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")}
    if not present & set(names):
        raise ValueError(f"none of the declared classes has a folder under {root} (found: {sorted(present)})")
    return names


def _image_files(class_dir: Path) -> list[Path]:
    return sorted(
        p for p in class_dir.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_SUFFIXES
    )


def _decode_rgb(Image, path: Path, size_hw: tuple[int, int] | None) -> np.ndarray:
    try:
        with Image.open(path) as image:
            rgb = image.convert("RGB")
            if size_hw is not None and rgb.size != (size_hw[1], size_hw[0]):
                # Pillow's bilinear resize widens its kernel when shrinking, i.e. it antialiases.
                rgb = rgb.resize((size_hw[1], size_hw[0]), Image.Resampling.BILINEAR)
            return np.asarray(rgb, dtype=np.uint8)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        # Pillow's errors for corrupt, truncated, or absurdly large files.
        raise ValueError(f"cannot decode image {path}: {exc}") from exc


def load_image_folder(
    root: str | Path,
    size: tuple[int, int] | None = None,
    classes: list[str] | None = None,
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Load every image under ``root/<class>/`` as uint8 (N, H, W, 3), int64 labels (N,), class names.

    ``size`` is ``(height, width)``; images are resized to it. Without ``size`` all images
    must already share one size. With ``classes``, only those subfolders are read and
    label ``i`` means ``classes[i]``; a listed class with no images keeps its id.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder root {root} does not exist or is not a directory")
    if size is not None:
        if len(size) != 2 or not all(isinstance(s, (int, np.integer)) and s > 0 for s in size):
            raise ValueError(f"size must be (height, width) with positive ints, got {size!r}")
        size = (int(size[0]), int(size[1]))
    class_names = _class_names(root, classes)
    Image = _import_pillow()

    images: list[np.ndarray] = []
    labels: list[int] = []
    for class_id, name in enumerate(class_names):
        if not (root / name).is_dir():
            continue
        for path in _image_files(root / name):
            image = _decode_rgb(Image, path, size)
            if images and image.shape != images[0].shape:
                raise ValueError(
                    f"{path} is {image.shape[1]}x{image.shape[0]} but earlier images are "
                    f"{images[0].shape[1]}x{images[0].shape[0]}; pass size=(height, width) to resize"
                )
            images.append(image)
            labels.append(class_id)
    if not images:
        raise ValueError(f"no images ({', '.join(sorted(IMAGE_SUFFIXES))}) found under {root}")
    return np.stack(images), np.asarray(labels, dtype=np.int64), class_names
