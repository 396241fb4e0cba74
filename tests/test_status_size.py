"""``GET /api/status``, which the dashboard polls each second, answers the same few hundred bytes
whatever the fleet's size: it listed every online, revoked and stranger device and a last-seen time
per device (4 MB at 100,000 online), and every device of the open round. Its counts are the
fleet's; the devices themselves are the paginated ``/api/devices``'s."""

import time
from types import SimpleNamespace

from starlette.testclient import TestClient

from aggregator.api.app import create_app
from aggregator.jobs.registry import build_job
from aggregator.security.fleet import Fleet
from aggregator.service.active_job import ActiveJob
from aggregator.service.reporting import live_snapshot
from aggregator.storage.store import Store
from fedfleet.admin_rendering import progress_line
from protocols.rounds import RoundCoordinator

TOKEN = "status-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def status_of_a_fleet(tmp_path, n: int):
    """``/api/status`` of a service that hears ``n`` devices (a tenth revoked, half not enrolled) and
    serves a job whose open round asked them all, a quarter of which answered; and what it was built of."""
    devices = [f"dev{i:06d}" for i in range(n)]
    enrolled, revoked, accepted = set(devices[: n // 2]), set(devices[: n // 10]), devices[: n // 4]
    fleet = Fleet(None, None, enrolled, False)
    fleet.online, fleet.revoked = set(devices), revoked
    fleet.last_seen = dict.fromkeys(devices, time.time())
    cfg = {"num_classes": 3, "feature_dim": 8, "clients_per_round": n, "rounds": 5, "job_id": "ops"}
    active = ActiveJob(build_job("fedavg", cfg), "fedavg", tmp_path / f"out{n}")
    active.current = RoundCoordinator(1, frozenset(devices), time.time() + 60,
                                      accepted={d: f"m-{d}" for d in accepted})
    service = SimpleNamespace(live=live_snapshot(active, fleet, {}))
    client = TestClient(create_app(Store(tmp_path / f"state{n}.db"), TOKEN, service))
    answer = client.get("/api/status", headers=AUTH)
    assert answer.status_code == 200, answer.text[:300]
    return answer, {"online": n, "revoked": len(revoked), "strangers": n - len(enrolled), "accepted": len(accepted)}


def test_the_status_is_as_large_for_ten_thousand_devices_as_for_ten_and_counts_them(tmp_path):
    small, _ = status_of_a_fleet(tmp_path, 10)
    large, fleet = status_of_a_fleet(tmp_path, 10_000)
    # the counts' digits and the timestamps' may differ; a device listed costs at least 9 bytes
    assert abs(len(large.content) - len(small.content)) < 64, (len(small.content), len(large.content))
    assert len(large.content) < 2000, large.text
    status = large.json()
    assert (status["devices_online"], status["revoked"], status["not_enrolled"]) == \
        (fleet["online"], fleet["revoked"], fleet["strangers"])
    assert "last_seen" not in status
    current = status["job"]["current_round"]
    assert (current["round"], current["participants"], current["accepted"], current["pending"]) == \
        (1, fleet["online"], fleet["accepted"], fleet["online"] - fleet["accepted"])
    assert (current["declined"], current["rejected"], current["lost"]) == (0, 0, 0)
    # what `fedfleet admin status` draws of it: the round's answers of its participants, the online count
    line = progress_line(status)
    assert f"{fleet['accepted']}/{fleet['online']}" in line and line.endswith(f"online {fleet['online']}"), line


def test_without_a_service_the_status_is_empty_as_before(tmp_path):
    client = TestClient(create_app(Store(tmp_path / "state.db"), TOKEN))
    assert client.get("/api/status", headers=AUTH).json() == {}
