"""The web dashboard in headless Chromium (Playwright driving Debian's /usr/bin/chromium) while a
simulated Fed3R job runs: real agents over mosquitto, one device per round, each device held until
the test lets it answer, so the page must show the rounds advance. The screenshot is kept in
test-artifacts/dashboard.png."""

import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
import pytest

from aggregator.api.app import create_app
from aggregator.api.server import ApiServer
from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from aggregator.storage.store import Store
from protocols.mqtt_link import BrokerConfig

from ops_fleet import REPO, Fleet, data_for, job_config

CHROMIUM = "/usr/bin/chromium"
# Playwright's wait_for_function polls by evaluating its string in the page, which the dashboard's
# Content-Security-Policy refuses (no eval): these tests read the page with it bypassed;
# tests/test_output_injection.py checks the page under its policy.
UNDER_TEST = {"bypass_csp": True}
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TOKEN = "dashboard-token-0123456789"
DEVICES = ["dev01", "dev02", "dev03", "dev04"]


def text(page, element_id: str) -> str:
    return page.text_content(f"#{element_id}") or ""


def cells(page, table_id: str) -> list[list[str]]:
    return [[td.text_content() for td in tr.query_selector_all("td")]
            for tr in page.query_selector_all(f"#{table_id} tbody tr")]


def test_dashboard_shows_rounds_advance_during_a_running_job(broker, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not installed (Debian package chromium)")
    gates = {d: threading.Event() for d in DEVICES}
    Z, y = data_for("dev99")
    store = Store(tmp_path / "state.db")
    svc = AggregatorService(Fed3RJob(Fed3RConfig(**job_config(DEVICES, clients_per_round=1))),
                            BrokerConfig.from_url(broker.url), tmp_path / "out", ServiceSettings(tick_s=0.05),
                            enrolled=set(DEVICES), eval_set=(Z, y), store=store)
    result = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=90)), daemon=True)
    thread.start()
    api = ApiServer(create_app(store, TOKEN, svc)).start()
    profile = tempfile.mkdtemp(prefix="fedfleet-chromium-")
    seen_rounds = []
    try:
        with Fleet(broker.url, DEVICES, gates=gates), sync_api.sync_playwright() as pw:
            ctx = pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True,
                                                        args=CHROMIUM_ARGS, viewport={"width": 1280, "height": 1000},
                                                        **UNDER_TEST)
            page = ctx.new_page()
            page.goto(f"{api.url}/dashboard/")                          # the sign-in page
            page.fill("#token", TOKEN)
            page.click("#login button[type=submit]")                    # POSTs, gets a session, redirected
            page.wait_for_selector("#round-number", timeout=20000)
            assert page.url == f"{api.url}/dashboard/"
            for _ in range(3):
                deadline = time.time() + 20
                while not (svc.live.get("job") or {}).get("current_round") and time.time() < deadline:
                    time.sleep(0.05)
                current = svc.live["job"]["current_round"]
                page.wait_for_function(
                    f"document.getElementById('round-number').textContent === '{current['round']}'", timeout=20000)
                seen_rounds.append(int(text(page, "round-number")))
                assert f"round {current['round']}: 0/1 accepted" in text(page, "round-detail")
                gates[current["participants"][0]].set()               # let this round's device answer
                deadline = time.time() + 20
                while (svc.live["job"].get("current_round") or {}).get("round") == current["round"] \
                        and time.time() < deadline:
                    time.sleep(0.05)
            page.wait_for_function("document.querySelectorAll('#rounds-table tbody tr').length >= 3", timeout=20000)
            page.wait_for_function(
                "document.getElementById('accuracy-line').getAttribute('points').split(' ').length >= 3",
                timeout=20000)
            fleet_rows = page.query_selector_all("#fleet-table tbody tr")
            assert len(fleet_rows) == len(DEVICES)
            assert all("online" in r.inner_text() for r in fleet_rows)
            assert int(text(page, "contributions")) >= 3
            expected_device = "cuda:0" if torch.cuda.is_available() else "cpu"
            page.wait_for_function(f"document.getElementById('compute-device').textContent === "
                                   f"'{expected_device}'", timeout=20000)
            assert "SecAgg unmask: " + ("cuda" if torch.cuda.is_available() else "cpu") in text(page, "compute-detail")
            artifacts = REPO / "test-artifacts"
            artifacts.mkdir(exist_ok=True)
            page.screenshot(path=str(artifacts / "dashboard.png"), full_page=True)
            for g in gates.values():
                g.set()
            thread.join(60)
            ctx.close()
    finally:
        api.stop()
        svc.stop()
        shutil.rmtree(profile, ignore_errors=True)
    assert seen_rounds == sorted(set(seen_rounds)) and len(seen_rounds) == 3, seen_rounds
    assert result["state"] == "done" and len(result["contributed"]) == len(DEVICES)
    png = (REPO / "test-artifacts" / "dashboard.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert np.isfinite(result["final"]["accuracy"])


def test_dashboard_after_the_job_ended_keeps_its_history_lists_every_device_and_asks_for_the_token(broker, tmp_path):
    """The job has ended before the browser comes: the page opened at the printed address asks
    for the token (a wrong one is refused on the page), then shows the finished job with its
    rounds, evaluations and models as the store holds them, and every device the aggregator knows
    or heard from with its state: enrolled, revoked, and one that is online but not enrolled."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not installed (Debian package chromium)")
    enrolled, stranger = DEVICES[:3], "dev09"
    store = Store(tmp_path / "state.db")
    svc = AggregatorService(Fed3RJob(Fed3RConfig(**job_config(enrolled, clients_per_round=1))),
                            BrokerConfig.from_url(broker.url), tmp_path / "out",
                            ServiceSettings(tick_s=0.05, keep_serving=True), enrolled=set(enrolled),
                            eval_set=data_for("dev99"), store=store)
    thread = threading.Thread(target=lambda: svc.run(timeout_s=90), daemon=True)
    thread.start()
    api = ApiServer(create_app(store, TOKEN, svc)).start()
    profile = tempfile.mkdtemp(prefix="fedfleet-chromium-")
    try:
        with Fleet(broker.url, enrolled + [stranger]), sync_api.sync_playwright() as pw:
            deadline = time.time() + 60
            while store.job("ops")["state"] != "done" and time.time() < deadline:
                time.sleep(0.1)
            assert store.job("ops")["state"] == "done"
            svc.call(lambda: svc.revoke(enrolled[0]))
            ctx = pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True,
                                                        args=CHROMIUM_ARGS, viewport={"width": 1280, "height": 1400},
                                                        **UNDER_TEST)
            page = ctx.new_page()
            page.goto(api.url)                                  # what an operator types: the printed address
            assert page.is_visible("#login") and text(page, "login-error").strip() == ""
            page.fill("#token", "not-the-token-0000000000")
            page.click("#login button")
            page.wait_for_selector("#login")
            assert "Wrong token" in text(page, "login-error")
            page.fill("#token", TOKEN)
            page.click("#login button")
            page.wait_for_url(f"{api.url}/dashboard/")

            rounds, evals, models = store.rounds("ops"), store.evaluations("ops"), store.models("ops")
            page.wait_for_function(f"document.querySelectorAll('#rounds-table tbody tr').length === {len(rounds)}",
                                   timeout=20000)
            job_rows = cells(page, "jobs-table")
            assert [(r[0], r[2], int(r[3]), int(r[4])) for r in job_rows] == [("ops", "done", len(rounds), len(enrolled))]
            assert text(page, "job-state") == "done" and text(page, "round-detail") == "no open round"
            round_rows = cells(page, "rounds-table")
            assert [(int(r[0]), r[1], int(r[3])) for r in round_rows] == \
                [(x.round, "closed", len(x.outcome["accepted"])) for x in reversed(rounds)]
            with_accuracy = [e for e in evals if e.get("accuracy") is not None]
            assert len(page.query_selector_all("#accuracy-points circle")) == len(with_accuracy) > 0
            assert text(page, "accuracy") == f"{with_accuracy[-1]['accuracy']:.4f}"
            model_rows = cells(page, "models-table")
            assert sorted(int(r[0]) for r in model_rows) == sorted(m["model_id"] for m in models) and models

            states = {r[0]: (r[1], r[2]) for r in cells(page, "fleet-table")}
            assert states == {enrolled[0]: ("revoked", "offline"), enrolled[1]: ("enrolled", "online"),
                              enrolled[2]: ("enrolled", "online"), stranger: ("not enrolled", "online")}
            assert text(page, "online") == "3"
            assert text(page, "fleet-summary") == "4 known: 2 enrolled, 1 not enrolled, 1 revoked"
            artifacts = REPO / "test-artifacts"
            artifacts.mkdir(exist_ok=True)
            page.screenshot(path=str(artifacts / "dashboard-after-job.png"), full_page=True)
            ctx.close()
    finally:
        api.stop()
        svc.stop()
        thread.join(30)
        shutil.rmtree(profile, ignore_errors=True)


class SlowRoute:
    """An ASGI app in front of ``app`` that answers ``path`` ``delay_s`` late, keeping when each of
    its requests came and went and the most in flight at once (all on the server's event loop)."""

    def __init__(self, app, path: str, delay_s: float):
        self.app, self.path, self.delay_s = app, path, delay_s
        self.came, self.went = [], []
        self.in_flight = self.most_at_once = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != self.path:
            return await self.app(scope, receive, send)
        import asyncio

        self.came.append(time.monotonic())
        self.in_flight += 1
        self.most_at_once = max(self.most_at_once, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            self.went.append(time.monotonic())


def wait_until(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.02)


def test_a_slow_server_gets_one_dashboard_refresh_at_a_time(tmp_path):
    """Each refresh takes longer than the second between refreshes: the page asked again every
    second regardless (setInterval), so requests piled up on a slow server; now it asks a second
    after the last refresh settled. A click on a job during a refresh still refreshes at once
    after it, not beside it."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not installed (Debian package chromium)")
    store = Store(tmp_path / "state.db")
    store.create_job("ops", "fed3r", {})
    slow = SlowRoute(create_app(store, TOKEN), "/api/status", delay_s=1.3)
    api = ApiServer(slow).start()
    profile = tempfile.mkdtemp(prefix="fedfleet-chromium-")
    try:
        with sync_api.sync_playwright() as pw:
            ctx = pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True,
                                                        args=CHROMIUM_ARGS, **UNDER_TEST)
            page = ctx.new_page()
            page.goto(f"{api.url}/dashboard/")
            page.fill("#token", TOKEN)
            page.click("#login button[type=submit]")
            page.wait_for_selector("#jobs-table tbody tr", timeout=20000)     # the first refresh done
            wait_until(lambda: len(slow.came) == 2 and slow.in_flight == 1, "the second refresh under way")
            page.click("#jobs-table tbody tr")
            wait_until(lambda: len(slow.came) >= 3, "the refresh the click asked for")
            ctx.close()
    finally:
        api.stop()
        shutil.rmtree(profile, ignore_errors=True)
    assert slow.most_at_once == 1, (slow.came, slow.went)
    # the next refresh waited for the first's answer (and the page's pause), the click's ran at once after the second
    assert slow.came[1] - slow.went[0] >= 0.9 and slow.came[2] - slow.went[1] < 0.9, (slow.came, slow.went)
