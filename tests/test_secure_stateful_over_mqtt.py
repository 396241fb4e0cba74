"""Secure Scaffold(ψ) and secure Ditto(ψ) over mosquitto: the devices' handlers as a real device
builds them (``edge_client.handlers.secure_handlers`` around the plain stateful handlers, each
device with its state store), the aggregator service in process. The global head (and Scaffold's
server control c) equals an in-process replay of the plain job over each round's survivors
(devices with their own stores) within the fixed-point grid, and the aggregator never received a
head, a control delta or a personal head in the clear."""

import numpy as np
import pytest
from ops_fleet import RecordingService, SecureKeys

from aggregator.service.settings import ServiceSettings
from edge_client.agent import DeviceAgent
from edge_client.handlers import secure_handlers
from protocols.mqtt_link import BrokerConfig

from stateful_jobs import run_round
from test_secure_stateful import DEVICES, DITTO_KIND, GRID, HEAD, SCAFFOLD_KIND, plain_handler, plain_job, secure_job


@pytest.mark.parametrize("kind", [SCAFFOLD_KIND, DITTO_KIND])
def test_secure_stateful_rounds_over_mosquitto_equal_the_plain_rounds(broker, tmp_path, kind):
    keys = SecureKeys.create(tmp_path, DEVICES)
    job = secure_job(kind, tmp_path, keys, rounds=2, round_timeout_s=60, expected_devices=len(DEVICES),
                     start_timeout_s=30)
    service = RecordingService(job, broker.url, tmp_path / "agg", set(DEVICES), ServiceSettings(tick_s=0.05),
                               timeout_s=90)
    agents = []
    for i, d in enumerate(DEVICES):
        handler = plain_handler(kind, i, tmp_path / "secure")
        protocols = secure_handlers(keys.devices[d], keys.aggregator.public_key_bytes, {kind: handler})
        agents.append(DeviceAgent(d, BrokerConfig.from_url(broker.url), {}, protocol_handlers=protocols,
                                  state=handler.store, tick_s=0.05).start())
    try:
        result = service.join(90)
    finally:
        for a in agents:
            a.stop()
    assert result.get("state") == "done" and len(result["rounds"]) == 2 and not job.failed_rounds, result
    plain = plain_job(kind, rounds=2)
    replay = {d: plain_handler(kind, i, tmp_path / "plain") for i, d in enumerate(DEVICES)}
    for r in result["rounds"]:
        # the plain job samples as the secure one (same seed); those outside the round's sum never answer
        sent = run_round(plain, replay, kind, only=DEVICES, silent=set(DEVICES) - set(r["accepted"]))
        assert sorted(sent) == sorted(r["accepted"]) and len(sent) >= 3, r
    for k in HEAD:
        np.testing.assert_allclose(job.params[k], plain.params[k], rtol=0, atol=GRID)
        if kind == SCAFFOLD_KIND:
            np.testing.assert_allclose(job.control[k], plain.control[k], rtol=0, atol=GRID)
    assert np.abs(job.params["weight"] - plain_job(kind).params["weight"]).max() > 100 * GRID      # it trained
    envelopes = service.received_envelopes()
    assert "secagg" in {env.type for env in envelopes} and "result" not in {env.type for env in envelopes}
    assert not any(set(env.tensors) & {"weight", "bias", "delta_control.weight"} for env in envelopes)
