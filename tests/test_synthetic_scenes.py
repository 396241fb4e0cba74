"""The seeded synthetic street-scene benchmark."""

import numpy as np
import pytest

from fedfleet.emulation.synthetic_scenes import (CLASSES, DOMAINS, AppearanceShift, apply_appearance, make_benchmark,
                                                 render_domain, render_scene)

SMALL = dict(image_size=32, n_source=6, devices_per_domain=2, images_per_device=(3, 5), test_per_domain=3)


def test_same_seed_same_benchmark_other_seed_other_scenes():
    a, b, c = make_benchmark(seed=4, **SMALL), make_benchmark(seed=4, **SMALL), make_benchmark(seed=5, **SMALL)
    np.testing.assert_array_equal(a.source_images, b.source_images)
    np.testing.assert_array_equal(a.source_labels, b.source_labels)
    for da, db in zip(a.devices, b.devices):
        assert (da.device_id, da.domain) == (db.device_id, db.domain)
        np.testing.assert_array_equal(da.images, db.images)
    for d in a.test:
        np.testing.assert_array_equal(a.test[d][0], b.test[d][0])
    assert not np.array_equal(a.source_images, c.source_images)


def test_shapes_ids_and_domains():
    bench = make_benchmark(seed=0, target_domains=("night", "fog", "rain"), **SMALL)
    assert bench.source_images.shape == (6, 32, 32, 3) and bench.source_images.dtype == np.uint8
    assert bench.source_labels.shape == (6, 32, 32) and bench.source_labels.max() < len(CLASSES)
    assert [d.device_id for d in bench.devices] == [f"dev{i:03d}" for i in range(6)]
    assert [d.domain for d in bench.devices] == ["night"] * 2 + ["fog"] * 2 + ["rain"] * 2
    assert all(3 <= len(d.images) <= 5 and d.labels.shape == d.images.shape[:3] for d in bench.devices)
    assert sorted(bench.test) == ["fog", "night", "rain"] and bench.domains == ["fog", "night", "rain"]
    assert all(v[0].shape == (3, 32, 32, 3) for v in bench.test.values())


def test_scenes_have_several_classes_laid_out_like_streets():
    rng = np.random.default_rng(0)
    labels = np.stack([render_scene(rng, 48)[1] for _ in range(20)])
    counts = np.bincount(labels.ravel(), minlength=len(CLASSES)) / labels.size
    assert (counts > 0).all()                               # every class occurs
    assert (np.array([len(np.unique(l)) for l in labels]) >= 4).all()
    top, bottom = labels[:, :8], labels[:, -8:]
    assert (top == CLASSES.index("sky")).mean() > 0.4       # sky above, ground below
    assert np.isin(bottom, [CLASSES.index(c) for c in ("road", "sidewalk", "vegetation", "vehicle",
                                                        "person")]).mean() > 0.95


def test_domains_differ_in_global_appearance_only():
    # the same clean scenes in three domains: the labels are the scenes', only pixels change
    rng = np.random.default_rng(1)
    scenes = [render_scene(rng, 32)[0] for _ in range(5)]
    look = {d: np.stack([apply_appearance(s, DOMAINS[d], rng) for s in scenes]) for d in ("source", "night", "fog")}
    assert look["night"].mean() < look["source"].mean() - 20                       # darker
    assert look["night"][..., 2].mean() > look["night"][..., 0].mean()             # blue cast
    assert look["fog"].std() < look["source"].std()                                # haze lowers contrast
    images, labels = render_domain(3, DOMAINS["rain"], 32, np.random.default_rng(2))
    assert images.shape == (3, 32, 32, 3) and labels.shape == (3, 32, 32)


def test_appearance_shift_is_applied_as_documented():
    img = np.full((8, 8, 3), 0.5, np.float32)
    shift = AppearanceShift("t", gains=(2.0, 1.0, 0.5), jitter=0.0)
    out = apply_appearance(img, shift, np.random.default_rng(0))
    np.testing.assert_array_equal(out[0, 0], np.round(np.array([1.0, 0.5, 0.25]) * 255))
    hazy = apply_appearance(img, AppearanceShift("h", haze=0.5, haze_colour=(1.0, 1.0, 1.0), jitter=0.0),
                            np.random.default_rng(0))
    np.testing.assert_array_equal(hazy[0, 0], np.round(np.array([0.75] * 3) * 255))


@pytest.mark.parametrize("kwargs,match", [(dict(target_domains=("mars",)), "unknown domains"),
                                          (dict(image_size=8), "image_size"),
                                          (dict(images_per_device=(5, 2)), "images_per_device"),
                                          (dict(devices_per_domain=0), "devices_per_domain")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_benchmark(seed=0, **{**SMALL, **kwargs})
