"""``aggregator serve --shards K`` over a real mosquitto with real device agents: K shard
processes receive, validate, store and sum the results of their buckets' devices; the coordinator
reduces their sums. The model must be the bytes of one unsharded aggregator's (the canonical
bucketed order does not depend on K), every device must count once, and a shard SIGKILLed
mid-ingest must resume from its store with the same bytes. With ``--ray`` the shards are Ray
actors on a two-node local Ray cluster, one per node: the same bytes as the local shards'."""

import importlib.util
import json
import os
import signal
import sqlite3
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

from aggregator.shards.buckets import shard_of
from fedfleet.emulation.broker import MosquittoBroker

from ops_fleet import Features, Fleet, features_of, prepare, reference_sums, run_aggregator, run_uninterrupted, start_aggregator_in

DEVICES = [f"dev{i:02d}" for i in range(10)]
# Ray is an optional extra (fedfleet[ray]); `make setup` installs it, so these run in CI
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs fedfleet[ray]")


def outputs(out_dir):
    return dict(np.load(out_dir / "model.npz")), dict(np.load(out_dir / "statistics.npz")), \
        json.loads((out_dir / "results.json").read_text())


def shard_rows(state, shards: int) -> list[list[tuple[str, str]]]:
    return [sqlite3.connect(f"{state}.shards/shard-{i}-of-{shards}.db").execute(
        "SELECT device, message_id FROM contributions").fetchall() for i in range(shards)]


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory):
    return outputs(run_uninterrupted(tmp_path_factory.mktemp("unsharded"), DEVICES))


def shard_options(on: str, request) -> list[str]:
    """A shard's Ray actor goes where its custom resource is: shard 0's to the head, shard 1's to the
    second node (``aggregator/shards/ray_shards.py``; the shared cluster's ``SharedCluster.RESOURCES``)."""
    return ["--shards", "2"] + (["--ray", request.getfixturevalue("ray_test_cluster")] if on == "ray" else [])


ON = ["local", pytest.param("ray", marks=[pytest.mark.slow, needs_ray, pytest.mark.ray_cluster])]  # processes here, or Ray actors


def assert_same_model(got, want):
    model, stats, results = got
    assert sorted(model) == sorted(want[0])
    for name in want[0]:
        assert model[name].tobytes() == want[0][name].tobytes(), name          # bit for bit
    for name in ("A", "B", "counts"):
        assert stats[name].tobytes() == want[1][name].tobytes(), name
    assert sorted(results["contributed"]) == DEVICES and results["state"] == "done"
    A_ref, B_ref = reference_sums(DEVICES)                                     # and right
    np.testing.assert_allclose(stats["A"], A_ref, rtol=1e-12)
    np.testing.assert_allclose(stats["B"], B_ref, rtol=1e-12)


def assert_each_device_once(state, shards: int, orphans_allowed: bool = False) -> None:
    """The coordinator accepted each device once, every accepted result is in its owner's store;
    a shard holds only its own devices (and, after a coordinator crash, maybe results it receipted
    that the coordinator never accepted: orphans no sum counts)."""
    rows = shard_rows(state, shards)
    for i, held in enumerate(rows):
        assert all(shard_of(d, shards) == i for d, _ in held), "a shard holds only its buckets' devices"
    receipts = sqlite3.connect(state).execute("SELECT device, message_id FROM contributions").fetchall()
    assert sorted(d for d, _ in receipts) == DEVICES
    stored = sorted(r for held in rows for r in held)
    assert set(receipts) <= set(stored) and (orphans_allowed or sorted(receipts) == stored)


@pytest.fixture(scope="module")
def local_shards_run(tmp_path_factory):
    """The job on two local shard processes: its outputs and its state file."""
    workdir = tmp_path_factory.mktemp("local-shards")
    prepare(workdir, DEVICES)
    with MosquittoBroker() as broker, Fleet(broker.url, DEVICES):
        rc, log = run_aggregator(workdir, broker.url, workdir / "state.db", extra=["--shards", "2"])
    assert rc == 0, log[-3000:]
    return outputs(workdir / "out"), workdir / "state.db"


def test_two_shards_give_one_aggregators_model_bit_for_bit(local_shards_run, unsharded):
    assert len({shard_of(d, 2) for d in DEVICES}) == 2            # both shards have devices
    got, state = local_shards_run
    assert_same_model(got, unsharded)
    assert_each_device_once(state, 2)


@pytest.mark.slow
@pytest.mark.ray_cluster
@needs_ray
def test_shards_as_ray_actors_on_two_nodes_give_the_local_shards_model_bit_for_bit(tmp_path, ray_test_cluster,
                                                                                  local_shards_run, unsharded):
    prepare(tmp_path, DEVICES)
    with MosquittoBroker() as broker, Fleet(broker.url, DEVICES):
        rc, log = run_aggregator(tmp_path, broker.url, tmp_path / "state.db",
                                 extra=["--shards", "2", "--ray", ray_test_cluster])
    assert rc == 0, log[-3000:]
    got = outputs(tmp_path / "out")
    assert_same_model(got, local_shards_run[0])                   # the local shards' bytes
    assert_same_model(got, unsharded)                             # and one aggregator's
    assert_each_device_once(tmp_path / "state.db", 2)
    placement = json.loads((tmp_path / "state.db.shards" / "placement.json").read_text())
    assert sorted(p["shard"] for p in placement) == [0, 1]
    assert len({p["node_id"] for p in placement}) == 2            # one actor on each node
    assert all(p["resources"].get(f"fedfleet_shard_{p['shard']}") == 1 for p in placement)


@pytest.mark.parametrize("on", ON)
def test_a_shard_sigkilled_mid_ingest_resumes_bit_for_bit(tmp_path, unsharded, on, request):
    """A shard process, or a shard's Ray actor, dies: the coordinator restarts it on its store."""
    options = shard_options(on, request)
    prepare(tmp_path, DEVICES)
    state = tmp_path / "state.db"
    victim = shard_of(DEVICES[0], 2)
    held = [d for d in DEVICES if shard_of(d, 2) == victim][1:]     # the victim's later devices wait
    gates = {d: threading.Event() for d in held}
    with MosquittoBroker() as broker, Fleet(broker.url, DEVICES, gates=gates):
        proc = start_aggregator_in(tmp_path, broker.url, state, options)
        try:
            # a deadline, not a wait: the loop leaves at the first stored row (a Ray actor's start
            # on CI's 2 loaded cores took over a minute once)
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:           # the victim has stored some results, not all
                try:
                    if shard_rows(state, 2)[victim]:
                        break
                except sqlite3.OperationalError:
                    pass
                time.sleep(0.2)
            else:
                pytest.fail("the shard never stored a result")
            os.kill(int((tmp_path / "state.db.shards" / f"shard-{victim}.pid").read_text()), signal.SIGKILL)
            for g in gates.values():
                g.set()
            proc.wait(120)
        finally:
            proc.kill()
    out = proc.output()
    assert proc.returncode == 0, out[-3000:]
    assert f"shard {victim} exited" in out
    assert_same_model(outputs(tmp_path / "out"), unsharded)
    assert_each_device_once(state, 2)


@pytest.mark.parametrize("on,crashes", [
    # on Ray the coordinator's side is the same ShardPool code: the actor-kill test above covers
    # what differs (an actor's restart on its node's store), at a third of this test's time
    ("local", ("contribution_stored:2", "ack_sent:3", "round_closing"))])
def test_the_coordinator_sigkilled_at_its_crash_points_resumes_the_shards_bit_for_bit(tmp_path, unsharded, on,
                                                                                     crashes, request):
    """The coordinator dies (and its shards with it) after storing a receipt, after acking, at a
    round's close; each restart brings the shards back on their stores."""
    options = shard_options(on, request)
    prepare(tmp_path, DEVICES)
    state = tmp_path / "state.db"
    crashed, logs = [], ""
    with MosquittoBroker() as broker, Fleet(broker.url, DEVICES):
        for crash in (*crashes, None):
            rc, log = run_aggregator(tmp_path, broker.url, state, crash=crash, extra=options)
            logs += log
            if rc == 0:
                break
            assert rc == -9, log[-3000:]
            crashed.append(crash)
        else:
            pytest.fail("the job did not finish")
    assert rc == 0 and len(crashed) >= min(2, len(crashes)), (crashed, log[-3000:])
    assert "receipts only" not in logs              # no device's result reached the coordinator itself
    assert_same_model(outputs(tmp_path / "out"), unsharded)
    assert_each_device_once(state, 2, orphans_allowed=True)


# ---------------------------------------------------------------- FedAvg rounds on shards
# two rounds of six of the ten devices, the norm and contribution bounds on (they close in phases:
# aggregator/shards/fedavg_sums.py); the direction screen needs every update in one place
FEDAVG = {"kind": "fedavg", "rounds": 2, "clients_per_round": 6, "direction_screen": False}
TAIL_DEVICES = ["dev06", "dev07", "dev08"]          # dev08 is shard 1's, the others shard 0's


@dataclass(frozen=True)
class RoundJob:
    """A round-based job the shards sum with FedAvg's round sums: its devices, config and the
    devices' handlers (``handlers(device, workdir)``; None: the synthetic head trainer)."""
    devices: list[str]
    config: dict
    handlers: Callable | None = None


def device_store(workdir, device: str):
    """A device's own state store, in the run's folder: every run starts from empty stores."""
    from edge_client.state import DeviceStateStore

    return DeviceStateStore(workdir / "device-state" / device)


def tail_job(request, kind: str = "fedavg-tail") -> RoundJob:
    """FT(M) (or Scaffold(M), each device keeping its c_k) on the suite's 32 px tail bundle: three
    devices of 12 Fashion-MNIST images, the norm bound (3x the median, the kind's default) on: the
    tail's tensors close in phases too."""
    from edge_client.data import load_fashion_mnist
    from edge_client.handlers import HandlerConfig, LocalData, SharedExtractors, device_handlers

    manifest = request.getfixturevalue("tail_bundle")
    images, labels = load_fashion_mnist("train")
    extractors = SharedExtractors(lambda *_: Features(), None)

    def handlers(device: str, workdir) -> tuple[dict, dict]:
        i = TAIL_DEVICES.index(device)
        data = LocalData(images[12 * i:12 * i + 12], labels[12 * i:12 * i + 12].astype(np.int64), np.arange(12))
        return device_handlers(data, extractors, HandlerConfig(tail_manifest=str(manifest)),
                               device_store(workdir, device)), {}

    config = {"kind": kind, "num_classes": 10, "feature_dim": 1280, "image_size": 32, "rounds": 2,
              "clients_per_round": 3, "local_epochs": 1, "batch_size": 6, "client_lr": 0.01, "train": "tail+head",
              "tail_stages": 1, "init": "zeros", "tail_program_file": str(manifest.parent / "tail_eval.pt2")}
    return RoundJob(TAIL_DEVICES, config, handlers)


def stateful_handlers(device: str, workdir) -> tuple[dict, dict]:
    """The head kinds whose devices keep state, on the synthetic features: each device keeps its
    bias (FedAlt), its c_k (Scaffold) or its dual (FedGloSS) in its own state store (pp: and
    reports on its held-out split)."""
    from edge_client.handlers import HandlerConfig, device_handlers

    return device_handlers(features_of(device), lambda *_, **__: Features(), HandlerConfig(),
                           device_store(workdir, device)), {}


# each stateful head kind's config besides FEDAVG's (Scaffold: a Δc clip that bites; FedGloSS: its
# own server step, plain SGD, perturbing the head it sends from round 2 on)
HEAD_KINDS = {"pp": {"pp_algorithm": "fedalt"}, "scaffold": {"control_clip_norm": 0.05},
              "fedgloss": {"fedgloss_rho": 0.05, "server_momentum": 0.0}}


def round_job(kind: str, request) -> RoundJob:
    if kind == "fedavg":
        return RoundJob(DEVICES, FEDAVG)
    if kind in HEAD_KINDS:
        return RoundJob(DEVICES, {**FEDAVG, "kind": kind, **HEAD_KINDS[kind]}, stateful_handlers)
    return tail_job(request, kind)


def gated(handler, gate: threading.Event):
    """``handler`` waiting for ``gate`` before each task (a round that cannot close until a test says)."""
    def run(params, tensors=None):
        gate.wait(240)
        return handler(params, tensors)
    return run


def fleet_handlers(job: RoundJob, workdir, gates=None):
    """The Fleet's handlers of ``job``'s devices, the ``gates``' devices' gated (None: the synthetic
    head trainer, which the Fleet gates itself)."""
    if job.handlers is None:
        return None

    def handlers(device):
        plain, protocol = job.handlers(device, workdir)
        if device in (gates or {}):
            plain = {kind: gated(h, gates[device]) for kind, h in plain.items()}
        return plain, protocol
    return handlers


def run_rounds(workdir, job: RoundJob, extra=(), crash=None):
    prepare(workdir, job.devices, **job.config)
    with MosquittoBroker() as broker, Fleet(broker.url, job.devices, kind="fedavg", handlers=fleet_handlers(job, workdir)):
        rc, log = run_aggregator(workdir, broker.url, workdir / "state.db", crash=crash, extra=list(extra))
    return rc, log


def fedavg_outputs(out_dir):
    """(model.npz, results.json, statistics.npz: the job's state, Scaffold's c and FedGloSS's duals
    included, less the devices' state run, which each run draws anew)."""
    state = {k: v for k, v in np.load(out_dir / "statistics.npz").items() if k != "device_state_run"}
    return dict(np.load(out_dir / "model.npz")), json.loads((out_dir / "results.json").read_text()), state


@pytest.fixture(scope="module")
def rounds_unsharded(tmp_path_factory):
    """kind -> one aggregator's outputs of that kind's job (run on first use)."""
    done = {}

    def of(kind: str, request):
        if kind not in done:
            workdir = tmp_path_factory.mktemp(f"{kind}-unsharded")
            rc, log = run_rounds(workdir, round_job(kind, request))
            assert rc == 0, log[-3000:]
            done[kind] = fedavg_outputs(workdir / "out")
        return done[kind]
    return of


def assert_same_fedavg_model(got, want, job: RoundJob = RoundJob(DEVICES, FEDAVG)):
    for got_arrays, want_arrays in ((got[0], want[0]), (got[2], want[2])):
        assert sorted(got_arrays) == sorted(want_arrays)
        for name in want_arrays:
            assert got_arrays[name].tobytes() == want_arrays[name].tobytes(), name      # bit for bit
    assert got[1]["contributed"] == want[1]["contributed"] and got[1]["state"] == "done"
    assert sum(want[1]["contributed"].values()) == job.config["rounds"] * job.config["clients_per_round"]
    same = ("round", "contributions", "samples", "server_steps", "personal_wma", "global_wma", "heldout_devices")
    assert {k: got[1]["final"].get(k) for k in same} == {k: want[1]["final"].get(k) for k in same}   # pp: its WMAs
    if job.config["kind"] == "pp":
        assert want[1]["final"]["heldout_devices"] == len(want[1]["contributed"])
    if job.config["kind"].startswith("scaffold"):           # c moved
        assert any(np.abs(v).max() > 0 for k, v in want[2].items() if k.startswith("control."))


def fedavg_rounds_held(state, shard: int) -> set[int]:
    try:
        return {r for (r,) in sqlite3.connect(f"{state}.shards/shard-{shard}-of-2.db").execute(
            "SELECT round FROM contributions")}
    except sqlite3.OperationalError:
        return set()


# FT(φ)/FT(M) and FedGloSS are FedAvg's round sums (over more tensors; from w̃): their Ray and
# SIGKILL runs are FedAvg's; pp's receipts carry held-out reports as well, and Scaffold sums its
# Δc and moves the server state c: they have their own. Ditto is pp's sums and receipts
# (PersonalRoundSums) and FedNCM Fed3R's (Fed3RSums) on the same paths: their bytes are checked
# without a broker (tests/test_shard_fedavg.py, tests/test_shard_ingest.py)
ROUND_RUNS = [("fedavg", "local"), ("fedavg-tail", "local"), ("pp", "local"), ("scaffold", "local"),
              ("scaffold-tail", "local"), ("fedgloss", "local"),
              *(pytest.param(kind, "ray", marks=[pytest.mark.slow, needs_ray, pytest.mark.ray_cluster])
                for kind in ("fedavg", "pp", "scaffold"))]


@pytest.mark.parametrize("kind,on", ROUND_RUNS)
def test_fedavg_rounds_on_two_shards_give_one_aggregators_model_bit_for_bit(tmp_path, rounds_unsharded, kind, on,
                                                                            request):
    """Local shard processes, or Ray actors on the two-node cluster (one per node)."""
    job = round_job(kind, request)
    rc, log = run_rounds(tmp_path, job, shard_options(on, request))
    assert rc == 0, log[-3000:]
    assert_same_fedavg_model(fedavg_outputs(tmp_path / "out"), rounds_unsharded(kind, request), job)
    assert "receipts only" not in log               # every update reached the coordinator as a receipt
    rows = shard_rows(tmp_path / "state.db", 2)
    assert all(rows) and all(shard_of(d, 2) == i for i, held in enumerate(rows) for d, _ in held)


# pp: its receipts' reports replayed after the restart; Scaffold: its server control c restored
@pytest.mark.parametrize("kind", ["fedavg", "pp", "scaffold"])
def test_fedavg_on_shards_resumes_bit_for_bit_after_the_coordinator_and_a_shard_are_sigkilled(tmp_path, kind,
                                                                                            rounds_unsharded, request):
    """The coordinator dies closing round 1 (its shards with it); restarted, it closes the round
    again on the shards' stores. Then a shard is SIGKILLed once it holds a round-2 update: restarted
    on its store, it answers round 2's close. Every device but one of the victim's holds its round-2
    update until the kill, so the round cannot close before it (however the machine schedules them;
    round 2's six, drawn by the job's seed, are all shard 0's: gating shard 1's alone held nothing)."""
    options = ["--shards", "2"]
    job = round_job(kind, request)
    rc, log = run_rounds(tmp_path, job, options, crash="round_closing")
    assert rc == -9, log[-3000:]
    state, victim = tmp_path / "state.db", 0
    held_back = threading.Event()
    first = "dev00"                         # shard 0's, in round 2 (else no round-2 update is ever stored)
    assert shard_of(first, 2) == victim
    gates = {d: held_back for d in DEVICES if d != first}
    with MosquittoBroker() as broker, Fleet(broker.url, DEVICES, kind="fedavg", gates=gates,
                                            handlers=fleet_handlers(job, tmp_path, gates)):
        proc = start_aggregator_in(tmp_path, broker.url, state, options)
        try:
            deadline = time.monotonic() + 240
            while 2 not in fedavg_rounds_held(state, victim) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert 2 in fedavg_rounds_held(state, victim), "the shard never stored a round-2 update"
            os.kill(int((tmp_path / "state.db.shards" / f"shard-{victim}.pid").read_text()), signal.SIGKILL)
            held_back.set()
            proc.wait(120)
        finally:
            held_back.set()                 # never leave the agents waiting at the gate
            proc.kill()
    out = proc.output()
    assert proc.returncode == 0, out[-3000:]
    assert f"shard {victim} exited" in out
    assert_same_fedavg_model(fedavg_outputs(tmp_path / "out"), rounds_unsharded(kind, request), job)
