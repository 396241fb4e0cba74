"""What the secure shard tests over mosquitto share (tests/test_secure_shards_*.py,
tests/test_secure_ladd_shards.py): the fleet, a secure job run on a fresh broker by one aggregator
and by two shards with the same keys (devices verifying every message is the aggregator's), the
handlers of each kind, the devices' kept state, and the bit-for-bit comparison of the outputs."""

import json

import numpy as np

from aggregator.jobs.device_state_fields import RUN_KEY
from fedfleet.emulation.broker import MosquittoBroker

from ops_fleet import (Features, Fleet, SecureKeys, feature_handlers, features_of, prepare, run_aggregator,
                       secure_fed3r_handlers, with_secure)

DEVICES = [f"dev{i:02d}" for i in range(3, 9)]      # dev08 is shard 1's, the others shard 0's
SHARDS = ["--shards", "2"]


def outputs(out_dir, files=("model.npz", "statistics.npz")):
    return [dict(np.load(out_dir / f)) for f in files if (out_dir / f).exists()], \
        json.loads((out_dir / "results.json").read_text())


def assert_same_bytes(got, want):
    assert [sorted(a) for a in got] == [sorted(a) for a in want]
    for g, w in zip(got, want):
        for name in set(w) - {RUN_KEY}:     # pp's run id: a random nonce of each run, never the model's
            assert g[name].tobytes() == w[name].tobytes(), name         # bit for bit


def state_feature_handlers(workdir):
    """The real device handlers on the synthetic features, each device with its own state store
    (pp keeps its personal part there) in ``workdir``: every run starts from empty stores."""
    from edge_client.handlers import HandlerConfig, device_handlers
    from edge_client.state import DeviceStateStore

    def handlers(device: str) -> dict:
        return device_handlers(features_of(device), lambda *_, **__: Features(), HandlerConfig(),
                               DeviceStateStore(workdir / "device-state" / device))
    return handlers


def tail_handlers(request):
    """FT(M)'s device handlers on the suite's 32 px tail bundle: 12 Fashion-MNIST images a device."""
    from edge_client.data import load_fashion_mnist
    from edge_client.handlers import HandlerConfig, LocalData, SharedExtractors, device_handlers

    manifest = request.getfixturevalue("tail_bundle")
    images, labels = load_fashion_mnist("train")
    extractors = SharedExtractors(lambda *_: Features(), None)

    def handlers(device: str) -> dict:
        i = DEVICES.index(device)
        data = LocalData(images[12 * i:12 * i + 12], labels[12 * i:12 * i + 12].astype(np.int64), np.arange(12))
        return device_handlers(data, extractors, HandlerConfig(tail_manifest=str(manifest)))
    return handlers, manifest


SYNC_KINDS = ("fed3r-sync", "fedncm-sync")        # Fed3R-Sync's device task and groups; FedNCM solves them as class means


def run_secure(workdir, keys, kind: str, extra=(), plain=None, secure=None, **job) -> tuple[int, str]:
    """The job on a fresh broker and state, its devices verifying that every message they get is
    signed by the aggregator's key (a shard hosting a group signs as the aggregator). ``plain``:
    ``workdir -> device -> handlers`` (default: the real handlers on the synthetic features);
    ``secure``: ``(device, its protocol handlers) -> protocol handlers`` (a modified device's)."""
    prepare(workdir, DEVICES, kind=kind, max_samples=100, **{"phase_timeout_s": 20, **job}, **keys.job_fields(workdir.parent))
    if kind in SYNC_KINDS:
        handlers = lambda device: ({}, secure_fed3r_handlers(device, keys))   # noqa: E731
    else:
        handlers = with_secure(keys, (plain or (lambda _w: feature_handlers))(workdir))
    if secure is not None:
        handlers = modified(handlers, secure)
    with MosquittoBroker() as broker, Fleet(broker.url, DEVICES, kind=kind, secure=keys, handlers=handlers,
                                            aggregator_key=keys.aggregator.public_key_bytes):
        # a phase closes when its last member answers; its timeout only bounds a slow machine's
        # training (FT(M) on the tail program took over 5 s per device under the whole suite's load)
        return run_aggregator(workdir, broker.url, workdir / "state.db", extra=extra, timeout=420)


def modified(handlers, secure):
    def build(device: str) -> tuple[dict, dict]:
        plain, protocol = handlers(device)
        return plain, secure(device, protocol)
    return build


def one_and_sharded(tmp_path, kind: str, sharded=SHARDS, plain=None, **job):
    """(one aggregator's, two shards') outputs of the same job with the same keys."""
    keys = SecureKeys.create(tmp_path, DEVICES)
    runs = []
    for name, extra in (("one", ()), ("sharded", sharded)):
        (tmp_path / name).mkdir()
        rc, log = run_secure(tmp_path / name, keys, kind, extra, plain, **job)
        assert rc == 0, log[-3000:]
        assert "rejected message" not in log            # no secagg message reached the coordinator
        runs.append(outputs(tmp_path / name / "out"))
    return runs


# the secure FedAvg family's stateful kinds: their own fields (each device keeps v_k / c_k / v_k in its store)
STATEFUL = {"pp-secure": {"pp_algorithm": "fedalt"}, "scaffold-secure": {"total_devices": 6, "control_clip_norm": 0.5},
            "ditto-secure": {"ditto_lambda": 0.5}}


def secure_round_job(kind: str, request) -> tuple:
    """(device handlers, the kind's job fields) of a secure FedAvg family kind: every one is a
    ``SecureFedAvgJob`` whose groups shards host the same way (``group_placement.py``)."""
    fields = {"rounds": 2, "clients_per_round": 3, "local_epochs": 1, "max_abs_param": 50.0}
    if kind == "fedavg-secure":
        return None, fields
    if kind in STATEFUL:
        return state_feature_handlers, {**fields, **STATEFUL[kind]}
    handlers, manifest = tail_handlers(request)
    return (lambda _workdir: handlers), {
        **fields, "num_classes": 10, "feature_dim": 1280, "image_size": 32, "batch_size": 6, "client_lr": 0.01,
        "train": "tail+head", "tail_stages": 1, "init": "zeros", "tail_program_file": str(manifest.parent / "tail_eval.pt2"),
        "phase_timeout_s": 150}     # FT(M) on the tail program: its advertise phase holds the devices' training


def device_states(workdir) -> dict[str, dict[str, np.ndarray]]:
    """Each device's kept state (v_k, c_k) as its store holds it after the run: job -> arrays."""
    from edge_client.state import DeviceStateStore

    states = {}
    for device in DEVICES:
        store = DeviceStateStore(workdir / "device-state" / device)
        for job in store.jobs():
            states[f"{device}/{job}"] = store.load(job, None).arrays
    return states


SECURE_ROUND_KINDS = ["fedavg-secure", "pp-secure", "fedavg-tail-secure", "scaffold-secure", "ditto-secure"]


def check_secure_rounds(tmp_path, kind: str, request, sharded=SHARDS) -> None:
    """Two rounds of three of the six devices, each round's group on its own shard; a stateful
    kind's devices keep the same state (pp's v_k, Scaffold's c_k, Ditto's v_k), bit for bit."""
    plain, fields = secure_round_job(kind, request)
    (want, want_results), (got, results) = one_and_sharded(tmp_path, kind, sharded=sharded, plain=plain, **fields)
    # who contributed first: a member the slow machine's load timed out changes the model legitimately
    assert results["contributed"] == want_results["contributed"] and results["state"] == "done", (results, want_results)
    assert sum(results["contributed"].values()) == 2 * 3
    assert_same_bytes(got, want)
    if kind in STATEFUL:
        kept, want_kept = device_states(tmp_path / "sharded"), device_states(tmp_path / "one")
        assert len(kept) == len(results["contributed"])         # every contributor keeps its state
        assert_same_bytes(list(kept.values()), list(want_kept.values()))
        assert list(kept) == list(want_kept)
