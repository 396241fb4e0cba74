"""Seeded synthetic street scenes: one labelled source domain and unlabelled target domains.

No street-scene dataset can be installed here, so the LADD benchmark draws its own. A scene
is a small procedural street view with per-pixel labels for seven classes (``CLASSES``):
sky with clouds, a row of buildings (brick texture, windows), trees and lawn (grass texture),
a road in perspective (gravel texture, lane markings), sidewalks (paving texture), vehicles
and pedestrians. The textures are real photographs shipped with scikit-image
(``skimage.data.brick/grass/gravel/page``), read from the installed package (no download).

Domains differ only in *global appearance*, as cities, weather and cameras do
(:class:`AppearanceShift`): colour cast, gamma, haze (contrast loss), saturation, blur, sensor
noise and an overlaid texture (rain streaks, film grain). Scene content is drawn from the
same distribution in every domain, so a model trained on the clean source domain faces pure
covariate shift on the targets. Every image of a domain gets its own random jitter of the
shift's parameters, so images (and devices) of one domain are similar, not identical.

Labels of the target domains exist only for evaluation: the devices never read them.

Everything is a function of the seed: ``make_benchmark(seed=s)`` returns bit-identical
arrays on every call and machine (numpy ``Generator`` streams spawned per purpose).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

CLASSES = ("sky", "building", "vegetation", "road", "sidewalk", "vehicle", "person")
SKY, BUILDING, VEGETATION, ROAD, SIDEWALK, VEHICLE, PERSON = range(len(CLASSES))
IGNORE = 255


@dataclass(frozen=True)
class AppearanceShift:
    """A domain's global appearance, applied to a rendered scene in [0, 1] RGB.

    Order: gamma, colour gains, saturation, haze blend, contrast, blur, overlay, noise, clip.
    ``jitter`` is the relative per-image spread of the numeric parameters.
    """

    name: str
    gains: tuple[float, float, float] = (1.0, 1.0, 1.0)
    gamma: float = 1.0
    saturation: float = 1.0
    haze: float = 0.0
    haze_colour: tuple[float, float, float] = (0.8, 0.8, 0.82)
    contrast: float = 1.0
    blur_sigma: float = 0.0
    noise_sigma: float = 0.0
    overlay: str | None = None          # "rain" | "grain" | None
    jitter: float = 0.05


DOMAINS: dict[str, AppearanceShift] = {
    s.name: s for s in (
        AppearanceShift("source", jitter=0.08),
        AppearanceShift("night", gains=(0.55, 0.62, 1.0), gamma=1.7, saturation=0.8, noise_sigma=0.035),
        AppearanceShift("fog", haze=0.5, blur_sigma=0.9, saturation=0.7),
        AppearanceShift("sunset", gains=(1.25, 0.85, 0.5), gamma=0.9, contrast=1.25),
        AppearanceShift("rain", gains=(0.8, 0.92, 0.88), saturation=0.35, blur_sigma=0.5, noise_sigma=0.05,
                        overlay="rain"),
        AppearanceShift("overexposed", gains=(1.1, 1.05, 0.95), gamma=0.55, contrast=0.8, overlay="grain"),
    )
}
TARGET_DOMAINS = ("night", "fog", "sunset", "rain")


@dataclass
class DeviceData:
    device_id: str
    domain: str
    images: np.ndarray          # (n, S, S, 3) uint8
    labels: np.ndarray          # (n, S, S) uint8, evaluation only


@dataclass
class SceneBenchmark:
    """The labelled source set (server), unlabelled device sets, per-domain test sets."""

    image_size: int
    source_images: np.ndarray
    source_labels: np.ndarray
    devices: list[DeviceData]
    test: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    classes: tuple[str, ...] = CLASSES

    @property
    def domains(self) -> list[str]:
        return sorted({d.domain for d in self.devices})


# ----------------------------------------------------------------------------- textures
@functools.lru_cache(maxsize=None)
def _textures() -> dict[str, np.ndarray]:
    """Zero-mean, unit-std float32 texture maps from scikit-image's bundled photographs."""
    try:
        from skimage import data
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("the synthetic scene generator needs scikit-image (pip install scikit-image)") from exc
    out = {}
    for name, fetch, step in (("brick", data.brick, 3), ("grass", data.grass, 2), ("gravel", data.gravel, 3),
                              ("paving", data.page, 1)):
        t = fetch().astype(np.float32)[::step, ::step]
        out[name] = (t - t.mean()) / (t.std() + 1e-6)
    return out


def _patch(rng: np.random.Generator, name: str, size: int) -> np.ndarray:
    tex = _textures()[name]
    h, w = tex.shape
    if h < size or w < size:
        tex = np.tile(tex, (size // h + 1, size // w + 1))
        h, w = tex.shape
    y, x = rng.integers(0, h - size + 1), rng.integers(0, w - size + 1)
    return tex[y:y + size, x:x + size]


# ----------------------------------------------------------------------------- rendering
def _smooth_noise(rng: np.random.Generator, size: int, scale: float) -> np.ndarray:
    from scipy import ndimage      # here: the configs' checks import this module's names, not its rendering

    n = ndimage.gaussian_filter(rng.normal(size=(size, size)), scale * size)
    return (n - n.mean()) / (n.std() + 1e-9)


class _Canvas:
    """A scene being painted: the image, its label map, the pixel grid in [0, 1) and the scene's rng."""

    def __init__(self, rng: np.random.Generator, size: int):
        self.rng, self.size = rng, size
        self.yy, self.xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
        self.img = np.zeros((size, size, 3), np.float32)
        self.lab = np.full((size, size), SKY, np.uint8)

    def paint(self, mask, colour, texture=None, amp=0.0, cls=None):
        S = self.size
        shade = np.ones((S, S), np.float32) if texture is None else 1.0 + amp * _patch(self.rng, texture, S)
        self.img[mask] = (np.asarray(colour, np.float32)[None, :] * shade[mask][:, None])
        if cls is not None:
            self.lab[mask] = cls


def render_scene(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
    """One clean scene: float32 (S, S, 3) in [0, 1] and uint8 (S, S) class ids. Painted back to
    front (sky, skyline, ground, then objects far to near), every layer drawing from ``rng`` in
    this order, so a seed gives one scene."""
    c = _Canvas(rng, size)
    horizon = rng.uniform(0.38, 0.52)
    _paint_sky(c, horizon)
    _paint_skyline(c, horizon)
    vx, road_half = _paint_ground(c, horizon)
    _paint_objects(c, horizon, vx, road_half)
    return np.clip(c.img, 0.0, 1.0), c.lab


def _paint_sky(c: _Canvas, horizon: float) -> None:
    """A vertical gradient plus soft clouds."""
    rng = c.rng
    top = np.array([0.30, 0.52, 0.88]) + rng.normal(0, 0.04, 3)
    bottom = np.array([0.68, 0.80, 0.95]) + rng.normal(0, 0.03, 3)
    t = np.clip(c.yy / max(horizon, 1e-3), 0, 1)[..., None]
    c.img[:] = (1 - t) * top + t * bottom
    clouds = np.clip(_smooth_noise(rng, c.size, 0.08) - 0.6, 0, None)[..., None] * 0.35
    c.img[:] = c.img + clouds * (1.0 - c.img)


def _paint_skyline(c: _Canvas, horizon: float) -> None:
    """Buildings along the horizon, with gaps filled by trees."""
    rng, xx, yy = c.rng, c.xx, c.yy
    x = -rng.uniform(0, 0.1)
    tree_spots = []
    while x < 1.0:
        width = rng.uniform(0.12, 0.3)
        if rng.random() < 0.78:
            roof = rng.uniform(0.04, horizon - 0.06)
            mask = (xx >= x) & (xx < x + width) & (yy >= roof) & (yy < horizon + 0.02)
            base = np.array([[0.72, 0.62, 0.48], [0.55, 0.55, 0.56], [0.62, 0.38, 0.30],
                             [0.80, 0.76, 0.66]][rng.integers(4)]) * rng.uniform(0.85, 1.1)
            c.paint(mask, base, "brick", 0.18, BUILDING)
            # windows: a grid of dark panes (still "building")
            pitch_x, pitch_y = rng.uniform(0.05, 0.08), rng.uniform(0.06, 0.09)
            wx = ((xx - x) % pitch_x) < pitch_x * 0.5
            wy = ((yy - roof) % pitch_y) < pitch_y * 0.5
            win = mask & wx & wy & (yy > roof + 0.02) & (yy < horizon - 0.02)
            c.img[win] = np.array([0.20, 0.24, 0.30]) * rng.uniform(0.8, 1.3)
        else:
            tree_spots.append(x + width / 2)
        x += width
    for _ in range(rng.integers(0, 3)):
        tree_spots.append(rng.uniform(0, 1))
    for cx in tree_spots:
        r = rng.uniform(0.06, 0.12)
        cy = horizon - r * rng.uniform(0.3, 0.9)
        mask = ((xx - cx) / r) ** 2 + ((yy - cy) / (r * 1.2)) ** 2 < 1
        c.paint(mask, np.array([0.22, 0.48, 0.18]) * rng.uniform(0.8, 1.2), "grass", 0.35, VEGETATION)


def _paint_ground(c: _Canvas, horizon: float) -> tuple[float, np.ndarray]:
    """A road in perspective, sidewalks beside it, lawn beyond; returns the vanishing point's x
    and the road's half width per pixel (the objects stand on them)."""
    rng, xx, yy = c.rng, c.xx, c.yy
    vx = rng.uniform(0.38, 0.62)
    depth = np.clip((yy - horizon) / (1 - horizon), 0, 1)
    road_half = depth * rng.uniform(0.3, 0.48) + 0.01
    walk = road_half + depth * rng.uniform(0.12, 0.22)
    ground = yy >= horizon
    road = ground & (np.abs(xx - vx) < road_half)
    sidewalk = ground & ~road & (np.abs(xx - vx) < walk)
    lawn = ground & ~road & ~sidewalk
    c.paint(lawn, np.array([0.30, 0.52, 0.22]) * rng.uniform(0.85, 1.15), "grass", 0.3, VEGETATION)
    c.paint(sidewalk, np.array([0.70, 0.66, 0.60]) * rng.uniform(0.9, 1.1), "paving", 0.12, SIDEWALK)
    c.paint(road, np.array([0.33, 0.33, 0.35]) * rng.uniform(0.8, 1.2), "gravel", 0.15, ROAD)
    dash = road & (np.abs(xx - vx) < 0.006 + 0.012 * depth) & ((depth * 6 + rng.random()) % 1.0 < 0.5)
    c.img[dash] = 0.92
    return vx, road_half


def _paint_objects(c: _Canvas, horizon: float, vx: float, road_half: np.ndarray) -> None:
    """Vehicles on the road and pedestrians on the sidewalks, far to near (painter's order)."""
    rng = c.rng
    objects = [("car", rng.uniform(horizon + 0.08, 0.98)) for _ in range(rng.integers(1, 4))]
    objects += [("person", rng.uniform(horizon + 0.06, 0.98)) for _ in range(rng.integers(0, 4))]
    for kind, base_y in sorted(objects, key=lambda o: o[1]):
        d = (base_y - horizon) / (1 - horizon)
        if kind == "car":
            _paint_car(c, base_y, d, vx)
        else:
            _paint_person(c, base_y, d, vx, road_half)


def _paint_car(c: _Canvas, base_y: float, d: float, vx: float) -> None:
    rng, xx, yy = c.rng, c.xx, c.yy
    w, h = 0.12 + 0.3 * d, 0.07 + 0.16 * d
    cx = vx + rng.uniform(-0.7, 0.7) * (d * 0.4)
    body = (np.abs(xx - cx) < w / 2) & (yy > base_y - h) & (yy < base_y - 0.12 * h)
    colour = rng.uniform(0.05, 0.95, 3)
    colour[rng.integers(3)] = rng.uniform(0.7, 1.0)
    c.paint(body, colour, None, 0.0, VEHICLE)
    glass = (np.abs(xx - cx) < w * 0.36) & (yy > base_y - h) & (yy < base_y - 0.62 * h)
    c.img[glass] = np.array([0.15, 0.18, 0.22])
    for side in (-1, 1):
        wheel = ((xx - (cx + side * w * 0.3)) / (w * 0.1)) ** 2 + ((yy - (base_y - 0.12 * h)) / (h * 0.14)) ** 2 < 1
        c.paint(wheel, (0.05, 0.05, 0.05), None, 0.0, VEHICLE)


def _paint_person(c: _Canvas, base_y: float, d: float, vx: float, road_half: np.ndarray) -> None:
    rng, xx, yy = c.rng, c.xx, c.yy
    h, w = 0.1 + 0.3 * d, 0.03 + 0.06 * d
    side = rng.choice((-1, 1))
    cx = vx + side * ((road_half.max() * d) + (0.05 + 0.12 * d) * rng.uniform(0.3, 1.0))
    torso = ((xx - cx) / (w / 2)) ** 2 + ((yy - (base_y - 0.45 * h)) / (0.45 * h)) ** 2 < 1
    c.paint(torso, rng.uniform(0.05, 0.9, 3), None, 0.0, PERSON)
    head = ((xx - cx) / (w * 0.32)) ** 2 + ((yy - (base_y - 0.93 * h)) / (0.1 * h)) ** 2 < 1
    c.paint(head, np.array([0.85, 0.65, 0.5]) * rng.uniform(0.6, 1.1), None, 0.0, PERSON)


# ----------------------------------------------------------------------------- domains
def apply_appearance(image: np.ndarray, shift: AppearanceShift, rng: np.random.Generator) -> np.ndarray:
    """float (S, S, 3) in [0, 1] -> uint8 (S, S, 3) in the domain's look (per-image jitter from ``rng``)."""
    def j(value: float) -> float:
        return value * (1.0 + shift.jitter * rng.normal())

    x = np.clip(image, 0.0, 1.0).astype(np.float32) ** j(shift.gamma)
    x = x * np.array([j(g) for g in shift.gains], np.float32)
    grey = x.mean(axis=2, keepdims=True)
    x = grey + np.clip(j(shift.saturation), 0.0, 3.0) * (x - grey)
    if shift.haze:
        a = float(np.clip(j(shift.haze), 0.0, 0.95))
        x = (1 - a) * x + a * np.asarray(shift.haze_colour, np.float32)
    if shift.contrast != 1.0:
        m = x.mean()
        x = m + j(shift.contrast) * (x - m)
    if shift.blur_sigma:
        from scipy import ndimage

        x = ndimage.gaussian_filter(x, (abs(j(shift.blur_sigma)), abs(j(shift.blur_sigma)), 0))
    S = x.shape[0]
    if shift.overlay == "rain":
        streaks = np.zeros((S, S), np.float32)
        for _ in range(max(1, S // 3)):
            y0, x0, length = rng.integers(0, S), rng.integers(0, S), rng.integers(S // 10 + 2, S // 4 + 3)
            ys = np.clip(y0 + np.arange(length), 0, S - 1)
            xs = np.clip(x0 + np.arange(length) // 3, 0, S - 1)
            streaks[ys, xs] = 1.0
        x = x + 0.25 * streaks[..., None]
    elif shift.overlay == "grain":
        x = x * (1.0 + 0.12 * _patch(rng, "gravel", S)[..., None])
    if shift.noise_sigma:
        x = x + rng.normal(0.0, abs(j(shift.noise_sigma)), x.shape).astype(np.float32)
    return np.round(np.clip(x, 0.0, 1.0) * 255.0).astype(np.uint8)


def render_domain(n: int, shift: AppearanceShift, size: int, rng: np.random.Generator
                  ) -> tuple[np.ndarray, np.ndarray]:
    """n scenes in one domain: uint8 (n, S, S, 3) images and uint8 (n, S, S) labels."""
    images = np.empty((n, size, size, 3), np.uint8)
    labels = np.empty((n, size, size), np.uint8)
    for i in range(n):
        clean, labels[i] = render_scene(rng, size)
        images[i] = apply_appearance(clean, shift, rng)
    return images, labels


def make_benchmark(seed: int = 0, image_size: int = 64, n_source: int = 400,
                   target_domains: tuple[str, ...] = TARGET_DOMAINS, devices_per_domain: int = 10,
                   images_per_device: tuple[int, int] = (12, 24), test_per_domain: int = 40,
                   device_prefix: str = "dev") -> SceneBenchmark:
    """The whole seeded benchmark. Devices are numbered domain-major (``dev000``.. in domain order).

    ``images_per_device`` is the inclusive range of local set sizes (uniform per device).
    """
    unknown = [d for d in target_domains if d not in DOMAINS]
    if unknown:
        raise ValueError(f"unknown domains {unknown}; known: {sorted(DOMAINS)}")
    if image_size < 16:
        raise ValueError(f"image_size must be >= 16, got {image_size}")
    lo, hi = images_per_device
    if not 1 <= lo <= hi:
        raise ValueError(f"images_per_device must be 1 <= lo <= hi, got {images_per_device}")
    if n_source < 1 or devices_per_domain < 1 or test_per_domain < 0:
        raise ValueError("n_source and devices_per_domain must be >= 1, test_per_domain >= 0")
    root = np.random.SeedSequence(seed)
    src_seq, dev_seq, test_seq = root.spawn(3)
    source_images, source_labels = render_domain(n_source, DOMAINS["source"], image_size, np.random.default_rng(src_seq))
    devices = []
    sizes_rng = np.random.default_rng(dev_seq.spawn(1)[0])
    device_seqs = dev_seq.spawn(len(target_domains) * devices_per_domain + 1)[1:]
    for di, domain in enumerate(target_domains):
        for k in range(devices_per_domain):
            index = di * devices_per_domain + k
            n = int(sizes_rng.integers(lo, hi + 1))
            images, labels = render_domain(n, DOMAINS[domain], image_size, np.random.default_rng(device_seqs[index]))
            devices.append(DeviceData(f"{device_prefix}{index:03d}", domain, images, labels))
    test = {}
    for domain, seq in zip(target_domains, test_seq.spawn(len(target_domains))):
        if test_per_domain:
            test[domain] = render_domain(test_per_domain, DOMAINS[domain], image_size, np.random.default_rng(seq))
    return SceneBenchmark(image_size, source_images, source_labels, devices, test)
