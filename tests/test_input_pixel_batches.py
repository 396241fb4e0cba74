"""Batches are bounded by the pixels of the images as a device holds them, not only as the model
takes them (a review's finding): features and FDA styles made a whole batch float at the images'
own size before resizing it, so 64 photos of 12 MP were 9 GB of float32 for a 224 px backbone,
and 256 of them 73 GB of float64 for a 32 px style. The results are those of one image at a time."""

from __future__ import annotations

import tracemalloc

import numpy as np

from edge_client import features, style
from edge_client.features import FeatureExtractor


def test_feature_batches_hold_at_most_max_batch_pixels_of_the_images_as_given(monkeypatch):
    monkeypatch.setattr(features, "MAX_BATCH_PIXELS", 3 * 40 * 40)      # 3 images of 40x40 a batch
    seen = []

    def forward(batch):
        seen.append(len(batch))
        return batch.reshape(len(batch), -1)[:, :4].astype(np.float32)

    extractor = FeatureExtractor(forward, image_size=8, mean=(0.5,) * 3, std=(0.25,) * 3, feature_dim=4)
    images = np.random.default_rng(1).integers(0, 256, (7, 40, 40, 3), dtype=np.uint8)
    got = extractor.extract(images)
    assert max(seen) * 40 * 40 <= features.MAX_BATCH_PIXELS and sum(seen) == 7, seen
    np.testing.assert_array_equal(got, np.concatenate([extractor.extract(image[None]) for image in images]))


def test_style_batches_hold_at_most_max_style_batch_pixels_of_the_images_as_given():
    """3 images of 800x800 styled at 16 px: the old batch (the 16 px count) took all three, 46 MB of
    float64; one at a time is 15 MB."""
    images = np.random.default_rng(2).integers(0, 256, (3, 800, 800, 3), dtype=np.uint8)
    tracemalloc.start()
    try:
        got = style.image_styles(images, 1, (16, 16))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    one_image_float64 = 800 * 800 * 3 * 8
    assert peak < 2 * one_image_float64, f"{peak:,} bytes at once for images of {one_image_float64:,} (float64)"
    np.testing.assert_allclose(got, np.concatenate([style.image_styles(image[None], 1, (16, 16))
                                                    for image in images]), rtol=1e-12)
