"""Cityscapes / GTA5 / Mapillary readers on tiny fixtures written in each published layout."""

import json

import numpy as np
import pytest
from PIL import Image

from edge_client.data.segmentation_folders import (CITYSCAPES_CLASSES, CITYSCAPES_ID_TO_TRAIN, cityscapes, gta5,
                                                   mapillary)

H, W = 6, 8


def rgb(seed):
    return np.random.default_rng(seed).integers(0, 256, (H, W, 3), dtype=np.uint8)


def ids(values):
    """A label image cycling through ``values`` (what the dataset stores)."""
    return np.resize(np.asarray(values, np.uint8), (H, W))


def save_palette(path, array):
    im = Image.fromarray(array, mode="L").convert("P")
    im.putpalette([v for i in range(256) for v in (i, 255 - i, (7 * i) % 256)])   # colours are irrelevant
    path.parent.mkdir(parents=True, exist_ok=True)
    im.save(path)


def save_rgb(path, array):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)


def expected_train_ids(raw, mapping):
    return np.vectorize(lambda v: mapping.get(int(v), 255))(raw).astype(np.uint8)


def test_cityscapes_layout_label_ids_and_cities(tmp_path):
    raw = {}
    for i, (city, frame) in enumerate([("aachen", "000000_000019"), ("aachen", "000001_000019"),
                                       ("bremen", "000000_000019")]):
        stem = f"{city}_{frame}"
        save_rgb(tmp_path / "leftImg8bit" / "train" / city / f"{stem}_leftImg8bit.png", rgb(i))
        raw[stem] = ids([7, 8, 26, 0, 23, 33, 4, 24])     # road sidewalk car unlabeled sky bicycle void person
        save_palette(tmp_path / "gtFine" / "train" / city / f"{stem}_gtFine_labelIds.png", raw[stem])
    data = cityscapes(tmp_path, "train")
    assert len(data) == 3 and data.domains == ("aachen", "aachen", "bremen")
    images, labels = data.load((H, W))
    np.testing.assert_array_equal(images[0], rgb(0))                     # same size: no resampling
    np.testing.assert_array_equal(labels[0], expected_train_ids(raw["aachen_000000_000019"], CITYSCAPES_ID_TO_TRAIN))
    assert set(np.unique(labels)) == {0, 1, 10, 11, 13, 18, 255}
    assert list(data.by_domain()) == ["aachen", "bremen"] and len(data.by_domain()["aachen"]) == 2
    only = cityscapes(tmp_path, "train", cities=["bremen"])
    assert len(only) == 1
    # resizing: labels by nearest neighbour, so only values that exist appear
    small_images, small_labels = data.load(4)
    assert small_images.shape == (3, 4, 4, 3) and set(np.unique(small_labels)) <= set(np.unique(labels))


def test_cityscapes_train_ids_files_and_missing_labels(tmp_path):
    save_rgb(tmp_path / "leftImg8bit" / "val" / "lindau" / "lindau_000000_000019_leftImg8bit.png", rgb(3))
    trainids = ids([0, 5, 18, 255])
    save_palette(tmp_path / "gtFine" / "val" / "lindau" / "lindau_000000_000019_gtFine_labelTrainIds.png", trainids)
    _, labels = cityscapes(tmp_path, "val").load((H, W))
    np.testing.assert_array_equal(labels[0], trainids)
    save_rgb(tmp_path / "leftImg8bit" / "val" / "lindau" / "lindau_000001_000019_leftImg8bit.png", rgb(4))
    with pytest.raises(FileNotFoundError, match="no label file"):
        cityscapes(tmp_path, "val")
    with pytest.raises(FileNotFoundError, match="expected folder"):
        cityscapes(tmp_path, "test")


def test_gta5_layout(tmp_path):
    raw = ids([7, 11, 21, 27, 3, 17])
    for name in ("00001", "00002"):
        save_rgb(tmp_path / "images" / f"{name}.png", rgb(int(name)))
        save_palette(tmp_path / "labels" / f"{name}.png", raw)
    data = gta5(tmp_path)
    images, labels = data.load((H, W))
    assert images.shape == (2, H, W, 3) and data.domains == ("gta5", "gta5")
    np.testing.assert_array_equal(labels[1], expected_train_ids(raw, CITYSCAPES_ID_TO_TRAIN))


def test_gta5_size_mismatch_is_an_error(tmp_path):
    save_rgb(tmp_path / "images" / "00001.png", rgb(0))
    save_palette(tmp_path / "labels" / "00001.png", np.zeros((H + 1, W), np.uint8))
    with pytest.raises(ValueError, match="its image"):
        gta5(tmp_path).load(4)


def test_mapillary_layout_maps_classes_by_name(tmp_path):
    names = ["animal--bird", "construction--flat--road", "nature--sky", "object--vehicle--car",
             "construction--flat--sidewalk", "human--rider--bicyclist", "void--unlabeled"]
    (tmp_path / "config_v1.2.json").write_text(json.dumps({"labels": [{"name": n, "readable": n} for n in names]}))
    raw = ids([0, 1, 2, 3, 4, 5, 6])
    for key in ("aaa", "bbb"):
        save_rgb(tmp_path / "validation" / "images" / f"{key}.jpg", rgb(5))
        save_palette(tmp_path / "validation" / "v1.2" / "labels" / f"{key}.png", raw)
    data = mapillary(tmp_path, "validation")
    _, labels = data.load((H, W))
    t = {n: i for i, n in enumerate(CITYSCAPES_CLASSES)}
    mapping = {1: t["road"], 2: t["sky"], 3: t["car"], 4: t["sidewalk"], 5: t["rider"]}
    np.testing.assert_array_equal(labels[0], expected_train_ids(raw, mapping))
    (tmp_path / "config_v1.2.json").write_text("{}")
    with pytest.raises(ValueError, match="labels"):
        mapillary(tmp_path, "validation")
    (tmp_path / "config_v1.2.json").unlink()
    with pytest.raises(FileNotFoundError, match="config"):
        mapillary(tmp_path, "validation")


def test_rgb_label_images_are_refused(tmp_path):
    save_rgb(tmp_path / "images" / "00001.png", rgb(0))
    save_rgb(tmp_path / "labels" / "00001.png", rgb(1))
    with pytest.raises(ValueError, match="single-channel"):
        gta5(tmp_path).load(4)
