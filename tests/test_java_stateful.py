"""The Java device's stateful head tasks (``scaffold.head``, ``ditto.head``, ``pp.head`` FedSim
and FedAlt: clients/java ScaffoldTask, DittoTask, PartialTask over its DeviceStateStore) against
the Python device:

* golden vectors (``protocols/golden/training/stateful.json``, written by
  edge_client/golden_training.py from the Python device's handlers and state store): two signed
  rounds of one job per case, the Java device verifying each task's signature; its uploads, its
  bodies (the held-out counts, ``restarted``) and the state it keeps (read back with the Python
  device's store: the same files) equal the vectors', the float values within the derived float32
  tolerance (tests/test_differential_fuzz.py head_tolerance, over both rounds' steps: round 2
  starts from round 1's state); a redelivered round 2 starts from the same value and uploads the
  same bytes;
* a malformed task is declined with its reason, and a device without a state store declines.

* a mixed fleet over mosquitto (tests/java_tasks.py's harness): Java and Python devices in
  one Scaffold(ψ), Ditto or FedAlt(ψ) job, the global head (and Scaffold's server control) equal
  to an in-process replay's; when the job ends (``job.ended``) every device, Java or Python, drops
  its state for the job (the state a Java device keeps after two rounds is the golden vectors').

* the secure kinds ``scaffold.head.secure`` and ``ditto.head.secure`` (SecureStatefulHeadTask):
  the vector the Java device masks and the state it keeps equal the Python device's, with the same
  declines; and a mixed Java/Python fleet runs scaffold-secure and ditto-secure over mosquitto, the
  head (and c) equal to the plain job's replay.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

import java_build
from test_differential_fuzz import head_tolerance
from java_tasks import C, D, device_data, java, personal_data, run_java_task, task_bytes

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))

# the fleet replay's bounds (tests/java_tasks.py HEAD_ATOL: a few steps at lr 0.05); a control
# carries (w − y) / (K lr), twice the head's difference at K = 10 steps of lr 0.05
HEAD_ATOL = 1e-5
CONTROL_ATOL = 2 * HEAD_ATOL


@pytest.fixture(scope="module")
def java_cp() -> str:
    return java_build.built()


def test_the_checked_in_stateful_vectors_are_what_the_python_device_computes_now(tmp_path):
    from edge_client import golden_training as g

    want, files = g.stateful_vectors(tmp_path)
    folder = g.training_dir()
    assert json.loads((folder / g.STATEFUL_INDEX).read_text()) == json.loads(json.dumps(want))
    assert all((folder / f).read_bytes() == data for f, data in files.items()), "stale: python -m edge_client.golden_training"


def steps_per_round(case: dict) -> int:
    """Every SGD step a round takes (both passes of Ditto and FedAlt), for the tolerance."""
    p, per_epoch = case["rounds"][0]["params"], -(-37 // case["rounds"][0]["params"]["batch_size"])
    personal = p.get("personal_epochs", 0) if case["kind"] != "pp.head" or p["algorithm"] == "fedalt" else 0
    return per_epoch * (p["epochs"] + personal)


def test_java_stateful_head_tasks_reproduce_the_golden_vectors(java_cp, tmp_path):
    from edge_client import golden_training as g
    from edge_client.state import DeviceStateStore
    from protocols.envelope import decode
    from protocols.identity import DeviceIdentity

    folder = g.training_dir()
    index = json.loads((folder / g.STATEFUL_INDEX).read_text())
    lines, where = [], []
    for name, case in sorted(index.items()):
        heldout = folder / case["heldout"] if case["kind"] != "scaffold.head" else "-"
        for r, rnd in enumerate(case["rounds"] + [case["rounds"][-1]]):          # round 2 twice: a redelivery
            lines.append(f"{folder / rnd['task']} {folder / case['features']} {tmp_path / f'{name}_{r}.bin'} "
                         f"{heldout} {tmp_path / 'state' / name}")
            where.append((name, r))
    (tmp_path / "cases").write_text("\n".join(lines) + "\n")
    key = next(iter(index.values()))["public_key"]
    out = java(java_cp, "--batch", tmp_path / "cases", key, DeviceIdentity.from_private_bytes("java0", bytes(32))
               .private_bytes().hex())
    blocks = out.split("CASE ")[1:]
    assert len(blocks) == len(lines) and all(b.split("\n")[1] == "DONE" for b in blocks), out
    Z, _ = g.features()
    for name, case in sorted(index.items()):
        params = case["rounds"][0]["params"]
        every = [{k: np.float32(v) for k, v in {**rnd["tensors"], **rnd["state"]}.items()} for rnd in case["rounds"]]
        tol = head_tolerance(params, g.start_head(), Z, 2 * steps_per_round(case), params["batch_size"], *every)
        if case["kind"] == "scaffold.head":          # Δc and c_k⁺ carry (w − y) / (K lr)
            tol *= 1 + 1 / (steps_per_round(case) * params["lr"])
        for r, rnd in enumerate(case["rounds"]):
            result = decode((tmp_path / f"{name}_{r}.bin").read_bytes())
            assert {k: result.body[k] for k in rnd["body"]} == rnd["body"], (name, r)
            assert sorted(result.tensors) == sorted(rnd["tensors"]), (name, r)
            for k, want in rnd["tensors"].items():
                err = np.abs(result.tensors[k] - np.float32(want)).max()
                assert err <= tol, (name, r, k, err, tol)
        kept = DeviceStateStore(tmp_path / "state" / name).load(params["job_id"], g.RUN)
        want_state = case["rounds"][-1]["state"]
        last_round = case["rounds"][-1]["params"]["state"]["round"]       # 2, or past max_staleness (a restart)
        assert kept is not None and kept.round == last_round and sorted(kept.arrays) == sorted(want_state), name
        for k, want in want_state.items():
            assert np.abs(kept.arrays[k] - np.float32(want)).max() <= tol, (name, k, tol)
        moved = max(np.abs(np.float32(case["rounds"][1]["state"][k]) - np.float32(case["rounds"][0]["state"][k])).max()
                    for k in want_state if not k.startswith(("previous.", "replaced.")))
        assert moved > 10 * tol, (name, moved, tol)                # the check can tell a round from the next
        again = decode((tmp_path / f"{name}_2.bin").read_bytes())
        redelivered = decode((tmp_path / f"{name}_1.bin").read_bytes())
        assert all(np.array_equal(again.tensors[k], redelivered.tensors[k]) for k in again.tensors), name


STATE = {"run": "0123abcd", "round": 1}
ROOMY = 1 << 20             # a state budget every task here fits in


@pytest.mark.parametrize("kind, change, tensors, reason, budget", [
    ("scaffold.head", {}, {}, "state budget is 100 bytes", 100),        # c_k and its previous value: 224 bytes
    ("ditto.head", {}, {}, "state budget is 0 bytes", 0),
    ("scaffold.head", {}, {}, "control.weight and control.bias", ROOMY),
    ("scaffold.head", {"state": {**STATE, "extra": 1}}, {}, "unknown state fields", ROOMY),
    ("scaffold.head", {"state": None}, {}, "needs a 'state' object", ROOMY),
    ("ditto.head", {"ditto_lambda": 0.0}, {}, "ditto_lambda must be a finite number", ROOMY),
    ("ditto.head", {"personal_lr": None}, {}, "personal_lr", ROOMY),
    ("pp.head", {"algorithm": "ditto"}, {}, "algorithm must be one of", ROOMY),
    ("pp.head", {"job_id": ""}, {}, "needs a job_id", ROOMY),
    ("pp.head", {}, {"weight": np.zeros((C, D), np.float64)}, "must carry float32 weight", ROOMY),
    ("ditto.head", {"lr": 1e30}, {}, "diverged", ROOMY),
])
def test_malformed_stateful_tasks_are_declined_with_a_reason(java_cp, tmp_path, kind, change, tensors, reason, budget):
    from test_java_device import write_features

    params = {"num_classes": C, "feature_dim": D, "backbone": "b", "image_size": 8, "job_id": "j-1", "state": STATE,
              "ditto_lambda": 0.1, "personal_epochs": 1, "personal_lr": 0.01, **change}
    head = {"weight": np.zeros((C, D), np.float32), "bias": np.zeros(C, np.float32), **tensors}
    feats = write_features(tmp_path / "f.feat", *device_data(0))
    control = {f"control.{k}": np.zeros_like(v) for k, v in head.items()} if budget < ROOMY else {}   # else well-formed
    (tmp_path / "task.bin").write_bytes(task_bytes(params, {**head, **control}, kind))
    out = java(java_cp, tmp_path / "task.bin", feats, tmp_path / "result.bin", "-", tmp_path / "state", budget)
    assert out.startswith("DECLINED") and reason in out, out
    assert list((tmp_path / "state").iterdir()) == []              # a declined task keeps nothing


def test_a_java_device_without_a_state_store_declines_stateful_tasks(java_cp, tmp_path):
    out, _ = run_java_task(java_cp, tmp_path, {"num_classes": C, "feature_dim": D, "backbone": "b", "image_size": 8,
                                               "job_id": "j-1", "state": STATE},
                           {"weight": np.zeros((C, D), np.float32), "bias": np.zeros(C, np.float32)}, device_data(0),
                           kind="scaffold.head")
    assert out.startswith("DECLINED") and "no state store" in out, out


def stateful_kind(kind: str):
    """(job type, its config type, config fields, the Python handler type) of a stateful head kind."""
    from aggregator.jobs.ditto import DittoConfig, DittoJob
    from aggregator.jobs.partial import PartialConfig, PartialPersonalizationJob
    from aggregator.jobs.scaffold import ScaffoldConfig, ScaffoldJob
    from edge_client.tasks.ditto_training import DittoTrainingTask
    from edge_client.tasks.partial_training import PartialTrainingTask
    from edge_client.tasks.scaffold_training import ScaffoldTrainingTask

    return {"scaffold.head": (ScaffoldJob, ScaffoldConfig, {}, ScaffoldTrainingTask),
            "ditto.head": (DittoJob, DittoConfig, {"ditto_lambda": 0.5, "personal_epochs": 2, "personal_lr": 0.03},
                           DittoTrainingTask),
            "pp.head": (PartialPersonalizationJob, PartialConfig, {"pp_algorithm": "fedalt", "personal_epochs": 2},
                        PartialTrainingTask)}[kind]


def assert_equals_plain_replay(job, replay, fresh, rounds: list[dict], ids: list[str], handler, kind: str) -> None:
    """The mixed fleet's job equals ``replay`` (the plain job) stepped through the same rounds'
    accepted devices by Python handlers (``handler(i, d, "replay")``), head and Scaffold's control
    within the float32 tolerances; and it trained (moved from ``fresh``'s head), so the check can fail."""
    from ops_fleet import replay_round

    tasks = {d: handler(i, d, "replay") for i, d in enumerate(ids)}
    for r in rounds:
        chosen = replay.next_participants(set(ids))
        assert chosen == sorted(r["accepted"])
        replay_round(replay, chosen, tasks, kind=kind)
    for k in ("weight", "bias"):
        assert np.abs(job.params[k] - replay.params[k]).max() <= HEAD_ATOL, k
        if kind == "scaffold.head":
            assert np.abs(job.control[k] - replay.control[k]).max() <= CONTROL_ATOL, k
    assert np.abs(job.params["weight"] - fresh.params["weight"]).max() > 100 * HEAD_ATOL


@pytest.mark.parametrize("kind", ["scaffold.head", "ditto.head", "pp.head"])
def test_mixed_java_and_python_fleet_runs_a_stateful_job_with_state_kept_on_each_device(java_cp, broker, tmp_path,
                                                                                        kind):
    """Three Java devices (one JVM, each with its state store and a held-out split) and two Python
    devices in one Scaffold(ψ) / Ditto / FedAlt(ψ) job over mosquitto, all five in each of 2 rounds:
    every device contributes every round (the second from the state it kept), and the final global
    head (and Scaffold's server control) equal an in-process replay in which Python devices (each
    with its own store) hold the Java devices' data. Once the job is done, the aggregator's
    ``job.ended`` makes every device drop its state for the job (opened with the Python store),
    while the replay's devices, told nothing, still hold round 2's."""
    from ops_fleet import Features
    from java_tasks import JAVA_IDS, PY_IDS, personal_data, serve, start_java_devices, stop_mixed_fleet

    from edge_client.agent import DeviceAgent
    from edge_client.state import DeviceStateStore
    from protocols.mqtt_link import BrokerConfig

    job_type, config_type, fields, handler_type = stateful_kind(kind)
    ids = JAVA_IDS + PY_IDS
    cfg = dict(job_id=kind.replace(".", "-") + "-mixed", num_classes=C, feature_dim=D, rounds=2,
               clients_per_round=len(ids), round_timeout_s=60, local_epochs=2, batch_size=8, client_lr=0.05,
               expected_devices=len(ids), start_timeout_s=30, seed=5, **fields)
    job = job_type(config_type(**cfg))
    served = serve(job, broker.url, tmp_path / "agg", ids)
    jvm = start_java_devices(java_cp, broker.url, tmp_path, ["--state-dir", str(tmp_path / "java-state")])

    def handler(i: int, d: str, where: str):
        store = DeviceStateStore(tmp_path / where / d)
        held = () if kind == "scaffold.head" else personal_data(50 + i, 30, list(range(C)))   # the JVM's held-out split
        return handler_type(*device_data(i), lambda b, s, w: Features(D), store, *held)

    py_handlers = {d: handler(len(JAVA_IDS) + i, d, "py") for i, d in enumerate(PY_IDS)}
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url), {kind: py_handlers[d]}, state=py_handlers[d].store).start()
              for d in PY_IDS]
    stores = [DeviceStateStore(tmp_path / "java-state" / d) for d in JAVA_IDS] + [h.store for h in py_handlers.values()]
    try:
        served["thread"].join(120)
        result = served["result"]
        assert result.get("state") == "done" and len(result["rounds"]) == 2, result
        assert all(sorted(r["accepted"]) == sorted(ids) for r in result["rounds"]), result["rounds"]
        deadline = time.monotonic() + 10           # job.ended: every device, Java or Python, drops the job's state
        while any(s.jobs() for s in stores) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(s.jobs() for s in stores), [s.jobs() for s in stores]
    finally:
        out, err = stop_mixed_fleet(agents, jvm)
    assert jvm.returncode == 0, err[-3000:]
    for d in JAVA_IDS:
        assert f"STATS {d} done=2 declined=0" in out, (out, err[-3000:])

    assert_equals_plain_replay(job, job_type(config_type(**cfg)), job_type(config_type(**cfg)), result["rounds"],
                               ids, handler, kind)
    for d in JAVA_IDS:          # the replay's devices (no job.ended) still hold round 2's state; the Java devices none
        assert DeviceStateStore(tmp_path / "replay" / d).load(cfg["job_id"], None).round == 2, d
        assert DeviceStateStore(tmp_path / "java-state" / d).load(cfg["job_id"], None) is None, d


def secure_stateful_case(tmp_path, kind: str, change: dict, clock=None):
    """A scaffold.head.secure / ditto.head.secure task of device 0 (task.bin, f.feat and h.feat in
    tmp_path) and the Python device's secure handler over the store py-state (its ``clock``):
    (plain kind, params, tensors, Z, y, held-out features file or "-", the Python wrapper)."""
    import time as clocks

    from ops_fleet import Features
    from test_java_device import write_features

    from edge_client.state import DeviceStateStore
    from edge_client.tasks.secure_fedavg_training import SecureFedAvgTraining, SecureScaffoldTraining
    from protocols.identity import DeviceIdentity

    plain = "scaffold.head" if kind.startswith("scaffold") else "ditto.head"
    _, _, fields, handler_type = stateful_kind(plain)
    Z, y = device_data(0)
    held = () if plain == "scaffold.head" else personal_data(50, 30, list(range(C)))
    rng = np.random.default_rng(4)
    head = {"weight": (0.1 * rng.normal(size=(C, D))).astype(np.float32), "bias": np.zeros(C, np.float32)}
    control = {f"control.{k}": (0.05 * rng.normal(size=v.shape)).astype(np.float32) for k, v in head.items()}
    params = {"num_classes": C, "feature_dim": D, "backbone": "b", "image_size": 8, "epochs": 2, "batch_size": 8,
              "lr": 0.05, "seed": 3, "job_id": "sec-1", "state": STATE, "group": "g1", "max_samples": 100,
              "max_abs_param": 20.0, **({"control_clip_norm": 5.0} if plain == "scaffold.head" else fields), **change}
    tensors = {**head, **(control if plain == "scaffold.head" else {})}
    (tmp_path / "task.bin").write_bytes(task_bytes(params, tensors, kind))
    heldout = write_features(tmp_path / "h.feat", *held) if held else "-"
    write_features(tmp_path / "f.feat", Z, y)
    store = DeviceStateStore(tmp_path / "py-state", clock=clock or clocks.time)
    handler = handler_type(Z, y, lambda b, s, w: Features(D), store, *held)
    wrapper = (SecureScaffoldTraining if plain == "scaffold.head" else SecureFedAvgTraining)(
        DeviceIdentity.generate("d"), bytes(32), handler)
    return plain, params, tensors, Z, y, heldout, wrapper


@pytest.mark.parametrize("kind, change, reason", [
    ("scaffold.head.secure", {}, None), ("scaffold.head.secure", {"vector_order": ["bias", "weight"]}, None),
    ("scaffold.head.secure", {"control_clip_norm": 1e-3}, None),
    ("scaffold.head.secure", {"max_abs_param": 0.01}, "> the round's bound 0.01"),
    ("scaffold.head.secure", {"control_clip_norm": 0}, "control_clip_norm"),
    ("scaffold.head.secure", {"dp": {"stddev": 0.1, "scale_bits": 16, "clip_norm": 1.0}}, "dp"),
    ("ditto.head.secure", {}, None), ("ditto.head.secure", {"update_clip_norm": 0.5}, None),
    ("ditto.head.secure", {"max_samples": 10}, "exceed the round's bound of 10"),
    ("ditto.head.secure", {"vector_order": ["weight"]}, "does not name exactly"),
])
def test_secure_stateful_vectors_are_the_python_devices(java_cp, tmp_path, kind, change, reason):
    """scaffold.head.secure / ditto.head.secure: the vector the Java device masks is the Python
    device's (SecureScaffoldTraining: [n·y | clip(Δc) | n]; SecureFedAvgTraining around ditto.head:
    [n·ψ_k | n]) within n·HEAD_ATOL on the head and CONTROL_ATOL (scaled by the clip) on Δc, and the
    state it keeps (c_k, v_k) is the Python device's; tasks beyond the bounds are declined by both."""
    from edge_client.agent import TaskDeclined
    from edge_client.state import DeviceStateStore

    plain, params, tensors, Z, y, heldout, wrapper = secure_stateful_case(tmp_path, kind, change)
    out = java(java_cp, tmp_path / "task.bin", tmp_path / "f.feat", tmp_path / "x.bin", heldout, tmp_path / "java-state")
    if reason is not None:
        assert out.startswith("DECLINED") and reason in out, out
        with pytest.raises(TaskDeclined, match=reason):
            wrapper.vector(params, tensors)
        # neither keeps the round's state: a decline after training (|θ|) puts the store back
        assert DeviceStateStore(tmp_path / "java-state").load("sec-1", None) is None
        assert DeviceStateStore(tmp_path / "py-state").load("sec-1", None) is None
        return
    got, want = np.array(out.split()[1:], dtype=np.float64), wrapper.vector(params, tensors)
    assert got.shape == want.shape and got[-1] == want[-1] == len(y)
    head_size = C * D + C
    assert np.abs(got[:head_size] - want[:head_size]).max() <= len(y) * HEAD_ATOL
    if plain == "scaffold.head":
        clip = params["control_clip_norm"]
        assert np.abs(got[head_size:-1] - want[head_size:-1]).max() <= CONTROL_ATOL * min(1.0, clip)
        assert np.abs(want[head_size:-1]).max() > 100 * CONTROL_ATOL * min(1.0, clip)      # Δc is in the vector
    java_state = DeviceStateStore(tmp_path / "java-state").load("sec-1", None)
    py_state = DeviceStateStore(tmp_path / "py-state").load("sec-1", None)
    assert sorted(java_state.arrays) == sorted(py_state.arrays)
    for k, v in py_state.arrays.items():
        assert np.abs(java_state.arrays[k] - v).max() <= CONTROL_ATOL, k


class FailingNoise:
    """A noise source whose every draw fails (an AssertionError: a bug in it, say)."""

    def poisson(self, *args, **kwargs):
        raise AssertionError("the noise source failed")


def test_a_secure_stateful_task_failing_after_its_handler_kept_state_puts_it_back(java_cp, tmp_path):
    """A ditto.head.secure task under distributed DP whose noise draw throws an Error after the
    plain handler kept the round's v_k: nothing is sent (the agent declines the task and goes on:
    MqttAgent.endsTheLoop), so the job's entry goes back to before the round (none: a first round
    keeps nothing), as the Python device's (state_restored_on_decline). The Java device put it back
    only for a TaskDeclined: it kept the v_k of a round it never sent."""
    from edge_client.state import DeviceStateStore

    dp = {"stddev": 0.01, "scale_bits": 16, "threshold": 3, "clip_norm": 1.0}
    plain, params, tensors, Z, y, heldout, wrapper = secure_stateful_case(tmp_path, "ditto.head.secure", {"dp": dp})
    wrapper.noise_rng = FailingNoise()
    with pytest.raises(AssertionError, match="the noise source failed"):
        wrapper.vector(params, tensors)
    assert DeviceStateStore(tmp_path / "py-state").load("sec-1", None) is None
    out = java(java_cp, "--noise-fails", tmp_path / "task.bin", tmp_path / "f.feat", heldout, tmp_path / "java-state")
    assert out.startswith("FAILED java.lang.AssertionError: the noise source failed"), out
    assert DeviceStateStore(tmp_path / "java-state").load("sec-1", None) is None


@pytest.mark.parametrize("kind", ["scaffold.head.secure", "ditto.head.secure"])
def test_a_secure_stateful_task_sent_again_for_its_live_round_trains_once(java_cp, tmp_path, kind):
    """The aggregator re-sends a scaffold.head.secure / ditto.head.secure task while its SecAgg
    round is live, an hour later by the device's clock: the Java device (SecureRounds) finds the
    duplicate before it trains, as the Python device (SecureUpdate.on_task) does, so each trained
    once and keeps the state of that one run (c_k / v_k, and its expiry from the first delivery's
    clock), the Python device's. It used to train the duplicate too (on its one agent thread, the
    live round's messages waiting) and rewrite the state, moving its expiry an hour on."""
    from edge_client.state import DeviceStateStore

    now = [1.7e9]
    plain, params, tensors, _, _, heldout, wrapper = secure_stateful_case(tmp_path, kind, {}, clock=lambda: now[0])
    out = java(java_cp, "--retask", tmp_path / "task.bin", tmp_path / "f.feat", heldout, tmp_path / "java-state")
    assert out.split("\n")[:2] == ["START true TRAINED 1", "START false TRAINED 1"], out

    contributions = []
    computed = wrapper.contribution
    wrapper.contribution = lambda p, t: contributions.append(1) or computed(p, t)
    for _ in range(2):                              # the Python device, its clock as the Java device's
        assert wrapper.on_task("sec-1", 1, params, tensors) == []
        now[0] += 3600
    assert len(contributions) == 1 and wrapper.sessions.live(("sec-1", 1, "g1"))
    java_state = DeviceStateStore(tmp_path / "java-state", clock=lambda: now[0]).load("sec-1", None)
    py_state = DeviceStateStore(tmp_path / "py-state", clock=lambda: now[0]).load("sec-1", None)
    assert java_state.round == py_state.round == 1 and sorted(java_state.arrays) == sorted(py_state.arrays)
    assert java_state.expires_at == pytest.approx(py_state.expires_at, abs=1e-3)
    for k, v in py_state.arrays.items():
        assert np.abs(java_state.arrays[k] - v).max() <= CONTROL_ATOL, k


def test_a_secure_scaffold_task_with_the_ledger_unreadable_is_declined_before_it_trains(java_cp, tmp_path):
    """The Java device's secure-input ledger file is unreadable: a scaffold.head.secure task of a
    later round is declined (LOST_REASON) before ScaffoldTask trains, as the Python device declines
    it (tests/test_secure_stateful.py), and its store keeps the sent round's c_k byte for byte (a
    copy of the Python device's files after that round). SecureRounds used to train first, the
    store saving the next round's c_k, and decline only then."""
    import shutil

    from edge_client.secure_inputs import LOST_REASON, SECURE_INPUTS_FILE

    _, params, tensors, _, _, heldout, wrapper = secure_stateful_case(tmp_path, "scaffold.head.secure", {},
                                                                     clock=lambda: 1.7e9)
    assert wrapper.on_task("sec-1", 1, params, tensors) == []          # a sent round: its c_k is kept
    shutil.copytree(tmp_path / "py-state", tmp_path / "java-state")
    kept = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "java-state").rglob("*") if p.is_file()}
    assert kept
    ledger = tmp_path / SECURE_INPUTS_FILE
    ledger.write_text('{"inputs": [["a", "b"]]}')                      # an entry that is not [key, digest]
    later = {**params, "state": {**STATE, "round": 2}}
    (tmp_path / "task.bin").write_bytes(task_bytes(later, tensors, "scaffold.head.secure"))
    out = java(java_cp, "--retask", tmp_path / "task.bin", tmp_path / "f.feat", heldout, tmp_path / "java-state", ledger)
    assert {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / "java-state").rglob("*") if p.is_file()} == kept
    assert out.split("\n")[:2] == [f"DECLINED TRAINED 0 {LOST_REASON}"] * 2, out


@pytest.mark.parametrize("kind", ["scaffold.head.secure", "ditto.head.secure"])
def test_a_secure_stateful_round_over_before_it_finished_leaves_scaffolds_control_where_it_was(java_cp, tmp_path, kind):
    """A sent round 1 (a copy of the Python device's store), then round 2's task, whose SecAgg round
    ends at its deadline before it finished (its input never in the sum): the Java device's
    Scaffold store holds round 1's entry again, byte for byte, as the Python device's does
    (SecureScaffoldTraining.round_end; tests/test_secure_scaffold_round_end.py), so the server's c,
    which never counted round 2's Δc, stays the mean of the c_k. Ditto's v_k is the device's own:
    round 2's stays. It used to keep round 2's c_k⁺."""
    import shutil
    import time

    from edge_client.state import DeviceStateStore
    from edge_client.work_deadline import working_until

    now = time.time()               # the training checks its deadline on the wall clock
    _, params, tensors, _, _, heldout, wrapper = secure_stateful_case(tmp_path, kind, {}, clock=lambda: now)
    assert wrapper.on_task("sec-1", 1, params, tensors) == []          # round 1, summed: its state stays
    wrapper.sessions.rounds.clear()                                     # (its session over)
    shutil.copytree(tmp_path / "py-state", tmp_path / "java-state")
    first = DeviceStateStore(tmp_path / "py-state", clock=lambda: now).load("sec-1", None)
    later = {**params, "state": {**STATE, "round": 2}}
    (tmp_path / "task.bin").write_bytes(task_bytes(later, tensors, kind))
    out = java(java_cp, "--leave", tmp_path / "task.bin", tmp_path / "f.feat", heldout, tmp_path / "java-state")
    assert out.split("\n")[:2] == ["START true", "LEFT 0"], out
    with working_until(now + 3600):                                     # the Python device, the same round
        assert wrapper.on_task("sec-1", 2, later, tensors) == []
    wrapper.sessions.expire(now + 3601)
    ours, theirs = (DeviceStateStore(tmp_path / where, clock=lambda: now).load("sec-1", None)
                    for where in ("java-state", "py-state"))
    assert (ours.run, ours.round, sorted(ours.arrays)) == (theirs.run, theirs.round, sorted(theirs.arrays))
    if kind == "scaffold.head.secure":
        assert theirs.round == 1
        for name, value in first.arrays.items():
            assert ours.arrays[name].tobytes() == value.tobytes() == theirs.arrays[name].tobytes(), name
    else:
        assert theirs.round == 2
        for k, v in theirs.arrays.items():
            assert np.abs(ours.arrays[k] - v).max() <= CONTROL_ATOL, k


@pytest.mark.parametrize("kind", ["scaffold.head", "ditto.head"])
def test_mixed_java_and_python_fleet_runs_secure_scaffold_and_ditto(java_cp, broker, tmp_path, kind):
    """scaffold-secure / ditto-secure over mosquitto: three Java devices (one JVM, enrolled, with
    state stores) and two Python devices (``secure_handlers``) in one SecAgg group per round, all
    five in each of 2 rounds; the aggregator receives only secagg messages, and its head (and
    Scaffold's server control) equal the plain job's in-process replay over the same devices
    (Python devices holding the Java devices' data, each with its own store)."""
    import os

    from ops_fleet import Features, RecordingService
    from java_tasks import JAVA_IDS, PY_IDS, start_java_devices, two_rounds_done

    from aggregator.jobs.registry import build_job
    from aggregator.jobs.robustness_fields import PLAIN_MEAN
    from aggregator.service.settings import ServiceSettings
    from edge_client.agent import DeviceAgent
    from edge_client.handlers import secure_handlers
    from edge_client.state import DeviceStateStore
    from protocols.identity import DeviceIdentity
    from protocols.mqtt_link import BrokerConfig

    job_type, config_type, fields, handler_type = stateful_kind(kind)
    ids = JAVA_IDS + PY_IDS
    seeds = {d: os.urandom(32) for d in JAVA_IDS}
    keys = {**{d: DeviceIdentity.from_private_bytes(d, s) for d, s in seeds.items()},
            **{d: DeviceIdentity.generate(d) for d in PY_IDS}}
    agg = DeviceIdentity.generate("aggregator")
    (tmp_path / "aggregator.pem").write_bytes(agg.to_pem())
    (tmp_path / "device_keys.json").write_text(json.dumps({d: k.public_key_bytes.hex() for d, k in keys.items()}))
    cfg = dict(job_id=kind.replace(".", "-") + "-secure-mixed", num_classes=C, feature_dim=D, rounds=2,
               clients_per_round=len(ids), round_timeout_s=60, local_epochs=2, batch_size=8, client_lr=0.05,
               expected_devices=len(ids), start_timeout_s=30, seed=5, **fields)
    job = build_job(kind.split(".")[0] + "-secure", {**cfg, "max_samples": 100, "max_abs_param": 20.0,
                                                       "phase_timeout_s": 4, "identity_file": str(tmp_path / "aggregator.pem"),
                                                       "device_keys_file": str(tmp_path / "device_keys.json")})
    service = RecordingService(job, broker.url, tmp_path / "agg", set(ids),
                               ServiceSettings(evaluate_every_contribution=False), identity=agg)
    jvm = start_java_devices(java_cp, broker.url, tmp_path, ["--aggregator-key", agg.public_key_bytes.hex(),
                                                             "--state-dir", str(tmp_path / "java-state")], seeds=seeds)

    def handler(i: int, d: str, where: str):
        held = () if kind == "scaffold.head" else personal_data(50 + i, 30, list(range(C)))   # the JVM's held-out split
        return handler_type(*device_data(i), lambda b, s, w: Features(D), DeviceStateStore(tmp_path / where / d), *held)

    agents = []
    for i, d in enumerate(PY_IDS):
        h = handler(len(JAVA_IDS) + i, d, "py")
        agents.append(DeviceAgent(d, BrokerConfig.from_url(broker.url), {}, state=h.store,
                                  protocol_handlers=secure_handlers(keys[d], agg.public_key_bytes, {kind: h})).start())
    result, out = two_rounds_done(service, job, agents, jvm)
    assert all(sorted(r["accepted"]) == sorted(ids) for r in result["rounds"]), result["rounds"]
    assert_equals_plain_replay(job, job_type(config_type(**cfg, **PLAIN_MEAN)), job_type(config_type(**cfg)),
                               result["rounds"], ids, handler, kind)
    received = service.received_envelopes()
    assert {env.type for env in received} <= {"secagg", "presence"}           # no head, Δc or v_k in the clear
    for d in JAVA_IDS:
        assert f"STATS {d} done=2 declined=0" in out, out


@pytest.mark.parametrize("kind", ["scaffold.head", "ditto.head"])
@pytest.mark.parametrize("how", ["oversize", "throw"])
def test_a_java_stateful_task_that_sends_nothing_after_its_handler_saved_puts_the_state_back(java_cp, tmp_path,
                                                                                            kind, how):
    """The Java device's MqttAgent (tests/java_device/AgentTurns.java) runs round 1 of a plain
    scaffold.head / ditto.head job, then round 2, whose result cannot be encoded (a body over the
    header limit) or whose handler throws after it saved: the task is declined and the job's entry is
    round 1's, the Python device's after round 1 (tests/test_stateful_put_back.py shows the Python
    agent's put-back). The Java agent used to keep round 2's state, a round the server never counted."""
    from java_agent_turns import AgentTurns
    from ops_fleet import Features
    from test_java_device import write_features

    from edge_client.state import DeviceStateStore
    from protocols import messages as M
    from protocols.envelope import Envelope

    _, _, fields, handler_type = stateful_kind(kind)
    Z, y = device_data(0)
    rng = np.random.default_rng(4)

    def task(round_: int) -> tuple[dict, dict]:
        head = {"weight": (0.1 * rng.normal(size=(C, D))).astype(np.float32), "bias": np.zeros(C, np.float32)}
        control = {f"control.{k}": (0.05 * rng.normal(size=v.shape)).astype(np.float32) for k, v in head.items()}
        params = {"num_classes": C, "feature_dim": D, "backbone": "b", "image_size": 8, "epochs": 2, "batch_size": 8,
                  "lr": 0.05, "seed": 3, "job_id": "put-back", "state": {**STATE, "round": round_}, **fields}
        return params, {**head, **(control if kind == "scaffold.head" else {})}

    def envelope(round_: int, params: dict, tensors: dict) -> Envelope:
        t = M.task_message("aggregator", "put-back", round_, kind, params, time.time() + 600)
        return Envelope(t.type, t.sender, t.body, tensors, id=t.id, ts=t.ts)

    rounds = [task(1), task(2)]
    python = DeviceStateStore(tmp_path / "py-state")
    handler_type(Z, y, lambda b, s, w: Features(D), python)(*rounds[0])     # the Python device's round 1
    agent = AgentTurns(write_features(tmp_path / "f.feat", Z, y), tmp_path / "java-state")
    try:
        first = agent.turn(envelope(1, *rounds[0]))
        assert (first.done, first.declined) == (1, 0)
        agent.fail(how)
        failed = agent.turn(envelope(2, *rounds[1]))
        assert (failed.done, failed.declined, failed.stopped_by) == (1, 1, None)
    finally:
        log = agent.close()
    assert ("result cannot be sent" if how == "oversize" else "failed after the handler saved") in log, log[-3000:]
    java_state = DeviceStateStore(tmp_path / "java-state").load("put-back", None)
    py_state = python.load("put-back", None)
    assert java_state.round == py_state.round == 1 and sorted(java_state.arrays) == sorted(py_state.arrays)
    for k, v in py_state.arrays.items():
        assert np.abs(java_state.arrays[k] - v).max() <= CONTROL_ATOL, k
