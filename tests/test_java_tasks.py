"""The Java device library's head-level tasks against the Python device on the same inputs:

* the mini-batch order: the library's NumpyGenerator gives numpy's ``default_rng(seed)``
  permutations bit for bit, so both devices visit the same rows in the same steps
  (``protocols.payloads.fedavg.batch_schedule``, golden vector ``sample_order.json``);
* ``fedavg.head`` (FedAvg(ψ), and FedBuff's ``model_version`` echoed): the Java device's trained
  head equals the Python device's (its numpy step, what a torch-free device runs, and the eager
  torch step of a full install) on the same features, initial head and recipe, within
  ``HEAD_ATOL``; its result passes the aggregator's parser; a malformed task is declined with a
  reason;
* a mixed fleet over mosquitto: Java and Python devices in one FedAvg(ψ) job, all of them in
  every round, give the head of an in-process replay in which Python devices hold the Java
  devices' data.

Tolerance. Both devices keep the head in float32 between steps and apply the same update; the
Python device computes each step's logits, softmax and gradients in float32 (numpy/torch), the
Java device in double, rounded once into the float32 update. How far two correct steppers may
part after S steps is derived from that arithmetic in ``test_differential_fuzz.head_tolerance``
(float32 rounding of the logits and of the gradient's sums, times lr, plus one rounding of θ per
step): the single-task checks below use it, and check that it is far below what training moves
the head. It grows with lr·S/T: at lr 0.3, T 0.1 and 24 steps an OLL fine-tune legitimately
drifts 2.6e-5, past the 1e-5 once asserted. HEAD_ATOL = 1e-5 stays for the fleet replays here
(a few steps at lr 0.05, where the derived bound is below it).
"""

from __future__ import annotations

import os
import subprocess
import threading

import numpy as np
import pytest

import java_build
from test_differential_fuzz import head_tolerance
from ops_fleet import kept_windows
from test_java_device import write_features
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from aggregator.service.settings import ServiceSettings

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))

HEAD_ATOL = 1e-5
D, C = 6, 4


@pytest.fixture(scope="module")
def java_cp() -> str:
    return java_build.built()


def java(java_cp: str, *args) -> str:
    # a hang guard, not a speed bound: 20,000 PTRS draws took 15-33 s on a loaded 2-core machine
    proc = subprocess.run(java_build.java_command("-cp", java_cp, "TaskRunner", *map(str, args)), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_sample_order_is_the_golden_vectors(java_cp):
    """The golden sample_order.json is what the protocol's batch_schedule (numpy's default_rng)
    gives now, and the Java device's LocalTraining takes exactly those mini-batches."""
    import json

    from protocols import golden

    path = golden.golden_dir() / golden.SAMPLE_ORDER_FILE
    assert json.loads(path.read_text()) == golden.golden_sample_order()
    out = java(java_cp, "--sample-order", path)
    assert out.split("\n")[:-1] == [f"ORDER {i} ok" for i in range(len(golden.golden_sample_order()))], out


def device_data(i: int, n: int = 37) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(900 + i)
    y = rng.integers(0, C, n)
    return (rng.normal(size=(n, D)) + 2 * np.eye(C, D)[y]).astype(np.float32), y


def task_bytes(params: dict, tensors: dict, kind: str = "fedavg.head") -> bytes:
    from protocols import messages as M
    from protocols.envelope import Envelope, encode

    task = M.task_message("aggregator", "ft", 1, kind, params, 1e10)
    return encode(Envelope(task.type, task.sender, task.body, tensors, id=task.id, ts=task.ts))


RECIPE = {"num_classes": C, "feature_dim": D, "backbone": "b", "image_size": 8, "weights_sha256": "",
          "epochs": 3, "batch_size": 8, "lr": 0.05, "weight_decay": 4e-5, "temperature": 0.1, "seed": 11}


def state_args(state) -> list:
    """TaskRunner's arguments for a device with the state folder ``state`` (made here; none when None):
    a Fed3R task that caps samples or streams is answered only with one (edge_client/sample_windows.py)."""
    if state is None:
        return []
    state.mkdir(parents=True, exist_ok=True)
    return ["-", state]


def run_java_task(java_cp, tmp_path, params, tensors, data, kind: str = "fedavg.head",
                  state=None) -> tuple[str, object]:
    """The Java handler of ``kind`` on one task: (its output lines, the result envelope or None)."""
    from protocols.envelope import decode

    (tmp_path / "task.bin").write_bytes(task_bytes(params, tensors, kind))
    feats = write_features(tmp_path / "f.feat", *data)
    out = java(java_cp, tmp_path / "task.bin", feats, tmp_path / "result.bin", *state_args(state))
    return out, (decode((tmp_path / "result.bin").read_bytes()) if out.startswith("DONE") else None)


@pytest.mark.parametrize("rule", [{}, {"local_rule": "sam", "sam_rho": 0.2},
                                  {"local_rule": "asam", "sam_rho": 0.5, "asam_eta": 0.2, "prox_mu": 0.1}])
def test_fedavg_head_equals_the_python_device(java_cp, tmp_path, rule):
    """Plain SGD, FedSAM, FedASAM+FedProx (edge_client/tasks/local_rules.py) steps of the Java head trainer."""
    from edge_client.tasks.head_training import LocalTraining, _TorchHeadStepper, local_sgd, train_head
    from edge_client.tasks.numpy_head import NumpyHeadStepper
    from protocols.payloads.fedavg import parse_head_update

    Z, y = device_data(0)
    rng = np.random.default_rng(3)
    head = {"weight": (rng.normal(size=(C, D)) * 0.1).astype(np.float32), "bias": rng.normal(size=C).astype(np.float32)}
    out, result = run_java_task(java_cp, tmp_path, {**RECIPE, **rule, "model_version": 4}, head, (Z, y))
    update = parse_head_update(result, C, D)                     # what the aggregator accepts
    assert update.n == len(y) and result.body["model_version"] == 4      # FedBuff's staleness echo
    recipe = LocalTraining.from_params({**RECIPE, **rule})
    steps, java_loss = int(out.split()[2]), float(out.split()[4])
    for stepper_class in (NumpyHeadStepper, _TorchHeadStepper):  # torch-free device, full install
        stepper = stepper_class(head["weight"], head["bias"], recipe)
        py_steps, py_loss = local_sgd(stepper, len(y), Z, y, recipe)
        ref = stepper.parameters()
        assert steps == py_steps == 15 and abs(java_loss - py_loss) <= 1e-5
        tol = head_tolerance(RECIPE, head, Z, steps, RECIPE["batch_size"], ref, update.tensors())
        for k, got in (("weight", update.weight), ("bias", update.bias)):
            diff = np.abs(got - ref[k]).max()
            assert diff <= tol, (stepper_class.__name__, k, diff, tol)
            assert np.abs(ref[k] - head[k]).max() > 10 * tol   # it trained: the tolerance can fail
    trained = train_head(head["weight"], head["bias"], Z, y, recipe)     # what HeadTrainingTask runs here
    assert np.abs(update.weight - trained.weight).max() <= tol
    if not rule:
        _, without_version = run_java_task(java_cp, tmp_path, RECIPE, head, (Z, y))
        assert "model_version" not in without_version.body
    else:      # the rule changed the step, by more than the tolerance
        plain = train_head(head["weight"], head["bias"], Z, y, LocalTraining.from_params(RECIPE))
        assert np.abs(plain.weight - update.weight).max() > 10 * tol


@pytest.mark.parametrize("change, tensors, reason", [
    ({"lr": -1.0}, None, "lr must be a finite number > 0"),
    ({"seed": -3}, None, "seed must be an integer >= 0"),
    ({"feature_dim": D + 1}, None, "shape"),
    ({"num_classes": 2}, None, "outside the job's 2 classes"),
    ({}, {"weight": np.zeros((C, D), np.float32)}, "no head tensor 'bias'"),
    ({}, {"weight": np.full((C, D), np.nan, np.float32), "bias": np.zeros(C, np.float32)}, "NaN or Inf"),
    ({"lr": 1e30}, None, "diverged"),
    ({"local_rule": "nesterov"}, None, "local_rule must be one of"),
    ({"local_rule": "sam", "sam_rho": 0.0}, None, "needs sam_rho > 0"),
    ({"prox_mu": -0.5}, None, "prox_mu must be a finite number"),
])
def test_malformed_fedavg_head_tasks_are_declined_with_a_reason(java_cp, tmp_path, change, tensors, reason):
    head = tensors if tensors is not None else {"weight": np.zeros((change.get("num_classes", C), D), np.float32),
                                                "bias": np.zeros(change.get("num_classes", C), np.float32)}
    out, _ = run_java_task(java_cp, tmp_path, {**RECIPE, **change}, head, device_data(0))
    assert out.startswith("DECLINED") and reason in out, out


@pytest.mark.parametrize("change, reason", [({}, None), ({"vector_order": ["bias", "weight"]}, None),
                                            ({"vector_order": ["weight"]}, "does not name exactly"),
                                            ({"max_abs_param": 0.01}, "> the round's bound 0.01"),
                                            ({"max_samples": 10}, "exceed the round's bound of 10"),
                                            ({"dp": {"clip_norm": 1.0, "stddev": 0.1}}, "scale_bits"),
                                            ({"dp": {"stddev": 0.1, "scale_bits": 16}}, "needs its clip_norm"),
                                            ({"update_clip_norm": 0.5}, None), ({"update_clip_norm": 0.0}, None),
                                            ({"group": ""}, "needs its group"), ({"lr": 0}, "lr must be")])
def test_secure_fedavg_vector_is_the_python_devices(java_cp, tmp_path, change, reason):
    """fedavg.secure: the vector the Java device masks is [n·θ in vector_order | n] of its trained
    head (θ_t + the update clipped to update_clip_norm when the task sets one), the Python device's
    (protocols.payloads.secagg.pack_weighted, SecureUpdate.clipped_delta) within n·HEAD_ATOL; heads
    beyond the round's bounds and malformed params are declined with a reason."""
    from edge_client.tasks.head_training import LocalTraining, train_head
    from edge_client.tasks.secure_update import SecureUpdate
    from protocols.payloads.secagg import pack_weighted

    Z, y = device_data(0)
    head = {"weight": np.zeros((C, D), np.float32), "bias": np.zeros(C, np.float32)}
    params = {**RECIPE, "group": "g1", "max_samples": 100, "max_abs_param": 20.0, **change}
    (tmp_path / "task.bin").write_bytes(task_bytes(params, head, "fedavg.secure"))
    proc = subprocess.run(java_build.java_command("-cp", java_cp, "TaskRunner", str(tmp_path / "task.bin"),
                                                  str(write_features(tmp_path / "f.feat", Z, y)),
                                                  str(tmp_path / "unused.bin")),
                          capture_output=True, text=True, timeout=60)
    if reason is not None:
        assert proc.stdout.startswith("DECLINED") and reason in proc.stdout, proc.stdout + proc.stderr[-2000:]
        return
    got = np.array(proc.stdout.split()[1:], dtype=np.float64)
    trained = train_head(head["weight"], head["bias"], Z, y, LocalTraining.from_params(RECIPE))
    tensors = {"weight": trained.weight, "bias": trained.bias}
    if change.get("update_clip_norm"):        # bounded influence: θ_t + clip(θ_k − θ_t); 0 means no clip
        delta = SecureUpdate.clipped_delta(change["update_clip_norm"], tensors, head)
        assert np.linalg.norm(trained.weight) > 2 * change["update_clip_norm"]      # the clipping bites
        tensors = {k: np.asarray(head[k], np.float64) + delta[k] for k in tensors}
    want = pack_weighted(tensors, params.get("vector_order", ["weight", "bias"]), len(y))
    assert got.shape == want.shape and got[-1] == len(y)
    assert np.abs(got - want).max() <= len(y) * HEAD_ATOL


def java_vector(java_cp, tmp_path, params, tensors, kind, data, state=None) -> np.ndarray:
    (tmp_path / "task.bin").write_bytes(task_bytes(params, tensors, kind))
    out = java(java_cp, tmp_path / "task.bin", write_features(tmp_path / "f.feat", *data), tmp_path / "x.bin",
               *state_args(state))
    assert out.startswith("VECTOR"), out
    return np.array(out.split()[1:], dtype=np.float64)


GRID_BITS = 16      # the rounds' scale_bits here: the vectors lie on the 2^-16 grid


def test_secure_vectors_under_distributed_dp_are_the_python_devices(java_cp, tmp_path):
    """Distributed DP: fedavg.secure sends [clip(θ_k − θ_t) | 1] and fed3r.secure the clipped,
    capped statistics with count 0, both rounded to the 2^-f grid with the device's noise share.
    With a negligible noise (μ ≈ 1e-9 ring units) the Java vectors are the Python device's rounded
    ones within one grid step (+ HEAD_ATOL for the trained head)."""
    from ops_fleet import Features

    from edge_client.tasks.fed3r_stats import Fed3RStatsTask
    from edge_client.tasks.head_training import LocalTraining, train_head
    from edge_client.tasks.secure_update import SecureUpdate
    from protocols.payloads.secagg import pack_sync_vector, pack_weighted

    Z, y = device_data(0)
    head = {"weight": np.zeros((C, D), np.float32), "bias": np.zeros(C, np.float32)}
    dp = {"clip_norm": 0.5, "stddev": 1e-9, "scale_bits": GRID_BITS}
    got = java_vector(java_cp, tmp_path, {**RECIPE, "group": "g", "max_samples": 100, "max_abs_param": 20.0, "dp": dp},
                      head, "fedavg.secure", (Z, y))
    trained = train_head(head["weight"], head["bias"], Z, y, LocalTraining.from_params(RECIPE))
    delta = SecureUpdate.clipped_delta(dp["clip_norm"], {"weight": trained.weight, "bias": trained.bias}, head)
    want = np.rint(np.ldexp(pack_weighted(delta, ["weight", "bias"], 1), GRID_BITS)) / 2.0 ** GRID_BITS
    assert np.linalg.norm(trained.weight) > 1.0                       # the clipping bites
    assert got[-1] == 1.0 and np.all(np.ldexp(got, GRID_BITS) == np.rint(np.ldexp(got, GRID_BITS)))
    assert np.abs(got - want).max() <= 2.0 ** -GRID_BITS + HEAD_ATOL

    params = {**FED3R_PARAMS, "group": "g", "max_samples": 20, "feature_clip_norm": 2.0, "cap_samples": True,
              "dp": {"stddev": 1e-9, "scale_bits": GRID_BITS}}
    got = java_vector(java_cp, tmp_path, params, {}, "fed3r.secure", device_data(1), state=tmp_path / "java")
    _, stats = Fed3RStatsTask(*device_data(1), lambda b, s, w: Features(D), windows=kept_windows(tmp_path / "python"))(
        dict(params, format="dense", dtype="float64"))
    want = np.rint(np.ldexp(pack_sync_vector(stats["A_upper"], stats["b"], 0), GRID_BITS)) / 2.0 ** GRID_BITS
    assert got[-1] == 0.0 and np.abs(got - want).max() <= 2.0 ** -GRID_BITS


@pytest.mark.parametrize("stddev, scale_bits", [(32.0, 29), (2.0 ** 31, 1), (2.0 ** 20, 12)])
def test_a_noise_too_large_to_draw_is_declined_by_both_devices(java_cp, tmp_path, stddev, scale_bits):
    """Found by the differential fuzzer: a dp round whose Poisson mean μ = (σ·2^f)²/2 is past what
    numpy draws (~9.2e18) was declined by the Python device ("lam value too large") but taken by
    the Java one, whose PTRS candidate saturated at Long.MAX_VALUE in both draws: a zero noise, an
    un-noised release. Both decline it now, by the one declared limit (POISSON_LAM_MAX); the limit
    itself is still drawn by numpy."""
    from ops_fleet import Features

    from edge_client.agent import TaskDeclined
    from edge_client.tasks.fed3r_stats import Fed3RStatsTask
    from edge_client.tasks.secure_fed3r import SecureFed3R
    from protocols.identity import DeviceIdentity

    from protocols.secagg.distributed_dp import POISSON_LAM_MAX

    assert (stddev * 2.0 ** scale_bits) ** 2 / 2 > POISSON_LAM_MAX
    params = {**FED3R_PARAMS, "group": "g", "max_samples": 20, "feature_clip_norm": 2.0, "cap_samples": True,
              "dp": {"stddev": stddev, "scale_bits": scale_bits}}
    (tmp_path / "task.bin").write_bytes(task_bytes(params, {}, "fed3r.secure"))
    out = java(java_cp, tmp_path / "task.bin", write_features(tmp_path / "f.feat", *device_data(1)), tmp_path / "x.bin",
               *state_args(tmp_path / "java"))
    assert out.startswith("DECLINED bad dp params") and "too large to draw" in out, out
    device = SecureFed3R(DeviceIdentity.generate("d"), bytes(32), Fed3RStatsTask(
        *device_data(1), lambda b, s, w: Features(D), windows=kept_windows(tmp_path / "python")))
    with pytest.raises(TaskDeclined, match="too large to draw"):
        device.vector(params, {})
    assert np.isfinite(np.random.default_rng(0).poisson(POISSON_LAM_MAX))      # the limit itself is drawn


@pytest.mark.parametrize("mu", [0.5, 50.0, 1e9])
def test_skellam_noise_share_has_the_right_distribution(java_cp, mu):
    """The noise share: Poisson(μ) − Poisson(μ) integers (multiplication method below μ = 10,
    PTRS above), mean 0 and variance 2μ within 5 standard errors over 20 000 draws, and the same
    distribution as numpy's draws (two-sample Kolmogorov-Smirnov, p > 1e-4)."""
    from scipy.stats import ks_2samp

    n = 20_000
    draws = np.array(java(java_cp, "--skellam", np.sqrt(2 * mu), n).split()[1:], dtype=np.float64)
    assert draws.shape == (n,)
    var = 2 * mu
    assert abs(draws.mean()) <= 5 * np.sqrt(var / n)
    assert abs(draws.var() / var - 1) <= 5 * np.sqrt((2 + 1 / mu) / n)      # Skellam's excess kurtosis: 1/(2μ)
    rng = np.random.default_rng(0)
    assert ks_2samp(draws, rng.poisson(mu, n) - rng.poisson(mu, n)).pvalue > 1e-4


JAVA_IDS, PY_IDS = ["java0", "java1", "java2"], ["py0", "py1"]


def serve(job, broker_url: str, workdir, ids: list[str]) -> dict:
    """The aggregator service on a thread (as a deployment runs it), until the job ends."""
    from aggregator.service.loop import AggregatorService
    from protocols.mqtt_link import BrokerConfig

    workdir.mkdir(exist_ok=True)
    svc = AggregatorService(job, BrokerConfig.from_url(broker_url), workdir,
                            ServiceSettings(evaluate_every_contribution=False), enrolled=set(ids))
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=120)), daemon=True)
    thread.start()
    return {"thread": thread, "result": result}


def start_java_devices(java_cp, broker_url, tmp_path, extra: list[str], seeds: dict | None = None,
                       scale: dict | None = None, data=None) -> subprocess.Popen:
    """JAVA_IDS in one JVM (HeadlessDevices), each on data(i) (default device_data; times scale[d]),
    with a held-out split; signing with seeds[d] when given."""
    cmd = java_build.java_command("-cp", java_cp, "org.fedfleet.device.HeadlessDevices", "--stop-on-stdin-eof",
                                  "--broker", broker_url, "--retry-after", "2", "--tick", "0.1", *extra)
    for i, d in enumerate(JAVA_IDS):
        Z, y = (data or device_data)(i)
        feats = write_features(tmp_path / f"{d}.feat", Z * (scale or {}).get(d, 1.0), y)
        held = write_features(tmp_path / f"{d}-test.feat", *personal_data(50 + i, 30, list(range(C))))
        cmd += ["--holdout", d, str(held), "--device", d, str(feats), seeds[d].hex() if seeds else "-"]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop_mixed_fleet(agents, jvm: subprocess.Popen) -> tuple[str, str]:
    """Stops the Python agents, then the JVM's devices (their stdin closed): the JVM's stdout and stderr."""
    for a in agents:
        a.stop()
    return jvm.communicate(timeout=30)


def two_rounds_done(service, job, agents, jvm: subprocess.Popen, timeout_s: float = 150) -> tuple[dict, str]:
    """Waits for the job, then stops the fleet: (its result, the JVM's stdout), once the JVM ended
    cleanly and the job finished both its rounds with none failed."""
    try:
        result = service.join(timeout_s)
    finally:
        out, err = stop_mixed_fleet(agents, jvm)
    assert jvm.returncode == 0, err[-3000:]
    assert result.get("state") == "done" and len(result["rounds"]) == 2 and not job.failed_rounds, (result, err[-3000:])
    return result, out


def test_mixed_java_and_python_fleet_runs_fedavg_head_then_personalization(java_cp, broker, tmp_path):
    """Three Java devices (one JVM) and two Python devices in one FedAvg(ψ) job over mosquitto,
    all five in each of 3 rounds: every device contributes every round, and the final head equals
    an in-process replay of the same rounds in which Python devices hold the Java devices' data.
    Then a personalization job (OLL + FP(ψ)) of that head: every device reports, and each Java
    device's report is what the Python device computes on its data."""
    from ops_fleet import Features, replay_round

    from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob
    from aggregator.jobs.personalize import PersonalizeConfig, PersonalizeJob
    from edge_client.agent import DeviceAgent
    from edge_client.tasks.head_training import HeadTrainingTask
    from edge_client.tasks.personalization import PersonalizeTask
    from protocols.mqtt_link import BrokerConfig

    ids = JAVA_IDS + PY_IDS
    cfg = dict(job_id="ft-mixed", num_classes=C, feature_dim=D, rounds=3, clients_per_round=len(ids),
               round_timeout_s=60, local_epochs=2, batch_size=8, client_lr=0.05, expected_devices=len(ids),
               start_timeout_s=30, seed=5)
    job = FedAvgJob(FedAvgConfig(**cfg))
    fedavg = serve(job, broker.url, tmp_path / "fedavg", ids)
    jvm = start_java_devices(java_cp, broker.url, tmp_path, [])
    tasks = {d: HeadTrainingTask(*device_data(i), lambda b, s, w: Features(D)) for i, d in enumerate(ids)}
    personalize = {d: PersonalizeTask(*device_data(i), *personal_data(50 + i, 30, list(range(C))),
                                      lambda b, s, w: Features(D)) for i, d in enumerate(ids)}
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url),
                          {"fedavg.head": tasks[d], "oll.personalize": personalize[d]}).start() for d in PY_IDS]
    try:
        fedavg["thread"].join(120)
        result = fedavg["result"]
        assert result.get("state") == "done" and len(result["rounds"]) == 3, result
        assert all(sorted(r["accepted"]) == sorted(ids) for r in result["rounds"]), result["rounds"]
        pjob = PersonalizeJob(PersonalizeConfig(job_id="oll-mixed", num_classes=C, feature_dim=D, fp_epochs=4,
                                                batch_size=16, fp_lrs=[0.001, 0.01], fp_folds=3,
                                                clients_per_round=len(ids), expected_devices=len(ids),
                                                start_timeout_s=30, round_timeout_s=60),
                              head={k: job.params[k].astype(np.float32) for k in ("weight", "bias")})
        personal = serve(pjob, broker.url, tmp_path / "oll", ids)
        personal["thread"].join(120)
        assert personal["result"].get("state") == "done", personal["result"]
    finally:
        out, err = stop_mixed_fleet(agents, jvm)
    assert jvm.returncode == 0, err[-3000:]
    for d in JAVA_IDS:
        assert f"STATS {d} done=4 declined=0" in out, (out, err[-3000:])

    replay = FedAvgJob(FedAvgConfig(**cfg))
    for r in result["rounds"]:
        chosen = replay.next_participants(set(ids))
        assert chosen == sorted(r["accepted"])
        replay_round(replay, chosen, tasks)
    for k in ("weight", "bias"):
        assert np.abs(job.params[k] - replay.params[k]).max() <= HEAD_ATOL, k
    assert not np.allclose(job.params["weight"], FedAvgJob(FedAvgConfig(**cfg)).params["weight"])   # it trained

    assert sorted(pjob.contributed) == sorted(ids)
    params, head = pjob.task_for("java0")
    for d in JAVA_IDS:          # what a Python device on the Java device's data reports
        body, _ = personalize[d](params, head)
        assert pjob.contributed[d] == body, d


def test_mixed_java_and_python_fleet_runs_secure_fedavg(java_cp, broker, tmp_path):
    """Secure FedAvg(ψ): Java and Python devices in one SecAgg group per round (the SecAgg messages
    signed by each device's key, the tasks by the aggregator's); the aggregator sees only masked vectors and its head equals a plain in-process FedAvg
    replay over the devices in each sum. One Java device's features are huge, so its trained head
    breaks the round's max_abs_param: it declines and the rounds go on without it."""
    from ops_fleet import Features, RecordingService, replay_round, start_secure_fedavg_agents

    from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob
    from aggregator.jobs.secure_fedavg import SecureFedAvgConfig, SecureFedAvgJob
    from aggregator.jobs.robustness_fields import PLAIN_MEAN
    from edge_client.tasks.head_training import HeadTrainingTask
    from protocols.identity import DeviceIdentity, IdentityRegistry
    from protocols.payloads.secagg import SECURE_FEDAVG_KIND

    ids, outlier = JAVA_IDS + PY_IDS, "java2"
    seeds = {d: os.urandom(32) for d in JAVA_IDS}
    keys = {**{d: DeviceIdentity.from_private_bytes(d, s) for d, s in seeds.items()},
            **{d: DeviceIdentity.generate(d) for d in PY_IDS}}
    agg = DeviceIdentity.generate("aggregator")
    plain = dict(job_id="sft-mixed", num_classes=C, feature_dim=D, rounds=2, clients_per_round=len(ids),
                 round_timeout_s=60, local_epochs=2, batch_size=8, client_lr=0.05, expected_devices=len(ids),
                 start_timeout_s=30, seed=4)
    job = SecureFedAvgJob(SecureFedAvgConfig(**plain, max_samples=100, max_abs_param=20.0, phase_timeout_s=4),
                          identity=agg, registry=IdentityRegistry({d: k.public_key_bytes for d, k in keys.items()}))
    service = RecordingService(job, broker.url, tmp_path / "out", set(ids),
                               ServiceSettings(evaluate_every_contribution=False), identity=agg)
    scale = {outlier: 1000.0}
    jvm = start_java_devices(java_cp, broker.url, tmp_path, ["--aggregator-key", agg.public_key_bytes.hex()],
                             seeds=seeds, scale=scale)
    tasks = {d: HeadTrainingTask(device_data(i)[0] * scale.get(d, 1.0), device_data(i)[1],
                                 lambda b, s, w: Features(D)) for i, d in enumerate(ids)}
    agents = start_secure_fedavg_agents(broker.url, {d: keys[d] for d in PY_IDS}, agg.public_key_bytes,
                                        SECURE_FEDAVG_KIND, {d: tasks[d] for d in PY_IDS})
    result, out = two_rounds_done(service, job, agents, jvm)
    # the secure sum is FedAvg's plain mean of the accepted updates: the replay bounds nothing
    replay = FedAvgJob(FedAvgConfig(**plain, **PLAIN_MEAN))
    for r in result["rounds"]:
        chosen = replay.next_participants(set(ids))
        assert sorted(r["accepted"]) == sorted(set(ids) - {outlier}) == sorted(set(chosen) - {outlier}), r
        replay_round(replay, sorted(r["accepted"]), tasks)
    for k in ("weight", "bias"):
        assert np.abs(job.params[k] - replay.params[k]).max() <= HEAD_ATOL, k
    received = service.received_envelopes()
    assert {env.type for env in received} <= {"secagg", "decline", "presence"}   # no head in the clear
    masked = {env.sender for env in received if env.type == "secagg" and env.body["secagg"]["type"] == "secagg.masked_input"}
    assert masked == set(ids) - {outlier}
    declines = [env for env in received if env.type == "decline" and env.sender == outlier]
    assert len(declines) == 2 and all("> the round's bound 20" in env.body["reason"] for env in declines)
    assert f"STATS {outlier} done=0 declined=2" in out, out

FED3R_PARAMS = {"num_classes": C, "backbone": "b", "image_size": 8, "weights_sha256": "", "fit_intercept": True,
                "random_features": None, "format": "sparse", "dtype": "float64"}


@pytest.mark.parametrize("extra", [{"from_sample": 0}, {"from_sample": 25},
                                   {"feature_clip_norm": 1.5, "max_samples": 20, "cap_samples": True},
                                   {"from_sample": 10, "feature_clip_norm": 2.0, "max_samples": 9, "cap_samples": True}],
                         ids=["stream-start", "stream-increment", "dp-clip-cap", "dp-increment"])
def test_fed3r_stats_streaming_and_dp_equal_the_python_device(java_cp, tmp_path, extra):
    """A streaming task's increment (the samples after from_sample, echoed) and a DP task's
    clipped rows and capped sample count: the Java device's statistics are the Python device's
    (both accumulate in float64; relative difference ≤ 1e-12, summation order only)."""
    from ops_fleet import Features

    from edge_client.tasks.fed3r_stats import Fed3RStatsTask

    Z, y = device_data(1)
    params = {**FED3R_PARAMS, **extra}
    out, result = run_java_task(java_cp, tmp_path, params, {}, (Z, y), kind="fed3r.stats", state=tmp_path / "java")
    assert out.startswith("DONE"), out
    body, tensors = Fed3RStatsTask(Z, y, lambda b, s, w: Features(D), windows=kept_windows(tmp_path / "python"))(params, None)
    for k in ("n", "from_sample"):
        assert result.body.get(k) == body.get(k), k
    assert set(result.tensors) == set(tensors)
    for k, ref in tensors.items():
        got = result.tensors[k]
        assert got.dtype == ref.dtype and got.shape == ref.shape, k
        assert np.abs(got - ref).max() <= 1e-12 * max(1.0, np.abs(ref).max()), k
    if extra.get("cap_samples"):       # the clipping bit: unclipped statistics would differ
        _, unclipped = Fed3RStatsTask(Z, y, lambda b, s, w: Features(D), windows=kept_windows(tmp_path / "other"))(
            {**params, "feature_clip_norm": 0.0}, None)
        assert not np.allclose(unclipped["A_upper"], tensors["A_upper"])


@pytest.mark.parametrize("extra, reason", [({"from_sample": 37}, "no new samples"),
                                           ({"from_sample": 40}, "holds 40 samples of this device, it has 37"),
                                           ({"feature_clip_norm": -1.0}, "feature_clip_norm"),
                                           ({"cap_samples": True}, "max_samples")])
def test_bad_streaming_and_dp_fed3r_tasks_are_declined(java_cp, tmp_path, extra, reason):
    out, _ = run_java_task(java_cp, tmp_path, {**FED3R_PARAMS, **extra}, {}, device_data(1), kind="fed3r.stats")
    assert out.startswith("DECLINED") and reason in out, out


def personal_data(seed: int, n: int, labels: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Overlapping class clusters (OLL and FP(ψ) both change answers) over ``labels``."""
    rng = np.random.default_rng(seed)
    y = rng.choice(labels, n)
    return (rng.normal(size=(n, D)) * 1.5 + 2 * np.eye(C, D)[y]).astype(np.float32), y


PERSONALIZE = {"num_classes": C, "feature_dim": D, "backbone": "b", "image_size": 8, "weights_sha256": "",
               "fallback": "global", "fp_epochs": 6, "batch_size": 16, "fp_lrs": [0.0005, 0.02, 0.2], "fp_folds": 4,
               "weight_decay": 4e-5, "temperature": 0.1, "seed": 3}


def java_personalize(java_cp, tmp_path, params, head, train, held_out):
    from protocols.envelope import decode

    (tmp_path / "task.bin").write_bytes(task_bytes(params, head, "oll.personalize"))
    out = java(java_cp, tmp_path / "task.bin", write_features(tmp_path / "train.feat", *train), tmp_path / "result.bin",
               write_features(tmp_path / "test.feat", *held_out))
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines()}
    return out, lines, (decode((tmp_path / "result.bin").read_bytes()) if "DONE" in lines else None)


@pytest.mark.parametrize("fp_epochs", [0, 6])
def test_oll_and_fp_personalization_equal_the_python_device(java_cp, tmp_path, fp_epochs):
    """OLL's pruning and label map, the FP(ψ) rate's cross-validation (same folds, same per-fold
    training) and the fine-tuned head: the Java device reports the Python device's counts and
    rate exactly, and holds the Python device's personalised head within the derived head_tolerance
    (the same float32-vs-float64 argument as fedavg.head). The counts are exactly equal because no held-out
    or cross-validation sample lies within that tolerance of a decision boundary here (checked)."""
    from ops_fleet import Features

    from edge_client.oll import PersonalizedHead, choose_fp_lr
    from edge_client.tasks.head_training import LocalTraining
    from edge_client.tasks.personalization import PersonalizeTask
    from protocols.payloads.personalize import parse_report

    train, held_out = personal_data(1, 90, [0, 1, 3]), personal_data(2, 40, [0, 1, 2, 3])   # label 2: fallback
    rng = np.random.default_rng(4)
    head = {"weight": (rng.normal(size=(C, D)) * 0.3).astype(np.float32), "bias": (rng.normal(size=C) * 0.1).astype(np.float32)}
    params = {**PERSONALIZE, "fp_epochs": fp_epochs}
    out, lines, result = java_personalize(java_cp, tmp_path, params, head, train, held_out)
    assert result is not None, out
    report = parse_report(result, C, with_fp=bool(fp_epochs))
    python = PersonalizeTask(*train, *held_out, lambda b, s, w: Features(D))
    body, _ = python(params, head)
    assert {k: result.body[k] for k in body} == body and report.fallback > 0 and report.local_classes == 3
    weight = np.array(lines["OLL_WEIGHT"], dtype=np.float32).reshape(3, D)
    bias = np.array(lines["OLL_BIAS"], dtype=np.float32)
    steps = fp_epochs * -(-len(train[1]) // params["batch_size"])
    tol = head_tolerance({**params, "lr": report.fp_lr or 0.0}, head, train[0], steps, params["batch_size"],
                         {"weight": weight, "bias": bias}, {"weight": python.head.weight, "bias": python.head.bias})
    diff = max(np.abs(weight - python.head.weight).max(), np.abs(bias - python.head.bias).max())
    assert diff <= tol
    # no held-out sample near a boundary of the Python head: the counts' equality is not luck (heads
    # that differ by diff move a logit by at most diff·(‖f‖₁ + 1), a gap between two by twice that)
    logits = np.sort(held_out[0] @ python.head.weight.T + python.head.bias, axis=1)
    assert (logits[:, -1] - logits[:, -2]).min() > 2 * diff * (np.abs(held_out[0]).sum(axis=1).max() + 1)
    if fp_epochs:
        recipe = LocalTraining.from_params({**params, "epochs": fp_epochs})
        lr, scores = choose_fp_lr(head["weight"], head["bias"], train[0], train[1], recipe, params["fp_lrs"], 4)
        assert [float(s) for s in lines["CV"]] == [scores[float(x)] for x in params["fp_lrs"]]
        assert report.fp_lr == lr and len(set(scores.values())) > 1      # the rates differ: the choice is tested
        assert not np.allclose(python.head.weight, PersonalizedHead(head["weight"], head["bias"], train[1]).weight)


@pytest.mark.parametrize("change, reason", [({"fallback": "error"}, "OLL with fallback='error'"),
                                            ({"fallback": "maybe"}, "fallback must be one of"),
                                            ({"fp_lrs": []}, "at least one learning rate"),
                                            ({"fp_lrs": [0.1, -1]}, "finite and > 0"),
                                            ({"tail_stages": 1}, "no tail bundle")])
def test_bad_personalization_tasks_are_declined(java_cp, tmp_path, change, reason):
    head = {"weight": np.zeros((C, D), np.float32), "bias": np.zeros(C, np.float32)}
    out, _, _ = java_personalize(java_cp, tmp_path, {**PERSONALIZE, **change}, head,
                                 personal_data(1, 30, [0, 1]), personal_data(2, 20, [0, 1, 2]))
    assert out.startswith("DECLINED") and reason in out, out


def run_mixed_sync_fleet(java_cp, broker, tmp_path, job, agg, keys, seeds, py_ids, data, dim) -> None:
    """Serve the Fed3R-Sync ``job`` to JAVA_IDS (one JVM) and Python agents ``py_ids`` (device i
    on ``data(i)``, Java first) until it is done with every device contributing."""
    from ops_fleet import Features, RecordingService

    from edge_client.agent import DeviceAgent
    from edge_client.tasks.fed3r_stats import Fed3RStatsTask
    from edge_client.tasks.secure_fed3r import SecureFed3R
    from protocols.mqtt_link import BrokerConfig
    from protocols.payloads.secagg import SECAGG_TYPE, SYNC_KIND

    ids = JAVA_IDS + list(py_ids)
    service = RecordingService(job, broker.url, tmp_path / "out", set(ids), identity=agg)
    # every device with a state folder: the DP job caps their samples (edge_client/sample_windows.py)
    jvm = start_java_devices(java_cp, broker.url, tmp_path, ["--aggregator-key", agg.public_key_bytes.hex(),
                                                             "--state-dir", str(tmp_path / "java_state")],
                             seeds=seeds, data=data)
    agents = []
    for i, d in enumerate(py_ids, start=len(JAVA_IDS)):
        secure = SecureFed3R(keys[d], agg.public_key_bytes, Fed3RStatsTask(
            *data(i), lambda b, s, w: Features(dim), windows=kept_windows(tmp_path / "py_state" / d)))
        agents.append(DeviceAgent(d, BrokerConfig.from_url(broker.url), {}, aggregator_key=agg.public_key_bytes,
                                  protocol_handlers={SYNC_KIND: secure, SECAGG_TYPE: secure}).start())
    try:
        result = service.join(150)
    finally:
        out, err = stop_mixed_fleet(agents, jvm)
    assert result.get("state") == "done" and sorted(result["contributed"]) == sorted(ids), (result, err[-3000:])


def test_mixed_fleet_fed3r_sync_under_distributed_dp_releases_clipped_sums_plus_noise(java_cp, broker, tmp_path):
    """Fed3R-Sync under distributed DP with Java and Python devices in one SecAgg group: every
    device clips its features, caps its samples, scales its vector's blocks (``block_scales``) and
    adds its noise share; what the aggregator releases is the clipped sums plus ``ssp``'s per-block
    noise (survivors × the per-device variance on A's diagonal, divided by the square of each
    block's scale off it and on B; χ² bounds at 1e-6 per block, 465 off-diagonal and 124 B
    entries: without the Java devices' shares the ratio would be 0.4, many standard deviations
    off, and a device that did not scale would fail the round by its count slot), so the Java
    devices' clipping (features ~10× the clip norm), cap (20 of 37 samples), scaling and noise are
    the protocol's."""
    from ops_fleet import assert_noise_of_variance, clipped_sums

    from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob
    from protocols.identity import DeviceIdentity, IdentityRegistry

    ids, F, N, dim = JAVA_IDS + PY_IDS, 4.0, 20, 30

    def data(i):
        rng = np.random.default_rng(700 + i)
        y = rng.integers(0, C, 37)
        return (10 * (rng.normal(size=(37, dim)) + 2 * np.eye(C, dim)[y])).astype(np.float32), y

    seeds = {d: os.urandom(32) for d in JAVA_IDS}
    keys = {**{d: DeviceIdentity.from_private_bytes(d, s) for d, s in seeds.items()},
            **{d: DeviceIdentity.generate(d) for d in PY_IDS}}
    agg = DeviceIdentity.generate("aggregator")
    cfg = Fed3RSyncConfig(job_id="dp-sync", num_classes=C, feature_dim=dim, clients_per_round=len(ids),
                          expected_devices=len(ids), start_timeout_s=30, round_timeout_s=60, max_samples=N,
                          feature_clip_norm=F, dp_noise_multiplier=0.8, dp_target_epsilon=8.0, phase_timeout_s=4,
                          max_attempts=1)
    job = Fed3RSyncJob(cfg, identity=agg, registry=IdentityRegistry({d: k.public_key_bytes for d, k in keys.items()}))
    run_mixed_sync_fleet(java_cp, broker, tmp_path, job, agg, keys, seeds, PY_IDS, data, dim)
    A, B = clipped_sums(map(data, range(len(ids))), C, N, F)
    assert job.strategy.releases == 1
    # one stddev on every entry of the block-scaled vectors: ssp's per-block noise once scaled back
    total, scales = len(ids) * job._round_dp["stddev"] ** 2, cfg.block_scales()
    assert scales.a_off_diagonal == pytest.approx(2 ** 0.5) and scales.b > 1.5
    assert_noise_of_variance(job.strategy.released, A, B,
                             (total, total / scales.a_off_diagonal ** 2, total / scales.b ** 2))


def test_mixed_fleet_fed3r_sync_with_a_private_center_releases_the_center_then_centred_sums(java_cp, broker, tmp_path):
    """Fed3R-Sync under distributed DP with a private feature center (``dp_center_devices``), Java
    and Python devices in each group: the center round's members send (Σ z, n) of their clipped
    rows with their noise share (``center_round``), whose noisy group sum is the center; the
    rest centre their rows on it (the ``feature_center`` tensor), clip them to F_c, scale their
    blocks and add their share. Checked against numpy: the center round's sum is the members'
    clipped (Σ z, n) plus noise of the survivors' variance on every entry, the released sums are
    the others' centred, clipped statistics plus ``ssp``'s per-block noise (χ² bounds at 1e-6: a
    device that did not centre, or sent its whole statistics in the center round, fails them),
    and the model is the centred one shifted back to raw features."""
    from ops_fleet import assert_noise_of_variance
    from scipy import stats as scipy_stats

    from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob
    from protocols.identity import DeviceIdentity, IdentityRegistry

    py_ids = ["py0", "py1", "py2"]
    ids, F, Fc, N, dim = JAVA_IDS + py_ids, 400.0, 12.0, 20, 30

    def data(i):
        rng = np.random.default_rng(900 + i)
        y = rng.integers(0, C, 37)
        return (10 * (rng.normal(size=(37, dim)) + 2 * np.eye(C, dim)[y] + 5)).astype(np.float32), y   # a large mean

    seeds = {d: os.urandom(32) for d in JAVA_IDS}
    keys = {**{d: DeviceIdentity.from_private_bytes(d, s) for d, s in seeds.items()},
            **{d: DeviceIdentity.generate(d) for d in py_ids}}
    agg = DeviceIdentity.generate("aggregator")
    cfg = Fed3RSyncConfig(job_id="dp-sync-center", num_classes=C, feature_dim=dim, clients_per_round=3,
                          expected_devices=len(ids), start_timeout_s=30, round_timeout_s=60, max_samples=N,
                          feature_clip_norm=F, dp_center_devices=3, dp_center_clip_norm=Fc, dp_noise_multiplier=0.002,
                          phase_timeout_s=4, max_attempts=1, seed=5)   # noise far below the data: it is checked too
    job = Fed3RSyncJob(cfg, identity=agg, registry=IdentityRegistry({d: k.public_key_bytes for d, k in keys.items()}))
    sums, on_sum = [], job.on_secure_sum
    job.on_secure_sum = lambda total, survivors: (
        sums.append((job.strategy.centering, survivors, np.array(total), job._round_dp["stddev"])), on_sum(total, survivors))
    run_mixed_sync_fleet(java_cp, broker, tmp_path, job, agg, keys, seeds, py_ids, data, dim)
    assert [centering for centering, *_ in sums] == [True, False]
    (_, members, center_sum, center_stddev), (_, others, _, _) = sums
    assert sorted(members + others) == sorted(ids)
    assert {d[:2] for d in members} == {"ja", "py"} or {d[:2] for d in others} == {"ja", "py"}   # a mixed group
    rows = {d: data(ids.index(d)) for d in ids}

    def clipped(Z, clip):
        Z = Z[:N].astype(np.float64)
        return Z * np.minimum(1.0, clip / np.linalg.norm(Z, axis=1, keepdims=True))

    exact = np.concatenate([sum(clipped(rows[d][0], F).sum(axis=0) for d in members), [N * len(members)]])
    noise = center_sum - exact
    lo, hi = scipy_stats.chi2.ppf([1e-6, 1 - 1e-6], noise.size) / noise.size
    assert lo < np.mean(noise ** 2) / (len(members) * center_stddev ** 2) < hi
    mu = job.strategy.center.value
    np.testing.assert_allclose(mu, center_sum[:-1] / max(center_sum[-1], 1.0), rtol=1e-12)   # dp_center.py
    A = B = 0.0
    for d in others:
        Zc = np.hstack([clipped(rows[d][0].astype(np.float64) - mu, Fc), np.ones((N, 1))])
        A, B = A + Zc.T @ Zc, B + Zc.T @ np.eye(C)[rows[d][1][:N]]
    total, scales = len(others) * job._round_dp["stddev"] ** 2, cfg.block_scales()
    assert job.strategy.releases == 1           # the center round released μ̂ only
    assert_noise_of_variance(job.strategy.released, A, B,
                             (total, total / scales.a_off_diagonal ** 2, total / scales.b ** 2))
    model, Zt = job.model(), rows[ids[0]][0][:5].astype(np.float64)
    # the group's sum carries s/t of a release's variance (each member adds σ²/t): what the denoising reads
    assert job.strategy.noise_units == len(others) / job._round_dp["threshold"]
    centred = job.strategy.mechanism.solve(job.strategy.released, job.strategy.noise_units)
    np.testing.assert_allclose(Zt @ model.coef_.T + model.intercept_,
                               (Zt - mu) @ centred.coef_.T + centred.intercept_, rtol=1e-9, atol=1e-9)


def factor_data(n: int, dim: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """ReLU-like features with dead channels (zero in every row), a column parallel to another and
    a repeated image (two equal rows): what the canonical factor has to handle on real devices."""
    rng = np.random.default_rng(31)
    Z = np.maximum(rng.normal(size=(n, dim)), 0).astype(np.float32)
    Z[:, [3, 17]] = 0.0
    Z[:, 9] = 2 * Z[:, 4]
    Z[-1] = Z[0]
    return Z, rng.integers(0, C, n)


@pytest.mark.parametrize("n, dtype", [(12, "float64"), (12, "float32"), (60, "float64")],
                         ids=["factor", "factor-float32", "n>=p:packed"])
def test_fed3r_factor_form_equals_the_python_device(java_cp, tmp_path, n, dtype):
    """The exact factor form (a task with "factor": true): the Java device sends what the Python
    device sends, the canonical R and QtY within 1e-12 of the largest entry (float64 Householder
    steps in the same order; summation order only), the same zero_columns, class_ids and body, and
    the aggregator's parser accepts it (canonical form, A and b consistent with n); with n ≥ p both
    send the packed triangle."""
    from ops_fleet import Features

    from edge_client.tasks.fed3r_stats import Fed3RStatsTask
    from protocols.payloads.fed3r import parse_stats

    Z, y = factor_data(n)
    params = {**FED3R_PARAMS, "factor": True, "dtype": dtype}
    out, result = run_java_task(java_cp, tmp_path, params, {}, (Z, y), kind="fed3r.stats")
    assert out.startswith("DONE"), out
    body, tensors = Fed3RStatsTask(Z, y, lambda b, s, w: Features(Z.shape[1]))(params, None)
    assert {k: result.body[k] for k in body} == body and set(result.tensors) == set(tensors)
    assert (body.get("a_format") == "factor") == (n < Z.shape[1] + 1)
    for k, ref in tensors.items():
        got = result.tensors[k]
        assert got.dtype == ref.dtype and got.shape == ref.shape, k
        tol = 1e-12 if dtype == "float64" else 2 * np.finfo(np.float32).eps
        assert np.abs(got.astype(np.float64) - ref).max() <= tol * max(1.0, np.abs(ref).max()), k
    parse_stats(result, Z.shape[1] + 1, C)


@pytest.mark.parametrize("name", ["task_fedavg_head_sam", "task_fedavg_head_asam_prox"])
def test_java_sam_step_reproduces_the_golden_training_vector(java_cp, tmp_path, name):
    """The signed FedSAM / FedASAM+FedProx fedavg.head tasks of protocols/golden/training/ (written
    by edge_client/golden_training.py from the Python device's numpy step): the Java device verifies
    each task's signature and trains the golden head within head_tolerance; the files on disk are
    what the generator produces now."""
    import json

    from edge_client import golden_training
    from edge_client.tasks.head_training import LocalTraining, local_sgd
    from edge_client.tasks.numpy_head import NumpyHeadStepper
    from protocols.envelope import decode
    from protocols.identity import DeviceIdentity

    folder = golden_training.training_dir()
    want_index, files = golden_training.training_vectors()
    assert json.loads((folder / "index.json").read_text()) == json.loads(json.dumps(want_index))
    assert all((folder / f).read_bytes() == data for f, data in files.items())
    case = want_index[name]
    (tmp_path / "cases").write_text(f"{folder / case['task']} {folder / case['features']} {tmp_path / 'result.bin'}\n")
    device = DeviceIdentity.from_private_bytes("java0", bytes(32))
    out = java(java_cp, "--batch", tmp_path / "cases", case["public_key"], device.private_bytes().hex())
    lines = out.splitlines()
    assert lines[0] == "CASE 0" and lines[1] == "DONE", out
    assert int(lines[2].split()[1]) == case["steps"] and abs(float(lines[2].split()[3]) - case["loss"]) <= 1e-5
    result = decode((tmp_path / "result.bin").read_bytes())
    want = {k: np.array(case[k], np.float32) for k in ("weight", "bias")}
    start = golden_training.start_head()
    Z, y = golden_training.features()
    tol = head_tolerance(case["params"], start, Z, case["steps"], case["params"]["batch_size"], want, result.tensors)
    for k in ("weight", "bias"):
        assert np.abs(result.tensors[k] - want[k]).max() <= tol, (k, tol)
    plain = {**case["params"], "local_rule": "sgd", "prox_mu": 0.0}       # the rule moved the head far past tol
    stepper = NumpyHeadStepper(start["weight"], start["bias"], LocalTraining.from_params(plain))
    local_sgd(stepper, len(y), Z, y, LocalTraining.from_params(plain))
    assert np.abs(stepper.parameters()["weight"] - want["weight"]).max() > 10 * tol


def test_a_head_task_past_the_work_budget_is_declined_by_both_devices_before_training(java_cp, tmp_path):
    """A review's finding: the step budget counts SGD steps, not their cost: 50,000 classes, a batch
    of every row and 10,000 epochs is 10,000 steps and held a device's only task thread for 84
    minutes. Both devices decline a head task past MAX_LOCAL_WORK (epochs x rows x C(d + 1)
    multiply-adds) before any step, with the same count."""
    import time

    from edge_client.agent import TaskDeclined
    from edge_client.tasks.head_training import LocalTraining, train_head
    from protocols.payloads.fedavg import MAX_LOCAL_WORK

    classes, rows, epochs = 100_000, 2000, 10_000
    work = epochs * rows * classes * (D + 1)
    assert work > MAX_LOCAL_WORK and epochs * 1 <= 1_000_000          # within the step budget: one batch an epoch
    rng = np.random.default_rng(5)
    Z, y = rng.normal(size=(rows, D)), rng.integers(0, 10, rows)
    head = {"weight": np.zeros((classes, D), np.float32), "bias": np.zeros(classes, np.float32)}
    params = {**RECIPE, "num_classes": classes, "epochs": epochs, "batch_size": rows}
    t0 = time.monotonic()
    out, _ = run_java_task(java_cp, tmp_path, params, head, (Z, y))
    count = f"is {work:.2e} multiply-adds, more than a device takes (1e+13)"
    assert out.startswith("DECLINED") and count in out, out
    with pytest.raises(TaskDeclined) as declined:
        train_head(head["weight"], head["bias"], Z, y, LocalTraining.from_params(params))
    assert count in str(declined.value)
    assert time.monotonic() - t0 < 60                      # declined before training, on both devices
