"""A job's rounds as the dashboard asks for them each second: ``/api/jobs/{id}/rounds?last=N`` is
the last N rounds, exactly as the whole listing shows them, and reading it (or the jobs table) does
not read the job's every round. A review found the dashboard's poll parsed every stored round of
every job twice a second (the jobs table counted rounds by reading them all, and the rounds table
asked for all of them to show 15): a job of 5,000 rounds cost 0.8 s of the process's time a
second, and a long asynchronous job (one round per dispatch) more than the poll's interval."""

import time

import pytest
from starlette.testclient import TestClient

import aggregator.storage.contributions as contributions_module
import aggregator.storage.rounds as rounds_module
from aggregator.api.app import create_app
from aggregator.storage.store import Store

from test_admin_api import AUTH, TOKEN

CLOSED = 120                    # closed rounds, then one open


def participants(r: int) -> list[str]:
    return sorted({f"dev{(r * 7 + i) % 40:02d}" for i in range(3)})


@pytest.fixture
def long_job(tmp_path):
    """A job of CLOSED closed rounds, each accepting all but its first participant (who declined), and an
    open round one device answered and one declined; read-only API (no service: the durable records)."""
    store = Store(tmp_path / "state.db")
    store.create_job("long", "fedavg", {"job_id": "long"})
    for r in range(1, CLOSED + 2):
        devs = participants(r)
        store.open_round("long", r, devs, {d: f"t{r}-{d}" for d in devs}, {}, time.time() + 600)
        store.add_contributions([("long", r, d, f"m{r}-{d}", b"x" * r) for d in devs[1:2 if r > CLOSED else None]])
        if r <= CLOSED:
            store.close_round("long", r, {"accepted": devs[1:], "dropped": [], "declined": devs[:1], "rejected": []},
                              bytes_in=r)
        else:
            store.add_round_event("long", r, devs[0], "declined", "busy")
    return TestClient(create_app(store, TOKEN))


@pytest.mark.parametrize("last", [1, 5, CLOSED + 1, CLOSED + 50])
def test_the_last_rounds_are_the_whole_listings_last_rounds(long_job, last):
    whole = long_job.get("/api/jobs/long/rounds", headers=AUTH).json()
    page = long_job.get(f"/api/jobs/long/rounds?last={last}", headers=AUTH).json()
    assert [r["round"] for r in whole] == list(range(1, CLOSED + 2))
    assert page == whole[-last:]
    shown = range(max(1, CLOSED + 2 - last), CLOSED + 2)
    assert [r["round"] for r in page] == list(shown)
    for r, view in zip(shown, page):
        devs = participants(r)
        assert view["participants"] == devs
        assert view["accepted"] == (devs[1:] if r <= CLOSED else devs[1:2])
        assert sorted(view["result_latency_s"]) == view["accepted"]     # its contributions were read
        assert view["declined"] == devs[:1]
        assert view["pending"] == ([] if r <= CLOSED else devs[2:])


def count_store_reads(monkeypatch) -> dict[str, int]:
    """Rounds and contributions read from the store from now on, counted as the store builds them."""
    read = {"rounds": 0, "contributions": 0}

    def counted(cls, what):
        def build(*args):
            read[what] += 1
            return cls(*args)
        return build

    monkeypatch.setattr(rounds_module, "StoredRound", counted(rounds_module.StoredRound, "rounds"))
    monkeypatch.setattr(contributions_module, "StoredContribution",
                        counted(contributions_module.StoredContribution, "contributions"))
    return read


@pytest.mark.parametrize("last", [0, -1, "x"])
def test_a_bad_page_size_is_one_422(long_job, last):
    resp = long_job.get(f"/api/jobs/long/rounds?last={last}", headers=AUTH)
    assert resp.status_code == 422 and "last" in resp.text


def test_the_dashboards_poll_reads_only_the_rounds_it_shows(long_job, monkeypatch):
    """Rounds and contributions read from the store per request, counted as the store builds them."""
    read = count_store_reads(monkeypatch)

    def reads(path):
        read.update(rounds=0, contributions=0)
        resp = long_job.get(path, headers=AUTH)
        assert resp.status_code == 200, resp.text
        return resp.json(), dict(read)

    (job,), jobs_read = reads("/api/jobs")
    assert (job["rounds"], job["contributions"]) == (CLOSED + 1, 2 * CLOSED + 1)
    assert jobs_read == {"rounds": 0, "contributions": 0}
    one, one_read = reads("/api/jobs/long")
    assert (one["rounds"], one["contributions"]) == (CLOSED + 1, 2 * CLOSED + 1)
    assert one_read == {"rounds": 0, "contributions": 0}
    page, page_read = reads("/api/jobs/long/rounds?last=15")
    assert len(page) == 15
    assert page_read == {"rounds": 15, "contributions": 2 * 14 + 1}


@pytest.mark.parametrize("round_no", [1, CLOSED // 2, CLOSED + 1])
def test_one_rounds_detail_reads_only_that_round(long_job, monkeypatch, round_no):
    """``/api/jobs/{id}/rounds/{n}`` (``fedfleet admin round JOB N``) is the whole listing's round n,
    read alone: it built the view of every round of the job, every contribution of it read, to keep
    one (a review's finding: a long job's one-round question cost what its whole history does)."""
    whole = long_job.get("/api/jobs/long/rounds", headers=AUTH).json()
    read = count_store_reads(monkeypatch)
    resp = long_job.get(f"/api/jobs/long/rounds/{round_no}", headers=AUTH)
    assert resp.status_code == 200, resp.text
    assert resp.json() == whole[round_no - 1]
    assert read == {"rounds": 1, "contributions": len(whole[round_no - 1]["accepted"])}
    missing = long_job.get(f"/api/jobs/long/rounds/{CLOSED + 2}", headers=AUTH)
    assert missing.status_code == 404 and f"no round {CLOSED + 2}" in missing.text
