"""Reader for a class-per-subfolder image dataset: ``root/<class_name>/*.png|jpg|jpeg|ppm|pgm``.

Class ids are positions in the class list: the sorted subfolder names by default, so the
mapping is the same on every device that holds the same folder names, or an explicit list
the caller gives (the fleet's shared label space, where a device may lack some classes).
Within a class, files are read in sorted name order so the returned arrays are
deterministic. Every image is converted to 8-bit RGB (grayscale replicated, alpha dropped,
16-bit grayscale to its high byte), turned upright as its EXIF orientation says. A file is decoded
only as the format its suffix names, and only if its header declares at most ``MAX_IMAGE_PIXELS``.
The whole folder is held decoded in memory, so its total is bounded too: the headers are read
first, and a folder that would decode to more than ``max_bytes`` (``MAX_FOLDER_BYTES`` unless told)
is refused before any image is decoded (2,000 photos of 12 MP are 72 GB); images are decoded
straight into the one preallocated array (a list then ``np.stack`` held everything twice).

Decoding uses Pillow, imported on first use so that devices which only read IDX data do
not need it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# The one format each suffix is decoded as: Image.open alone tries every format Pillow knows, so a
# ".png" holding PostScript was handed to Ghostscript, and TIFF, ICO, PSD, ... decoders ran on data
# that needs none of them.
FORMATS_BY_SUFFIX = {".png": ("PNG",), ".jpg": ("JPEG",), ".jpeg": ("JPEG",), ".ppm": ("PPM",), ".pgm": ("PPM",)}
IMAGE_SUFFIXES = frozenset(FORMATS_BY_SUFFIX)
# The most pixels one image may have, judged from its header before it is decoded (about 150 MB as
# 8-bit RGB; a 48 MP photo fits). Pillow's own bound (Image.MAX_IMAGE_PIXELS) only warns below 179 M
# pixels (0.7 GB as RGBA), and is a process-wide setting any library may lift.
MAX_IMAGE_PIXELS = 50_000_000
# The most a whole folder may decode to (8-bit RGB, at ``size`` when given) unless the caller says.
MAX_FOLDER_BYTES = 4 << 30


class MixedImageSizesError(ValueError):
    """The folder's images do not share one size and no ``size`` was given to resize them to;
    ``detail`` says which, without the hint (a command names its own option for ``size``)."""

    def __init__(self, detail: str):
        super().__init__(f"{detail}; pass size=(height, width) to resize")
        self.detail = detail


class ImageFolderTooLargeError(ValueError):
    """The folder would decode to more than the caller's byte cap."""


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


def _declared_size(Image, path: Path) -> tuple[int, int]:
    """(width, height) the header of ``path`` declares; nothing decoded."""
    try:
        with Image.open(path, formats=FORMATS_BY_SUFFIX[path.suffix.lower()]) as image:
            return _checked_size(image)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise ValueError(f"cannot decode image {path}: {exc}") from exc


def _checked_size(image) -> tuple[int, int]:
    """(width, height) of an opened image, ValueError above ``MAX_IMAGE_PIXELS``."""
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(f"{width}x{height} is more than the {MAX_IMAGE_PIXELS:,} pixels an image may have")
    return width, height


def _decode_rgb(Image, path: Path, size_hw: tuple[int, int] | None) -> np.ndarray:
    from PIL import ImageOps

    try:
        with Image.open(path, formats=FORMATS_BY_SUFFIX[path.suffix.lower()]) as image:
            _checked_size(image)
            # as it was taken: a camera stores a portrait photo landscape, with an EXIF orientation
            ImageOps.exif_transpose(image, in_place=True)
            rgb = _eight_bit_rgb(Image, image)
            if size_hw is not None and rgb.size != (size_hw[1], size_hw[0]):
                # Pillow's bilinear resize widens its kernel when shrinking, i.e. it antialiases.
                rgb = rgb.resize((size_hw[1], size_hw[0]), Image.Resampling.BILINEAR)
            return np.asarray(rgb, dtype=np.uint8)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        # Pillow's errors for corrupt, truncated, or absurdly large files.
        raise ValueError(f"cannot decode image {path}: {exc}") from exc


def _eight_bit_rgb(Image, image):
    """``image`` as 8-bit RGB. 16-bit grayscale (PNG's I;16, PGM's I: 0..65535) keeps its high byte:
    convert("RGB") clipped every value above 255 to white."""
    if image.mode.startswith("I;16") or image.mode == "I":
        gray = np.clip(np.asarray(image), 0, 65535).astype(np.uint16) >> 8
        return Image.fromarray(gray.astype(np.uint8), "L").convert("RGB")
    return image.convert("RGB")


def load_image_folder(
    root: str | Path,
    size: tuple[int, int] | None = None,
    classes: list[str] | None = None,
    max_bytes: int = MAX_FOLDER_BYTES,
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Load every image under ``root/<class>/`` as uint8 (N, H, W, 3), int64 labels (N,), class names.

    ``size`` is ``(height, width)``; images are resized to it. Without ``size`` all images
    must already share one size. With ``classes``, only those subfolders are read and
    label ``i`` means ``classes[i]``; a listed class with no images keeps its id. A folder that
    would decode to more than ``max_bytes`` raises ImageFolderTooLargeError before any decoding;
    images of differing sizes without ``size``, MixedImageSizesError.
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

    files: list[Path] = []
    labels: list[int] = []
    for class_id, name in enumerate(class_names):
        if (root / name).is_dir():
            class_files = _image_files(root / name)
            files += class_files
            labels += [class_id] * len(class_files)
    if not files:
        raise ValueError(f"no images ({', '.join(sorted(IMAGE_SUFFIXES))}) found under {root}")
    if size is not None:
        total_bytes = len(files) * size[0] * size[1] * 3
    else:   # an EXIF rotation swaps width and height, never changes their product
        total_bytes = sum(w * h * 3 for w, h in (_declared_size(Image, path) for path in files))
    if total_bytes > max_bytes:
        raise ImageFolderTooLargeError(
            f"the {len(files):,} images under {root} decode to {total_bytes / 2**20:,.0f} MiB, more than the "
            f"{max_bytes / 2**20:,.0f} MiB cap on an image folder")

    first = _decode_rgb(Image, files[0], size)
    images = np.empty((len(files), *first.shape), np.uint8)
    images[0] = first
    for index, path in enumerate(files[1:], start=1):
        image = _decode_rgb(Image, path, size)
        if image.shape != first.shape:
            raise MixedImageSizesError(
                f"{path} is {image.shape[1]}x{image.shape[0]} but earlier images are "
                f"{first.shape[1]}x{first.shape[0]}")
        images[index] = image
    return images, np.asarray(labels, dtype=np.int64), class_names
