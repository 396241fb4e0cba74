"""The operator's side of a rollout over a real mosquitto: ``fedfleet admin`` deploys, promotes and
rolls back a model through the admin API, lists and shows deployments and their logs; the API
refuses an unknown model, a bad guard, a bad log offset, and deploying without a controller."""

from ops_fleet import wait_for
from deployment_fleet import DEVICES, D_sha, model_id
from deployment_fleet import setup, world  # noqa: F401 (fixtures)


TOKEN = "deploy-token-0123456789abcdef"


def test_the_operator_deploys_promotes_and_rolls_back_through_the_cli(setup, world, capsys):
    from starlette.testclient import TestClient

    from aggregator.api.app import create_app
    from aggregator.api.server import ApiServer
    from fedfleet.admin import main as admin

    store, controller, fleet = setup
    good = model_id(store, "good", *world["good"])
    devices = DEVICES[:4]
    for d in devices:
        fleet.start(d)
    ctl = controller()
    api = ApiServer(create_app(store, TOKEN, None, ctl)).start()
    base = ["--url", api.url, "--token", TOKEN]

    def cli(*args, ok=True):
        capsys.readouterr()
        rc = admin([*args, *base])
        out = capsys.readouterr()
        assert (rc == 0) == ok, (args, rc, out.err)
        return out.out if ok else out.err

    try:
        out = cli("model", "deploy", str(good), "--cohort", "devices:cam-0", "--stages", "50%,100%", "--bake", "1h",
                  "--deployment-id", "ops-1")
        assert "deployment ops-1: model" in out and "canary" in out and "stages devices:cam-0 -> 50% -> 100%" in out
        good_sha = D_sha(world["good"])
        wait_for(lambda: fleet.sha("cam-0") == good_sha, what="the canary device to swap")
        assert all(fleet.sha(d) is None for d in devices[1:])               # a one-hour bake: nobody else yet
        assert "ops-1 is canary" in cli("model", "deploy", str(good), ok=False)
        assert "widening" in cli("deployment", "promote", "ops-1")          # 50 %
        assert "now stage 2" in cli("deployment", "promote", "ops-1")      # 100 %
        assert "complete" in cli("deployment", "promote", "ops-1")
        wait_for(lambda: all(fleet.sha(d) == good_sha for d in devices), what="every device to swap")
        assert "is complete" in cli("deployment", "promote", "ops-1", ok=False)
        out = cli("deployment", "rollback", "ops-1", "--reason", "field complaints")
        assert "rolled_back" in out and "reason    field complaints" in out
        wait_for(lambda: all(fleet.sha(d) is None for d in devices), what="every device back to its own version")
        line = cli("deployments").splitlines()[-1]
        assert line.startswith("ops-1") and "rolled_back" in line and "field complaints" in line
        shown = cli("deployment", "show", "ops-1")
        assert "canary -> widening: promoted by the operator" in shown and "cam-0" in shown
        # admin logs: every state change with its reason, in the job log's line format
        logged = cli("logs", "--deployment", "ops-1").splitlines()
        assert [line.split()[1:3] for line in logged] == [["canary", "deployment_id=ops-1"],
                                                          ["widening", "deployment_id=ops-1"],
                                                          ["widening", "deployment_id=ops-1"],
                                                          ["complete", "deployment_id=ops-1"],
                                                          ["rolled_back", "deployment_id=ops-1"]]
        assert "why=promoted by the operator" in logged[1] and "why=field complaints" in logged[-1]
        assert "admin logs: name a job" in cli("logs", ok=False)
        assert "admin logs: name a job" in cli("logs", "job", "--deployment", "ops-1", ok=False)
        assert "HTTP 404" in cli("logs", "--deployment", "nope", ok=False)

        client = TestClient(create_app(store, TOKEN, None, ctl))
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert client.post("/api/models/999/deploy", headers=auth, json={}).status_code == 404
        bad = client.post(f"/api/models/{good}/deploy", headers=auth, json={"guard": "accuracy>0"})
        assert bad.status_code == 422 and "METRIC OP NUMBER" in bad.json()["detail"]
        assert client.get("/api/deployments/nope", headers=auth).status_code == 404
        history = client.get("/api/deployments/ops-1", headers=auth).json()["history"]
        page = client.get("/api/deployments/ops-1/log?offset=3", headers=auth).json()
        assert page["next_offset"] == len(history) == 5 and page["state"] == "rolled_back"
        assert [(e["from"], e["event"], e["why"]) for e in page["lines"]] == \
            [(h["from"], h["to"], h["why"]) for h in history[3:]]
        assert client.get("/api/deployments/ops-1/log?offset=9", headers=auth).json() == \
            {"lines": [], "next_offset": 9, "state": "rolled_back"}
        assert client.get("/api/deployments/ops-1/log?offset=-1", headers=auth).status_code == 422
        read_only = TestClient(create_app(store, TOKEN))
        assert read_only.post(f"/api/models/{good}/deploy", headers=auth, json={}).status_code == 409
        assert read_only.get("/api/deployments/ops-1", headers=auth).json()["state"] == "rolled_back"
    finally:
        api.stop()
