"""The admin REST API and the ``fedfleet admin`` CLI against a running aggregator service.

* every route refuses requests without the token (and with a wrong one);
* schemathesis generates requests from the OpenAPI schema: no 5xx, responses match the schema;
* a real Fed3R job (real agents over mosquitto) is paused, resumed and inspected through the
  CLI: rounds, participants, timings, bytes, model versions, download, lineage, metrics.
"""

import json
import os
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from fastapi.routing import APIRoute
from starlette.testclient import TestClient

from aggregator.api.app import create_app
from aggregator.api.server import ApiServer
from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from aggregator.storage.store import Store
from fedfleet.admin import main as admin
from protocols.mqtt_link import BrokerConfig

from ops_fleet import Fleet, job_config

TOKEN = "test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DEVICES = ["dev01", "dev02", "dev03", "dev04"]


def start_service(broker, tmp_path, devices, keep_serving=False, **cfg):
    store = Store(tmp_path / "state.db")
    job = Fed3RJob(Fed3RConfig(**job_config(devices, **cfg)))
    svc = AggregatorService(job, BrokerConfig.from_url(broker.url), tmp_path / "out",
                            ServiceSettings(keep_serving=keep_serving, tick_s=0.05), enrolled=set(devices),
                            store=store)
    thread = threading.Thread(target=svc.run, kwargs={"timeout_s": 120}, daemon=True)
    thread.start()
    return svc, store, thread


@pytest.fixture
def idle_api(broker, tmp_path):
    """A service whose job waits for devices that never come, and its API app."""
    svc, store, thread = start_service(broker, tmp_path, ["ghost"], expected_devices=1)
    yield create_app(store, TOKEN, svc)
    svc.stop()
    thread.join(30)


def sample_path(route: APIRoute) -> str:
    samples = {"device_id": "dev01", "job_id": "ops", "model_id": "1", "round_no": "1", "action": "pause",
               "asset": "app.js", "deployment_id": "d1"}
    path = route.path
    for name, value in samples.items():
        path = path.replace("{" + name + "}", value)
    return path


def test_every_endpoint_needs_the_token(idle_api):
    client = TestClient(idle_api)
    routes = [r for r in idle_api.routes if isinstance(r, APIRoute)]
    assert len(routes) >= 20
    for route in routes:
        for method in route.methods:
            for headers in ({}, {"Authorization": "Bearer wrong-token-wrong-token"}, {"Authorization": TOKEN}):
                resp = client.request(method, sample_path(route), headers=headers, json={})
                assert resp.status_code == 401, (method, route.path, headers, resp.status_code)
    health = client.get("/api/health", headers=AUTH).json()
    assert health["status"] == "ok"
    assert health["compute"]["device"] == ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert health["compute"]["secagg_unmask"].startswith("cuda" if torch.cuda.is_available() else "cpu (")
    schema = TestClient(idle_api).get("/openapi.json", headers=AUTH).json()
    assert "HTTPBearer" in schema["components"]["securitySchemes"]


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_openapi_property_based_no_server_errors(idle_api, mode):
    """Requests generated from the OpenAPI schema. Valid ones: every schemathesis check (no 5xx, status
    codes, content types and bodies as documented, valid data accepted). Schema-violating ones: no 5xx
    (extra query parameters are ignored, as most REST APIs do, so "must be rejected" is not required)."""
    schemathesis = pytest.importorskip("schemathesis")
    from schemathesis.checks import not_a_server_error
    from schemathesis.generation.modes import GenerationMode

    checks = None if mode == "positive" else [not_a_server_error]

    schema = schemathesis.openapi.from_asgi("/openapi.json", idle_api, headers=AUTH)
    assert len(list(schema.get_all_operations())) >= 20

    from schemathesis.specs.openapi.checks import positive_data_acceptance

    @given(case=schema.as_strategy(generation_mode=GenerationMode(mode)))
    @settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def requests_from_schema(case):
        # A job config has cross-field rules a JSON schema cannot state (k_min <= k_max, init "fed3r"
        # needs its head file, ...): a schema-valid config may be refused there, with a 422 naming it.
        # Likewise an enrolment's 64 hex digits need not be an Ed25519 point (protocols.identity.check_curve_point).
        semantic = case.method == "POST" and case.path in ("/api/jobs", "/api/devices")
        case.call_and_validate(headers=AUTH, checks=checks,
                               excluded_checks=[positive_data_acceptance] if semantic else None)

    requests_from_schema()


def test_job_lifecycle_and_inspection_through_the_cli(broker, tmp_path, capsys):
    svc, store, thread = start_service(broker, tmp_path, DEVICES, keep_serving=True, clients_per_round=2)
    api = ApiServer(create_app(store, TOKEN, svc)).start()
    base = ["--url", api.url, "--token", TOKEN]

    def cli(*args, ok=True):
        capsys.readouterr()
        rc = admin([*base, *args])
        out = capsys.readouterr()
        assert (rc == 0) == ok, (args, rc, out.err)
        return out.out

    def cli_json(*args):
        return json.loads(cli("--json", *args))

    try:
        # enrolment and revocation
        creds_file = tmp_path / "creds.json"
        assert "tags lab" in cli("device", "enroll", "newdev", "--out", str(creds_file), "--tags", "lab")
        assert store.device("newdev")["tags"] == ["lab"]
        creds = json.loads(creds_file.read_text())
        assert oct(os.stat(creds_file).st_mode & 0o777) == "0o600"
        assert creds["mqtt_username"] == "newdev" and "PRIVATE KEY" in creds["private_key_pem"]
        # the operator's tags (a deployment's tags: cohort): set, shown, replaced, refused when malformed
        assert cli_json("device", "tag", "newdev", "--tags", "lab, north")["tags"] == ["lab", "north"]
        assert cli_json("device", "show", "newdev")["tags"] == ["lab", "north"] and "lab,north" in cli("devices")
        cli("device", "tag", "newdev", "--tags", "has space", ok=False)      # 422: nothing changed
        cli("device", "tag", "nobody", "--tags", "lab", ok=False)             # 404
        cli("device", "tag", "newdev", ok=False)                              # no --tags: one line, nothing sent
        cli("device", "enroll", "other", "--tags", "a b", ok=False)            # checked before enrolling: no
        assert store.device("other") is None                                   # credentials shown once, then lost
        assert cli_json("device", "show", "newdev")["tags"] == ["lab", "north"]
        assert cli_json("device", "tag", "newdev", "--tags", "")["tags"] == [] == store.device("newdev")["tags"]
        assert cli_json("device", "revoke", "newdev")["status"] == "revoked"
        cli("device", "revoke", "newdev", ok=False)                          # 409: not enrolled any more
        assert "DEVICE" in cli("devices") and cli_json("fleet")["revoked"] == 1

        # pause before the fleet arrives: no round opens until resumed
        assert cli_json("job", "pause", "ops")["state"] == "paused"
        with Fleet(broker.url, DEVICES):
            time.sleep(1.5)
            assert cli_json("job", "rounds", "ops") == [] and cli_json("status")["devices_online"] == 4
            assert cli_json("job", "resume", "ops")["state"] == "running"
            deadline = time.time() + 60
            while cli_json("job", "show", "ops")["state"] != "done" and time.time() < deadline:
                time.sleep(0.2)
        job = cli_json("job", "show", "ops")
        assert job["state"] == "done" and job["contributions"] == 4 and job["rounds"] == 2

        rounds = cli_json("job", "rounds", "ops")
        assert sorted(d for r in rounds for d in r["accepted"]) == DEVICES
        r1 = cli_json("round", "ops", "1")
        assert sorted(r1["result_latency_s"]) == r1["accepted"] and r1["bytes_in"] > 0 and r1["duration_s"] >= 0
        assert "answered after" in cli("round", "ops", "1") and "ROUND" in cli("job", "rounds", "ops")

        models = cli_json("models", "--job", "ops")
        final = [m for m in models if m["final"]]
        assert len(final) == 1 and len(models) == 3                         # one per round + the final model
        cli("model", "download", str(final[0]["model_id"]), "-o", str(tmp_path / "m.npz"))
        got, want = np.load(tmp_path / "m.npz"), np.load(tmp_path / "out" / "model.npz")
        assert all(np.array_equal(got[k], want[k]) for k in want.files)
        lineage = cli_json("model", "lineage", str(final[0]["model_id"]))
        assert [m["version"] for m in lineage] == [3, 2, 1]
        assert [m["parent_id"] for m in lineage[:-1]] == [m["model_id"] for m in lineage[1:]]
        assert sorted(d for m in lineage for d in m["accepted"]) == DEVICES

        metrics = cli("metrics")
        assert 'fedfleet_devices{status="enrolled"} 4.0' in metrics and "fedfleet_jobs" in metrics

        # a second job from a config file: queued, taken up by the service, cancelled
        cfg = tmp_path / "j2.json"
        cfg.write_text(json.dumps(job_config(["x"], job_id="j2", expected_devices=99)))
        assert cli_json("job", "create", str(cfg), "--start")["state"] == "queued"
        deadline = time.time() + 10
        while cli_json("job", "show", "j2")["state"] != "running" and time.time() < deadline:
            time.sleep(0.1)
        cli("job", "cancel", "j2")
        while cli_json("job", "show", "j2")["state"] != "cancelled" and time.time() < deadline:
            time.sleep(0.1)
        assert cli_json("job", "show", "j2")["state"] == "cancelled"
        cli("job", "start", "j2", ok=False)                                  # 409 from a final state
        cli("job", "show", "nope", ok=False)                                 # 404
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"job_id": "j3", "lam": -1}))
        cli("job", "create", str(bad), ok=False)                             # 422
        assert "no active job" in cli("watch", "--until-done", "--interval", "0.1")
    finally:
        api.stop()
        svc.stop()
        thread.join(30)


def test_the_dashboard_signs_in_by_post_to_an_opaque_session_never_the_token_in_a_url(idle_api):
    """The sign-in form sent the token as ``/dashboard/?token=`` (kept by history, proxy logs and
    Referer) and the cookie was the token itself. Now: POST, and a session cookie that is not the
    token, works only as a cookie, and ends with its 12 hours or with a new token."""
    from aggregator.api.guard import COOKIE, SESSION_TTL_S, new_session

    client = TestClient(idle_api)
    assert client.get(f"/dashboard/?token={TOKEN}", follow_redirects=False).status_code == 401   # no token in URLs
    wrong = client.post("/dashboard/login", data={"token": "nope"}, follow_redirects=False)
    assert wrong.status_code == 401 and "Wrong token" in wrong.text and COOKIE not in wrong.cookies
    too_big = client.post("/dashboard/login", content=b"token=" + b"x" * 5000,
                          headers={"content-type": "application/x-www-form-urlencoded"}, follow_redirects=False)
    assert too_big.status_code == 413
    ok = client.post("/dashboard/login", data={"token": TOKEN}, follow_redirects=False)
    cookie = ok.headers["set-cookie"]
    assert ok.status_code == 303 and ok.headers["location"] == "/dashboard/"
    assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower() and TOKEN not in cookie
    session = ok.cookies[COOKIE]
    assert client.get("/api/health").status_code == 200                     # the cookie jar has the session
    assert "<title>fedfleet" in client.get("/dashboard/").text
    anonymous = TestClient(idle_api)
    assert anonymous.get("/api/health", headers={"Authorization": f"Bearer {session}"}).status_code == 401
    anonymous.cookies.set(COOKIE, session[:-2] + ("AA" if not session.endswith("AA") else "BB"))
    assert anonymous.get("/api/health").status_code == 401                  # forged
    anonymous.cookies.set(COOKIE, new_session(TOKEN, now=time.time() - SESSION_TTL_S - 5))
    assert anonymous.get("/api/health").status_code == 401                  # expired
    assert "session has ended" in anonymous.get("/dashboard/").text
    anonymous.cookies.set(COOKIE, new_session("another-token-another-token"))
    assert anonymous.get("/api/health").status_code == 401                  # made under another token


@pytest.mark.parametrize("other", ['prefs={"theme":"dark"}', "grafana_session=a b", 'x=[1,2]"'])
def test_a_session_is_seen_beside_another_applications_cookies_and_odd_digits_are_no_session(idle_api, other):
    """A browser sends the dashboard every cookie of its host (Grafana, Jupyter on localhost): the
    parser stopped at the first value it could not read and the session behind it was never seen.
    An issue time of '²' (str.isdigit, not int) answered 500 before any check."""
    from aggregator.api.guard import COOKIE, new_session, session_valid

    client = TestClient(idle_api, raise_server_exceptions=False)
    assert client.get("/api/health", headers={"cookie": f"{other}; {COOKIE}={new_session(TOKEN)}"}).status_code == 200
    assert session_valid("\u00b2.nonce.mac", TOKEN) is False
    assert client.get("/api/health", headers={"cookie": f'{COOKIE}="\\262.a.b"'}).status_code == 401


def test_a_change_made_with_the_dashboards_session_must_come_from_its_origin(idle_api):
    """A review's finding: SameSite=Strict keeps the session cookie from other sites, not from
    another port or subdomain of the same site, whose form could POST a job's cancel or a device's
    revocation with it. Such a change is refused by what the browser says of its origin."""
    from aggregator.api.guard import COOKIE, new_session

    client = TestClient(idle_api)
    client.cookies.set(COOKIE, new_session(TOKEN))
    cancel = "/api/jobs/nope/cancel"
    foreign = [{"sec-fetch-site": "same-site"}, {"sec-fetch-site": "cross-site"},
               {"origin": "http://testserver:8081"}, {"origin": "http://grafana.testserver"}, {"origin": "null"}]
    for headers in foreign:
        r = client.post(cancel, headers=headers)
        assert r.status_code == 403 and "origin" in r.json()["detail"], (headers, r.text)
    for headers in ({"sec-fetch-site": "same-origin"}, {"origin": "http://testserver"}, {}):
        assert client.post(cancel, headers=headers).status_code == 404, headers      # past the guard: no such job
    assert client.get("/api/health", headers={"sec-fetch-site": "cross-site"}).status_code == 200   # a read
    bearer = TestClient(idle_api)                                   # the CLI's way: no cookie, any origin
    assert bearer.post(cancel, headers={"Authorization": f"Bearer {TOKEN}", "origin": "http://x"}).status_code == 404


@pytest.mark.parametrize("body", [{"tags": ["has space"]}, {"tags": ["a,b"]}, {"tags": ["x" * 65]}, {"tags": [""]},
                                  {"tags": [f"t{i}" for i in range(33)]}, {"tags": "lab"}, {"tags": [5]},
                                  {"tags": ["lab"], "extra": 1}, {}])
def test_a_malformed_tags_request_is_refused_and_changes_nothing(idle_api, body):
    """The operator's tags are what a deployment's tags: cohort selects by: a malformed request
    (a tag a cohort could not name, too many, not a list of strings, an unknown field) is one 422,
    the device's tags as they were; an unknown device is a 404."""
    client = TestClient(idle_api)
    assert client.post("/api/devices/ghost/tags", headers=AUTH, json={"tags": ["lab", "north"]}).json()["tags"] == \
        ["lab", "north"]
    assert client.post("/api/devices/ghost/tags", headers=AUTH, json=body).status_code == 422
    assert client.get("/api/devices/ghost", headers=AUTH).json()["tags"] == ["lab", "north"]
    assert client.post("/api/devices/nobody/tags", headers=AUTH, json={"tags": ["lab"]}).status_code == 404


def test_a_repeated_query_parameter_an_unreadable_body_and_a_dot_device_are_one_clear_refusal(idle_api):
    """A review's findings: ``?job_id=a&job_id=b`` acted on b and ``?limit=1&limit=3`` listed three
    (the last value taken silently, as a JSON body's repeated key was before); a body nested
    100,000 deep or holding a 5,000-digit integer got "There was an error parsing the body"; and
    devices named "." and ".." could be enrolled, then never revoked or tagged by a client that
    normalises paths. Each is one 400 or 422 with its reason now, and nothing changes."""
    client = TestClient(idle_api)
    listed = client.get("/api/devices?limit=1&limit=3", headers=AUTH)
    assert listed.status_code == 400 and "'limit' given more than once" in listed.json()["detail"]
    assert client.get("/api/devices?limit=1", headers=AUTH).status_code == 200
    before = client.get("/api/devices", headers=AUTH).json()
    for body, reason in ((b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
                         (b'{"device_id": "d9", "n": ' + b"7" * 5000 + b"}", "cannot be read")):
        answer = client.post("/api/devices", headers={**AUTH, "content-type": "application/json"}, content=body)
        assert answer.status_code == 400 and reason in answer.json()["detail"], answer.text[:300]
    for name in (".", ".."):
        assert client.post("/api/devices", headers=AUTH, json={"device_id": name}).status_code == 422
    assert client.get("/api/devices", headers=AUTH).json() == before
