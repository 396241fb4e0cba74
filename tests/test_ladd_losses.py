"""LADD on the device: pseudo-label thresholding, L_pseudo + λ·L_KD, HNM, the network's pieces,
local SGD, and the ``ladd.train`` handler's checks."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from fedfleet.ladd.pretrain import hnm_cross_entropy
from edge_client.agent import TaskDeclined
from edge_client.models.segmentation import (SegmentationModel, SegmentationSpec, bilinear_matrix,
                                             self_training_loss)
from edge_client.tasks.ladd_training import (LaddTrainTask, SelfTrainingRecipe, kd_targets, self_train,
                                             threshold_pseudo_labels)
from protocols.payloads.ladd import layout_digest, layout_to_json, make_layout, pack, packed_digest


def test_thresholding_on_a_hand_made_tensor():
    # 2 classes, 1 image, 1 x 6 pixels; class 0 wins at pixels 0-3, class 1 at 4-5
    p0 = np.array([0.95, 0.6, 0.7, 0.8, 0.3, 0.45])
    probs = np.stack([p0, 1 - p0])[None, :, None, :]
    labels, thr = threshold_pseudo_labels(probs, quantile=0.66, cap=0.9)
    # class 0 confidences sorted: .6 .7 .8 .95 -> index round(4 * .66) = 3 -> .95, capped at .9
    # class 1 confidences sorted: .55 .7 -> index round(2 * .66) = 1 -> .7
    np.testing.assert_allclose(thr, [0.9, 0.7])
    np.testing.assert_array_equal(labels[0, 0], [0, 255, 255, 255, 1, 255])
    labels, thr = threshold_pseudo_labels(probs, quantile=0.0, cap=0.9)      # minimum: keep every pixel
    np.testing.assert_array_equal(labels[0, 0], [0, 0, 0, 0, 1, 1])
    # a class nobody predicts gets no threshold
    _, thr = threshold_pseudo_labels(np.stack([np.ones(3), np.zeros(3), np.zeros(3)])[None, :, None, :])
    assert thr[0] == 0.9 and np.isinf(thr[1:]).all()


def test_thresholding_matches_a_numpy_loop_on_random_tensors():
    rng = np.random.default_rng(0)
    probs = F.softmax(torch.from_numpy(rng.normal(0, 2, (3, 4, 5, 6))), dim=1).numpy()
    labels, thr = threshold_pseudo_labels(probs, 0.5, 0.8)
    flat = probs.transpose(0, 2, 3, 1).reshape(-1, 4)
    expect = []
    for c in range(4):
        conf = sorted(flat[flat.argmax(1) == c].max(1))
        t = min(0.8, conf[min(int(np.round(len(conf) * 0.5)), len(conf) - 1)]) if conf else np.inf
        expect.append(t)
    np.testing.assert_allclose(thr, expect)
    for (i, y, x), lab in np.ndenumerate(labels):
        pix = probs[i, :, y, x]
        assert lab == (pix.argmax() if pix.max() >= expect[pix.argmax()] else 255)


def test_thresholding_rejects_bad_tensors():
    with pytest.raises(ValueError, match="N, C, H, W"):
        threshold_pseudo_labels(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="NaN"):
        threshold_pseudo_labels(np.full((1, 2, 2, 2), np.nan))
    with pytest.raises(ValueError, match="quantile"):
        threshold_pseudo_labels(np.ones((1, 2, 2, 2)) / 2, quantile=1.5)


def numpy_losses(z, y, q, m, lam):
    z = z.astype(np.float64)
    logp = z - z.max(1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(1, keepdims=True))
    N, C, H, W = z.shape
    pseudo = 0.0
    for i in range(N):
        for a in range(H):
            for b in range(W):
                if y[i, a, b] != 255:
                    pseudo -= logp[i, y[i, a, b], a, b]
    kd = -sum(m[i, a, b] * np.mean(q[i, :, a, b] * logp[i, :, a, b])
              for i in range(N) for a in range(H) for b in range(W))
    return (pseudo + lam * kd) / (N * H * W), pseudo / (N * H * W), kd / (N * H * W)


def test_self_training_loss_on_hand_made_tensors():
    rng = np.random.default_rng(1)
    z = rng.normal(size=(2, 3, 2, 4)).astype(np.float32)
    y = np.array([[[0, 255, 2, 1], [255, 255, 0, 0]], [[1, 1, 255, 2], [2, 0, 1, 255]]])
    q = F.softmax(torch.from_numpy(0.5 * rng.normal(size=(2, 3, 2, 4))), dim=1).numpy().astype(np.float32)
    m = (rng.random((2, 2, 4)) > 0.4).astype(np.float32)
    total, lp, lk = self_training_loss(torch.from_numpy(z), torch.from_numpy(y), torch.from_numpy(q),
                                       torch.from_numpy(m), 10.0)
    np.testing.assert_allclose([float(total), float(lp), float(lk)], numpy_losses(z, y, q, m, 10.0), rtol=1e-5)
    # an all-ignored image contributes nothing to L_pseudo but still counts in the denominator
    y_none = np.full_like(y, 255)
    _, lp0, _ = self_training_loss(torch.from_numpy(z), torch.from_numpy(y_none), torch.from_numpy(q),
                                   torch.from_numpy(m), 1.0)
    assert float(lp0) == 0.0


def test_kd_targets_are_tempered_softmax_with_the_teachers_own_mask():
    logits = torch.tensor([[[[4.0, 0.1]], [[0.0, 0.0]]]])        # (1, 2, 1, 2)
    q, mask = kd_targets(logits, alpha=0.5, quantile=0.66, cap=0.9)
    np.testing.assert_allclose(q.numpy(), F.softmax(0.5 * logits, 1).numpy())
    # pixel 0: confidence 0.98 >= its threshold; pixel 1: class 0 with 0.52, below 0.9 = τ_0 (cap)
    np.testing.assert_array_equal(mask.numpy(), [[[1.0, 0.0]]])


def test_hnm_cross_entropy_matches_numpy():
    rng = np.random.default_rng(2)
    logits = torch.from_numpy(rng.normal(size=(3, 4, 5, 5)).astype(np.float32))
    labels = rng.integers(0, 4, (3, 5, 5))
    labels[1, :3] = 255
    labels[2] = 255
    got = float(hnm_cross_entropy(logits, torch.from_numpy(labels), 0.25))
    lp = F.log_softmax(logits.double(), 1).numpy()
    per_image = []
    for i in range(3):
        losses = sorted((-lp[i, labels[i, a, b], a, b] for a in range(5) for b in range(5) if labels[i, a, b] != 255),
                        reverse=True)
        if losses:
            per_image.append(np.mean(losses[:math.ceil(0.25 * len(losses))]))
    assert got == pytest.approx(np.mean(per_image), rel=1e-5)
    assert float(hnm_cross_entropy(logits, torch.full((3, 5, 5), 255), 0.25)) == 0.0
    full = float(hnm_cross_entropy(logits, torch.from_numpy(np.where(labels == 255, 0, labels)), 1.0))
    ref = F.cross_entropy(logits, torch.from_numpy(np.where(labels == 255, 0, labels)))
    assert full == pytest.approx(float(ref), rel=1e-5)


@pytest.mark.parametrize("n_in,n_out", [(4, 16), (8, 64), (5, 17), (12, 96)])
def test_bilinear_matrix_equals_interpolate(n_in, n_out):
    x = torch.randn(2, 3, n_in, n_in + 1)
    ref = F.interpolate(x, size=(n_out, n_out + 3), mode="bilinear", align_corners=False)
    A, B = torch.from_numpy(bilinear_matrix(n_in, n_out)), torch.from_numpy(bilinear_matrix(n_in + 1, n_out + 3))
    torch.testing.assert_close(A @ x @ B.T, ref, rtol=1e-5, atol=1e-5)


SPEC = SegmentationSpec(num_classes=5, image_size=32, head_channels=8)


@pytest.fixture(scope="module")
def model():
    return SegmentationModel(SPEC, seed=0)


def test_model_layout_exchange_and_frozen_parts(model):
    x = torch.from_numpy(model.preprocess(np.random.default_rng(3).integers(0, 256, (2, 32, 32, 3), np.uint8)))
    assert model(x).shape == (2, 5, 32, 32)
    state = model.exchanged_state()
    assert all(k.startswith(("tail.", "head.")) for k in state) and state
    assert not any("num_batches_tracked" in k for k in state)
    names = model.trainable_names("tail+head")
    assert names and all(".bn" not in n and n.endswith(("weight", "bias")) for n in names)
    bn_names = {f"{m}.{p}" for m, mod in model.named_modules() if isinstance(mod, torch.nn.BatchNorm2d)
                for p in ("weight", "bias")}
    assert not set(names) & bn_names                           # BatchNorm is never trained on device
    assert set(model.trainable_names("head")) < set(names)
    other = SegmentationModel(SPEC, seed=1)
    assert not np.allclose(other.exchanged_state()["head.classifier.weight"], state["head.classifier.weight"])
    other.load_exchanged(state)
    torch.testing.assert_close(other(x), model(x))
    with pytest.raises(ValueError, match="mismatch"):
        other.load_exchanged({k: v for k, v in state.items() if k != "head.classifier.bias"})
    with pytest.raises(ValueError, match="shape"):
        other.load_exchanged({**state, "head.classifier.bias": np.zeros(3, np.float32)})


def test_model_exports_for_inference(model):
    example = torch.from_numpy(model.preprocess(np.zeros((1, 32, 32, 3), np.uint8)))
    exported = torch.export.export(model.eval(), (example,))
    torch.testing.assert_close(exported.module()(example), model(example))


def test_local_training_past_every_devices_step_budget_is_declined_before_a_step(model):
    """A review's finding: LADD's self-training ran its own epoch loop, outside the step budget
    every other kind's training declines past (MAX_LOCAL_STEPS): 10,000 epochs in batches of 1
    over 101 images would have held the device for hours. Declined now, the model untouched."""
    from edge_client.agent import TaskDeclined

    rng = np.random.default_rng(5)
    frozen = model.frozen_features(rng.integers(0, 256, (101, 32, 32, 3), np.uint8))
    pseudo = rng.integers(0, 5, (101, 32, 32))
    kd_probs, kd_mask = F.softmax(torch.randn(101, 5, 32, 32), 1), torch.ones(101, 32, 32)
    names, start = model.trainable_names("tail+head"), model.exchanged_state()
    recipe = SelfTrainingRecipe(epochs=10_000, batch_size=1, lr=0.05, momentum=0.9, kd_lambda=3.0, seed=7)
    with pytest.raises(TaskDeclined, match="1010000 SGD steps"):
        self_train(model, names, frozen, pseudo, kd_probs, kd_mask, recipe)
    assert all(np.array_equal(v, start[k]) for k, v in model.exchanged_state().items())


def test_local_sgd_is_torch_sgd_with_momentum(model):
    rng = np.random.default_rng(4)
    images = rng.integers(0, 256, (5, 32, 32, 3), np.uint8)
    frozen = model.frozen_features(images)
    pseudo = rng.integers(0, 5, (5, 32, 32))
    pseudo[:, :10] = 255
    kd_probs = F.softmax(torch.randn(5, 5, 32, 32), 1)
    kd_mask = torch.from_numpy((rng.random((5, 32, 32)) > 0.5).astype(np.float32))
    recipe = SelfTrainingRecipe(epochs=2, batch_size=2, lr=0.05, momentum=0.9, kd_lambda=3.0, seed=7)
    names = model.trainable_names("tail+head")
    start = model.exchanged_state()
    got = self_train(model, names, frozen, pseudo, kd_probs, kd_mask, recipe)
    model.load_exchanged(start)
    params = model.set_trainable(names)
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    order_rng = np.random.default_rng(7)
    for _ in range(2):
        order = order_rng.permutation(5)
        for s in range(0, 5, 2):
            rows = torch.from_numpy(np.sort(order[s:s + 2]))
            loss, _, _ = self_training_loss(model.logits_from_features(frozen[rows]), torch.from_numpy(pseudo)[rows],
                                            kd_probs[rows], kd_mask[rows], 3.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.set_trainable(())
    ref = model.state_dict()
    assert got.steps == 6
    for name in names:
        np.testing.assert_allclose(got.arrays[name], ref[name].numpy(), rtol=1e-4, atol=1e-6)
    model.load_exchanged(start)


def train_params(model, **over):
    state = model.exchanged_state()
    layout = make_layout(state)
    flat = pack(state, layout)
    params = {"model": SPEC.to_dict(), "cluster": 1, "layout": layout_to_json(layout),
              "layout_sha256": layout_digest(layout), "trainable": model.trainable_names("head"), "teacher": "model",
              "kd_sha256": packed_digest(flat), "epochs": 1, "batch_size": 4, "lr": 0.01, "kd_lambda": 10.0,
              "seed": 0, **over}
    return params, {"model": flat, "kd_model": flat}


def test_train_handler_end_to_end_and_caches(model):
    images = np.random.default_rng(5).integers(0, 256, (6, 32, 32, 3), np.uint8)
    task = LaddTrainTask(images, lambda spec: model)
    params, tensors = train_params(model)
    body, out = task(params, tensors)
    assert body["n"] == 6 and body["cluster"] == 1 and body["kd_sha256"] == params["kd_sha256"]
    assert out["update"].dtype == np.float32 and np.isfinite(out["update"]).all()
    # the KD teacher is cached by digest: a second task without it works, a new digest does not
    body2, _ = task(params, {"model": tensors["model"]})
    assert body2["steps"] == 2
    with pytest.raises(TaskDeclined, match="kd model missing"):
        task({**params, "kd_sha256": "0" * 64}, {"model": tensors["model"]})


def test_the_encoder_features_are_kept_for_the_last_few_task_shapes_only(monkeypatch):
    """A review's leftover: ``ladd.train`` kept the frozen encoder's features of the local images per
    task shape (image size, output stride, tail blocks), which the task chooses, and never dropped
    any: a stream of tasks naming new shapes grew the device for the process's life. Now the last
    MAX_HELD_EXTRACTORS shapes are kept, the least recently used leaving first; a shape asked for
    again is computed again, and trains to the same update."""
    import gc
    import weakref

    from edge_client.tasks.extractors import MAX_HELD_EXTRACTORS

    shapes = ([(8, tail) for tail in range(5)] + [(16, tail) for tail in range(5)])[:MAX_HELD_EXTRACTORS + 2]
    models = {shape: SegmentationModel(SegmentationSpec(num_classes=3, image_size=16, output_stride=shape[0],
                                                        tail_blocks=shape[1], head_channels=4, aspp_rates=(2,)),
                                       seed=0) for shape in shapes}
    computed: list[tuple] = []          # the shape of each encoder pass, and a weak reference to its features
    encode = SegmentationModel.frozen_features

    def counting(self, images, batch=64):
        features = encode(self, images, batch)
        computed.append(((self.spec.output_stride, self.spec.tail_blocks), weakref.ref(features)))
        return features

    monkeypatch.setattr(SegmentationModel, "frozen_features", counting)
    task = LaddTrainTask(np.random.default_rng(7).integers(0, 256, (3, 16, 16, 3), np.uint8),
                         lambda spec: models[(spec.output_stride, spec.tail_blocks)])

    # each shape's task, made before any training (the eager step trains the model it is given in place)
    tasks = {shape: train_params(models[shape], epochs=1, batch_size=3) for shape in shapes}

    def update(shape):
        params, tensors = tasks[shape]
        return task({**params, "model": models[shape].spec.to_dict()}, tensors)[1]["update"]

    first = {shape: update(shape) for shape in shapes}             # a task of each shape in turn
    gc.collect()
    assert [shape for shape, _ in computed] == shapes
    alive = [shape for shape, features in computed if features() is not None]
    assert alive == shapes[-MAX_HELD_EXTRACTORS:], "encoder features of shapes past the last few stay in memory"
    for shape in reversed(shapes[-MAX_HELD_EXTRACTORS:]):          # still held: not computed again
        update(shape)
    assert len(computed) == len(shapes)
    np.testing.assert_array_equal(update(shapes[0]), first[shapes[0]])      # dropped: computed again, same update
    assert [shape for shape, _ in computed] == shapes + [shapes[0]]


@pytest.mark.parametrize("mutate,match", [
    (lambda p, t: t.pop("model"), "no 'model'"),
    (lambda p, t: t.update(model=t["model"][:-1]), "float32"),
    (lambda p, t: t.update(model=np.full_like(t["model"], np.nan)), "NaN"),
    (lambda p, t: p.update(layout_sha256="x"), "layout_sha256"),
    (lambda p, t: p.update(trainable=["head.aspp.branches.0.1.weight"]), "frozen"),
    (lambda p, t: p.update(lr=-1.0), "lr"),
    (lambda p, t: p.update(teacher="tensor"), "teacher"),
    (lambda p, t: p.update(model={**SPEC.to_dict(), "image_size": 64}), "64px"),
    (lambda p, t: p.update(kd_sha256="f" * 64), "kd_model does not match"),
    (lambda p, t: t.update(extra=t["model"]), "unexpected"),
    (lambda p, t: p.update(local_rule="nesterov"), "local_rule must be one of"),
    (lambda p, t: p.update(local_rule="sam", sam_rho=0.0), "needs sam_rho > 0"),
    (lambda p, t: p.update(prox_mu=float("inf")), "prox_mu"),
])
def test_train_handler_declines_bad_tasks(model, mutate, match):
    images = np.random.default_rng(6).integers(0, 256, (3, 32, 32, 3), np.uint8)
    params, tensors = train_params(model)
    mutate(params, tensors)
    with pytest.raises(TaskDeclined, match=match):
        LaddTrainTask(images, lambda spec: model)(params, tensors)


def test_executorch_training_program_matches_eager():
    """The on-device path: SelfTrainingStep lowered to an ExecuTorch training program (joint
    forward/backward, frozen BatchNorm baked in); a partial last batch is padded and rescaled."""
    pytest.importorskip("executorch.exir")
    spec = SegmentationSpec(num_classes=3, image_size=16, head_channels=4, aspp_rates=(2,))
    net = SegmentationModel(spec, seed=0)
    rng = np.random.default_rng(8)
    frozen = net.frozen_features(rng.integers(0, 256, (5, 16, 16, 3), np.uint8))
    pseudo = rng.integers(0, 3, (5, 16, 16))
    pseudo[:, :4] = 255
    kd_probs = F.softmax(torch.randn(5, 3, 16, 16), 1)
    kd_mask = torch.from_numpy((rng.random((5, 16, 16)) > 0.5).astype(np.float32))
    recipe = SelfTrainingRecipe(epochs=1, batch_size=3, lr=0.1, momentum=0.9, kd_lambda=10.0, seed=1)  # 3 + 2
    names = net.trainable_names("head")
    start = net.exchanged_state()
    eager = self_train(net, names, frozen, pseudo, kd_probs, kd_mask, recipe, "eager")
    net.load_exchanged(start)
    program = self_train(net, names, frozen, pseudo, kd_probs, kd_mask, recipe, "executorch")
    assert program.steps == eager.steps == 2
    assert program.loss == pytest.approx(eager.loss, rel=1e-4)
    for name in names:
        np.testing.assert_allclose(program.arrays[name], eager.arrays[name], rtol=1e-4, atol=1e-6)
        assert not np.allclose(program.arrays[name], start[name])
    # FedASAM + FedProx (edge_client/tasks/local_rules.py): two program calls per step, the same
    # lowered program (its cache key does not hold the rule), the eager twin's result
    from protocols.payloads.fedavg import LocalRuleRecipe
    sharp = dataclasses.replace(recipe, rule=LocalRuleRecipe("asam", sam_rho=1.0, asam_eta=0.1, prox_mu=0.5))
    net.load_exchanged(start)
    eager_sam = self_train(net, names, frozen, pseudo, kd_probs, kd_mask, sharp, "eager")
    net.load_exchanged(start)
    program_sam = self_train(net, names, frozen, pseudo, kd_probs, kd_mask, sharp, "executorch")
    assert program_sam.gradient_evaluations == eager_sam.gradient_evaluations == 4
    for name in names:
        np.testing.assert_allclose(program_sam.arrays[name], eager_sam.arrays[name], rtol=1e-4, atol=1e-6)
    assert max(np.abs(eager_sam.arrays[k] - eager.arrays[k]).max() for k in names) > 1e-3


def test_a_process_keeps_a_bounded_number_of_lowered_training_programs(monkeypatch):
    """A review's finding: lowered programs were cached per (spec, trainable set, batch size, λ_KD,
    frozen tensors) for the process's life, and the batch size and λ are each task's to choose, so a
    job that changed one every round lowered and kept one more program per round. The most recently
    used MAX_HELD_PROGRAMS stay; one in use is its stepper's whatever the cache lets go."""
    pytest.importorskip("executorch.extension.training")
    import executorch.extension.training as training

    from edge_client.models import segmentation
    from edge_client.tasks import ladd_training

    lowered = []
    monkeypatch.setattr(segmentation, "lower_self_training_program",
                        lambda model, names, batch, kd: lowered.append(batch) or f"program {batch}".encode())
    monkeypatch.setattr(training, "_load_for_executorch_for_training_from_buffer", lambda program: object())
    monkeypatch.setattr(ladd_training, "_PROGRAMS", type(ladd_training._PROGRAMS)())
    net = SegmentationModel(SegmentationSpec(num_classes=3, image_size=16, head_channels=4, aspp_rates=(2,)), seed=0)
    names = net.trainable_names("head")
    steppers = [ladd_training._ExecuTorchStepper(net, names, SelfTrainingRecipe(batch_size=b)) for b in range(1, 11)]
    assert len(ladd_training._PROGRAMS) == ladd_training.MAX_HELD_PROGRAMS < 10
    assert [s._program for s in steppers] == [f"program {b}".encode() for b in range(1, 11)]
    ladd_training._ExecuTorchStepper(net, names, SelfTrainingRecipe(batch_size=10))       # held: not lowered again
    ladd_training._ExecuTorchStepper(net, names, SelfTrainingRecipe(batch_size=1))        # let go: lowered again
    assert lowered == list(range(1, 11)) + [1]
