""""Any MQTT 3.1.1 or 5 broker": the protocol version is part of the broker address, and a Fed3R
job over MQTT 3.1.1 gives the same statistics against mosquitto and against a second,
independently written broker (amqtt) — real agents, the real service, an independent numpy sum."""

import threading

import numpy as np
import pytest

from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from edge_client.agent import DeviceAgent
from fedfleet.emulation.broker import MosquittoBroker
from protocols.mqtt_link import BrokerConfig

from second_broker import AmqttBroker
from test_aggregator_over_mqtt import C, D, SyntheticStats, data_for

DEVICES = [f"dev{i:02d}" for i in range(3)]


@pytest.mark.parametrize("url,version", [("mqtt://h:1883", "5"), ("mqtt://h?version=3.1.1", "3.1.1"),
                                         ("mqtt://u:p%40ss@h:1884?version=5", "5")])
def test_the_version_is_part_of_the_broker_address(url, version):
    cfg = BrokerConfig.from_url(url)
    assert cfg.protocol == version and BrokerConfig.from_url(cfg.url()).protocol == version
    if "u:" in url:
        assert (cfg.username, cfg.password, cfg.port) == ("u", "p@ss", 1884)


@pytest.mark.parametrize("url,words", [("htp://h", "scheme"), ("mqtt://h?version=4", "version"),
                                       ("mqtt://h?qos=2", "unknown parameter"), ("mqtt://h:99999", "port")])
def test_a_bad_broker_address_is_one_clear_error(url, words):
    with pytest.raises(ValueError, match=words):
        BrokerConfig.from_url(url)


def run_fed3r(url: str, out) -> dict:
    config = Fed3RConfig(num_classes=C, feature_dim=D, clients_per_round=3, round_timeout_s=30, expected_devices=3)
    svc = AggregatorService(Fed3RJob(config), BrokerConfig.from_url(url), out, ServiceSettings(tick_s=0.05),
                            enrolled=set(DEVICES))
    result = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=60)), daemon=True)
    thread.start()
    agents = [DeviceAgent(d, BrokerConfig.from_url(url), {"fed3r.stats": SyntheticStats(i)}, retry_after_s=2).start()
              for i, d in enumerate(DEVICES)]
    thread.join(65)
    for a in agents:
        a.stop()
    return result


@pytest.mark.parametrize("broker_cls", [MosquittoBroker, AmqttBroker], ids=["mosquitto", "amqtt"])
def test_a_fed3r_job_over_mqtt_311(broker_cls, tmp_path):
    with broker_cls() as broker:
        url = broker.url if "version" in broker.url else broker.url + "?version=3.1.1"
        result = run_fed3r(url, tmp_path)
    assert result["state"] == "done" and sorted(result["contributed"]) == DEVICES
    Zb = [np.hstack([data_for(i)[0], np.ones((30, 1))]) for i in range(3)]
    np.testing.assert_allclose(np.load(tmp_path / "statistics.npz")["A"], sum(z.T @ z for z in Zb), rtol=1e-12)


def test_an_mqtts_address_without_a_ca_file_still_speaks_tls_never_the_password_in_the_clear():
    """A review's finding: ``mqtts://`` without --tls-ca made a plain TCP connection whose CONNECT
    carried the MQTT password in the clear to whatever answered at the address. Now it is TLS
    verified against the system's trusted CAs (as the Java client's ssl:// does): the first bytes
    sent are a TLS handshake record, and the password is in none of them."""
    import socket

    from fedfleet.emulation.broker import free_port
    from protocols.mqtt_link import MqttLink

    port = free_port()
    listener = socket.create_server(("127.0.0.1", port))
    received = bytearray()

    def take_first_connection():
        conn, _ = listener.accept()
        conn.settimeout(3)
        try:
            while len(received) < 4096:
                block = conn.recv(4096)
                if not block:
                    break
                received.extend(block)
        except OSError:
            pass
        finally:
            conn.close()

    reader = threading.Thread(target=take_first_connection, daemon=True)
    reader.start()
    cfg = BrokerConfig.from_url(f"mqtts://dev01:S3CRET-MQTT-PW@127.0.0.1:{port}")
    link = MqttLink("dev01", cfg, lambda *_: None)
    with pytest.raises(ConnectionError):
        link.start(timeout=2)
    reader.join(5)
    listener.close()
    assert received[:1] == b"\x16", bytes(received[:32])           # a TLS handshake record, not MQTT CONNECT (0x10)
    assert b"S3CRET-MQTT-PW" not in received
    assert cfg.url().startswith("mqtts://")                         # and its address says so again
