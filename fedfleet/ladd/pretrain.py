"""Server pre-training for LADD: supervised segmentation on the labelled source set, each image
restyled with a device style drawn from the style bank (FDA, spec §2.1).

FDA restyling of one image x (uint8 RGB, the size the styles were computed at) with style s
(3, 2b+1, 2b+1)::

    F = fft2(x_c) per channel;  A = fftshift(|F|), P = angle(F)
    A[centre window] = s_c        (replaced, no β blending, phase kept)
    x' = clip(round(real(ifft2(ifftshift(A) · e^{iP}))), 0, 255)

The style must come from images of the same size as x (the unnormalised FFT's DC term grows
with H·W), which is why devices resize to the job's image size before extracting.

Pre-training ([C]'s recipe, scaled down): SGD with momentum 0.9 and no weight decay, poly
learning rate ``lr · (1 − step/steps)^0.9``, batch B of source images, every image restyled
with probability ``style_prob`` by a style drawn uniformly from the bank, loss = pixel CE
(ignore 255) with hard-negative mining: the mean of the top ``hnm_fraction`` of pixel losses
of each image.

With ``pool_copies = R > 0`` the restyling is drawn once per (image, copy) instead of per
step: R restyled copies of every source image (each with its own random style) are pushed
through the frozen part of the network once, and the steps sample from that pool. On a CPU
this removes the FFTs and the frozen encoder from every step (about 3x faster); the styles
seen are the same distribution, only finitely many per image.

This module is model-agnostic so that the aggregator never imports ``edge_client``: the
caller (the fedfleet layer) passes the network. It must provide ``preprocess(uint8 images) ->
normalised float32 NCHW`` and map that to logits (N, C, H, W); for the pool it must also
provide ``frozen_features(uint8 images) -> tensor`` and ``logits_from_features(tensor)``.
``trainable`` are the parameters to optimise.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn import functional as F

IGNORE = 255


def apply_style(images: np.ndarray, styles: np.ndarray) -> np.ndarray:
    """Restyle uint8 (N, H, W, 3) images with per-image styles (N, 3, w, w); returns uint8."""
    images = np.asarray(images)
    styles = np.asarray(styles, dtype=np.float64)
    if images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"images must be (N, H, W, 3), got {images.shape}")
    if styles.ndim != 4 or styles.shape[:2] != (len(images), 3) or styles.shape[2] != styles.shape[3] \
            or styles.shape[2] % 2 != 1:
        raise ValueError(f"styles must be (N, 3, 2b+1, 2b+1) with N = {len(images)}, got {styles.shape}")
    if not np.isfinite(styles).all() or (styles < 0).any():
        raise ValueError("styles must be finite, non-negative amplitudes")
    b = styles.shape[2] // 2
    H, W = images.shape[1:3]
    if 2 * b + 1 > min(H, W):
        raise ValueError(f"a {2 * b + 1}x{2 * b + 1} style does not fit {H}x{W} images")
    spectrum = np.fft.fft2(images.astype(np.float64), axes=(1, 2))
    amplitude = np.fft.fftshift(np.abs(spectrum), axes=(1, 2))
    phase = np.angle(spectrum)
    ch, cw = H // 2, W // 2
    amplitude[:, ch - b:ch + b + 1, cw - b:cw + b + 1, :] = np.transpose(styles, (0, 2, 3, 1))
    amplitude = np.fft.ifftshift(amplitude, axes=(1, 2))
    restyled = np.real(np.fft.ifft2(amplitude * np.exp(1j * phase), axes=(1, 2)))
    return np.clip(np.round(restyled), 0, 255).astype(np.uint8)


def hnm_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, fraction: float = 0.25) -> torch.Tensor:
    """Per image, the mean of the largest ⌈fraction · valid⌉ pixel CE losses; then the mean over
    images that have a valid pixel (ignored pixels, label 255, never count)."""
    pixel = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="none").flatten(1)
    valid = (labels != IGNORE).flatten(1)
    ranked = pixel.masked_fill(~valid, -1.0).sort(dim=1, descending=True).values   # losses are >= 0
    counts = valid.sum(dim=1)
    k = torch.ceil(fraction * counts.to(pixel.dtype)).clamp(min=1)
    take = torch.arange(ranked.shape[1])[None, :] < k[:, None]
    per_image = torch.where(take, ranked, torch.zeros_like(ranked)).sum(dim=1) / k
    has = counts > 0
    if not bool(has.any()):
        return logits.sum() * 0.0
    return per_image[has].mean()


@dataclass(frozen=True)
class PretrainRecipe:
    steps: int = 600
    batch_size: int = 16
    lr: float = 0.05
    momentum: float = 0.9
    poly_power: float = 0.9
    style_prob: float = 1.0          # 0: plain source-only training
    hnm_fraction: float = 0.25       # 1.0: plain mean CE
    pool_copies: int = 0             # > 0: restyle R copies per image once (see the module doc)
    seed: int = 0

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError("steps and batch_size must be >= 1")
        if not (self.lr > 0 and math.isfinite(self.lr)) or not 0 <= self.momentum < 1:
            raise ValueError("lr must be > 0 and momentum in [0, 1)")
        if not 0 <= self.style_prob <= 1 or not 0 < self.hnm_fraction <= 1:
            raise ValueError("style_prob must be in [0, 1] and hnm_fraction in (0, 1]")
        if not 0 <= self.pool_copies <= 64:
            raise ValueError("pool_copies must be in [0, 64]")


@dataclass
class PretrainReport:
    steps: int
    seconds: float
    losses: list[float] = field(default_factory=list)     # mean loss per 10% of the steps
    styled_fraction: float = 0.0


def _restyled(batch: np.ndarray, style_bank: np.ndarray | None, prob: float, rng: np.random.Generator
              ) -> tuple[np.ndarray, np.ndarray]:
    """Each image restyled with probability ``prob`` by a uniformly drawn bank style."""
    pick = rng.random(len(batch)) < prob if prob > 0 else np.zeros(len(batch), bool)
    if pick.any():
        chosen = style_bank[rng.integers(0, len(style_bank), int(pick.sum()))]
        batch = batch.copy()
        batch[pick] = apply_style(batch[pick], chosen)
    return batch, pick


@torch.no_grad()
def _feature_pool(model, images, style_bank, recipe, rng) -> tuple[torch.Tensor, np.ndarray]:
    """Frozen features of R restyled copies of every image (copy r of image i at row r·N + i)."""
    copies = recipe.pool_copies if recipe.style_prob > 0 else 1
    feats, styled = [], []
    for _ in range(copies):
        for start in range(0, len(images), 64):
            batch, pick = _restyled(images[start:start + 64], style_bank, recipe.style_prob, rng)
            feats.append(model.frozen_features(batch))
            styled.append(pick)
    return torch.cat(feats), np.concatenate(styled)


def pretrain(model: torch.nn.Module, trainable: Sequence[torch.nn.Parameter], images: np.ndarray,
             labels: np.ndarray, style_bank: np.ndarray | None, recipe: PretrainRecipe,
             progress: Callable[[int, float], None] | None = None) -> PretrainReport:
    """Train ``trainable`` in place on (images uint8 (N,S,S,3), labels uint8 (N,S,S)); see module doc."""
    if images.ndim != 4 or labels.shape != images.shape[:3]:
        raise ValueError(f"images (N,S,S,3) and labels (N,S,S) do not match: {images.shape}, {labels.shape}")
    if recipe.style_prob > 0:
        if style_bank is None or len(style_bank) == 0:
            raise ValueError("FDA pre-training needs a non-empty style bank (or style_prob=0)")
        style_bank = np.asarray(style_bank, dtype=np.float64)
    params = list(trainable)
    if not params:
        raise ValueError("nothing to train")
    rng = np.random.default_rng(recipe.seed)
    velocity: list[torch.Tensor | None] = [None] * len(params)
    t0 = time.perf_counter()
    pool = _feature_pool(model, images, style_bank, recipe, rng) if recipe.pool_copies else None
    styled = 0
    losses, window = [], []
    n = len(images) if pool is None else len(pool[0])
    order, cursor = rng.permutation(n), 0
    model.train()
    for step in range(recipe.steps):
        if cursor + recipe.batch_size > len(order):
            order, cursor = rng.permutation(n), 0
        rows = np.sort(order[cursor:cursor + recipe.batch_size])
        cursor += recipe.batch_size
        if pool is not None:
            logits = model.logits_from_features(pool[0][torch.from_numpy(rows)])
            y = torch.from_numpy(labels[rows % len(images)].astype(np.int64))
            styled += int(pool[1][rows].sum())
        else:
            batch, pick = _restyled(images[rows], style_bank, recipe.style_prob, rng)
            styled += int(pick.sum())
            logits = model(torch.from_numpy(model.preprocess(batch)))
            y = torch.from_numpy(labels[rows].astype(np.int64))
        loss = hnm_cross_entropy(logits, y, recipe.hnm_fraction)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        lr = recipe.lr * (1 - step / recipe.steps) ** recipe.poly_power
        with torch.no_grad():   # torch.optim.SGD's rule, written out (its first step imports dynamo: seconds)
            for i, (p, g) in enumerate(zip(params, grads)):
                if g is None:
                    continue
                velocity[i] = g.clone() if velocity[i] is None else velocity[i].mul_(recipe.momentum).add_(g)
                p.add_(velocity[i], alpha=-lr)
        window.append(float(loss.detach()))
        if len(window) >= max(1, recipe.steps // 10) or step == recipe.steps - 1:
            losses.append(float(np.mean(window)))
            window = []
            if progress:
                progress(step + 1, losses[-1])
    model.eval()
    return PretrainReport(recipe.steps, time.perf_counter() - t0, losses,
                          styled / (recipe.steps * recipe.batch_size))
