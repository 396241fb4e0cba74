"""Readers for street-scene segmentation datasets in their published folder layouts.

All three give Cityscapes' 19 training classes (``CITYSCAPES_CLASSES``, train ids 0..18,
255 = ignore), so a model trained on one is evaluated on the others:

* **Cityscapes**: ``root/leftImg8bit/<split>/<city>/<city>_<seq>_<frame>_leftImg8bit.png``
  with ``root/gtFine/<split>/<city>/<city>_<seq>_<frame>_gtFine_labelIds.png`` (label ids
  0..33, mapped to train ids by the official table). A ``..._gtFine_labelTrainIds.png``
  (made by cityscapesScripts) is used as is when there is no labelIds file. Images carry
  their city, the LADD/FedDrive "one city per client" domain.
* **GTA5**: ``root/images/<name>.png`` with ``root/labels/<name>.png``, whose values
  (palette indices) are Cityscapes label ids.
* **Mapillary Vistas**: ``root/<split>/images/<key>.jpg`` with
  ``root/<split>/v1.2/labels/<key>.png`` (or ``root/<split>/labels/<key>.png``); label
  values index the ``labels`` list of ``root/config_v1.2.json`` (or ``root/config.json``),
  mapped to Cityscapes classes *by name* (``MAPILLARY_TO_CITYSCAPES``), others to 255.

Every reader returns a :class:`SegmentationSet` of file pairs; ``load(size)`` decodes them
(Pillow, imported on first use) to uint8 RGB images resized bilinearly and labels resized
with nearest neighbour, so labels never get blended values. Files are sorted by path, so
the arrays are deterministic. A label whose size differs from its image is an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CITYSCAPES_CLASSES = ("road", "sidewalk", "building", "wall", "fence", "pole", "traffic light", "traffic sign",
                      "vegetation", "terrain", "sky", "person", "rider", "car", "truck", "bus", "train",
                      "motorcycle", "bicycle")
IGNORE = 255

# Cityscapes label id -> train id (cityscapesScripts' labels.py); every other id is ignored.
CITYSCAPES_ID_TO_TRAIN = {7: 0, 8: 1, 11: 2, 12: 3, 13: 4, 17: 5, 19: 6, 20: 7, 21: 8, 22: 9, 23: 10, 24: 11,
                          25: 12, 26: 13, 27: 14, 28: 15, 31: 16, 32: 17, 33: 18}

_T = {name: i for i, name in enumerate(CITYSCAPES_CLASSES)}
MAPILLARY_TO_CITYSCAPES = {
    "construction--flat--road": _T["road"], "construction--flat--bike-lane": _T["road"],
    "construction--flat--crosswalk-plain": _T["road"], "construction--flat--service-lane": _T["road"],
    "construction--flat--parking": _T["road"], "construction--flat--rail-track": _T["road"],
    "marking--crosswalk-zebra": _T["road"], "marking--general": _T["road"],
    "construction--flat--sidewalk": _T["sidewalk"], "construction--flat--pedestrian-area": _T["sidewalk"],
    "construction--flat--curb-cut": _T["sidewalk"], "construction--barrier--curb": _T["sidewalk"],
    "construction--structure--building": _T["building"], "construction--barrier--wall": _T["wall"],
    "construction--barrier--fence": _T["fence"], "construction--barrier--guard-rail": _T["fence"],
    "object--support--pole": _T["pole"], "object--support--utility-pole": _T["pole"],
    "object--support--traffic-sign-frame": _T["pole"], "object--traffic-light": _T["traffic light"],
    "object--traffic-sign--front": _T["traffic sign"], "nature--vegetation": _T["vegetation"],
    "nature--terrain": _T["terrain"], "nature--sand": _T["terrain"], "nature--sky": _T["sky"],
    "human--person": _T["person"], "human--rider--bicyclist": _T["rider"],
    "human--rider--motorcyclist": _T["rider"], "human--rider--other-rider": _T["rider"],
    "object--vehicle--car": _T["car"], "object--vehicle--truck": _T["truck"], "object--vehicle--bus": _T["bus"],
    "object--vehicle--on-rails": _T["train"], "object--vehicle--motorcycle": _T["motorcycle"],
    "object--vehicle--bicycle": _T["bicycle"],
}


def _lut(mapping: dict[int, int]) -> np.ndarray:
    lut = np.full(256, IGNORE, np.uint8)
    for src, dst in mapping.items():
        lut[src] = dst
    return lut


CITYSCAPES_LUT = _lut(CITYSCAPES_ID_TO_TRAIN)


@dataclass(frozen=True)
class SegmentationSet:
    """Matched (image, label) files; ``domains[i]`` names image i's domain (city, split, ...)."""

    images: tuple[Path, ...]
    labels: tuple[Path, ...]
    domains: tuple[str, ...]
    lut: np.ndarray              # label value -> train id (uint8, 256 entries)

    def __len__(self) -> int:
        return len(self.images)

    def subset(self, indices) -> "SegmentationSet":
        idx = [int(i) for i in indices]
        return SegmentationSet(tuple(self.images[i] for i in idx), tuple(self.labels[i] for i in idx),
                               tuple(self.domains[i] for i in idx), self.lut)

    def by_domain(self) -> dict[str, "SegmentationSet"]:
        out: dict[str, list[int]] = {}
        for i, d in enumerate(self.domains):
            out.setdefault(d, []).append(i)
        return {d: self.subset(idx) for d, idx in sorted(out.items())}

    def load(self, size: tuple[int, int] | int) -> tuple[np.ndarray, np.ndarray]:
        """uint8 images (N, H, W, 3) and train-id labels (N, H, W) at ``size`` = (H, W) or S."""
        Image = _pillow()
        H, W = (size, size) if isinstance(size, int) else size
        images = np.empty((len(self), H, W, 3), np.uint8)
        labels = np.empty((len(self), H, W), np.uint8)
        for i, (ip, lp) in enumerate(zip(self.images, self.labels)):
            with Image.open(ip) as im, Image.open(lp) as lab:
                if im.size != lab.size:
                    raise ValueError(f"{lp} is {lab.size}, its image {ip} is {im.size}")
                if lab.mode not in ("L", "P", "I;16", "I"):
                    raise ValueError(f"{lp}: label images must be single-channel (L/P), got mode {lab.mode}")
                images[i] = np.asarray(im.convert("RGB").resize((W, H), Image.BILINEAR))
                raw = np.asarray(lab.resize((W, H), Image.NEAREST))
            if raw.max(initial=0) > 255:
                raise ValueError(f"{lp}: label value {raw.max()} does not fit the 0..255 table")
            labels[i] = self.lut[raw.astype(np.uint8)]
        return images, labels


def _pillow():
    try:
        from PIL import Image
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("segmentation readers need Pillow: pip install pillow") from exc
    return Image


def _require_dir(path: Path) -> Path:
    if not path.is_dir():
        raise FileNotFoundError(f"expected folder {path}")
    return path


def _paired(images: list[Path], label_for, domains: list[str], lut: np.ndarray, what: str) -> SegmentationSet:
    pairs = []
    missing = []
    for img, dom in zip(images, domains):
        lab = label_for(img)
        if lab is None:
            missing.append(img.name)
        else:
            pairs.append((img, lab, dom))
    if missing:
        raise FileNotFoundError(f"{what}: no label file for {len(missing)} image(s), e.g. {missing[:3]}")
    if not pairs:
        raise FileNotFoundError(f"{what}: no images found")
    return SegmentationSet(tuple(p[0] for p in pairs), tuple(p[1] for p in pairs), tuple(p[2] for p in pairs), lut)


def cityscapes(root: str | Path, split: str = "train", cities: list[str] | None = None) -> SegmentationSet:
    root = Path(root)
    img_root = _require_dir(root / "leftImg8bit" / split)
    gt_root = _require_dir(root / "gtFine" / split)
    chosen = sorted(p.name for p in img_root.iterdir() if p.is_dir()) if cities is None else list(cities)
    images, domains = [], []
    for city in chosen:
        files = sorted(_require_dir(img_root / city).glob("*_leftImg8bit.png"))
        images += files
        domains += [city] * len(files)
    raw_ids: dict[Path, bool] = {}

    def label_for(img: Path) -> Path | None:
        stem = img.name[: -len("_leftImg8bit.png")]
        ids = gt_root / img.parent.name / f"{stem}_gtFine_labelIds.png"
        train = gt_root / img.parent.name / f"{stem}_gtFine_labelTrainIds.png"
        if ids.is_file():
            raw_ids[ids] = True
            return ids
        return train if train.is_file() else None

    found = _paired(images, label_for, domains, CITYSCAPES_LUT, f"Cityscapes {split}")
    if len(raw_ids) not in (0, len(found)):
        raise ValueError("Cityscapes: mixed labelIds and labelTrainIds files; keep one kind")
    if not raw_ids:      # train ids already: identity on 0..18 and 255
        found = SegmentationSet(found.images, found.labels, found.domains,
                                _lut({i: i for i in range(len(CITYSCAPES_CLASSES))}))
    return found


def gta5(root: str | Path) -> SegmentationSet:
    root = Path(root)
    files = sorted(p for p in _require_dir(root / "images").iterdir() if p.suffix.lower() in (".png", ".jpg"))
    labels = _require_dir(root / "labels")

    def label_for(img: Path) -> Path | None:
        lab = labels / f"{img.stem}.png"
        return lab if lab.is_file() else None

    return _paired(files, label_for, ["gta5"] * len(files), CITYSCAPES_LUT, "GTA5")


def mapillary(root: str | Path, split: str = "training") -> SegmentationSet:
    root = Path(root)
    config = next((p for p in (root / "config_v1.2.json", root / "config.json") if p.is_file()), None)
    if config is None:
        raise FileNotFoundError(f"Mapillary: {root}/config_v1.2.json (or config.json) not found")
    try:
        names = [entry["name"] for entry in json.loads(config.read_text())["labels"]]
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"Mapillary: {config} has no usable 'labels' list: {exc}") from exc
    if len(names) > 256:
        raise ValueError(f"Mapillary: {len(names)} classes do not fit 8-bit labels")
    lut = _lut({i: MAPILLARY_TO_CITYSCAPES[n] for i, n in enumerate(names) if n in MAPILLARY_TO_CITYSCAPES})
    base = _require_dir(root / split)
    label_dir = base / "v1.2" / "labels" if (base / "v1.2" / "labels").is_dir() else _require_dir(base / "labels")
    files = sorted(p for p in _require_dir(base / "images").iterdir() if p.suffix.lower() in (".jpg", ".png"))

    def label_for(img: Path) -> Path | None:
        lab = label_dir / f"{img.stem}.png"
        return lab if lab.is_file() else None

    return _paired(files, label_for, [split] * len(files), lut, f"Mapillary {split}")
