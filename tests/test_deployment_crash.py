"""A SIGKILL of the aggregator mid-rollout (issue 29): ``aggregator serve --state --api`` runs the
deployment controller; the canary swaps and reports, the process is killed during the bake time,
and the restarted aggregator resumes the same deployment to 100 % without sending the canary
devices anything again."""

import signal
import socket
import subprocess
import time

from aggregator.storage.deployments import DeploymentStore
from aggregator.storage.store import Store
from edge_client.deployment import DeploymentFollower, ModelSlot
from fedfleet.admin_client import AdminClient
from protocols.mqtt_link import BrokerConfig
from protocols.topics import Topics

from ops_fleet import REPO, aggregator_cmd, aggregator_env, prepare
from deployment_fleet import D_sha, model_id, world  # noqa: F401  (the module fixture)

DEVICES = [f"cam-{i}" for i in range(4)]
CANARY = ["cam-0", "cam-1"]
TOKEN = "crash-token-0123456789abcdef"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except Exception:           # the API is not up yet
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_sigkilled_aggregator_resumes_the_rollout_without_resending(broker, tmp_path, world):  # noqa: F811
    state = tmp_path / "state.db"
    store = Store(state)
    good = model_id(store, "good", *world["good"])
    store.close()
    prepare(tmp_path, DEVICES, expected_devices=99, start_timeout_s=1e5)
    (tmp_path / "token").write_text(TOKEN)
    port, topics = free_port(), Topics(f"crash{time.monotonic_ns()}")     # apart from other tests' retained messages
    cmd = aggregator_cmd(tmp_path, broker.url, state, ["--keep-serving", "--api", f"127.0.0.1:{port}",
                                                       "--api-token-file", str(tmp_path / "token"),
                                                       "--topic-root", topics.root])
    api = AdminClient(f"http://127.0.0.1:{port}", TOKEN, timeout=5)
    followers = {d: DeploymentFollower(d, BrokerConfig.from_url(broker.url), ModelSlot(tmp_path / d),
                                       lambda bundle, d=d: world["holdout"][d], topics, retry_s=0.5).start()
                 for d in DEVICES}
    procs = [subprocess.Popen(cmd, env=aggregator_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)]
    good_sha = D_sha(world["good"])
    try:
        wait_for(lambda: api.get("/api/deployments") == [], 60, "the admin API")
        api.post(f"/api/models/{good}/deploy", {"cohort": "devices:" + ",".join(CANARY), "stages": "100%",
                                                "bake_s": 6, "min_reports": 2, "deployment_id": "crash-1"})
        wait_for(lambda: api.get("/api/deployments/crash-1")["counts"]["reported"] == 2, 30, "the canary's reports")
        procs[0].send_signal(signal.SIGKILL)
        assert procs[0].wait(30) == -9
        before = Store(state)
        row, sent = DeploymentStore(before).get("crash-1"), DeploymentStore(before).devices("crash-1")
        before.close()
        assert row["state"] == "canary" and sorted(sent) == CANARY
        reports = {d: len(f.reports) for d, f in followers.items()}

        procs.append(subprocess.Popen(cmd, env=aggregator_env(), cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
        wait_for(lambda: api.get("/api/deployments/crash-1")["state"] == "complete", 60, "the resumed rollout")
        wait_for(lambda: all(f.slot.current and f.slot.current.sha256 == good_sha for f in followers.values()), 30,
                 "every device on the deployed head")
        after = api.get("/api/deployments/crash-1")
        assert [h["to"] for h in after["history"]] == ["canary", "widening", "complete"]
        for d in CANARY:            # not sent again, not asked to report again
            assert after["devices"][d]["sent_at"] == sent[d]["sent_at"] and len(followers[d].reports) == reports[d]
    finally:
        log = ""
        for p in procs:
            if p.poll() is None:
                p.terminate()
            try:
                log += p.communicate(timeout=30)[0]
            except subprocess.TimeoutExpired:
                p.kill()
        for f in followers.values():
            f.stop()
    assert "Traceback" not in log, log[-3000:]
    assert "deployment crash-1 resumed in state canary" in log, log[-3000:]
