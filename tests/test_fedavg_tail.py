"""FT(φ) / FT(M): fine-tuning the backbone's last stages on device (``fedavg.tail``).

References are independent of the code under test: the backbone's own modules with real
eval-mode BatchNorm and a hand-written SGD loop (device side), numpy weighted means and an
eager forward pass (server side).
"""

import copy
import threading

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from aggregator.jobs.fedavg_tail import TailFedAvgConfig, TailFedAvgJob
from aggregator.jobs.registry import build_job
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from aggregator.compute.tail_program import TailProgram, TailProgramError
from edge_client.agent import DeviceAgent, TaskDeclined
from edge_client.data import load_fashion_mnist
from edge_client.models import build_backbone
from edge_client.models.preprocess import to_model_input
from edge_client.models.tail import FrozenBatchNorm2d, split_backbone
from edge_client.runtime import read_manifest
from edge_client.tasks.tail_training import TailTrainingTask, TrunkActivations
from protocols.envelope import EnvelopeError, decode, encode
from protocols.messages import TaskRef, result_message
from protocols.mqtt_link import BrokerConfig
from protocols.payloads.fedavg import KIND_TAIL
from protocols.rounds import RoundClosed

from ops_fleet import in_memory_keys, replay_round

SIZE, C, T = 32, 10, 0.1


@pytest.fixture(scope="module")
def bundle(tail_bundle):
    """conftest's session bundle: 32 px MobileNetV2, last stage trainable, C classes."""
    assert read_manifest(tail_bundle).num_classes == C and SIZE == 32
    return tail_bundle


@pytest.fixture(scope="module")
def fmnist():
    images, labels = load_fashion_mnist("train")
    return images[:200], labels[:200].astype(np.int64)


def _head(seed=0):
    rng = np.random.default_rng(seed)
    return {"weight": rng.normal(0, 0.05, (C, 1280)).astype(np.float32), "bias": rng.normal(0, 0.05, C).astype(np.float32)}


def _model(program: TailProgram, seed=0):
    return {**program.tail_parameters, **_head(seed)}


def _params(train="tail", **extra):
    return {"num_classes": C, "backbone": "mobilenet_v2", "image_size": SIZE, "tail_stages": 1, "train": train,
            "epochs": 1, "batch_size": 10, "lr": 0.01, "weight_decay": 4e-5, "temperature": T, "seed": 5, **extra}


# ---------------------------------------------------------------- the split and the bundle
@pytest.mark.parametrize("name", ["mobilenet_v2", "efficientnet_lite0"])
@pytest.mark.parametrize("stages", [1, 3])
def test_trunk_then_tail_is_the_backbone(name, stages):
    backbone = build_backbone(name)
    x = torch.from_numpy(np.random.default_rng(0).normal(size=(3, 3, 64, 64)).astype(np.float32))
    trunk, tail = split_backbone(backbone, stages)
    with torch.no_grad():
        np.testing.assert_allclose(tail(trunk(x)).numpy(), backbone(x).numpy(), atol=2e-5)
    assert all(p.requires_grad for p in tail.parameters()) and not any(p.requires_grad for p in trunk.parameters())
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in tail.modules())     # frozen into buffers
    with pytest.raises(ValueError, match="tail_stages"):
        split_backbone(backbone, 0)


def test_frozen_batchnorm_is_eval_mode_batchnorm():
    bn = torch.nn.BatchNorm2d(5).eval()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 2), bn.bias.normal_(), bn.running_mean.normal_(), bn.running_var.uniform_(0.1, 3)
    x = torch.randn(4, 5, 3, 3)
    np.testing.assert_allclose(FrozenBatchNorm2d.from_batchnorm(bn)(x).detach().numpy(), bn(x).detach().numpy(),
                               atol=1e-6)


def test_bundle_holds_trunk_tail_training_and_eval_programs_within_tolerance(bundle):
    manifest = read_manifest(bundle)
    assert manifest.tail.stages == 1 and manifest.tail.activation_shape == (320, 1, 1)
    kinds = {(a.kind, a.runtime): a for a in manifest.artifacts}
    assert {("trunk", "eager"), ("tail_training", "executorch"), ("tail_training", "eager"),
            ("tail_eval", "eager")} <= set(kinds)
    for runtime in ("executorch", "eager"):
        parity = kinds[("tail_training", runtime)].parity
        assert parity["gradient_max_abs_error"] <= 1e-5 and parity["sgd_max_abs_error"] <= 1e-5
    assert kinds[("tail_eval", "eager")].parity["max_abs_error"] <= 1e-4
    assert set(kinds[("tail_training", "executorch")].details["trainable_parameters"]) == \
        {"tail.stages.0.0.weight", "weight", "bias"}


def test_tail_program_refuses_a_tampered_file(bundle, tmp_path):
    path = bundle.parent / "tail_eval.pt2"
    good = TailProgram(path)
    with pytest.raises(TailProgramError, match="sha256"):
        TailProgram(path, expected_sha256="0" * 64)
    broken = tmp_path / "broken.pt2"
    broken.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(TailProgramError, match="not a torch.export program"):
        TailProgram(broken)
    assert good.activation_shape == (320, 1, 1)


# ---------------------------------------------------------------- the device
def _reference_local_sgd(images, labels, start, params, train_head):
    """FT(φ)/FT(M) from the backbone's own last stage (real eval-mode BatchNorm), autograd and a
    hand-written SGD with weight decay, on the same seeded shuffles."""
    backbone = build_backbone("mobilenet_v2")
    last = copy.deepcopy(backbone.features[-1]).eval()
    trunk = torch.nn.Sequential(*list(backbone.features)[:-1]).eval()
    x = torch.from_numpy(to_model_input(images, SIZE, backbone.mean, backbone.std))
    with torch.no_grad():
        acts = trunk(x)
        last[0].weight.copy_(torch.from_numpy(start["tail.stages.0.0.weight"]))
    weight = torch.tensor(start["weight"], requires_grad=train_head)
    bias = torch.tensor(start["bias"], requires_grad=train_head)
    conv = last[0].weight
    trained = [conv] + ([weight, bias] if train_head else [])
    order_rng = np.random.default_rng(params["seed"])
    for _ in range(params["epochs"]):
        order = order_rng.permutation(len(labels))
        for s in range(0, len(order), params["batch_size"]):
            rows = torch.from_numpy(order[s:s + params["batch_size"]])
            feats = last(acts[rows]).mean(dim=(2, 3))
            loss = F.cross_entropy(F.linear(feats, weight, bias) / T, torch.from_numpy(labels)[rows])
            grads = torch.autograd.grad(loss, trained)
            with torch.no_grad():
                for p, g in zip(trained, grads):
                    p -= params["lr"] * (g + params["weight_decay"] * p)
    return {"tail.stages.0.0.weight": conv.detach().numpy(), "weight": weight.detach().numpy(),
            "bias": bias.detach().numpy()}


@pytest.mark.parametrize("train", ["tail", "tail+head"])
def test_device_local_training_matches_a_torch_reference(bundle, fmnist, train):
    images, labels = fmnist[0][:30], fmnist[1][:30]
    start = _model(TailProgram(bundle.parent / "tail_eval.pt2"))
    task = TailTrainingTask(images, labels, bundle)
    body, out = task(_params(train), start)
    expected_names = {"tail.stages.0.0.weight"} | ({"weight", "bias"} if train == "tail+head" else set())
    assert set(out) == expected_names and body["n"] == 30
    reference = _reference_local_sgd(images, labels, start, _params(train), train == "tail+head")
    for name in expected_names:
        assert not np.allclose(out[name], start[name])                                # it trained
        np.testing.assert_allclose(out[name], reference[name], atol=2e-5)


def test_device_declines_tasks_its_bundle_cannot_run(bundle, fmnist):
    images, labels = fmnist[0][:10], fmnist[1][:10]
    start = _model(TailProgram(bundle.parent / "tail_eval.pt2"))
    task = TailTrainingTask(images, labels, bundle)
    bad_nan = {**start, "weight": np.full_like(start["weight"], np.nan)}
    cases = [(_params(tail_stages=2), start, "tail 2"),
             (_params(train="head"), start, "train must be"),
             (_params(), {k: v for k, v in start.items() if k != "bias"}, "not the bundle's"),
             (_params(), {**start, "bias": np.zeros(C + 1, np.float32)}, "bias"),
             (_params(), bad_nan, "NaN"),
             (_params(temperature=1.0), start, "temperature"),
             ({k: v for k, v in _params().items() if k != "train"}, start, "bad fedavg.tail params")]
    for params, tensors, match in cases:
        with pytest.raises(TaskDeclined, match=match):
            task(params, tensors)
    with pytest.raises(TaskDeclined, match="no bundle"):
        TailTrainingTask(images, labels, None)(_params(), start)


def test_trunk_activations_are_cached_and_match_the_backbone(bundle, fmnist, tmp_path):
    trunk = TrunkActivations(bundle, cache_dir=str(tmp_path))
    first = trunk.extract(fmnist[0][:12])
    assert first.shape == (12, 320, 1, 1) and list(tmp_path.glob("features-*.npy"))
    np.testing.assert_array_equal(trunk.extract(fmnist[0][:12]), first)
    backbone = build_backbone("mobilenet_v2")
    x = torch.from_numpy(to_model_input(fmnist[0][:12], SIZE, backbone.mean, backbone.std))
    with torch.no_grad():
        np.testing.assert_allclose(first, torch.nn.Sequential(*list(backbone.features)[:-1])(x).numpy(), atol=1e-4)


def test_cached_trunk_activations_belong_to_the_trunk_file_not_only_to_its_backbone_and_weights(bundle, fmnist,
                                                                                                 tmp_path):
    """A review's finding: the activations' cache key named the backbone, its weights digest, the image
    size, the stages and the runtime, not the trunk program itself, so a bundle whose trunk was swapped
    for another (same manifest otherwise) was served the first trunk's cached activations. Two bundles
    differing only in their eager trunk file, one cache folder: each gets its own trunk's activations."""
    import hashlib
    import json
    import shutil

    from edge_client.runtime.eager_runtime import state_dict_from_bytes, state_dict_to_bytes

    manifest = json.loads(bundle.read_bytes())
    trunk_entry = next(a for a in manifest["artifacts"] if a["kind"] == "trunk" and a["runtime"] == "eager")
    original, swapped = tmp_path / "original", tmp_path / "swapped"
    for folder in (original, swapped):
        folder.mkdir()
        shutil.copy(bundle.parent / trunk_entry["file"], folder)
    shutil.copy(bundle, original / "manifest.json")
    state = state_dict_from_bytes((bundle.parent / trunk_entry["file"]).read_bytes())
    first_weight = next(name for name in state if name.endswith("weight"))
    state[first_weight] = state[first_weight] * 2                  # another trunk, same names and shapes
    data = state_dict_to_bytes(state)
    (swapped / trunk_entry["file"]).write_bytes(data)
    trunk_entry.update(sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))
    (swapped / "manifest.json").write_text(json.dumps(manifest))

    images, cache = fmnist[0][:6], str(tmp_path / "cache")
    from_original = TrunkActivations(original / "manifest.json", cache, prefer=("eager",)).extract(images)
    from_swapped = TrunkActivations(swapped / "manifest.json", cache, prefer=("eager",)).extract(images)
    uncached = TrunkActivations(swapped / "manifest.json", None, prefer=("eager",)).extract(images)
    assert not np.allclose(uncached, from_original, atol=1e-3)      # the swap does change the activations
    np.testing.assert_array_equal(from_swapped, uncached)


# ---------------------------------------------------------------- the aggregator
def _job(bundle, train="tail+head", **extra):
    cfg = dict(job_id="ft-tail", num_classes=C, feature_dim=1280, rounds=2, clients_per_round=3, local_epochs=1,
               batch_size=10, client_lr=0.01, round_timeout_s=60, expected_devices=3, seed=1, train=train,
               tail_stages=1, tail_program_file=str(bundle.parent / "tail_eval.pt2"), init="zeros", image_size=SIZE,
               **extra)
    return TailFedAvgJob(TailFedAvgConfig(**cfg)), cfg


def _result(job, device, tensors, n=10, round_=None):
    body = {"n": n}
    msg = result_message(device, TaskRef(job.config.job_id, round_ or job.round, "x" * 32), KIND_TAIL, body, tensors)
    return job.parse_result(decode(encode(msg)))


def test_job_averages_the_trained_tensors_with_weights_n_k(bundle):
    job, _ = _job(bundle, train="tail", weight_bound_multiplier=0.0)    # n_k as claimed (25 > 2 x the median 10)
    start = {k: v.copy() for k, v in job.params.items()}
    chosen = job.next_participants({"a", "b", "c"})
    rng = np.random.default_rng(3)
    sent, ns = {}, {"a": 5, "b": 10, "c": 25}
    for device in chosen:
        sent[device] = {"tail.stages.0.0.weight": rng.normal(size=start["tail.stages.0.0.weight"].shape).astype(np.float32)}
        job.apply(device, _result(job, device, sent[device], ns[device]))
    job.close_round(RoundClosed(job.round, tuple(chosen), (), (), ()))
    expected = sum(ns[d] * sent[d]["tail.stages.0.0.weight"].astype(np.float64) for d in chosen) / sum(ns.values())
    np.testing.assert_allclose(job.params["tail.stages.0.0.weight"], expected, rtol=1e-6, atol=1e-7)
    for name in ("weight", "bias"):                                                 # FT(φ): head frozen
        np.testing.assert_array_equal(job.params[name], start[name])


def test_job_refuses_results_with_the_wrong_tensors(bundle):
    job, _ = _job(bundle, train="tail")
    job.next_participants({"a", "b", "c"})
    tail = job.params["tail.stages.0.0.weight"]
    bad = [({"tail.stages.0.0.weight": tail, "weight": job.params["weight"]}, "unexpected"),   # FT(φ) sends no head
           ({}, "missing"),
           ({"tail.stages.0.0.weight": tail[:10]}, "shape"),
           ({"tail.stages.0.0.weight": np.full_like(tail, np.inf)}, "NaN or Inf"),
           ({"tail.stages.0.0.weight": tail.astype(np.float64)}, "dtype")]
    for tensors, match in bad:
        with pytest.raises(EnvelopeError, match=match):
            _result(job, "a", tensors)
    with pytest.raises(EnvelopeError, match="sample count"):
        _result(job, "a", {"tail.stages.0.0.weight": tail}, n=0)
    with pytest.raises(ValueError, match="train must be"):
        _job(bundle, train="head")
    with pytest.raises(ValueError, match="tail_program_file"):
        build_job("fedavg-tail", {"job_id": "x", "num_classes": C, "feature_dim": 1280})


def test_job_evaluation_equals_an_eager_forward_pass(bundle, fmnist):
    job, _ = _job(bundle)
    job.params = {**job.params, **_head(4)}
    images, labels = fmnist
    trunk = TrunkActivations(bundle)
    acts = trunk.extract(images)
    backbone = build_backbone("mobilenet_v2")
    x = torch.from_numpy(to_model_input(images, SIZE, backbone.mean, backbone.std))
    with torch.no_grad():
        feats = backbone(x).numpy()
    expected = float(((feats @ job.params["weight"].T + job.params["bias"]).argmax(1) == labels).mean())
    assert job.evaluate(acts.reshape(len(acts), -1), labels)["accuracy"] == pytest.approx(expected, abs=1.5 / len(labels))


def test_ft_m_over_mosquitto_equals_in_process_replay(broker, bundle, fmnist, tmp_path):
    """Three real device agents train through the ExecuTorch tail program; the aggregated model
    equals replaying the same rounds in process, and the job's state survives a restart."""
    images, labels = fmnist
    ids = ["d0", "d1", "d2"]
    shards = {d: np.arange(i * 20, i * 20 + 20) for i, d in enumerate(ids)}
    tasks = {d: TailTrainingTask(images[shards[d]], labels[shards[d]], bundle) for d in ids}
    job, cfg = _job(bundle, train="tail+head")
    svc = AggregatorService(job, BrokerConfig.from_url(broker.url), tmp_path,
                            ServiceSettings(evaluate_every_contribution=False), enrolled=set(ids))
    result = {}
    t = threading.Thread(target=lambda: result.update(svc.run(timeout_s=120)), daemon=True)
    t.start()
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url), {KIND_TAIL: tasks[d]}).start() for d in ids]
    t.join(150)
    for a in agents:
        a.stop()
    assert result["state"] == "done" and len(result["rounds"]) == 2, result
    assert all(len(r["accepted"]) == 3 for r in result["rounds"]), result["rounds"]

    replay, _ = _job(bundle, train="tail+head")
    fresh = {d: TailTrainingTask(images[shards[d]], labels[shards[d]], bundle) for d in ids}
    for r in result["rounds"]:
        chosen = replay.next_participants(set(ids))
        assert chosen == sorted(r["accepted"])
        replay_round(replay, chosen, fresh, KIND_TAIL)
    for name in replay.params:
        np.testing.assert_allclose(job.params[name], replay.params[name], rtol=1e-5, atol=1e-6)
    assert not np.allclose(job.params["tail.stages.0.0.weight"], _job(bundle)[0].params["tail.stages.0.0.weight"])

    restored, _ = _job(bundle, train="tail+head")
    restored.load_state_dict(job.state_dict())
    for name in job.params:
        np.testing.assert_array_equal(restored.params[name], job.params[name])


def test_golden_vectors_of_fedavg_tail_messages_parse():
    """What an Android client is written against: the tail task carries the whole model, the FT(φ)
    result exactly the tail."""
    from protocols import golden
    from protocols.payloads.fedavg import parse_model_update

    task = decode((golden.golden_dir() / "task_fedavg_tail.bin").read_bytes())
    assert task.body["kind"] == KIND_TAIL and task.body["params"]["train"] == "tail"
    assert set(task.tensors) == {"tail.stages.0.0.weight", "weight", "bias"}
    result = decode((golden.golden_dir() / "result_fedavg_tail.bin").read_bytes())
    update = parse_model_update(result, {"tail.stages.0.0.weight": (2, 1, 1, 1)})
    assert update.n == 40
    np.testing.assert_array_equal(update.trained["tail.stages.0.0.weight"], task.tensors["tail.stages.0.0.weight"] * 0.75)


def test_secure_ft_phi_over_mosquitto_equals_the_plain_mean_of_the_summed_devices(broker, bundle, fmnist, tmp_path):
    """fedavg-tail-secure: each round's tail updates are summed under SecAgg; the tail equals the
    n_k-weighted mean of what the devices in the sum trained (recomputed here in plaintext with
    the same handlers), the head stays frozen, and no tail tensor reaches the aggregator in the clear."""
    from aggregator.jobs.secure_fedavg import SecureTailFedAvgConfig, SecureTailFedAvgJob
    from ops_fleet import RecordingService, start_secure_fedavg_agents

    from protocols.payloads.secagg import SECURE_TAIL_KIND

    images, labels = fmnist
    ids = [f"s{i}" for i in range(4)]
    shards = {d: np.arange(i * 15, i * 15 + 15) for i, d in enumerate(ids)}
    identities, agg, registry = in_memory_keys(ids)
    _, cfg = _job(bundle, train="tail")
    cfg.update(job_id="sft-tail", clients_per_round=4, expected_devices=4)
    job = SecureTailFedAvgJob(SecureTailFedAvgConfig(**cfg, max_samples=100, max_abs_param=50.0, phase_timeout_s=5),
                              identity=agg, registry=registry)
    start = {k: v.copy() for k, v in job.params.items()}
    service = RecordingService(job, broker.url, tmp_path, set(ids), ServiceSettings(evaluate_every_contribution=False))
    agents = start_secure_fedavg_agents(broker.url, identities, agg.public_key_bytes, SECURE_TAIL_KIND,
                                        {d: TailTrainingTask(images[shards[d]], labels[shards[d]], bundle) for d in ids})
    result = service.join(150)
    for a in agents:
        a.stop()
    assert result.get("state") == "done", result
    assert len(result["rounds"]) == 2 and not job.failed_rounds

    replay = TailFedAvgJob(TailFedAvgConfig(**cfg))          # same config, plaintext
    fresh = {d: TailTrainingTask(images[shards[d]], labels[shards[d]], bundle) for d in ids}
    for r in result["rounds"]:
        chosen = replay.next_participants(set(ids))
        assert sorted(r["accepted"]) == chosen
        outputs = replay_round(replay, chosen, fresh, KIND_TAIL)
        trained = [out["tail.stages.0.0.weight"].astype(np.float64) for _, out in outputs]
        ns = [body["n"] for body, _ in outputs]
        plain_mean = sum(n * t for n, t in zip(ns, trained)) / sum(ns)
        np.testing.assert_allclose(replay.params["tail.stages.0.0.weight"], plain_mean, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(job.params["tail.stages.0.0.weight"], replay.params["tail.stages.0.0.weight"],
                               rtol=0, atol=1e-5)
    for name in ("weight", "bias"):
        np.testing.assert_array_equal(job.params[name], start[name])
    envelopes = service.received_envelopes()
    assert not any(name.startswith("tail.") for env in envelopes for name in env.tensors)
    types = {env.type for env in envelopes}
    assert "secagg" in types and "result" not in types


def test_manifest_refuses_inconsistent_tail_sections(bundle, tmp_path):
    """A bundle whose tail programs do not match its tail section is refused before any load."""
    import json
    import shutil

    from edge_client.runtime import ManifestError

    def broken(edit):
        copy_dir = tmp_path / f"b{len(list(tmp_path.iterdir()))}"
        shutil.copytree(bundle.parent, copy_dir)
        data = json.loads((copy_dir / "manifest.json").read_text())
        edit(data)
        (copy_dir / "manifest.json").write_text(json.dumps(data))
        return copy_dir

    def drop_tail(d):
        del d["tail"]

    def wrong_activations(d):
        d["tail"]["activation_shape"] = [320, 2, 2]

    def unnamed_parameter(d):
        d["tail"]["parameters"] = {"stages.0.0.weight": [1280, 320, 1, 1]}

    def wrong_parameter_shape(d):
        d["tail"]["parameters"]["tail.stages.0.0.weight"] = [1280, 321, 1, 1]

    for edit, match in ((drop_tail, "needs the manifest's tail section"), (wrong_activations, "activations"),
                        (unnamed_parameter, "tail"), (wrong_parameter_shape, "trainable_parameters|parameters")):
        with pytest.raises(ManifestError, match=match):
            read_manifest(broken(edit))


def test_secure_update_declines_a_vector_order_that_is_not_what_it_trained(bundle, fmnist):
    """fedavg.tail.secure: the device packs exactly the tensors it trained, in the task's order;
    an order naming other tensors is declined before anything is masked."""
    from edge_client.tasks.secure_fedavg_training import SecureFedAvgTraining
    from protocols.identity import DeviceIdentity
    from protocols.payloads.secagg import pack_weighted, unpack_weighted_sum

    images, labels = fmnist[0][:10], fmnist[1][:10]
    start = _model(TailProgram(bundle.parent / "tail_eval.pt2"))
    secure = SecureFedAvgTraining(DeviceIdentity.generate("s0"), DeviceIdentity.generate("agg").public_key_bytes,
                                TailTrainingTask(images, labels, bundle))
    params = _params(group="g1", max_samples=100, max_abs_param=50.0)
    for order in (["weight", "bias"], ["tail.stages.0.0.weight", "tail.stages.0.0.weight"], "tail.stages.0.0.weight"):
        with pytest.raises(TaskDeclined, match="vector_order"):
            secure.vector({**params, "vector_order": order}, start)
    vector = secure.vector({**params, "vector_order": ["tail.stages.0.0.weight"]}, start)
    sums, n = unpack_weighted_sum(vector, {"tail.stages.0.0.weight": (1280, 320, 1, 1)})
    assert n == 10 and np.isfinite(sums["tail.stages.0.0.weight"]).all()
    with pytest.raises(ValueError, match="weighted sum has shape"):
        unpack_weighted_sum(vector[:-1], {"tail.stages.0.0.weight": (1280, 320, 1, 1)})
    with pytest.raises(ValueError, match="vector order"):
        pack_weighted({"a": np.zeros(2)}, ["a", "b"], 1)
    with pytest.raises(TaskDeclined, match="bound"):
        secure.vector({**params, "max_abs_param": 1e-6, "vector_order": ["tail.stages.0.0.weight"]}, start)


# ---------------------------------------------------------------- OLL after FT(φ)/FT(M)
def _fine_tuned(model):
    """An eager MobileNetV2 whose last stage holds the model's tail: the independent reference."""
    backbone = build_backbone("mobilenet_v2").eval()
    with torch.no_grad():
        backbone.features[-1][0].weight.copy_(torch.from_numpy(model["tail.stages.0.0.weight"]))
    return backbone


def _oll_params(**extra):
    return {"num_classes": C, "feature_dim": 1280, "backbone": "mobilenet_v2", "image_size": SIZE,
            "fallback": "global", "fp_epochs": 0, "tail_stages": 1, **extra}


def test_personalization_on_a_fine_tuned_tail_counts_what_the_eager_backbone_gives(bundle, fmnist):
    """The oll.personalize task with a tail: the device's features are the fine-tuned backbone's
    (trunk program + the task's tail), so its counts equal those of the eager backbone with the
    tail copied in -- and differ from the frozen backbone's for a moved tail."""
    from edge_client.tasks.personalization import PersonalizeTask
    from edge_client.tasks.tail_training import TailFeatures

    images, labels = fmnist
    program = TailProgram(bundle.parent / "tail_eval.pt2")
    rng = np.random.default_rng(4)
    tail = {k: v + rng.normal(0, 0.05, v.shape).astype(np.float32) for k, v in program.tail_parameters.items()}
    backbone = _fine_tuned(tail)
    x = torch.from_numpy(to_model_input(images[100:160], SIZE, backbone.mean, backbone.std))
    with torch.no_grad():
        reference = backbone(x).numpy()
    # a head that fits the fine-tuned features, so the counts are far from chance
    head = {"weight": np.stack([reference[labels[100:160] == c].mean(0) if (labels[100:160] == c).any()
                                else np.zeros(1280) for c in range(C)]).astype(np.float32),
            "bias": np.zeros(C, np.float32)}
    task = PersonalizeTask(images[:100], labels[:100], images[100:160], labels[100:160], extractor_factory=None,
                           tail_features=TailFeatures(bundle))
    task(_oll_params(), {**tail, **head})
    logits = reference @ head["weight"].T + head["bias"]
    y = labels[100:160]
    local = np.unique(labels[:100])
    masked = np.where(np.isin(np.arange(C), local), logits, -np.inf)
    inside = np.isin(y, local)
    expected_oll = int((masked.argmax(1) == y)[inside].sum() + (logits.argmax(1) == y)[~inside].sum())
    assert task.last.correct["global"] == int((logits.argmax(1) == y).sum())
    assert task.last.correct["oll"] == expected_oll
    features, = task.tail_features.extract({**tail, **head}, images[100:160])
    np.testing.assert_allclose(features, reference, atol=1e-4)
    with torch.no_grad():
        frozen = build_backbone("mobilenet_v2").eval()(x).numpy()
    assert np.abs(features - frozen).max() > 1e-2                    # the tail really moved them


def test_personalization_declines_tail_tasks_it_cannot_run(bundle, fmnist):
    from edge_client.tasks.personalization import PersonalizeTask
    from edge_client.tasks.tail_training import TailFeatures

    images, labels = fmnist[0][:40], fmnist[1][:40]
    model = _model(TailProgram(bundle.parent / "tail_eval.pt2"))
    with_tail = PersonalizeTask(images[:20], labels[:20], images[20:], labels[20:], extractor_factory=None,
                                tail_features=TailFeatures(bundle))
    without = PersonalizeTask(images[:20], labels[:20], images[20:], labels[20:], extractor_factory=None)
    cases = [(without, _oll_params(), model, "no tail bundle"),
             (with_tail, _oll_params(tail_stages=0), model, "tail_stages = 0"),
             (with_tail, _oll_params(tail_stages=2), model, "2-stage tail"),
             (with_tail, _oll_params(), {k: v for k, v in model.items() if not k.startswith("tail.")}, "not the bundle's"),
             (with_tail, _oll_params(), {**model, "tail.stages.0.0.weight": np.full_like(
                 model["tail.stages.0.0.weight"], np.inf)}, "NaN or Inf")]
    for task, params, tensors, match in cases:
        with pytest.raises(TaskDeclined, match=match):
            task(params, tensors)


def test_personalize_job_sends_the_fine_tuned_tail_with_the_head(bundle, tmp_path):
    from aggregator.jobs.personalize import PersonalizeConfig, PersonalizeJob

    model = _model(TailProgram(bundle.parent / "tail_eval.pt2"))
    path = tmp_path / "model.npz"
    np.savez(path, **model)
    common = dict(num_classes=C, feature_dim=1280, backbone="mobilenet_v2", image_size=SIZE, head_file=str(path))
    with pytest.raises(ValueError, match="set tail_stages"):
        PersonalizeJob(PersonalizeConfig(**common))
    job = PersonalizeJob(PersonalizeConfig(**common, tail_stages=1))
    params, tensors = job.task_for("dev0")
    assert params["tail_stages"] == 1 and set(tensors) == set(model)
    for name in model:
        np.testing.assert_array_equal(tensors[name], model[name])
    assert "global_accuracy" not in job.evaluate(np.zeros((3, 1280), np.float32), np.zeros(3, np.int64))
    head_only = tmp_path / "head.npz"
    np.savez(head_only, weight=model["weight"], bias=model["bias"])
    with pytest.raises(ValueError, match="no tail"):
        PersonalizeJob(PersonalizeConfig(**{**common, "head_file": str(head_only)}, tail_stages=1))
    build_job("personalize", {**common, "tail_stages": 1})          # the admin API's path accepts it
    with pytest.raises(ValueError, match="tail_stages"):
        build_job("personalize", {**common, "tail_stages": -1})


def test_only_the_eager_twin_gives_tail_features(bundle, fmnist):
    """An ExecuTorch training program returns loss and logits only: asking it for features is a
    clear error naming the eager twin, not a wrong answer."""
    from edge_client.runtime import RuntimeUnavailableError, TrainingSession

    session = TrainingSession.load(bundle, prefer=("executorch",), kind="tail_training")
    with pytest.raises(RuntimeUnavailableError, match="eager twin"):
        session.features(np.zeros((2, 320, 1, 1), np.float32))
