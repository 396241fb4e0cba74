"""/api/jobs and /api/models list a page at a time (a review found /api/jobs answered every job:
28 MB and 2 s at 20,000 jobs, polled each second by the dashboard, and past the CLI's 64 MB answer
cap ``fedfleet admin jobs`` failed): creation order, ``after`` and ``limit``, ``order=newest``,
X-Total-Count and X-Next-After; a listing followed page by page holds every job once even while
jobs are created; bad paging parameters are one 422; the CLI follows the pages. The service runs
for real over mosquitto, the jobs and models are stored in its SQLite store."""

import json
import sqlite3

import numpy as np
import pytest
from starlette.testclient import TestClient

from aggregator.api.app import create_app
from aggregator.api.server import ApiServer
from fedfleet.admin import main as admin
from test_admin_api import AUTH, TOKEN, start_service

EXTRA_JOBS = 1004                     # with the service's own job: past one default page (1000)


@pytest.fixture
def many_jobs(broker, tmp_path):
    tmp = tmp_path
    svc, store, thread = start_service(broker, tmp, ["ghost"], expected_devices=1)
    for i in range(EXTRA_JOBS):
        store.create_job(f"job-{(i * 7919) % EXTRA_JOBS:05d}", "fed3r", {})     # ids not in creation order
    for i in range(5):
        store.finish_job(f"job-{i:05d}", "done", {}, {}, {"w": np.full(2, float(i))}, {}, 1)
    yield TestClient(create_app(store, TOKEN, svc)), store, tmp / "state.db"
    svc.stop()
    thread.join(30)


def reference(db_path, table="jobs", key="job_id", order="created_at, job_id") -> list:
    """The listing read from the SQLite file itself, sorted here, not by the store's query."""
    db = sqlite3.connect(db_path)
    rows = db.execute(f"SELECT {key}, {order.split(',')[0]} FROM {table}").fetchall()
    db.close()
    return [k for k, _ in sorted(rows, key=lambda r: (r[1], r[0]))]


def follow(client, path, key, limit, between=None, **params):
    got, after, pages = [], None, 0
    while True:
        r = client.get(path, params={"limit": limit, **({"after": after} if after else {}), **params}, headers=AUTH)
        assert r.status_code == 200, r.text
        rows, pages = r.json(), pages + 1
        assert len(rows) <= limit
        got += [row[key] for row in rows]
        after = r.headers.get("x-next-after")
        if after is None:
            return got, pages, int(r.headers["x-total-count"])
        assert after == str(rows[-1][key]) and len(rows) == limit
        if between and pages == 1:
            between()


def test_a_jobs_page_is_bounded_and_says_what_follows(many_jobs):
    client, store, db_path = many_jobs
    everyone = reference(db_path)
    r = client.get("/api/jobs", headers=AUTH)                      # an old client's request, no parameters
    assert r.status_code == 200 and [j["job_id"] for j in r.json()] == everyone[:1000]
    assert r.headers["x-total-count"] == str(len(everyone)) == str(EXTRA_JOBS + 1)
    assert r.headers["x-next-after"] == everyone[999]
    newest = client.get("/api/jobs", params={"limit": 7, "order": "newest"}, headers=AUTH)
    assert [j["job_id"] for j in newest.json()] == everyone[::-1][:7]
    assert newest.json()[0]["rounds"] == 0 and newest.headers["x-next-after"] == everyone[-7]
    metrics = client.get("/metrics", headers=AUTH).text
    assert f'fedfleet_jobs{{state="created"}} {float(EXTRA_JOBS - 5)!r}' in metrics


@pytest.mark.parametrize("order", ["oldest", "newest"])
def test_following_pages_lists_every_job_once_in_order(many_jobs, order):
    client, store, db_path = many_jobs
    before = reference(db_path)
    late = f"late-{order}"
    got, pages, total = follow(client, "/api/jobs", "job_id", 97, order=order,
                               between=lambda: store.create_job(late, "fed3r", {}))   # created mid-listing
    if order == "oldest":
        assert got == before + [late] and total == len(before) + 1
    else:
        assert got == before[::-1]            # made after the listing began: before its first page
    assert pages == -(-len(got) // 97) and len(set(got)) == len(got)


def test_models_page_in_id_order_of_one_job_or_all(many_jobs):
    client, store, db_path = many_jobs
    ids = [m for m in reference(db_path, "models", "model_id", "model_id")]
    assert len(ids) == 5
    assert follow(client, "/api/models", "model_id", 2)[:3:2] == (ids, 5)
    assert follow(client, "/api/models", "model_id", 2, order="newest")[0] == ids[::-1]
    one = client.get("/api/models", params={"job_id": "job-00003"}, headers=AUTH)
    assert [m["job_id"] for m in one.json()] == ["job-00003"] and one.headers["x-total-count"] == "1"


@pytest.mark.parametrize("path,params", [
    ("/api/jobs", {"limit": 0}), ("/api/jobs", {"limit": 5001}), ("/api/jobs", {"limit": "many"}),
    ("/api/jobs", {"after": "../x"}), ("/api/jobs", {"order": "sideways"}), ("/api/models", {"after": 0}),
    ("/api/models", {"after": "x"}), ("/api/models", {"limit": 5001}), ("/api/deployments", {"limit": -1})])
def test_bad_paging_parameters_are_one_clear_422(many_jobs, path, params):
    client, store, _ = many_jobs
    jobs = store.job_count()
    r = client.get(path, params=params, headers=AUTH)
    assert r.status_code == 422, (path, params, r.text)
    assert len(r.json()["detail"]) == 1, r.text
    assert store.job_count() == jobs


@pytest.mark.parametrize("path,after", [("/api/jobs", "no-such-job"), ("/api/deployments", "no-such-deployment")])
def test_a_cursor_naming_no_row_is_a_404_naming_it(many_jobs, path, after):
    client, _, _ = many_jobs
    r = client.get(path, params={"after": after}, headers=AUTH)
    assert r.status_code == 404 and r.json()["detail"] == f"after={after!r}: no such row to list after", r.text


def test_the_cli_lists_every_job_across_pages(many_jobs, capsys):
    client, store, db_path = many_jobs
    api = ApiServer(client.app).start()
    try:
        def cli(*args):
            capsys.readouterr()
            assert admin(["--url", api.url, "--token", TOKEN, "--json", *args]) == 0
            return json.loads(capsys.readouterr().out)
        everyone = reference(db_path)
        assert [j["job_id"] for j in cli("jobs")] == everyone                  # past one page of 1000
        assert [j["job_id"] for j in cli("jobs", "--limit", "3")] == everyone[-3:]
        assert [m["model_id"] for m in cli("models")] == reference(db_path, "models", "model_id", "model_id")
    finally:
        api.stop()
