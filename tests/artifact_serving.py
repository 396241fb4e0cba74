"""What the bundle distribution tests (tests/test_artifact_*.py) share: a private copy of the exported
bundle (a test tampers with its files), an idle aggregator serving a shelf of artifacts over
mosquitto, and a valid one-file manifest that a test's own aggregator (or forger) serves."""

import shutil
import threading

import pytest

from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.service.loop import AggregatorService
from protocols.mqtt_link import BrokerConfig


@pytest.fixture(scope="module")
def bundle(onnx_bundle_32px, tmp_path_factory):
    """A private copy of the shared bundle: a test here tampers with its ONNX file."""
    out = tmp_path_factory.mktemp("bundle") / "mnv2-32"
    shutil.copytree(onnx_bundle_32px, out)
    return out


def serve(broker, tmp_path, shelf):
    # an idle Fed3R job that waits for devices: the service answers artifact requests meanwhile
    job = Fed3RJob(Fed3RConfig(num_classes=10, feature_dim=4, expected_devices=99, start_timeout_s=1e6))
    svc = AggregatorService(job, BrokerConfig.from_url(broker.url), tmp_path / "agg", enrolled={"cam1"},
                            artifacts=shelf)
    t = threading.Thread(target=lambda: svc.run(timeout_s=120), daemon=True)
    t.start()
    return svc, t


def one_file_manifest(bundle, name: str, data: bytes) -> bytes:
    """The bundle's manifest cut to one inference file named ``name`` that holds ``data``: a valid
    manifest that a test's own aggregator (or forger) serves with a file of its own."""
    import hashlib
    import json

    manifest = json.loads((bundle / "manifest.json").read_bytes())
    entry = next(spec for spec in manifest["artifacts"] if spec["kind"] == "inference")
    manifest["artifacts"] = [{**entry, "file": name, "sha256": hashlib.sha256(data).hexdigest(),
                              "size_bytes": len(data)}]
    return json.dumps(manifest).encode()
