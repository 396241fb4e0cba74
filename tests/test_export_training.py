"""The head's training program, run through TrainingSession in ExecuTorch and eager torch.

References are independent of the exported module: the loss and gradients of
temperature-scaled cross-entropy are computed in float64 numpy from their closed form, and
SGD trajectories with ``torch.optim.SGD`` on ``F.cross_entropy``. Features are real
(MobileNetV2 on Fashion-MNIST). The program's batch is 8 here, so 5 rows exercise padding
and 19 rows exercise chunking (8 + 8 + 3).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from edge_client.data.idx import load_fashion_mnist
from edge_client.models import build_backbone
from edge_client.models.preprocess import to_model_input
from edge_client.runtime import TrainingSession, read_manifest
from export import ParityError, export_bundle
from export.parity import load_parity_images

NUM_CLASSES = 5
BATCH = 8
TEMPERATURE = 0.1
IMAGE_SIZE = 32
GRADIENT_TOLERANCE = 1e-5  # acceptance criterion


@pytest.fixture(scope="module")
def manifest_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("training") / "bundle"
    return export_bundle("mobilenet_v2", out, num_classes=NUM_CLASSES, image_size=IMAGE_SIZE,
                         inference_runtimes=(), batch_size=BATCH,
                         parity_images=load_parity_images(count=16))


@pytest.fixture(scope="module")
def real_features():
    images, labels = load_fashion_mnist("train")
    backbone = build_backbone("mobilenet_v2")
    inputs = to_model_input(images[:40], IMAGE_SIZE, backbone.mean, backbone.std)
    with torch.no_grad():
        features = backbone(torch.from_numpy(inputs)).numpy()
    return features, (labels[:40] % NUM_CLASSES).astype(np.int64)


@pytest.fixture(params=["executorch", "eager"])
def session(request, manifest_path):
    session = TrainingSession.load(manifest_path, prefer=(request.param,))
    assert session.runtime == request.param
    return session


def random_head(seed):
    rng = np.random.default_rng(seed)
    return {"weight": rng.normal(0, 0.05, (NUM_CLASSES, 1280)).astype(np.float32),
            "bias": rng.normal(0, 0.05, NUM_CLASSES).astype(np.float32)}


def numpy_loss_and_gradients(params, features, labels, temperature=TEMPERATURE):
    """Mean CE of softmax(logits / T) and its gradients, float64, from the closed form."""
    x = features.astype(np.float64)
    scaled = (x @ params["weight"].astype(np.float64).T + params["bias"]) / temperature
    scaled -= scaled.max(axis=1, keepdims=True)
    log_probs = scaled - np.log(np.exp(scaled).sum(axis=1, keepdims=True))
    n = len(labels)
    loss = -log_probs[np.arange(n), labels].mean()
    d_scaled = np.exp(log_probs)
    d_scaled[np.arange(n), labels] -= 1.0
    d_logits = d_scaled / (n * temperature)
    return loss, {"weight": d_logits.T @ x, "bias": d_logits.sum(axis=0)}


@pytest.mark.parametrize("rows", [1, 5, BATCH, 19])
def test_gradients_match_closed_form(session, real_features, rows):
    features, labels = real_features[0][:rows], real_features[1][:rows]
    params = random_head(rows)
    session.set_parameters(params)
    loss, gradients = session.loss_and_gradients(features, labels)
    expected_loss, expected = numpy_loss_and_gradients(params, features, labels)
    assert loss == pytest.approx(expected_loss, abs=1e-5)
    for name in ("weight", "bias"):
        error = np.max(np.abs(gradients[name] - expected[name]))
        assert error <= GRADIENT_TOLERANCE, f"{session.runtime} d{name}: {error:.3g}"
    # Computing gradients does not move the parameters.
    for name, value in session.get_parameters().items():
        np.testing.assert_array_equal(value, params[name])


def test_sgd_steps_match_torch_optim_sgd(session, real_features):
    features, labels = real_features
    params = random_head(7)
    session.set_parameters(params)
    weight = torch.tensor(params["weight"], requires_grad=True)
    bias = torch.tensor(params["bias"], requires_grad=True)
    optimizer = torch.optim.SGD([weight, bias], lr=0.02)
    batches = [slice(0, 8), slice(8, 13), slice(13, 40), slice(0, 40)] * 3  # full, padded, chunked
    for lr_scale, rows in enumerate(batches):
        lr = 0.02 if lr_scale < 6 else 0.01  # a learning-rate change mid-way
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = session.train_step(features[rows], labels[rows], lr)
        optimizer.zero_grad()
        reference = F.cross_entropy(
            F.linear(torch.from_numpy(features[rows]), weight, bias) / TEMPERATURE,
            torch.from_numpy(labels[rows]))
        reference.backward()
        optimizer.step()
        assert loss == pytest.approx(reference.item(), abs=1e-4)
    trained = session.get_parameters()
    assert np.max(np.abs(trained["weight"] - weight.detach().numpy())) <= GRADIENT_TOLERANCE
    assert np.max(np.abs(trained["bias"] - bias.detach().numpy())) <= GRADIENT_TOLERANCE
    assert not np.allclose(trained["weight"], params["weight"])  # training did move it


def test_padding_rows_do_not_leak(session, real_features):
    """A padded batch of 3 real rows must equal those rows alone, whatever the padding."""
    features, labels = real_features
    session.set_parameters(random_head(3))
    _, padded = session.loss_and_gradients(features[:3], labels[:3])
    _, expected = numpy_loss_and_gradients(session.get_parameters(), features[:3], labels[:3])
    np.testing.assert_allclose(padded["weight"], expected["weight"], atol=GRADIENT_TOLERANCE)


def test_runtimes_agree_and_start_from_the_exported_head(manifest_path, real_features):
    sessions = [TrainingSession.load(manifest_path, prefer=(runtime,))
                for runtime in ("executorch", "eager")]
    for session in sessions:
        for value in session.get_parameters().values():
            assert not value.any()  # exported without head weights: zeros
        assert session.batch_size == BATCH
    features, labels = real_features
    losses = [[s.train_step(features[:13], labels[:13], 0.05) for _ in range(4)] for s in sessions]
    np.testing.assert_allclose(losses[0], losses[1], atol=1e-5)
    np.testing.assert_allclose(sessions[0].get_parameters()["weight"],
                               sessions[1].get_parameters()["weight"], atol=1e-6)


def test_bad_inputs_are_rejected_clearly(manifest_path, real_features):
    session = TrainingSession.load(manifest_path)
    features, labels = real_features[0][:4], real_features[1][:4]
    nan_features = features.copy()
    nan_features[1, 3] = np.nan
    cases = [
        ((nan_features, labels, 0.1), ValueError, "NaN"),
        ((features[:, :100], labels, 0.1), ValueError, r"\(n, 1280\)"),
        ((features[:0], labels[:0], 0.1), ValueError, "empty"),
        ((features, labels[:3], 0.1), ValueError, "labels must have shape"),
        ((features, labels + NUM_CLASSES, 0.1), ValueError, r"\[0, 5\)"),
        ((features, labels.astype(np.float32), 0.1), ValueError, "integers"),
        ((features, labels, 0.0), ValueError, "positive"),
        ((features, labels, float("nan")), ValueError, "positive"),
        ((features, labels, "0.1"), TypeError, "number"),
        ((features.tolist(), labels, 0.1), TypeError, "numpy"),
    ]
    before = session.get_parameters()
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            session.train_step(*args)
    good = random_head(0)
    bad_params = [
        ({"weight": good["weight"]}, "exactly"),
        ({**good, "extra": good["bias"]}, "exactly"),
        ({**good, "weight": good["weight"][:, :10]}, "shape"),
        ({**good, "bias": np.full(NUM_CLASSES, np.inf, np.float32)}, "NaN or infinite"),
        ({**good, "bias": np.arange(NUM_CLASSES)}, "floating"),
    ]
    for params, message in bad_params:
        with pytest.raises(ValueError, match=message):
            session.set_parameters(params)
    for name, value in session.get_parameters().items():  # nothing half-applied
        np.testing.assert_array_equal(value, before[name])


def test_export_refuses_when_parity_exceeds_tolerance(tmp_path):
    out = tmp_path / "refused"
    with pytest.raises(ParityError) as raised:
        export_bundle("mobilenet_v2", out, num_classes=NUM_CLASSES, image_size=IMAGE_SIZE,
                      inference_runtimes=(), batch_size=BATCH, gradient_tolerance=1e-12,
                      parity_images=load_parity_images(count=16))
    assert "head_training.pte" in str(raised.value)
    assert raised.value.measurements["head_training.pte"]["gradient_max_abs_error"] > 1e-12
    assert not out.exists() and list(tmp_path.iterdir()) == []  # nothing written, no leftovers


def test_exported_head_weights_initialise_the_program(tmp_path, real_features):
    head = random_head(11)
    np.savez(tmp_path / "head.npz", **head)
    path = export_bundle("mobilenet_v2", tmp_path / "b", num_classes=NUM_CLASSES,
                         image_size=IMAGE_SIZE, inference_runtimes=(), batch_size=BATCH,
                         head_weights=tmp_path / "head.npz", temperature=0.5,
                         parity_images=load_parity_images(count=16))
    assert read_manifest(path).temperature == 0.5
    session = TrainingSession.load(path, prefer=("executorch",))
    for name, value in session.get_parameters().items():
        np.testing.assert_array_equal(value, head[name])
    features, labels = real_features[0][:6], real_features[1][:6]
    loss, gradients = session.loss_and_gradients(features, labels)
    expected_loss, expected = numpy_loss_and_gradients(head, features, labels, temperature=0.5)
    assert loss == pytest.approx(expected_loss, abs=1e-5)
    assert np.max(np.abs(gradients["weight"] - expected["weight"])) <= GRADIENT_TOLERANCE
