"""Every job kind not covered by test_crash_recovery.py, created through the admin API and resumed
after SIGKILLs: the final model is bit-identical to an uninterrupted run.

The first aggregator process serves the admin API (``--keep-serving --api``); the test creates
the job with ``POST /api/jobs`` and starts it; the process SIGKILLs itself at a crash point
(``FEDFLEET_CRASH_AT``). Later processes resume from the state file alone (``serve --state``),
each killed at the next point of the kind's list, the last one running the job to its end. The
reference is the same job built from the same config and run without interruption (in process,
with a store too). test_crash_recovery.py kills Fed3R and FedAvg at every crash point; here one
point per kind keeps the test short, chosen so the kinds together cover both restore paths. The
FedAvg kinds step with FedOpt (Adam, Yogi) and serve WiMA / SWA (their moments, ring and mean are
part of what must come back), their devices step with FedASAM+FedProx / FedSAM.

Crash points: plain kinds are killed mid-round (after a contribution was stored, before the
round's close was committed), so a restart loads the last checkpoint and replays stored
contributions into the open round (LADD: a training round after the style round's clustering).
Secure kinds are killed between rounds: a secure round in flight at a crash cannot be resumed
(its secrets are never stored, docs/operations.md) and is redone with fresh keys, so only a kill
outside one can promise identical bytes. Secure rounds store no per-device contribution: the
store holds no empty payload, and every secure round closed with every member it drew as accepted
(a member left out by a phase timeout would make the two runs' sums differ for another reason).
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from aggregator.jobs.registry import build_job
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from aggregator.storage.store import Store
from edge_client.handlers import LocalData, HandlerConfig, SharedExtractors, device_handlers, ladd_handlers
from protocols.mqtt_link import BrokerConfig
from protocols.payloads.fedavg import KIND_TAIL as FEDAVG_TAIL_KIND
from protocols.topics import Topics

from aggregator_forkserver import start_aggregator
from ops_fleet import C, D, REPO, Features, Fleet, SecureKeys, feature_handlers, fresh_log, with_secure

TOKEN = "crash-resume-token"
TAIL_SIZE = 32


@dataclass
class Case:
    """One kind's job: its devices, config, device handlers and the crash points it passes."""
    kind: str
    devices: list[str]
    config: dict
    handlers: Callable[[str], tuple[dict, dict]]
    crashes: list[str]
    secure_rounds: set[int] = field(default_factory=set)      # rounds summed under SecAgg


def common(devices, **over) -> dict:
    return {"round_timeout_s": 60, "expected_devices": len(devices), "start_timeout_s": 10, "seed": 3, **over}


# Every member of these cases' secure rounds answers, so each phase closes as soon as the last one
# does (well under a second) and no run waits out a timeout: the timeout only says how slow a member may be
# before it is left out. The advertise phase holds the members' training (a device trains on its
# task before it reads the RoundStart behind it); when the idle limit applied there, a device a loaded
# CI machine slowed past 5 s was left out of one run's round only: another sum, another model. The
# first phase now ends at its budget only (test_a_member_whose_first_training_outlasts_the_phase_timeout_
# is_still_summed); the later phases get the product's 30 s so load cannot matter there either.
SECURE_FIELDS = {"max_samples": 100, "phase_timeout_s": 30}


def fedavg_secure(work: Path) -> Case:
    devices = [f"dev{i:02d}" for i in range(4)]
    keys = SecureKeys.create(work, devices)
    config = common(devices, num_classes=C, feature_dim=D, rounds=3, clients_per_round=3, local_epochs=2,
                    batch_size=8, client_lr=0.05, server_optimizer="adam", server_lr=0.05, max_abs_param=50.0,
                    served_model="wima", wima_window=2, local_rule="asam", sam_rho=0.5, prox_mu=0.01,
                    **SECURE_FIELDS,
                    **keys.job_fields(work))
    return Case("fedavg-secure", devices, config, with_secure(keys, feature_handlers),
                ["round_closed:2"], {1, 2, 3})


def personalize(work: Path) -> Case:
    devices = [f"dev{i:02d}" for i in range(4)]
    rng = np.random.default_rng(0)
    np.savez(work / "head.npz", weight=rng.normal(0, 0.1, (C, D)).astype(np.float32),
             bias=np.zeros(C, np.float32))
    config = common(devices, num_classes=C, feature_dim=D, head_file=str(work / "head.npz"), fp_epochs=2,
                    fp_lrs=[0.01, 0.1], fp_folds=2, batch_size=8, clients_per_round=2)
    return Case("personalize", devices, config, with_secure(None, feature_handlers),
                ["round_closing"])


def first_task_delayed(handler, delay_s: float):
    """``handler`` (a task handler) that sleeps ``delay_s`` before its first task: a device slowed
    by a loaded machine at the start."""
    first = threading.Event()

    def delayed(params, tensors):
        if not first.is_set():
            first.set()
            time.sleep(delay_s)
        return handler(params, tensors)
    return delayed


def tail_case(kind: str, work: Path, manifest: Path, images, labels, slow: dict[str, float] | None = None) -> Case:
    """``slow``: device -> seconds its first tail training is held (none by default)."""
    devices = [f"dev{i:02d}" for i in range(3)]
    shards = {d: np.arange(i * 12, i * 12 + 12) for i, d in enumerate(devices)}
    extractors = SharedExtractors(lambda *_: Features(), None)

    def plain(device: str) -> dict:
        data = LocalData(images[shards[device]], labels[shards[device]], np.arange(12))
        handlers = device_handlers(data, extractors, HandlerConfig(tail_manifest=str(manifest)))
        if device in (slow or {}):
            handlers[FEDAVG_TAIL_KIND] = first_task_delayed(handlers[FEDAVG_TAIL_KIND], slow[device])
        return handlers

    config = common(devices, num_classes=10, feature_dim=1280, image_size=TAIL_SIZE, rounds=2, clients_per_round=3,
                    local_epochs=1, batch_size=6, client_lr=0.01, train="tail+head", tail_stages=1, init="zeros",
                    server_optimizer="yogi", server_lr=0.01, served_model="swa",
                    tail_program_file=str(manifest.parent / "tail_eval.pt2"))
    if kind == "fedavg-tail":
        return Case(kind, devices, config, with_secure(None, plain), ["contribution_stored:2"])
    keys = SecureKeys.create(work, devices)
    config.update(max_abs_param=50.0, **SECURE_FIELDS, **keys.job_fields(work))
    return Case(kind, devices, config, with_secure(keys, plain), ["round_closed"], {1, 2})


def ladd_case(kind: str, work: Path) -> Case:
    from aggregator.jobs.ladd import save_initial_model
    from edge_client.models.segmentation import SegmentationModel, SegmentationSpec
    from fedfleet.emulation.synthetic_scenes import CLASSES, make_benchmark
    from protocols.files import file_sha256

    spec = SegmentationSpec(num_classes=len(CLASSES), image_size=32, head_channels=8)
    model = SegmentationModel(spec, seed=0)
    save_initial_model(work / "pretrained.npz", model.exchanged_state(), model.trainable_names("tail+head"))
    bench = make_benchmark(seed=0, image_size=32, n_source=1, target_domains=("night", "fog"), devices_per_domain=2,
                           images_per_device=(4, 4), test_per_domain=0)
    images = {d.device_id: d.images for d in bench.devices}
    devices = sorted(images)
    lock, shared = threading.Lock(), {}

    def plain(device: str) -> dict:     # one network for the process's devices, as a device host shares it
        return ladd_handlers(images[device], lambda s: shared.setdefault(s, SegmentationModel(s)), lock)

    config = common(devices, model=spec.to_dict(), clustering="styles", k_min=2, k_max=2, n_init=2, rounds=2,
                    clients_per_round=4, local_epochs=1, batch_size=4, teacher_every=1,
                    initial_model_file=str(work / "pretrained.npz"),
                    initial_model_sha256=file_sha256(work / "pretrained.npz"))
    if kind == "ladd":
        return Case(kind, devices, config, with_secure(None, plain), ["round_closing:2"])
    keys = SecureKeys.create(work, devices)
    config.update(max_abs_param=50.0, **SECURE_FIELDS, **keys.job_fields(work))
    # round 1 asks for styles (plain, stored); rounds 2 and 3 train under SecAgg
    return Case(kind, devices, config, with_secure(keys, plain), ["round_closed:2"], {2, 3})


@pytest.fixture(scope="module")
def fmnist_small():
    from edge_client.data import load_fashion_mnist

    images, labels = load_fashion_mnist("train")
    return images[:36], labels[:36].astype(np.int64)


def make_case(kind: str, work: Path, request) -> Case:
    if kind.startswith("fedavg-tail"):
        images, labels = request.getfixturevalue("fmnist_small")
        return tail_case(kind, work, request.getfixturevalue("tail_bundle"), images, labels)
    if kind.startswith("ladd"):
        return ladd_case(kind, work)
    return {"fedavg-secure": fedavg_secure, "personalize": personalize}[kind](work)


# ----------------------------------------------------------------------------- the two runs
def uninterrupted(case: Case, broker_url: str, work: Path) -> Path:
    out = work / "reference"
    job = build_job(case.kind, {**case.config, "job_id": "job"})
    svc = AggregatorService(job, BrokerConfig.from_url(broker_url), out,
                            ServiceSettings(topic_root="ref", evaluate_every_contribution=False, tick_s=0.05),
                            enrolled=set(case.devices), store=Store(work / "reference.db"))
    with Fleet(broker_url, case.devices, topics=Topics("ref"), handlers=case.handlers):
        summary = svc.run(timeout_s=120)
    assert summary.get("state") == "done", summary
    return out / "model.npz"


class AggregatorProcess:
    """``python -m aggregator serve`` on the crash run's state file (forked by
    tests/aggregator_forkserver.py), its output collected."""

    def __init__(self, work: Path, broker_url: str, crash: str | None, *extra: str):
        env = {k: v for k, v in os.environ.items() if k != "FEDFLEET_CRASH_AT"}
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        if crash:
            env["FEDFLEET_CRASH_AT"] = crash
        cmd = [sys.executable, "-m", "aggregator", "serve", "--state", str(work / "state.db"), "--broker", broker_url,
               "--out", str(work / "out"), "--enrolled", str(work / "enrolled.txt"), "--timeout", "120",
               "--evaluate", "round", *extra]
        self.proc = start_aggregator(cmd, env, REPO, fresh_log(work))

    def api_url(self, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            for line in self.proc.output().splitlines():
                if line.startswith("admin API on "):
                    return line.split()[3]
            time.sleep(0.05)
        raise AssertionError("the admin API did not start:\n" + self.proc.output()[-3000:])

    def wait(self, timeout: float = 150) -> tuple[int, str]:
        return self.proc.wait(timeout), self.proc.output()


def post(url: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


@contextlib.contextmanager
def job_created_through_the_api(case: Case, broker_url: str, work: Path):
    """The case's fleet online and an aggregator (to be killed at ``case.crashes[0]``) that the job
    was created and started through: yields that first run."""
    work.mkdir()
    (work / "enrolled.txt").write_text("\n".join(case.devices) + "\n")
    (work / "token").write_text(TOKEN)
    with Fleet(broker_url, case.devices, handlers=case.handlers):
        first = AggregatorProcess(work, broker_url, case.crashes[0], "--keep-serving", "--api", "127.0.0.1:0",
                                  "--api-token-file", str(work / "token"))
        api = first.api_url()
        created = post(f"{api}/api/jobs", {"job_id": "job", "kind": case.kind, "config": case.config})
        assert created["kind"] == case.kind and created["state"] == "created"
        assert post(f"{api}/api/jobs/job/start")["state"] == "queued"
        yield first


def crashed(case: Case, broker_url: str, work: Path) -> Path:
    """Created through the API, killed at every crash point in turn, resumed from --state alone."""
    with job_created_through_the_api(case, broker_url, work) as first:
        runs = [first] + [None] * (len(case.crashes) - 1)
        for i, crash in enumerate(case.crashes):
            rc, log = (runs[i] or AggregatorProcess(work, broker_url, crash)).wait()
            assert rc == -9, f"expected a SIGKILL at {crash}, got exit {rc}:\n{log[-3000:]}"
            assert f"crash point {crash.split(':')[0]} reached" in log
        rc, log = AggregatorProcess(work, broker_url, None).wait()
    assert rc == 0, log[-3000:]
    assert "job job restored: " in log                  # resumed from the store, not started again
    return work / "out" / "job" / "model.npz"


def assert_no_empty_contributions(state: Path, case: Case) -> None:
    db = sqlite3.connect(state)
    rows = db.execute("SELECT round, payload_bytes FROM contributions").fetchall()
    assert all(n > 0 for _, n in rows) and not {r for r, _ in rows} & case.secure_rounds, rows
    closed = dict(db.execute("SELECT round, outcome FROM rounds WHERE state='closed'").fetchall())
    for r in case.secure_rounds:
        outcome = json.loads(closed[r])
        assert outcome["accepted"] and set(outcome["accepted"]) <= set(case.devices), outcome


def assert_every_member_summed(state: Path, case: Case) -> None:
    """Each secure round summed every member it drew: no phase timed out on a slow member (which
    would make this run's sum, and model, differ from the other's for a reason the test does not check)."""
    db = sqlite3.connect(state)
    rounds = db.execute("SELECT round, participants, outcome FROM rounds WHERE state='closed'").fetchall()
    for r, participants, outcome in rounds:
        if r in case.secure_rounds:
            outcome = json.loads(outcome)
            assert sorted(outcome["accepted"]) == sorted(json.loads(participants)), (r, outcome)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fedavg-secure", "fedavg-tail", "fedavg-tail-secure", "personalize", "ladd",
                                  "ladd-secure"])
def test_job_created_through_the_api_resumes_after_sigkills_to_the_uninterrupted_model(kind, broker, tmp_path,
                                                                                       request):
    case = make_case(kind, tmp_path, request)
    ref = uninterrupted(case, broker.url, tmp_path)
    out = crashed(case, broker.url, tmp_path / "crashed")
    for state in (tmp_path / "crashed" / "state.db", tmp_path / "reference.db"):    # first: it says why sums differ
        assert_every_member_summed(state, case)
    want, got = dict(np.load(ref)), dict(np.load(out))
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name
    # what the model does not show (personalization: the devices' reports): the same final evaluation
    want_results, got_results = (json.loads((path.parent / "results.json").read_text()) for path in (ref, out))
    assert got_results["contributed"] == want_results["contributed"]
    volatile = {"t", "bytes_in", "bytes_out"}
    assert {k: v for k, v in got_results["final"].items() if k not in volatile} == \
        {k: v for k, v in want_results["final"].items() if k not in volatile}
    assert_no_empty_contributions(tmp_path / "crashed" / "state.db", case)
    assert_no_empty_contributions(tmp_path / "reference.db", case)


@pytest.mark.slow
def test_a_member_whose_first_training_outlasts_the_phase_timeout_is_still_summed(broker, tmp_path, tail_bundle,
                                                                                  fmnist_small):
    """One device's first tail training held 5 s, past a phase timeout of 2 s: it trains before it
    answers the RoundStart, so the first phase waits for it (its budget, not the idle limit, ends it:
    aggregator/jobs/phase_clock.py). With the idle limit there it was left out of round 1 (summed:
    dev00, dev01), the CI flake behind SECURE_FIELDS' comment, and a fleet training longer than the
    timeout lost every member."""
    case = tail_case("fedavg-tail-secure", tmp_path, tail_bundle, *fmnist_small, slow={"dev02": 5.0})
    case.config["phase_timeout_s"] = 2
    uninterrupted(case, broker.url, tmp_path)
    assert_every_member_summed(tmp_path / "reference.db", case)
