"""A job whose task no device would take is refused when it is created (a review's finding).

Devices take no message larger than their inbox holds of one topic, 128 MiB
(``protocols/device_inbox.py``, the Python and the Java agent alike). A Scaffold config of 20,000
classes of 1,280 features was accepted (its head is within ``MAX_HEAD_ENTRIES``), stored, started,
and then declined by every device: its task, the head and the server control, is 195 MiB. Now the
config is refused with the size and the bound, through the admin API (422, nothing stored), the
admin command, and the registry every entry point builds from; a config just under the bound is
accepted. The size the check computes is held to the bytes a real job's task encodes to."""

from __future__ import annotations

import json
import threading

import pytest
from starlette.testclient import TestClient

from aggregator.api.app import create_app
from aggregator.api.server import ApiServer
from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.jobs.registry import KINDS, build_job, full_config, kind_of
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from aggregator.storage.store import Store
from fedfleet.admin import main as admin
from protocols import messages as M
from protocols.device_inbox import DEVICE_INBOX_BOUND, LARGEST_DEVICE_MESSAGE_BYTES, message_bytes_at_most
from protocols.envelope import MAX_HEADER_BYTES, PREFIX_LEN, encode
from protocols.identity import DeviceIdentity
from protocols.mqtt_link import BrokerConfig
from protocols.topics import AGGREGATOR_ID

TOKEN = "test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BOUND = 128 * 2 ** 20
HEADROOM = PREFIX_LEN + MAX_HEADER_BYTES     # what the check counts beside the tensors


def largest_fitting_classes(heads_per_task: int, feature_dim: int) -> int:
    """The most classes whose task (``heads_per_task`` float32 heads of C x (d + 1)) is within the
    bound, worked out here from the sizes alone."""
    return (BOUND - HEADROOM) // (heads_per_task * 4 * (feature_dim + 1))


# (kind, float32 heads a task carries): FedAvg's head; Scaffold's head and its control c
EDGES = [("fedavg", 1), ("scaffold", 2), ("scaffold-secure", 2), ("ditto", 1), ("fedgloss", 1)]


def test_the_bound_is_the_devices_one_rule():
    assert LARGEST_DEVICE_MESSAGE_BYTES == DEVICE_INBOX_BOUND.source_bytes == BOUND
    from edge_client.agent import DEVICE_INBOX_BOUND as agents
    from edge_client.inbox import aggregator_inbox
    assert agents is DEVICE_INBOX_BOUND
    assert aggregator_inbox().reassembler.max_message_bytes == BOUND


def test_the_reviews_scaffold_job_is_refused_with_its_size_and_the_bound():
    config = {"num_classes": 20_000, "feature_dim": 1280}
    task = 2 * 4 * 20_000 * 1281 + HEADROOM
    for refuse in (full_config, build_job):
        with pytest.raises(ValueError) as refused:
            refuse("scaffold", config)
        said = str(refused.value)
        assert f"{task:,} bytes" in said and f"{BOUND:,} bytes (128 MiB)" in said and "num_classes" in said, said
    full_config("fedavg", config)                # the head alone, 98 MiB, fits


@pytest.mark.parametrize("kind,heads", EDGES)
def test_a_task_just_over_the_bound_is_refused_and_one_just_under_accepted(kind, heads):
    feature_dim = 1279 if heads == 1 else 1280
    fits = largest_fitting_classes(heads, feature_dim)
    under = {"num_classes": fits, "feature_dim": feature_dim, "job_id": "under"}
    over = {**under, "num_classes": fits + 1, "job_id": "over"}
    assert message_bytes_at_most(kind_of(kind).config_cls(**over).task_tensors()) > BOUND \
        >= message_bytes_at_most(kind_of(kind).config_cls(**under).task_tensors())
    assert full_config(kind, under)["num_classes"] == fits
    with pytest.raises(ValueError, match=f"more than the {BOUND:,} bytes"):
        full_config(kind, over)


def test_every_head_within_max_head_entries_still_fits_fedavg():
    """FedAvg's head at the config's entry limit was 128 MiB alone, its header no longer fitting:
    the limit is now the one the bound sets, said with the size."""
    from aggregator.jobs.model_fields import MAX_HEAD_ENTRIES
    with pytest.raises(ValueError, match="a fedavg job's task would be up to"):
        full_config("fedavg", {"num_classes": MAX_HEAD_ENTRIES // 1024, "feature_dim": 1023})


# every kind that builds from its config alone and whose task carries tensors, and one that carries none
BUILDABLE = [("fedavg", {}), ("scaffold", {}), ("pp", {}), ("ditto", {}), ("fedgloss", {}), ("fedavg-async", {}),
             ("fed3r", {}), ("fedncm", {})]


def real_task_bytes(kind: str, config: dict) -> tuple[int, int]:
    """A real job's first task, as the service builds it (``JobRunner._task_message``), encoded
    and signed: (its length, the payload's length)."""
    job = build_job(kind, config)
    if job.asynchronous:
        device = job.next_dispatches({"d1", "d2", "d3"})[0]
        job.open_dispatch(device)
    else:
        device = sorted(job.next_participants({"d1", "d2", "d3"}))[0]
    params, tensors = job.task_for(device)
    msg = M.task_message(AGGREGATOR_ID, config["job_id"], job.round, job.kind, params, 1.7e9, device=device)
    msg.id = "ab" * 16
    msg.tensors.update(tensors)
    data = encode(msg, signer=DeviceIdentity.generate(AGGREGATOR_ID).sign)
    header_len = int.from_bytes(data[4:8], "little")
    return len(data), len(data) - PREFIX_LEN - header_len


@pytest.mark.parametrize("kind,extra", BUILDABLE)
def test_the_computed_size_is_what_a_real_task_encodes_to(kind, extra):
    """The independent reference: a small real job's task, encoded. Its tensors weigh exactly what
    the config declares; the whole message is never more than the check counts, and less by the
    header's unused room only."""
    config = {"job_id": "small", "num_classes": 7, "feature_dim": 33, "clients_per_round": 3, **extra}
    total, payload = real_task_bytes(kind, config)
    computed = message_bytes_at_most(kind_of(kind).config_cls(**config).task_tensors())
    assert computed - HEADROOM == payload
    assert total <= computed and computed - total == MAX_HEADER_BYTES - (total - PREFIX_LEN - payload)
    if kind in ("fedavg", "scaffold"):
        assert payload == {"fedavg": 1, "scaffold": 2}[kind] * 4 * 7 * 34


def test_a_centred_fed3r_job_declares_the_feature_center_its_tasks_carry():
    """A DP Fed3R job that centres its rows sends the released center (float64, one value per
    feature: ``dp_center.py``) with each task after its center round."""
    config = Fed3RConfig(num_classes=3, feature_dim=5, dp_noise_multiplier=1.0, dp_center_devices=2,
                         dp_center_clip_norm=1.0, feature_clip_norm=1.0)
    assert config.task_tensors() == {"feature_center": ("float64", (5,))}
    assert Fed3RConfig(num_classes=3, feature_dim=5).task_tensors() == {}


def _service(broker, tmp_path):
    store = Store(tmp_path / "state.db")
    job = Fed3RJob(Fed3RConfig(job_id="idle", expected_devices=1))
    svc = AggregatorService(job, BrokerConfig.from_url(broker.url), tmp_path / "out",
                            ServiceSettings(keep_serving=True, tick_s=0.05), enrolled={"ghost"}, store=store)
    thread = threading.Thread(target=svc.run, kwargs={"timeout_s": 60}, daemon=True)
    thread.start()
    return svc, store, thread


def test_the_admin_api_and_command_refuse_it_and_store_nothing(broker, tmp_path, capsys):
    svc, store, thread = _service(broker, tmp_path)
    api = ApiServer(create_app(store, TOKEN, svc)).start()
    try:
        client = TestClient(create_app(store, TOKEN, svc))
        fits = largest_fitting_classes(2, 1280)
        over = {"num_classes": fits + 1, "feature_dim": 1280}
        refused = client.post("/api/jobs", headers=AUTH, json={"job_id": "big", "kind": "scaffold", "config": over})
        assert refused.status_code == 422, refused.text
        said = refused.json()["detail"]
        assert "a scaffold job's task would be up to" in said and f"{BOUND:,} bytes (128 MiB)" in said, said
        assert client.get("/api/jobs/big", headers=AUTH).status_code == 404 and store.job("big") is None

        path = tmp_path / "big.json"
        path.write_text(json.dumps({**over, "job_id": "big2"}))
        capsys.readouterr()
        assert admin(["--url", api.url, "--token", TOKEN, "job", "create", str(path), "--kind", "scaffold"]) != 0
        err = capsys.readouterr().err
        assert "a scaffold job's task would be up to" in err and len(err.strip().splitlines()) == 1, err
        assert store.job("big2") is None

        under = {"num_classes": fits, "feature_dim": 1280}
        made = client.post("/api/jobs", headers=AUTH, json={"job_id": "fits", "kind": "scaffold", "config": under})
        assert made.status_code == 201 and store.job("fits")["config"]["num_classes"] == fits, made.text
        assert {j["job_id"] for j in store.jobs()} == {"idle", "fits"}
    finally:
        api.stop()
        svc.stop()
        thread.join(30)


def test_every_kind_whose_tasks_carry_a_head_declares_it():
    """A kind whose tasks carry the head declares it (a new kind is held to the bound from its first line)."""
    from aggregator.jobs.base import JobConfig
    for name, spec in KINDS.items():
        if not any(part in name for part in ("fed3r", "fedncm", "ladd")):
            assert spec.config_cls.task_tensors is not JobConfig.task_tensors, name
            files = {"tail_program_file": "tail_eval.pt2"} if "tail" in name else {}
            assert set(spec.config_cls(job_id="x", **files).task_tensors()) >= {"weight", "bias"}, name


def test_a_built_job_whose_task_is_too_large_stops_before_any_device_is_asked(broker, tmp_path, monkeypatch):
    """What a config cannot declare (a tail program's tensors, a pretrained network) is held to the
    bound when the round's tasks are built: the job stops with the size and the bound, no round is
    stored, no device gets the task. Here a job built in Python (no config check) meets a bound
    lowered to 1 MiB; its head is 2.6 MB."""
    import protocols.device_inbox as inbox
    from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob
    from edge_client.agent import DeviceAgent

    monkeypatch.setattr(inbox, "LARGEST_DEVICE_MESSAGE_BYTES", 2 ** 20)
    devices = ["dev-a", "dev-b"]
    config = FedAvgConfig(job_id="wide", num_classes=80, feature_dim=8192, clients_per_round=2, expected_devices=2)
    store = Store(tmp_path / "state.db")
    svc = AggregatorService(FedAvgJob(config), BrokerConfig.from_url(broker.url), tmp_path, enrolled=set(devices),
                            store=store)
    result = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=60)), daemon=True)
    thread.start()
    ran = []
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url), {"fedavg.update": lambda p, t=None: ran.append(p)})
              .start() for d in devices]
    try:
        thread.join(30)
        assert not thread.is_alive()
        said = str(result) + str(store.job("wide"))
        assert f"job wide's task would be up to {4 * 80 * 8193 + HEADROOM:,} bytes" in said, said
        assert "more than the 1,048,576 bytes" in said
        assert store.rounds("wide") == [] and ran == []
    finally:
        for agent in agents:
            agent.stop()
        svc.stop()
