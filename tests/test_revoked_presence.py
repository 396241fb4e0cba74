"""A revoked device's retained presence, against a real mosquitto (aggregator/service/operator_actions.py).

Revoking a device reloads the broker's ACL before mosquitto drops the device, so its "offline" last
will is refused and its retained "online" stayed on the broker. Enrolling the same id again read
that presence back (``fetch_retained``) and marked the new device online before it ever connected.
Now the revocation clears it (an empty retained message), and an enrolment of a revoked id clears
whatever an earlier version left instead of reading it. The reference is the broker's own retained
store, read by a separate subscriber (a shard's account: it may read every presence).
"""

import threading
import time

import paho.mqtt.client as mqtt
import pytest

from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.security.enrollment import Enrollment
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from aggregator.shards.buckets import shard_role
from aggregator.storage.store import Store
from protocols import messages as M
from protocols.envelope import encode
from protocols.identity import DeviceIdentity
from protocols.mqtt_link import BrokerConfig
from protocols.topics import AGGREGATOR_ID, Topics, role_account

from ops_fleet import job_config
from test_broker_security import RawDevice, secured  # noqa: F401  (secured: the real mosquitto's fixture)

T = Topics()


def retained_presence(port, sec) -> dict[str, bytes]:
    """device -> its presence the broker retains, read by a subscriber of its own; dev01's, retained
    before, arrives with the others, so once it is here every retained one is."""
    got, ready = {}, threading.Event()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=role_account(AGGREGATOR_ID, shard_role(0)),
                         protocol=mqtt.MQTTv5)
    client.username_pw_set(role_account(AGGREGATOR_ID, shard_role(0)), sec.aggregator_password)
    client.tls_set(ca_certs=str(sec.ca_cert))
    client.on_connect = lambda c, u, f, rc, p: c.subscribe(T.all_presence, 1)
    client.on_message = lambda c, u, m: (got.__setitem__(T.device_of(m.topic), m.payload) if m.retain else None,
                                         "dev01" in got and ready.set())
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        assert ready.wait(10), "dev01's retained presence never came"
        time.sleep(0.3)
    finally:
        client.loop_stop()
        client.disconnect()
    return got


def wait_until(condition, timeout=10):
    deadline = time.time() + timeout
    while not condition() and time.time() < deadline:
        time.sleep(0.05)
    return condition()


@pytest.mark.parametrize("revoked_by", ["the running service", "an earlier version, its presence left"])
def test_a_revoked_devices_retained_presence_never_marks_a_device_enrolled_later_online(secured, tmp_path, revoked_by):
    sec, port = secured
    store = Store(tmp_path / "state.db")
    keys = {d: DeviceIdentity.generate(d) for d in ("dev01", "dev03")}
    creds = {d: Enrollment(store, sec).enroll(d, keys[d].public_key_bytes) for d in keys}
    time.sleep(0.5)                      # the broker's reload
    devices = {d: RawDevice(port, sec.ca_cert, d, creds[d].mqtt_password, client_id=d) for d in keys}
    for d, device in devices.items():    # as an edge client announces itself: retained, its will "offline"
        device.c.publish(T.presence(d), encode(M.presence_message(d, "online"), signer=keys[d].sign), qos=1,
                         retain=True).wait_for_publish(5)
    if revoked_by != "the running service":
        Enrollment(store, sec).revoke("dev03")
        assert wait_until(lambda: not devices["dev03"].c.is_connected())
    assert set(retained_presence(port, sec)) == {"dev01", "dev03"}

    job = Fed3RJob(Fed3RConfig(**job_config(["dev01", "dev02"], clients_per_round=2)))
    broker = BrokerConfig("127.0.0.1", port, AGGREGATOR_ID, sec.aggregator_password, tls_ca=str(sec.ca_cert))
    svc = AggregatorService(job, broker, tmp_path / "out", ServiceSettings(tick_s=0.05), store=store, security=sec)
    thread = threading.Thread(target=lambda: svc.run(timeout_s=60), daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: "dev01" in svc.call(lambda: set(svc.fleet.online)))
        if revoked_by == "the running service":
            assert "dev03" in svc.call(lambda: set(svc.fleet.online))
            svc.call(lambda: svc.revoke("dev03"))
            assert wait_until(lambda: not devices["dev03"].c.is_connected())
            assert wait_until(lambda: "dev03" not in retained_presence(port, sec)), "the revocation cleared it"

        successor = DeviceIdentity.generate("dev03")
        again = svc.call(lambda: svc.enroll("dev03", successor.public_key_bytes))
        time.sleep(0.5)                  # a retained presence read back at the enrolment would be here by now
        devices["dev01"].publish(T.presence("dev01"), encode(M.presence_message("dev01", "offline"),
                                                             signer=keys["dev01"].sign))
        assert wait_until(lambda: "dev01" not in svc.call(lambda: set(svc.fleet.online)))
        assert "dev03" not in svc.call(lambda: set(svc.fleet.online)), "online before it ever connected"
        assert "dev03" not in retained_presence(port, sec)

        time.sleep(0.5)                  # the broker's reload
        new = RawDevice(port, sec.ca_cert, "dev03", again.mqtt_password, client_id="dev03")
        new.publish(T.presence("dev03"), encode(M.presence_message("dev03", "online"), signer=successor.sign))
        assert wait_until(lambda: "dev03" in svc.call(lambda: set(svc.fleet.online)))   # when it does connect
        assert svc.call(lambda: dict(svc._stats().rejections)).get("malformed") is None   # the clearing is no message
        new.close()
    finally:
        svc.stop()
        thread.join(30)
        for device in devices.values():
            device.close()
