"""A secure kind whose config alone says how long its SecAgg vector is (Fed3R-Sync, FedNCM-Sync,
the secure FedAvg(ψ) family) is held to SecAgg's limits wherever a config is accepted: the longest
vector SecAgg sums and the mask words a member of the largest round expands (``MAX_MASK_WORDS``).
A review's finding: the admin API (and ``aggregator serve --config``) only validated the fields,
so a Fed3R-Sync config on the "complete" graph whose rounds ask a device more masks than it
expands was stored (201) and failed only when the service built it. Now it is one 422 naming the
fields to change, nothing stored; the kinds whose vector needs their initial model (tail kinds,
LADD) are still held to it when the job is built (tests/test_secagg_mask_budget.py)."""

from __future__ import annotations

from aggregator.api.app import create_app
from aggregator.api.server import ApiServer
from aggregator.jobs import secure_rounds

from test_admin_api import TOKEN, start_service
from test_secagg_mask_budget import FED3R_SYNC_WORDS
from test_secure_ladd_config import _request

MASK_WORDS = 2 ** 29            # protocols/secagg/config.py MAX_MASK_WORDS
STRAGGLERS = 2                  # MIN_GROUP - 1 devices may join a round's last group
# secure FedAvg(ψ)'s vector at 100 classes of 1,280 features: [n·weight | n·bias | n]
HEAD_WORDS = 100 * 1280 + 100 + 1
HEAD = {"num_classes": 100, "feature_dim": 1280, "graph": "complete"}
# the most members of a complete group whose masks fit the budget (each expands one per member)
HEAD_MEMBERS = MASK_WORDS // HEAD_WORDS


def test_the_admin_api_refuses_a_secure_vector_no_device_masks_and_stores_nothing(broker, tmp_path, monkeypatch):
    assert 643 * FED3R_SYNC_WORDS <= MASK_WORDS < 644 * FED3R_SYNC_WORDS
    assert HEAD_MEMBERS == 4190
    svc, store, thread = start_service(broker, tmp_path, ["ghost"], expected_devices=1)
    api = ApiServer(create_app(store, TOKEN, svc)).start()
    try:
        status, before = _request(api.url, "/api/jobs")
        assert status == 200
        made = {job["job_id"] for job in before}

        def create(job_id: str, kind: str, config: dict) -> tuple[int, str]:
            status, body = _request(api.url, "/api/jobs", {"job_id": job_id, "kind": kind, "config": config})
            return status, str(body.get("detail", body))

        status, said = create("sync", "fed3r-sync", {"graph": "complete", "clients_per_round": 642})
        assert status == 422, said
        assert f"644 masks of {FED3R_SYNC_WORDS} words" in said and "MAX_MASK_WORDS" in said, said
        assert "clients_per_round" in said and "graph" in said and "num_classes" in said, said
        over = HEAD_MEMBERS + 1 - STRAGGLERS
        status, said = create("head", "fedavg-secure", {**HEAD, "clients_per_round": over})
        assert status == 422, said
        assert f"{HEAD_MEMBERS + 1} masks of {HEAD_WORDS} words" in said and "clients_per_round" in said, said
        status, said = create("scaffold", "scaffold-secure", {**HEAD, "clients_per_round": over // 2})
        assert status == 422 and f"masks of {2 * HEAD_WORDS - 1} words" in said, said     # [n·y | Δc | n]
        status, said = create("fits", "fedavg-secure", {**HEAD, "clients_per_round": over - 1})
        assert status == 201, said                                  # one member fewer: within the budget
        # SecAgg's longest vector, lowered to one entry under Fed3R-Sync's default vector
        monkeypatch.setattr(secure_rounds, "MAX_VECTOR_LENGTH", FED3R_SYNC_WORDS - 1)
        status, said = create("long", "fed3r-sync", {})
        assert status == 422, said
        assert f"{FED3R_SYNC_WORDS:,} entries, more than SecAgg's" in said, said
        assert "num_classes" in said and "feature_dim" in said, said
        status, after = _request(api.url, "/api/jobs")
        assert status == 200 and {job["job_id"] for job in after} == made | {"fits"}
        assert all(store.job(job_id) is None for job_id in ("sync", "head", "scaffold", "long"))
    finally:
        api.stop()
        svc.stop()
        thread.join(30)
