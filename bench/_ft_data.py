"""Shared inputs of the fine-tuning benches (ft_ceiling.py, ft_recipe.py, claims/fed3r_pipeline.py).

Fashion-MNIST at the demo's 64 px through the pretrained MobileNetV2, computed ONCE per image
in eager torch: the activations entering the backbone's last ``MAX_TAIL`` stages (the trunk's
output for a ``tail_stages = MAX_TAIL`` split, (160, 2, 2) at 64 px) and the pooled features
(1280) in the same pass, cached on disk through ``FeatureExtractor``'s cache (one row =
[activations | features]). A split with fewer tail stages gets its activations by running the
first stages of that tail on these (cheap: 2×2 spatial), so every tail depth shares one pass.

The demo's partition (``fedfleet simulate --config demo``): ``make_split("dirichlet", α=0.1)``
over 100 devices with the simulator's seed, each device keeping 20 % as its local held-out split
(``train_holdout_split``, seeded seed·1000 + device); Fed3R and fine-tuning train on the rest.
"""

from __future__ import annotations

import pathlib
import sys
from dataclasses import dataclass

import numpy as np
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from edge_client.data.idx import load_fashion_mnist  # noqa: E402
from edge_client.features import FeatureExtractor  # noqa: E402
from edge_client.models import build_backbone, weights_sha256  # noqa: E402
from edge_client.models.tail import TailModel, split_backbone  # noqa: E402
from fedfleet.emulation.partition import make_split, train_holdout_split  # noqa: E402

BACKBONE, IMAGE_SIZE, NUM_CLASSES = "mobilenet_v2", 64, 10
MAX_TAIL = 3
CACHE = REPO / ".cache" / "features"
OUT_DIR = REPO / "runs" / "bench"


@dataclass
class Split:
    images: np.ndarray        # uint8 (n, 28, 28)
    labels: np.ndarray        # int64 (n,)
    features: np.ndarray      # float32 (n, 1280): the frozen backbone's
    acts: np.ndarray          # float32 (n, c, h, w): input of the last MAX_TAIL stages


def backbone_and_tail(max_tail: int = MAX_TAIL):
    backbone = build_backbone(BACKBONE, pretrained=True).eval()
    trunk, tail = split_backbone(backbone, max_tail)
    return backbone, trunk, tail


def load_data(threads: int = 2) -> dict[str, Split]:
    """Train and test splits with features and trunk activations (one eager pass, disk-cached)."""
    torch.set_num_threads(threads)
    backbone, trunk, tail = backbone_and_tail()
    with torch.inference_mode():
        probe = trunk(torch.zeros(1, 3, IMAGE_SIZE, IMAGE_SIZE))
    shape = tuple(probe.shape[1:])
    width = int(np.prod(shape))

    def forward(batch: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            acts = trunk(torch.from_numpy(batch))
            feats = tail(acts)
        return torch.cat([acts.reshape(len(batch), -1), feats], dim=1).numpy()

    extractor = FeatureExtractor(forward, image_size=IMAGE_SIZE, mean=backbone.mean, std=backbone.std,
                                 batch_size=256, cache_dir=CACHE, feature_dim=width + backbone.feature_dim,
                                 cache_key=f"{BACKBONE}:{weights_sha256(BACKBONE)}:{IMAGE_SIZE}:"
                                           f"trunk{MAX_TAIL}+features:eager")
    data = {}
    for name in ("train", "test"):
        images, labels = load_fashion_mnist(name)
        rows = extractor.extract(images)
        data[name] = Split(images, labels.astype(np.int64), np.ascontiguousarray(rows[:, width:]),
                           rows[:, :width].reshape(-1, *shape))
    return data


def tail_for(stages: int) -> tuple[TailModel, "callable"]:
    """(the pretrained tail of ``stages`` stages, a function mapping MAX_TAIL-split activations to
    this split's activations)."""
    if not 1 <= stages <= MAX_TAIL:
        raise ValueError(f"tail stages must lie in 1..{MAX_TAIL}")
    _, _, full = backbone_and_tail()
    prefix = full.stages[:MAX_TAIL - stages]
    tail = TailModel(list(full.stages[MAX_TAIL - stages:]), pointwise_matmul=False)

    def lift(acts: np.ndarray, batch: int = 4096) -> np.ndarray:
        if not len(prefix):
            return acts
        with torch.inference_mode():
            return np.concatenate([prefix(torch.from_numpy(acts[i:i + batch])).numpy()
                                   for i in range(0, len(acts), batch)])
    return tail, lift


def demo_partition(labels: np.ndarray, seed: int, devices: int = 100, alpha: float = 0.1,
                   holdout: float = 0.2) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(training parts, held-out parts) per device, as ``fedfleet simulate --config demo`` draws them."""
    parts = make_split("dirichlet", labels, devices, seed, alpha=alpha)
    pairs = [train_holdout_split(p, holdout, seed * 1000 + k) for k, p in enumerate(parts)]
    return [t for t, _ in pairs], [h for _, h in pairs]


def ridge_head(features: np.ndarray, labels: np.ndarray, lam: float = 0.01) -> dict[str, np.ndarray]:
    """The Fed3R head on these rows (the closed form Fed3R computes exactly, normalised columns,
    bias included): {"weight" (C, d), "bias" (C,)} float32."""
    from aggregator.compute.ridge import ClosedFormRidge

    model = ClosedFormRidge(lam=lam).fit(features.astype(np.float64), labels, NUM_CLASSES)
    return {"weight": model.coef_.astype(np.float32), "bias": model.intercept_.astype(np.float32)}


def accuracy(weight: np.ndarray, bias: np.ndarray, features: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(np.argmax(features @ weight.T + bias, axis=1) == labels))
