"""/api/devices lists a fleet a page at a time (a review found it returned every device in one
response: 100,000 rows on every dashboard refresh): pages in id order, ``after`` and ``limit``,
X-Next-After on a full page, the devices the running service heard from without enrolment
merged in order, status filters that page too, and the CLI's listing that follows the pages. The
service runs for real over mosquitto; the devices that are not enrolled announce themselves on it."""

import paho.mqtt.client as mqtt
import pytest
from starlette.testclient import TestClient

from aggregator.api.app import create_app
from fedfleet.admin_client import all_devices
from protocols import messages as M
from protocols.envelope import encode
from protocols.topics import Topics
from ops_fleet import wait_for
from test_admin_api import AUTH, TOKEN, start_service

ENROLLED = [f"dev{i:03d}" for i in range(0, 50, 2)]          # 25 enrolled, even ids
STRANGERS = ["dev007", "dev031", "zz-late", "aaa-first"]         # heard from, never enrolled


@pytest.fixture
def fleet_api(broker, tmp_path):
    svc, store, thread = start_service(broker, tmp_path, ENROLLED, expected_devices=len(ENROLLED) + 1)
    store.revoke_device("dev010")
    raw = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="strangers")
    raw.connect("127.0.0.1", broker.port)
    raw.loop_start()
    for dev in STRANGERS:
        raw.publish(Topics().presence(dev), encode(M.presence_message(dev, "online", {})), qos=1,
                    retain=True).wait_for_publish(5)
    wait_for(lambda: set(STRANGERS) <= set(svc.live.get("devices_online", ())), what="the strangers heard")
    yield TestClient(create_app(store, TOKEN, svc)), store
    raw.loop_stop()
    svc.stop()
    thread.join(30)


def pages(client, limit, **params):
    out, after, heads = [], "", []
    while True:
        r = client.get("/api/devices", params={"limit": limit, "after": after, **params}, headers=AUTH)
        assert r.status_code == 200, r.text
        rows = r.json()
        out.append([d["device_id"] for d in rows])
        heads.append(r.headers.get("x-next-after"))
        if len(rows) < limit:
            return out, heads
        after = heads[-1]


def test_pages_list_every_device_once_in_order(fleet_api):
    client, store = fleet_api
    everyone = sorted(ENROLLED + STRANGERS)
    got, heads = pages(client, 7)
    assert [d for page in got for d in page] == everyone
    assert all(len(p) == 7 for p in got[:-1]) and len(got[-1]) < 7
    assert heads[:-1] == [p[-1] for p in got[:-1]] and heads[-1] is None
    rows = {d["device_id"]: d for d in client.get("/api/devices", params={"limit": 100}, headers=AUTH).json()}
    assert {d for d, r in rows.items() if r["status"] == "not enrolled"} == set(STRANGERS)
    assert rows["dev010"]["status"] == "revoked" and rows["zz-late"]["online"]


@pytest.mark.parametrize("status,expected", [
    ("enrolled", sorted(set(ENROLLED) - {"dev010"})), ("revoked", ["dev010"]), ("not enrolled", sorted(STRANGERS))])
def test_a_status_filter_pages_through_its_devices_only(fleet_api, status, expected):
    client, _ = fleet_api
    got, _ = pages(client, 3, status=status)
    assert [d for page in got for d in page] == expected


def test_bad_paging_parameters_are_one_clear_422(fleet_api):
    client, _ = fleet_api
    for params in ({"limit": 0}, {"limit": 10_001}, {"after": "../x"}, {"limit": "many"}):
        r = client.get("/api/devices", params=params, headers=AUTH)
        assert r.status_code == 422, (params, r.text)
    assert len(client.get("/api/devices", headers=AUTH).json()) == len(ENROLLED) + len(STRANGERS)


def test_the_cli_listing_follows_every_page(fleet_api, monkeypatch):
    client, _ = fleet_api

    class Client:                 # the CLI's AdminClient.get, through the test client
        def get(self, path):
            r = client.get(path, headers=AUTH)
            assert r.status_code == 200, r.text
            return r.json()

    assert [d["device_id"] for d in all_devices(Client(), page=4)] == sorted(ENROLLED + STRANGERS)
    assert [d["device_id"] for d in all_devices(Client(), "not enrolled", page=2)] == sorted(STRANGERS)
