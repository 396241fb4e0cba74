"""Segmentation metrics of the LADD comparison: confusion matrices, mIoU, per-domain test sets."""

from __future__ import annotations

import collections

import numpy as np

from fedfleet.emulation.synthetic_scenes import CLASSES

def confusion(labels: np.ndarray, preds: np.ndarray, num_classes: int) -> np.ndarray:
    """(C, C) counts, rows = true class, columns = predicted; pixels labelled 255 are skipped."""
    labels, preds = np.asarray(labels).ravel().astype(np.int64), np.asarray(preds).ravel().astype(np.int64)
    ok = labels != 255
    return np.bincount(labels[ok] * num_classes + preds[ok], minlength=num_classes ** 2).reshape(num_classes,
                                                                                               num_classes)


def miou(cm: np.ndarray) -> tuple[float, np.ndarray]:
    """Mean IoU over the classes that occur (as truth or prediction), and the per-class IoU."""
    inter = np.diag(cm).astype(np.float64)
    union = cm.sum(0) + cm.sum(1) - inter
    iou = np.where(union > 0, inter / np.maximum(union, 1), np.nan)
    return float(np.nanmean(iou)) if (union > 0).any() else float("nan"), iou


class TestSets:
    """Per-domain test images with cached encoder features and per-image styles."""

    def __init__(self, model, test: dict[str, tuple[np.ndarray, np.ndarray]], style_b: int):
        from edge_client.style import image_styles

        self.domains = sorted(test)
        self.labels = {d: test[d][1] for d in self.domains}
        self.frozen = {d: model.frozen_features(test[d][0]) for d in self.domains}
        self.styles = {d: image_styles(test[d][0], style_b).reshape(len(test[d][0]), -1) for d in self.domains}

    def evaluate(self, model, cluster_arrays: dict[int, dict[str, np.ndarray]], centroids: np.ndarray | None,
                 num_classes: int) -> dict:
        """Segment every test image with the model of its cluster (nearest centroid; cluster 0 without)."""
        from aggregator.strategies.ladd import nearest_centroid

        cms = {d: np.zeros((num_classes, num_classes), np.int64) for d in self.domains}
        cluster_cms: dict[int, np.ndarray] = {}
        routing = {}
        for d in self.domains:
            routed = (nearest_centroid(self.styles[d], centroids) if centroids is not None
                      else np.zeros(len(self.labels[d]), np.int64))
            routing[d] = np.bincount(routed, minlength=len(cluster_arrays)).tolist()
            for c in np.unique(routed):
                rows = np.flatnonzero(routed == c)
                model.load_exchanged(cluster_arrays[int(c)])
                import torch

                pred = model.predict_logits(self.frozen[d][torch.from_numpy(rows)]).argmax(1).numpy()
                cm = confusion(self.labels[d][rows], pred, num_classes)
                cms[d] += cm
                cluster_cms[int(c)] = cluster_cms.get(int(c), 0) + cm
        per_domain = {d: miou(cms[d])[0] for d in self.domains}
        pooled = sum(cms.values())
        return {"miou": float(np.mean(list(per_domain.values()))), "per_domain": per_domain,
                "per_cluster": {str(c): miou(cm)[0] for c, cm in sorted(cluster_cms.items())},
                "per_class": dict(zip(CLASSES, np.round(miou(pooled)[1], 4).tolist())),
                "routing": routing}


def split_cluster_models(arrays: dict[str, np.ndarray]) -> tuple[dict[int, dict[str, np.ndarray]], np.ndarray | None]:
    """model.npz of a LADD job -> ({c: φ ∪ θ_c}, centroids or None)."""
    phi = {k[4:]: v for k, v in arrays.items() if k.startswith("phi.")}
    thetas: dict[int, dict] = collections.defaultdict(dict)
    for k, v in arrays.items():
        if k.startswith("theta."):
            _, c, name = k.split(".", 2)
            thetas[int(c)][name] = v
    models = {c: {**phi, **theta} for c, theta in sorted(thetas.items())} or {0: phi}
    return models, arrays.get("style_centroids")
