"""``aggregator serve --shards K`` closing the FedAvg family's rounds over a real mosquitto with real
device agents (FedAvg(ψ), FT(φ)/FT(M), pp, Scaffold(ψ/M), FedGloSS): each round's close asks the
shards for per-update statistics and bounded sums (aggregator/shards/fedavg_sums.py); the model,
the job's state (Scaffold's c, FedGloSS's duals) and the held-out reports must be one aggregator's
bytes, locally, on Ray actors, and after the coordinator and a shard are SIGKILLed. Fed3R's ingest
on shards: tests/test_shards.py."""

import json
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

from aggregator.shards.buckets import shard_of
from aggregator.strategies.dp_noise import NOISE_SEED_ENV
from fedfleet.emulation.broker import MosquittoBroker

from ops_fleet import Features, Fleet, features_of, prepare, run_aggregator, start_aggregator_in
from shard_runs import DEVICES, RAY_ALL, SHARDED_JOB_TIMEOUT_S, shard_options, shard_rows, sigkill_shard_holding

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
    env: dict | None = None             # the aggregator's extra environment (DP: the test's noise seed)


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
              "fedgloss": {"fedgloss_rho": 0.05, "server_momentum": 0.0}, "ditto": {"ditto_lambda": 0.5}}


# DP-FedAvg, adaptive clipping: the shards sum clipped deltas, the coordinator adds the noise, seeded
# in both runs (FEDFLEET_TEST_DP_NOISE_SEED, tests only) so that their bits can be compared
DP_FEDAVG = {**FEDAVG, "norm_bound_multiplier": 0.0, "contribution_bound_multiplier": 0.0, "dp_noise_multiplier": 0.8,
             "dp_clip_norm": 0.5, "dp_adaptive_clip": True, "dp_population": len(DEVICES)}


# Scaffold of lone devices: κ = 1, each round's update and Δc bounded by the references of earlier
# rounds (the model's and the Δc bound's, SmallRoundReference), the first rounds moving nothing
LONE_SCAFFOLD = {**FEDAVG, "kind": "scaffold", "clients_per_round": 1, "rounds": 6}


def round_job(kind: str, request) -> RoundJob:
    if kind == "fedavg":
        return RoundJob(DEVICES, FEDAVG)
    if kind == "scaffold-lone":
        return RoundJob(DEVICES, LONE_SCAFFOLD, stateful_handlers)
    if kind == "fedavg-dp":
        return RoundJob(DEVICES, DP_FEDAVG, env={NOISE_SEED_ENV: "17"})
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
        rc, log = run_aggregator(workdir, broker.url, workdir / "state.db", crash=crash, extra=list(extra),
                                 timeout=SHARDED_JOB_TIMEOUT_S, env=job.env)
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
    same = ("round", "contributions", "samples", "server_steps", "personal_wma", "global_wma", "heldout_devices",
            "privacy")
    assert {k: got[1]["final"].get(k) for k in same} == {k: want[1]["final"].get(k) for k in same}   # pp: its WMAs
    if job.config["kind"] == "pp":
        assert want[1]["final"]["heldout_devices"] == len(want[1]["contributed"])
    if job.config.get("dp_noise_multiplier"):       # every round a release; adaptive clipping moved C
        privacy = want[1]["final"]["privacy"]
        assert privacy["releases"] == job.config["rounds"] and privacy["clip_norm"] != job.config["dp_clip_norm"]
    if job.config["kind"].startswith("scaffold"):           # c moved
        assert any(np.abs(v).max() > 0 for k, v in want[2].items() if k.startswith("control."))


# FT(φ)/FT(M) and FedGloSS are FedAvg's round sums (over more tensors; from w̃): their Ray and
# SIGKILL runs are FedAvg's; pp's receipts carry held-out reports as well, and Scaffold sums its
# Δc and moves the server state c: they have their own (the Ray runs are in tests/test_shards.py,
# with the suite's other Ray cluster files). Ditto is pp's sums and receipts (PersonalRoundSums)
# and FedNCM Fed3R's (Fed3RSums) on the same paths: their bytes are checked without a broker
# (tests/test_shard_fedavg.py, tests/test_shard_ingest.py)
# `make test-ray` (shard_runs.RAY_ALL) runs every kind on both, Ditto over the broker as well
LOCAL_KINDS = (["fedavg", "fedavg-dp", "fedavg-tail", "pp", "scaffold", "scaffold-tail", "fedgloss"]
               + (["ditto"] if RAY_ALL else []))
# The suite sends one kind across Ray's transport, Scaffold (the most state: Δc sums and the server's
# c), since a kind's sums cross an actor's calls as they cross a local shard's; make test-ray sends all
RAY_KINDS = LOCAL_KINDS if RAY_ALL else ["scaffold"]


def check_rounds_on_two_shards(tmp_path, rounds_unsharded, kind: str, on: str, request) -> None:
    """``kind``'s job on two local shard processes, or Ray actors on the two-node cluster (one per
    node), gives one aggregator's outputs bit for bit; each shard holds its own devices' results."""
    job = round_job(kind, request)
    rc, log = run_rounds(tmp_path, job, shard_options(on, request))
    assert rc == 0, log[-3000:]
    assert_same_fedavg_model(fedavg_outputs(tmp_path / "out"), rounds_unsharded(kind, request), job)
    assert "receipts only" not in log               # every update reached the coordinator as a receipt
    rows = shard_rows(tmp_path / "state.db", 2)
    assert all(rows) and all(shard_of(d, 2) == i for i, held in enumerate(rows) for d, _ in held)


# FT(φ)/FT(M) exports the tail program (minutes on a slow machine): slow, so its file starts first
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if "tail" in k else k for k in LOCAL_KINDS])
def test_fedavg_rounds_on_two_shards_give_one_aggregators_model_bit_for_bit(tmp_path, rounds_unsharded, kind,
                                                                            request):
    check_rounds_on_two_shards(tmp_path, rounds_unsharded, kind, "local", request)


def test_scaffold_rounds_of_lone_devices_on_two_shards_give_one_aggregators_bytes(tmp_path, rounds_unsharded,
                                                                                   request):
    """κ = 1 on two shards: the coordinator keeps the model's and the Δc bound's references from the
    shards' statistics as one aggregator keeps them from its updates: the model and c are its bytes,
    and the checkpoint holds the Δc bound's reference once three devices have answered."""
    from aggregator.storage.store import Store

    check_rounds_on_two_shards(tmp_path, rounds_unsharded, "scaffold-lone", "local", request)
    checkpoint = Store(tmp_path / "state.db").checkpoint("ops")[1]
    assert {"unreleased_bounds.reference", "unreleased_scaffold.control_bounds.reference"} <= set(checkpoint)


# pp: its receipts' reports replayed after the restart; Scaffold: its server control c restored;
# DP-FedAvg: C restored (the restarted coordinator replays round 1 with its seed's first draws, as
# the uninterrupted run drew them; unseeded, a replayed round's noise is fresh: docs/operations.md)
@pytest.mark.parametrize("kind", ["fedavg", "fedavg-dp", "pp", "scaffold"])
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
        proc = start_aggregator_in(tmp_path, broker.url, state, options, timeout=SHARDED_JOB_TIMEOUT_S, env=job.env)
        out = sigkill_shard_holding(proc, state, victim, 2, held_back, SHARDED_JOB_TIMEOUT_S)
    assert proc.returncode == 0, out[-3000:]
    assert f"shard {victim} exited" in out
    assert_same_fedavg_model(fedavg_outputs(tmp_path / "out"), rounds_unsharded(kind, request), job)
