""""Any MQTT 3.1.1 or 5 broker": the protocol version is part of the broker address, and a Fed3R
job over MQTT 3.1.1 gives the same statistics against mosquitto and against a second,
independently written broker (amqtt) — real agents, the real service, an independent numpy sum;
and on amqtt with accounts (a password file, anonymous refused, the product's generated ACL), as
fedfleet runs in production, each party logging in as itself."""

import threading
import time

import numpy as np
import pytest

from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.security.broker import acl_text, new_password
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from edge_client.agent import DeviceAgent
from fedfleet.emulation.broker import MosquittoBroker
from protocols.mqtt_link import BrokerConfig, MqttLink
from protocols.topics import AGGREGATOR_ID, Topics

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


def run_fed3r(url: str, out, device_urls: dict[str, str] | None = None) -> dict:
    """A 3-device Fed3R job; ``url`` the aggregator's broker address, ``device_urls`` each
    device's (default: the same address, an open broker)."""
    config = Fed3RConfig(num_classes=C, feature_dim=D, clients_per_round=3, round_timeout_s=30, expected_devices=3)
    svc = AggregatorService(Fed3RJob(config), BrokerConfig.from_url(url), out, ServiceSettings(tick_s=0.05),
                            enrolled=set(DEVICES))
    result = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=60)), daemon=True)
    thread.start()
    device_urls = device_urls or dict.fromkeys(DEVICES, url)
    agents = [DeviceAgent(d, BrokerConfig.from_url(device_urls[d]), {"fed3r.stats": SyntheticStats(i)},
                          retry_after_s=2).start() for i, d in enumerate(DEVICES)]
    thread.join(65)
    for a in agents:
        a.stop()
    return result


def assert_the_reference_statistics(result: dict, out) -> None:
    assert result["state"] == "done" and sorted(result["contributed"]) == DEVICES
    Zb = [np.hstack([data_for(i)[0], np.ones((30, 1))]) for i in range(3)]
    np.testing.assert_allclose(np.load(out / "statistics.npz")["A"], sum(z.T @ z for z in Zb), rtol=1e-12)


@pytest.mark.parametrize("broker_cls", [MosquittoBroker, AmqttBroker], ids=["mosquitto", "amqtt"])
def test_a_fed3r_job_over_mqtt_311(broker_cls, tmp_path):
    with broker_cls() as broker:
        url = broker.url if "version" in broker.url else broker.url + "?version=3.1.1"
        result = run_fed3r(url, tmp_path)
    assert_the_reference_statistics(result, tmp_path)


def test_a_fed3r_job_on_amqtt_with_accounts_and_the_generated_acl(tmp_path):
    """amqtt with a password file (no anonymous clients) and the ACL fedfleet generates for
    mosquitto: the aggregator and every device log in with their own account, the job gives the
    reference statistics; a wrong password, an unknown account and no account are refused at
    CONNECT (the link's error says "Not authorized"); a device account's publish on another
    device's outbox never reaches the aggregator's account."""
    T = Topics()
    passwords = {AGGREGATOR_ID: new_password(), **{d: new_password() for d in DEVICES}}
    with AmqttBroker(accounts=passwords, acl=acl_text(T, DEVICES)) as broker:
        login = {user: broker.login_url(user, pw) for user, pw in passwords.items()}
        # Refused before the device connects: amqtt 0.12.1 acts on a CONNECT's client id before it
        # looks at the password (a clean session's subscriptions are deleted, a kept session's
        # connection taken over), so a refused "dev00" would disturb a connected dev00 on amqtt.
        for url in (broker.login_url("dev00", "wrong-" + passwords["dev00"]), broker.login_url("nobody", "x"),
                    broker.url):
            refused = MqttLink("dev00", BrokerConfig.from_url(url), lambda *_: None)
            with pytest.raises(ConnectionError, match="Not authorized"):
                refused.start(timeout=1.5)
        result = run_fed3r(login[AGGREGATOR_ID], tmp_path, {d: login[d] for d in DEVICES})
        assert_the_reference_statistics(result, tmp_path)

        outboxes = []
        watcher = MqttLink(AGGREGATOR_ID, BrokerConfig.from_url(login[AGGREGATOR_ID]),
                           lambda topic, payload: outboxes.append((topic, payload)),
                           subscriptions=[(T.all_outboxes, 1)], clean_start=True)
        dev01 = MqttLink("dev01", BrokerConfig.from_url(login["dev01"]), lambda *_: None, clean_start=True)
        watcher.start(timeout=5)
        dev01.start(timeout=5)
        time.sleep(0.3)                                         # the watcher's SUBSCRIBE reached the broker
        dev01.publish(T.outbox("dev02"), b"forged", wait=True)  # refused by the ACL (3.1.1: no reason code)
        dev01.publish(T.outbox("dev01"), b"own", wait=True)     # one connection's QoS 1 publishes stay in order
        deadline = time.time() + 5
        while not outboxes and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        dev01.stop()
        watcher.stop()
    assert outboxes == [(T.outbox("dev01"), b"own")]


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
