"""Shared fixtures for the operations tests: a small fleet of real DeviceAgents computing real
Fed3R statistics of synthetic features, the independent numpy reference, and the aggregator as a
process of its own (``python -m aggregator serve``, forked by tests/aggregator_forkserver.py) that a
test may kill and restart."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from aggregator_forkserver import ForkedAggregator, run_aggregator_process, start_aggregator
from edge_client.agent import DeviceAgent
from edge_client.fed3r import Fed3RAccumulator
from protocols.mqtt_link import BrokerConfig
from protocols.payloads.fed3r import encode_stats
from protocols.topics import Topics

D, C, N = 6, 3, 25
REPO = Path(__file__).resolve().parents[1]


def data_for(device: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(int(device.removeprefix("dev")) + 1000)
    return rng.normal(size=(N, D)), rng.integers(0, C, N)


class SyntheticStats:
    """Task handler: real Fed3R statistics of the device's fixed synthetic features (``data``:
    device -> (Z, y), default :func:`data_for`)."""

    def __init__(self, device, gate: threading.Event | None = None, data=data_for, compute_s: float = 0.0):
        self.Z, self.y = data(device)
        self.gate, self.compute_s = gate, compute_s      # compute_s: a slower device's working time

    def __call__(self, params, tensors=None):
        if self.gate is not None:
            self.gate.wait(240)
        time.sleep(self.compute_s)
        acc = Fed3RAccumulator(C, self.Z.shape[1])
        acc.update(self.Z, self.y)
        A, ids, b = acc.sparse()
        return encode_stats(A, ids, b, acc.n, C)


def reference_sums(devices, dtype=np.float64) -> tuple[np.ndarray, np.ndarray]:
    """(A, B) = Σ ZᵀZ, Σ ZᵀY over the devices, bias column appended: plain numpy (float64 sums of
    the features as ``dtype`` holds them)."""
    A, B = np.zeros((D + 1, D + 1)), np.zeros((D + 1, C))
    for d in devices:
        Z, y = data_for(d)
        Z = Z.astype(dtype).astype(np.float64)
        Zb = np.hstack([Z, np.ones((len(Z), 1))])
        A += Zb.T @ Zb
        B += (np.eye(C)[y].T @ Zb).T          # per-class sums of the rows (the devices' orientation)
    return A, B


def clipped_sums(data, num_classes: int, n: int, clip: float) -> tuple[np.ndarray, np.ndarray]:
    """(A, B) = Σ ZᵀZ, Σ ZᵀY of DP Fed3R, plain numpy: of every device's (Z, y) in ``data`` its first
    ``n`` rows, each scaled to norm at most ``clip``, bias column appended."""
    A = B = 0.0
    for Z, y in data:
        Z, y = Z[:n].astype(np.float64), y[:n]
        Z *= np.minimum(1.0, clip / np.linalg.norm(Z, axis=1, keepdims=True))
        Zb = np.hstack([Z, np.ones((len(Z), 1))])
        A = A + Zb.T @ Zb
        B = B + Zb.T @ np.eye(num_classes)[y]
    return A, B


def assert_noise_of_variance(released, A: np.ndarray, B: np.ndarray, sigma2: float | tuple[float, float, float]) -> None:
    """What a DP job released (``packed_upper()`` of A, ``B``) is the exact sums plus noise in every
    entry, of mean square sigma2 within χ² bounds at 1e-6: one variance for every entry, or one
    each for A's diagonal, A's off-diagonal entries and B (each block checked on its own)."""
    from scipy import stats

    iu = np.triu_indices(len(A))
    a_noise, b_noise = released.packed_upper() - A[iu], (released.B.cpu().numpy() - B).ravel()
    if np.isscalar(sigma2):
        blocks = [(np.concatenate([a_noise, b_noise]), sigma2)]
    else:
        diagonal = iu[0] == iu[1]
        blocks = [(a_noise[diagonal], sigma2[0]), (a_noise[~diagonal], sigma2[1]), (b_noise, sigma2[2])]
    for noise, variance in blocks:
        assert np.abs(noise).min() > 0
        lo, hi = stats.chi2.ppf([1e-6, 1 - 1e-6], noise.size) / noise.size
        assert lo < np.mean(noise ** 2) / variance < hi, (noise.size, np.mean(noise ** 2) / variance)


class Features:
    """Stands in for the backbone in tests: the synthetic 'images' already are features (the
    backbones and exported runtimes are tested on real images elsewhere)."""

    def __init__(self, dim: int = D):
        self.feature_dim = dim

    def extract(self, x):
        return np.asarray(x, dtype=np.float32)


def head_training(device: str, gate: threading.Event | None = None):
    """Task handler for FedAvg jobs: the real device training code on the synthetic features;
    with a ``gate``, each task waits for it first (a round that cannot close until a test says)."""
    from edge_client.tasks.head_training import HeadTrainingTask

    Z, y = data_for(device)
    task = HeadTrainingTask(Z.astype(np.float32), y, lambda b, s, w: Features())
    if gate is None:
        return task

    def gated(params, tensors=None):
        gate.wait(240)
        return task(params, tensors)
    return gated


def in_memory_keys(devices) -> tuple[dict, "DeviceIdentity", "IdentityRegistry"]:
    """Fresh identities for ``devices``, the aggregator's, and the registry of the devices' keys: what an
    in-process secure job and its agents are built with (``SecureKeys``: the same, in files)."""
    from protocols.identity import DeviceIdentity, IdentityRegistry

    identities = {d: DeviceIdentity.generate(d) for d in devices}
    return identities, DeviceIdentity.generate("aggregator"), \
        IdentityRegistry({d: idt.public_key_bytes for d, idt in identities.items()})


@dataclasses.dataclass
class SecureKeys:
    """Identities of a secure job: the aggregator's and every device's, written where the job
    config points (``identity_file``, ``device_keys_file``)."""

    aggregator: object
    devices: dict

    @classmethod
    def create(cls, workdir: Path, devices) -> "SecureKeys":
        from protocols.identity import DeviceIdentity

        keys = cls(DeviceIdentity.generate("aggregator"), {d: DeviceIdentity.generate(d) for d in devices})
        (workdir / "aggregator.pem").write_bytes(keys.aggregator.to_pem())
        (workdir / "device_keys.json").write_text(json.dumps({d: i.public_key_bytes.hex()
                                                              for d, i in keys.devices.items()}))
        return keys

    def job_fields(self, workdir: Path) -> dict:
        return {"identity_file": str(workdir / "aggregator.pem"), "device_keys_file": str(workdir / "device_keys.json")}


def secure_fed3r_handlers(device: str, keys: SecureKeys) -> dict:
    """Fed3R-Sync on the device: real dense statistics of its synthetic features under SecAgg."""
    from edge_client.tasks.fed3r_stats import Fed3RStatsTask
    from edge_client.tasks.secure_fed3r import SecureFed3R
    from protocols.payloads.secagg import SECAGG_TYPE, SYNC_KIND

    Z, y = data_for(device)
    handler = SecureFed3R(keys.devices[device], keys.aggregator.public_key_bytes,
                          Fed3RStatsTask(Z, y, lambda b, s, w: Features()))
    return {SYNC_KIND: handler, SECAGG_TYPE: handler}


def kept_windows(folder: Path, min_difference: int | None = None):
    """The Fed3R sample-window ledger of a device with a state folder (``folder``, made here), as
    ``fedfleet device --state-dir`` keeps it: a device without one answers only windows of all its
    samples (no streaming increments, no caps below its count; edge_client/sample_windows.py)."""
    from edge_client.sample_windows import MIN_DIFFERENCE, WINDOWS_FILE, SampleWindowLedger

    Path(folder).mkdir(parents=True, exist_ok=True)
    return SampleWindowLedger(Path(folder) / WINDOWS_FILE, min_difference or MIN_DIFFERENCE)


def features_of(device: str):
    """A device's synthetic features as the device handlers' local data (20 training, the rest held out)."""
    from edge_client.handlers import LocalData

    Z, y = data_for(device)
    return LocalData(Z.astype(np.float32), y, np.arange(20), np.arange(20, len(y)))


def feature_handlers(device: str) -> dict:
    """The real device handlers (FedAvg, OLL, ...) on a device's synthetic features."""
    from edge_client.handlers import HandlerConfig, device_handlers

    return device_handlers(features_of(device), lambda *_, **__: Features(), HandlerConfig())


def with_secure(keys: "SecureKeys | None", plain) -> Callable[[str], tuple[dict, dict]]:
    """A device's (handlers, protocol handlers): the plain ones, and with keys the secure ones around them."""
    from edge_client.handlers import secure_handlers

    def build(device: str) -> tuple[dict, dict]:
        handlers = plain(device)
        if keys is None:
            return handlers, {}
        return handlers, secure_handlers(keys.devices[device], keys.aggregator.public_key_bytes, handlers)
    return build


def job_config(devices, kind: str = "fed3r", **over) -> dict:
    cfg = {"job_id": "ops", "num_classes": C, "feature_dim": D, "clients_per_round": 3, "round_timeout_s": 60,
           "expected_devices": len(devices), "start_timeout_s": 5}
    if kind in ("fed3r", "fed3r-sync", "fedncm", "fedncm-sync"):     # Fed3R's device task and config
        cfg["max_attempts"] = 5
    else:
        cfg.update(rounds=4, local_epochs=2, batch_size=8, client_lr=0.05, server_momentum=0.9, seed=5)
    cfg.update(over)
    return cfg


class Fleet:
    """Real device agents on threads; ``gates`` hold chosen devices' computations until set;
    ``handlers(device) -> (handlers, protocol_handlers)`` replaces the kind's synthetic ones."""

    def __init__(self, broker_url: str, devices, topics: Topics = Topics(), gates: dict | None = None,
                 credentials: dict | None = None, tls_ca: str | None = None, retry_after_s: float = 0.5,
                 kind: str = "fed3r", secure: "SecureKeys | None" = None, handlers=None,
                 identities: dict | None = None, aggregator_key: bytes | None = None, compute_s: float = 0.0):
        """``identities``: device -> DeviceIdentity signing its messages (an aggregator requiring
        signatures); ``aggregator_key``: the devices accept only messages signed with it."""
        self.agents = []
        for d in devices:
            user, password = (credentials or {}).get(d, (None, None))
            cfg = BrokerConfig.from_url(broker_url, tls_ca=tls_ca)
            if user:
                cfg = dataclasses.replace(cfg, username=user, password=password)
            protocol_handlers = {}
            if handlers is not None:
                handlers_of, protocol_handlers = handlers(d)
            elif kind == "fed3r":
                handlers_of = {"fed3r.stats": SyntheticStats(d, (gates or {}).get(d), compute_s=compute_s)}
            elif kind == "fed3r-sync":
                handlers_of, protocol_handlers = {}, secure_fed3r_handlers(d, secure)
            else:
                handlers_of = {"fedavg.head": head_training(d, (gates or {}).get(d))}
            signer = identities[d].sign if identities else None
            self.agents.append(DeviceAgent(d, cfg, handlers_of, topics=topics, retry_after_s=retry_after_s, tick_s=0.1,
                                           protocol_handlers=protocol_handlers, signer=signer,
                                           aggregator_key=aggregator_key))

    def __enter__(self) -> "Fleet":
        for a in self.agents:
            a.start()
        return self

    def __exit__(self, *exc):
        for a in self.agents:       # all told to stop first: each stop() then waits for one agent only
            a.loop.stop(join_s=0)
        for a in self.agents:
            a.stop()


# How much sooner than the test's wait the service ends itself (``--timeout``): its own end, with
# its reason in the log, comes before the test gives up on it.
SERVICE_MARGIN_S = 30


def aggregator_cmd(workdir: Path, broker_url: str, state: Path, extra: list[str] = (), wait_s: float = 120) -> list[str]:
    """``aggregator serve`` on the job prepared in ``workdir``; ``wait_s``: how long the test will wait
    for it, which sets the service's own ``--timeout`` (the two were set apart once, and a sharded job
    the test allowed 360 s was ended by the service at 90 s)."""
    kind = (workdir / "kind").read_text() if (workdir / "kind").exists() else "fed3r"
    return [sys.executable, "-m", "aggregator", "serve", "--config", str(workdir / "job.json"), "--kind", kind,
            "--broker", broker_url, "--out", str(workdir / "out"), "--state", str(state),
            "--enrolled", str(workdir / "enrolled.txt"), "--timeout", str(wait_s - SERVICE_MARGIN_S), *extra]


def prepare(workdir: Path, devices, kind: str = "fed3r", **cfg) -> None:
    """The job's files for :func:`run_aggregator`: the suite's synthetic config of ``kind``, ``cfg`` over it."""
    write_job(workdir, devices, kind, job_config(devices, kind, **cfg))


def write_job(workdir: Path, devices, kind: str, config: dict) -> None:
    """``config`` as the job :func:`run_aggregator` serves, ``devices`` enrolled."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "job.json").write_text(json.dumps(config))
    (workdir / "kind").write_text(kind)
    (workdir / "enrolled.txt").write_text("\n".join(devices) + "\n")


def aggregator_env(crash: str | None = None, extra: dict | None = None) -> dict:
    """The aggregator subprocess's environment: this checkout, one BLAS thread, a crash point or
    none, and ``extra`` (a test's DP noise seed)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **(extra or {}))
    env.pop("FEDFLEET_CRASH_AT", None)
    if crash:
        env["FEDFLEET_CRASH_AT"] = crash
    return env


def run_aggregator(workdir: Path, broker_url: str, state: Path, crash: str | None = None,
                   timeout: float = 120, extra: list[str] = (), env: dict | None = None) -> tuple[int, str]:
    """``python -m aggregator serve`` on the job prepared in ``workdir`` until it exits (forked from
    tests/aggregator_forkserver.py, which imported the aggregator once); (exit status, output)."""
    return run_aggregator_process(aggregator_cmd(workdir, broker_url, state, extra, timeout),
                                  aggregator_env(crash, env), REPO, fresh_log(workdir), timeout)


def start_aggregator_in(workdir: Path, broker_url: str, state: Path, extra: list[str] = (),
                        timeout: float = 120, env: dict | None = None) -> ForkedAggregator:
    """:func:`run_aggregator` without waiting: the started process (``poll``, ``wait``, ``kill``,
    ``output``); ``timeout``: how long the test will wait for it."""
    return start_aggregator(aggregator_cmd(workdir, broker_url, state, extra, timeout), aggregator_env(extra=env),
                            REPO, fresh_log(workdir))


def fresh_log(workdir: Path) -> Path:
    """A new file for one aggregator process's output, beside its job."""
    logs = workdir / "aggregator-logs"
    logs.mkdir(parents=True, exist_ok=True)
    return logs / f"{len(list(logs.iterdir())):03d}.log"


def wait_for(condition, timeout: float = 30.0, what: str = "condition") -> None:
    """Poll ``condition`` every 50 ms until it holds; an AssertionError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def run_uninterrupted(workdir: Path, devices, **job) -> Path:
    """The reference a crash test compares with: the same job prepared in ``workdir`` and run once
    to the end by the same subprocess entry point, on a fresh broker and state. Its output folder."""
    from fedfleet.emulation.broker import MosquittoBroker

    prepare(workdir, devices, **job)
    with MosquittoBroker() as broker, Fleet(broker.url, devices):
        rc, log = run_aggregator(workdir, broker.url, workdir / "state.db")
    assert rc == 0, log[-3000:]
    return workdir / "out"


class RecordingService:
    """An in-process AggregatorService run on a thread, recording every payload it receives, so
    a test can check what the aggregator saw (e.g. nothing but masked vectors)."""

    def __init__(self, job, broker_url: str, workdir: Path, enrolled: set[str], settings=None, *,
                 timeout_s: float = 150, identity=None):
        from aggregator.service.loop import AggregatorService
        from aggregator.service.settings import ServiceSettings

        self.svc = AggregatorService(job, BrokerConfig.from_url(broker_url), workdir, settings or ServiceSettings(),
                                     enrolled=enrolled, identity=identity)
        self.seen: list[bytes] = []
        original = self.svc._on_payload
        self.svc._on_payload = lambda topic, payload: (self.seen.append(payload), original(topic, payload))
        self.result: dict = {}
        self.thread = threading.Thread(target=lambda: self.result.update(self.svc.run(timeout_s=timeout_s)),
                                       daemon=True)
        self.thread.start()

    def join(self, timeout_s: float = 150) -> dict:
        self.thread.join(timeout_s)
        return self.result

    def received_envelopes(self):
        """The envelopes reassembled from everything received, in arrival order."""
        from protocols.chunking import MessageAssembler

        assembler = MessageAssembler()
        return [env for env in map(assembler.feed, self.seen) if env is not None]


def start_secure_fedavg_agents(broker_url: str, identities: dict, aggregator_key: bytes, kind: str,
                               tasks: dict, clocks: dict | None = None) -> list:
    """One started DeviceAgent per device that answers ``kind`` (fedavg.secure / fedavg.tail.secure)
    by masking what its plain FedAvg-family handler ``tasks[device]`` trained; ``clocks``: a
    device's own wall clock (e.g. one running ahead), the host's for the others."""
    from edge_client.tasks.secure_fedavg_training import SecureFedAvgTraining
    from edge_client.tasks.secure_update import SecAggSessions
    from edge_client.work_deadline import wall_clock
    from protocols.payloads.secagg import SECAGG_TYPE

    agents = []
    for device, task in tasks.items():
        clock = (clocks or {}).get(device, wall_clock)
        sessions = SecAggSessions(device, clock=clock)
        secure = SecureFedAvgTraining(identities[device], aggregator_key, task, sessions, kind=kind)
        agents.append(DeviceAgent(device, BrokerConfig.from_url(broker_url), {},
                                  protocol_handlers={kind: secure, SECAGG_TYPE: sessions}, clock=clock).start())
    return agents


def replay_round(replay, devices, tasks: dict, kind: str = "fedavg.head") -> list[tuple[dict, dict]]:
    """One round of a FedAvg-family job replayed in process: ``replay`` opened the round; each of
    ``devices`` runs its handler ``tasks[device]`` on the task the job sends it, the result goes
    through the wire codec into the job, and the round closes with them all. The (body, tensors)
    each device returned, in order."""
    from protocols.envelope import decode, encode
    from protocols.messages import TaskRef, result_message
    from protocols.rounds import RoundClosed

    outputs = []
    for dev in devices:
        params, tensors = replay.task_for(dev)
        body, out = tasks[dev](params, tensors)
        msg = result_message(dev, TaskRef(replay.config.job_id, replay.round, "x" * 32), kind, body, out)
        replay.apply(dev, replay.parse_result(decode(encode(msg))))
        outputs.append((body, out))
    replay.close_round(RoundClosed(replay.round, tuple(devices), (), (), ()))
    return outputs


def serve_until_done(job, broker_url: str, workdir: Path, handlers: dict, store=None, timeout_s: float = 60):
    """Serve ``job`` in-process until it ends, with one started DeviceAgent per device of
    ``handlers`` ({device: {kind: handler}}); (the service, its summary)."""
    from aggregator.service.loop import AggregatorService
    from aggregator.service.settings import ServiceSettings

    svc = AggregatorService(job, BrokerConfig.from_url(broker_url), workdir, ServiceSettings(tick_s=0.05),
                            enrolled=set(handlers), store=store)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=timeout_s)), daemon=True)
    thread.start()
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker_url), h, retry_after_s=2, tick_s=0.05).start()
              for d, h in handlers.items()]
    thread.join(timeout_s)
    for a in agents:
        a.stop()
    return svc, result


def close_fails_once(monkeypatch) -> list[int]:
    """Make the store's next round close fail (a disk I/O error), once: the rounds it failed (one)."""
    from aggregator.storage.store import Store, StoreError

    commit, failed = Store.close_round, []

    def fails_once(self, job_id, round_, *args, **kwargs):
        if not failed:
            failed.append(round_)
            raise StoreError("disk I/O error")
        return commit(self, job_id, round_, *args, **kwargs)

    monkeypatch.setattr(Store, "close_round", fails_once)
    return failed
