"""The path a newcomer takes (issue 29, "Also"): ``fedfleet aggregator serve --artifacts BUNDLE``
with a minimal job config, and devices that cannot contribute.

* the bundle the aggregator serves is the job's ``bundle_sha256`` unless the config names one; a
  config naming a bundle it does not serve is refused when the job is created (CLI and admin API),
  not discovered by devices;
* a job no device contributed to ends ``failed``, with the devices' decline reasons, in the store,
  ``results.json``, the admin API and ``fedfleet admin jobs``;
* a device that declines logs the reason once, however often it is asked.
"""

import json
import logging
import shutil
import threading

import pytest
from starlette.testclient import TestClient

from aggregator import cli as aggregator_cli
from aggregator.api.app import create_app
from aggregator.api.server import ApiServer
from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.service.artifacts import ArtifactShelf, with_served_bundle
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from aggregator.storage.store import Store
from edge_client.agent import DeviceAgent, TaskDeclined
from fedfleet.admin import main as admin
from protocols.files import file_sha256
from protocols.mqtt_link import BrokerConfig
from protocols.payloads.fed3r import KIND as FED3R_KIND

TOKEN = "newcomer-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def bundle(onnx_bundle_32px):
    return onnx_bundle_32px


def other_bundle(bundle, tmp_path):
    """The same files under a manifest written differently: another manifest sha256."""
    copy = tmp_path / "other"
    shutil.copytree(bundle, copy)
    manifest = copy / "manifest.json"
    manifest.write_text(json.dumps(json.loads(manifest.read_text()), indent=4))
    return copy


def test_the_served_bundle_is_the_jobs_unless_the_config_names_one(bundle, tmp_path):
    shelf = ArtifactShelf()
    sha = shelf.add_bundle(bundle)
    assert with_served_bundle("fed3r", {"num_classes": 10}, shelf) == {"num_classes": 10, "bundle_sha256": sha}
    assert with_served_bundle("fed3r", {"bundle_sha256": sha}, shelf) == {"bundle_sha256": sha}
    assert with_served_bundle("fed3r", {}, None) == {} and with_served_bundle("fed3r", {}, ArtifactShelf()) == {}
    with pytest.raises(ValueError, match="not a bundle this aggregator serves"):
        with_served_bundle("fed3r", {"bundle_sha256": "ab" * 32}, shelf)
    # a file of the bundle is served too, but it is no bundle a job can run on
    with pytest.raises(ValueError, match="not a bundle this aggregator serves"):
        with_served_bundle("fed3r", {"bundle_sha256": file_sha256(bundle / "inference.onnx")}, shelf)
    second = shelf.add_bundle(other_bundle(bundle, tmp_path))
    assert second != sha and shelf.bundles == [sha, second]
    with pytest.raises(ValueError, match="serves 2 bundles"):
        with_served_bundle("fed3r", {}, shelf)
    assert with_served_bundle("fed3r", {"bundle_sha256": second}, shelf)["bundle_sha256"] == second


def test_a_job_created_through_the_api_runs_on_the_served_bundle(broker, bundle, tmp_path):
    shelf = ArtifactShelf()
    sha = shelf.add_bundle(bundle)
    store = Store(tmp_path / "state.db")
    job = Fed3RJob(Fed3RConfig(job_id="first", num_classes=10, feature_dim=4, expected_devices=9, start_timeout_s=1e6))
    svc = AggregatorService(job, BrokerConfig.from_url(broker.url), tmp_path / "out",
                            ServiceSettings(keep_serving=True, tick_s=0.05), store=store, artifacts=shelf)
    thread = threading.Thread(target=svc.run, kwargs={"timeout_s": 60}, daemon=True)
    thread.start()
    try:
        client = TestClient(create_app(store, TOKEN, svc))
        made = client.post("/api/jobs", headers=AUTH, json={"job_id": "plain", "kind": "fed3r", "config": {}})
        assert made.status_code == 201, made.text
        assert made.json()["config"]["bundle_sha256"] == sha
        refused = client.post("/api/jobs", headers=AUTH,
                              json={"job_id": "wrong", "kind": "fed3r", "config": {"bundle_sha256": "cd" * 32}})
        assert refused.status_code == 422 and "not a bundle this aggregator serves" in refused.json()["detail"]
        assert store.job("wrong") is None
    finally:
        svc.stop()
        thread.join(30)


class DecliningDevice:
    """A device with nothing to offer yet: it declines every task, noting the bundle it was told."""

    def __init__(self, device_id, broker):
        self.bundles = []
        self.agent = DeviceAgent(device_id, BrokerConfig.from_url(broker.url), {FED3R_KIND: self.handle},
                                 retry_after_s=1.0, tick_s=0.05)

    def handle(self, params, tensors):
        self.bundles.append(params["bundle_sha256"])
        raise TaskDeclined("no images in the camera roll yet")


def test_a_job_no_device_could_contribute_to_fails_saying_why(broker, bundle, tmp_path, caplog, capsys):
    shelf = ArtifactShelf()
    sha = shelf.add_bundle(bundle)
    config = tmp_path / "job.json"
    config.write_text(json.dumps({"job_id": "newcomer", "num_classes": 10, "expected_devices": 2, "max_attempts": 3,
                                  "clients_per_round": 2, "round_timeout_s": 20, "start_timeout_s": 30}))
    args = ["serve", "--config", str(config), "--broker", broker.url, "--artifacts", str(bundle),
            "--out", str(tmp_path / "out"), "--state", str(tmp_path / "state.db"), "--timeout", "90"]
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"job_id": "wrong", "bundle_sha256": "ef" * 32}))
    assert aggregator_cli.main(["serve", "--config", str(wrong), *args[3:]]) == 2      # one line, exit 2
    assert "not a bundle this aggregator serves" in capsys.readouterr().err

    devices = [DecliningDevice(d, broker) for d in ("cam-a", "cam-b")]
    caplog.set_level(logging.WARNING, logger="fedfleet.device")
    for d in devices:
        d.agent.start()
    try:
        rc = aggregator_cli.main(args)
    finally:
        for d in devices:
            d.agent.stop()
    assert rc == 1
    for d in devices:       # every task named the served bundle; asked max_attempts times, said why once
        assert d.bundles == [sha] * 3 and d.agent.stats.tasks_declined == 3
        said = [r for r in caplog.records if r.getMessage().startswith(f"{d.agent.device_id}: declined")]
        assert len(said) == 1 and "no images in the camera roll yet" in said[0].getMessage()

    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["state"] == "failed" and results["results_accepted"] == 0
    why = results["error"]
    assert "no device contributed" in why and "no images in the camera roll yet (cam-a, cam-b)" in why
    store = Store(tmp_path / "state.db")
    row = store.job("newcomer")
    assert row["state"] == "failed" and row["summary"]["error"] == why and row["finished_at"] is not None
    assert store.models("newcomer") == []                  # nothing was learnt: no final model version

    api = ApiServer(create_app(store, TOKEN)).start()
    try:
        (job,) = TestClient(create_app(store, TOKEN)).get("/api/jobs", headers=AUTH).json()
        assert job["state"] == "failed" and job["summary"]["error"] == why
        capsys.readouterr()
        assert admin(["jobs", "--url", api.url, "--token", TOKEN]) == 0
        line = capsys.readouterr().out.splitlines()[-1]
        assert line.startswith("newcomer") and "failed" in line and "no images in the camera roll yet" in line
    finally:
        api.stop()
