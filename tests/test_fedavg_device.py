"""The device side of FedAvg(ψ): the local head-training loop and the ``fedavg.head`` handler."""

import numpy as np
import pytest
from softmax_reference import softmax_sgd_gradients

from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from aggregator.strategies.fedavg import FedAvg
from edge_client.agent import TaskDeclined
from edge_client.features import FeatureExtractor
from edge_client.tasks.head_training import HeadTrainingTask, LocalTraining, train_head
from protocols import messages as M
from protocols.envelope import decode, encode
from protocols.payloads.fedavg import KIND
from protocols.rounds import RoundClosed

C, D, SIZE = 3, 8, 8


def numpy_sgd(W, b, Z, y, recipe):
    """Independent reference: softmax CE on logits/T, L2 decay, the same seeded shuffles."""
    W, b = W.astype(np.float64), b.astype(np.float64)
    rng = np.random.default_rng(recipe.seed)
    for _ in range(recipe.epochs):
        order = rng.permutation(len(y))
        for s in range(0, len(y), recipe.batch_size):
            gW, gb = softmax_sgd_gradients(W, b, Z, y, order[s:s + recipe.batch_size], recipe)
            W, b = W - recipe.lr * gW, b - recipe.lr * gb
    return W, b


def problem(seed, n=77, c=C, d=D):
    rng = np.random.default_rng(seed)
    Z = rng.normal(size=(n, d)).astype(np.float32)
    y = rng.integers(0, c, n)
    W = (0.1 * rng.normal(size=(c, d))).astype(np.float32)
    b = (0.1 * rng.normal(size=c)).astype(np.float32)
    return Z, y, W, b


@pytest.mark.parametrize("recipe", [LocalTraining(epochs=3, batch_size=10, lr=0.05, seed=1),
                                    LocalTraining(epochs=1, batch_size=50, lr=0.1, weight_decay=0.3, seed=2),
                                    LocalTraining(epochs=2, batch_size=200, lr=0.01, temperature=1.0, seed=3)])
def test_training_loop_matches_numpy_sgd(recipe):
    Z, y, W, b = problem(recipe.seed)
    out = train_head(W, b, Z, y, recipe)
    refW, refb = numpy_sgd(W, b, Z.astype(np.float64), y, recipe)
    np.testing.assert_allclose(out.weight, refW, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out.bias, refb, rtol=1e-4, atol=1e-5)
    assert out.steps == recipe.epochs * -(-len(y) // recipe.batch_size)
    assert out.weight.dtype == np.float32 and out.runtime == "torch"


def test_training_loop_rejects_bad_inputs():
    Z, y, W, b = problem(0)
    r = LocalTraining()
    with pytest.raises(ValueError, match="labels"):
        train_head(W, b, Z, np.full(len(y), C), r)
    with pytest.raises(ValueError, match="features"):
        train_head(W, b, Z[:, :3], y, r)
    with pytest.raises(ValueError, match="NaN"):
        train_head(W, b, np.full_like(Z, np.nan), y, r)
    with pytest.raises(FloatingPointError):
        train_head(W, b, Z * 1e30, y, LocalTraining(lr=1e30))
    for bad in ({"epochs": 0}, {"lr": -1.0}, {"lr": float("inf")}, {"batch_size": 2.5}, {"temperature": 0}):
        with pytest.raises(ValueError):
            LocalTraining(**bad)


def pixel_extractor():
    """A real FeatureExtractor whose model is a fixed random projection of the pixels."""
    proj = np.random.default_rng(99).normal(size=(3 * SIZE * SIZE, D)).astype(np.float32) / 20
    return FeatureExtractor(lambda x: x.reshape(len(x), -1) @ proj, image_size=SIZE,
                            mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), feature_dim=D)


def device_data(seed, n):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, SIZE, SIZE), dtype=np.uint8), rng.integers(0, C, n)


def test_one_round_through_job_handlers_and_wire_equals_weighted_mean():
    extractor = pixel_extractor()
    devices = {f"dev{i}": device_data(i, 20 + 13 * i) for i in range(4)}
    handlers = {d: HeadTrainingTask(x, y, lambda *a: extractor) for d, (x, y) in devices.items()}
    job = FedAvgJob(FedAvgConfig(num_classes=C, feature_dim=D, image_size=SIZE, clients_per_round=4, rounds=1,
                                 local_epochs=2, batch_size=8, **PLAIN_MEAN))   # FedAvg's own mean
    chosen = job.next_participants(set(devices))
    expected = []
    for d in chosen:
        params, tensors = job.task_for(d)
        task = decode(encode(M.task_message("aggregator", "fedavg", job.round, KIND, params, 1e9)))  # JSON-safe
        body, out = handlers[d](task.body["params"], tensors)
        env = decode(encode(M.result_message(d, M.TaskRef("fedavg", job.round, task.id), KIND, body, out)))
        job.apply(d, job.parse_result(env))
        x, y = devices[d]
        ref = train_head(tensors["weight"], tensors["bias"], extractor.extract(x), y, LocalTraining.from_params(params))
        expected.append(({"weight": ref.weight, "bias": ref.bias}, len(y)))
    job.close_round(RoundClosed(1, tuple(chosen), (), (), ()))
    mean = FedAvg.mean(expected)
    np.testing.assert_allclose(job.params["weight"], mean["weight"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(job.params["bias"], mean["bias"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mutate, match", [
    (lambda p, t: t.clear(), "no head tensor 'weight'"),
    (lambda p, t: t.update(weight=np.zeros((C + 1, D), np.float32)), "has shape"),
    (lambda p, t: t.update(bias=np.array([np.nan] * C, np.float32)), "NaN"),
    (lambda p, t: p.update(num_classes=C - 1, feature_dim=D), "has shape|outside"),
    (lambda p, t: p.update(lr=-0.1), "bad fedavg.head params"),
    (lambda p, t: p.pop("backbone"), "bad fedavg.head params"),
])
def test_handler_declines_bad_tasks(mutate, match):
    x, y = device_data(0, 30)
    handler = HeadTrainingTask(x, y, lambda *a: pixel_extractor())
    params, tensors = FedAvgJob(FedAvgConfig(num_classes=C, feature_dim=D, image_size=SIZE)).task_for("d")
    mutate(params, tensors)
    with pytest.raises(TaskDeclined, match=match):
        handler(params, tensors)


def test_handler_declines_wrong_backbone_width_and_empty_data():
    x, y = device_data(0, 30)
    params, tensors = FedAvgJob(FedAvgConfig(num_classes=C, feature_dim=D + 1, image_size=SIZE)).task_for("d")
    with pytest.raises(TaskDeclined, match="features"):
        HeadTrainingTask(x, y, lambda *a: pixel_extractor())(params, {"weight": np.zeros((C, D + 1), np.float32),
                                                                       "bias": np.zeros(C, np.float32)})
    with pytest.raises(TaskDeclined, match="no local"):
        HeadTrainingTask(x[:0], y[:0], lambda *a: pixel_extractor())(params, tensors)


def eager_training_session(num_classes, feature_dim, batch, temperature=0.1):
    """A TrainingSession on the eager training backend (the ExecuTorch program's twin, which
    export's parity checks tie to it), built in memory: exporting a .pte takes too long here."""
    import torch

    from edge_client.runtime import TrainingSession
    from edge_client.runtime.eager_runtime import EagerTrainer, state_dict_to_bytes
    from protocols.bundle_manifest import ArtifactSpec, BatchSpec, InputNormalisation, Manifest, TensorSpec
    from edge_client.runtime.program_modules import TemperatureScaledHead

    data = state_dict_to_bytes(TemperatureScaledHead(feature_dim, num_classes, temperature).state_dict())
    spec = ArtifactSpec("training", "eager", torch.__version__, "head.pt", "0" * 64, len(data),
                        BatchSpec(batch, True),
                        (TensorSpec("features", "float32", (batch, feature_dim)),
                         TensorSpec("labels", "int64", (batch,)), TensorSpec("sample_weight", "float32", (batch,))),
                        (TensorSpec("loss", "float32", ()),), {},
                        {"trainable_parameters": {"weight": [num_classes, feature_dim], "bias": [num_classes]}})
    manifest = Manifest("mobilenet_v2", "0" * 64, feature_dim, num_classes, temperature, "features",
                        InputNormalisation(32, (0.5,) * 3, (0.5,) * 3), (spec,), {})
    return TrainingSession(EagerTrainer(data, spec, manifest), spec, manifest)


def test_training_session_backend_matches_reference_including_weight_decay():
    recipe = LocalTraining(epochs=2, batch_size=12, lr=0.05, weight_decay=0.2, seed=4)
    Z, y, W, b = problem(4, n=41)
    session = eager_training_session(C, D, batch=8)          # 12-row batches span two program calls
    out = train_head(W, b, Z, y, recipe, session)
    assert out.runtime == "eager"
    refW, refb = numpy_sgd(W, b, Z.astype(np.float64), y, recipe)
    np.testing.assert_allclose(out.weight, refW, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out.bias, refb, rtol=1e-4, atol=1e-5)
    # A head the program cannot hold (other C or T) falls back to the torch path.
    Z2, y2, W2, b2 = problem(5, c=C + 1)
    assert train_head(W2, b2, Z2, y2, recipe, session).runtime == "torch"
    assert train_head(W, b, Z, y, LocalTraining(temperature=1.0), session).runtime == "torch"
