"""What POST /api/models/{id}/deploy accepts, through the API and a real deployment controller over
mosquitto: stages must widen at every step (a review found "100%,100%" deployed with 201, though
the refusal of other stages says they must be increasing), and the default deployment id is unique
even for deploys of one model within one second (it was m<model>-<unix time>: the second a 409)."""

import time

from starlette.testclient import TestClient

from aggregator.api.app import create_app
from aggregator.storage.deployments import DeploymentStore
from deployment_fleet import model_id
from deployment_fleet import setup, world  # noqa: F401 (fixtures)

TOKEN = "deploy-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CANARY = {"cohort": "devices:cam-0", "bake_s": 3600}


def test_stages_that_do_not_widen_are_one_422_and_deploy_nothing(setup, world):
    store, controller, fleet = setup
    good = model_id(store, "good", *world["good"])
    client = TestClient(create_app(store, TOKEN, None, controller()))
    for stages in ("100%,100%", "50%,50%,100%", "60%,40%,100%", "0.5,50%,100%"):
        r = client.post(f"/api/models/{good}/deploy", headers=AUTH, json={**CANARY, "stages": stages})
        assert r.status_code == 422, (stages, r.text)
        assert "increasing" in r.json()["detail"] and stages in r.json()["detail"], r.text
    assert DeploymentStore(store).list() == []                  # nothing deployed, nothing stored
    ok = client.post(f"/api/models/{good}/deploy", headers=AUTH, json={**CANARY, "stages": "50%,100%"})
    assert ok.status_code == 201 and ok.json()["stages"] == [0.5, 1.0]


def test_default_ids_of_deploys_within_one_second_differ(setup, world):
    store, controller, fleet = setup
    good = model_id(store, "good", *world["good"])
    client = TestClient(create_app(store, TOKEN, None, controller()))

    def deploy_and_roll_back(**body) -> str:
        r = client.post(f"/api/models/{good}/deploy", headers=AUTH, json={**CANARY, **body})
        assert r.status_code == 201, r.text
        dep = r.json()["deployment_id"]
        assert client.post(f"/api/deployments/{dep}/rollback", headers=AUTH, json={}).status_code == 200
        return dep

    # the default id the old rule gives for each of the next few seconds is already taken (by name)
    now = int(time.time())
    named = [deploy_and_roll_back(deployment_id=f"m{good}-{s}") for s in range(now, now + 4)]
    assert named == [f"m{good}-{s}" for s in range(now, now + 4)]          # a name given is kept as given
    defaults = [deploy_and_roll_back(), deploy_and_roll_back()]
    assert time.time() < now + 4, "too slow to test within the seconds taken"
    assert len(set(defaults + named)) == 6 and all(d.startswith(f"m{good}-") for d in defaults)
    again = client.post(f"/api/models/{good}/deploy", headers=AUTH, json={**CANARY, "deployment_id": named[0]})
    assert again.status_code == 409 and "already exists" in again.json()["detail"]


def test_deployments_list_a_page_at_a_time_without_their_devices(setup, world):
    """/api/deployments listed every deployment with every device of each (a review's finding): a
    page in creation order now, each deployment's devices only on its own route."""
    store, controller, fleet = setup
    good = model_id(store, "good", *world["good"])
    fleet.start("cam-0")
    client = TestClient(create_app(store, TOKEN, None, controller()))
    made = []
    for i in range(5):
        made.append(client.post(f"/api/models/{good}/deploy", headers=AUTH,
                                json={**CANARY, "deployment_id": f"d{(i * 3) % 5}"}).json()["deployment_id"])
        assert client.post(f"/api/deployments/{made[-1]}/rollback", headers=AUTH, json={}).status_code == 200
    r = client.get("/api/deployments", params={"limit": 2, "order": "newest"}, headers=AUTH)
    assert [d["deployment_id"] for d in r.json()] == made[::-1][:2] and r.headers["x-total-count"] == "5"
    assert all(d["devices"] is None for d in r.json()), r.json()
    full = client.get(f"/api/deployments/{made[-1]}", headers=AUTH).json()
    assert r.json()[0]["counts"] == full["counts"] and isinstance(full["devices"], dict)
    rest = client.get("/api/deployments", params={"after": r.headers["x-next-after"], "order": "newest"}, headers=AUTH)
    assert [d["deployment_id"] for d in rest.json()] == made[::-1][2:] and "x-next-after" not in rest.headers
