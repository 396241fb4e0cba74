"""What the bundle distribution tests (tests/test_artifact_*.py) share: a private copy of the exported
bundle (a test tampers with its files), an idle aggregator serving a shelf of artifacts over
mosquitto, a valid one-file manifest that a test's own aggregator (or forger) serves, and such a
stand-in aggregator answering a device's asks from a table of files."""

import contextlib
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


@contextlib.contextmanager
def answering(broker, device_id: str, served: dict, asked: list):
    """A stand-in aggregator on ``broker`` while in the block: it answers ``device_id``'s asks for the
    files in ``served`` (sha256 -> (file name, bytes)) and notes each sha256 asked for in ``asked``."""
    from protocols.envelope import decode, encode
    from protocols.mqtt_link import MqttLink
    from protocols.payloads.artifacts import GET, artifact_message
    from protocols.topics import AGGREGATOR_ID, Topics

    topics = Topics()

    def answer(payload: bytes) -> None:
        ask = decode(payload)
        if ask.type == GET and ask.body["sha256"] in served:
            asked.append(ask.body["sha256"])
            link.publish(topics.inbox(device_id), encode(artifact_message(AGGREGATOR_ID, ask.body["sha256"],
                                                                          *served[ask.body["sha256"]])))

    link = MqttLink("aggregator", BrokerConfig.from_url(broker.url), on_message=lambda t, p: answer(p),
                    subscriptions=[(topics.outbox(device_id), 1)])
    link.start(timeout=30)
    try:
        yield
    finally:
        link.stop()
