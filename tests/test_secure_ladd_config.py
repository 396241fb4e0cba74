"""Secure LADD's ``min_cluster_contributors`` is at least 2 (a slot summed over one device is that
device's update) at every entry point that checks a config, not when a job is built from it. A
review's finding: the field's declared limit was 1, so the checks that read the declarations (the
admin API's schema, ``validate_job_config``, ``--ladd-config``'s LaddSimConfig) took 1, and the
job's own rule refused it only when the secure job's config was built (for ``fedfleet simulate
--pipeline ladd --secure``: in the aggregator process, after the benchmark was rendered and the
device keys made)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from aggregator.api.app import create_app
from aggregator.api.server import ApiServer
from aggregator.jobs.registry import validate_job_config
from aggregator.jobs.secure_ladd import SecureLaddConfig
from aggregator.storage.store import Store
from fedfleet.ladd.config import QUICK, LaddSimConfig

from test_admin_api import TOKEN
from test_job_registry import SEG

ONE_DEVICE_SLOTS = {"model": SEG, "min_cluster_contributors": 1}


def test_the_job_config_check_refuses_one_contributor_before_any_config_is_built():
    with pytest.raises(ValueError, match="'min_cluster_contributors'=1"):
        validate_job_config("ladd-secure", ONE_DEVICE_SLOTS)
    validate_job_config("ladd-secure", {**ONE_DEVICE_SLOTS, "min_cluster_contributors": 2})
    with pytest.raises(ValueError, match="min_cluster_contributors=1"):       # a config built in Python
        SecureLaddConfig(**ONE_DEVICE_SLOTS)


def test_the_ladd_experiment_refuses_one_contributor_and_a_secure_group_too_large_at_once():
    with pytest.raises(ValueError, match="'min_cluster_contributors'=1"):
        LaddSimConfig(**{**QUICK, "secure": True, "min_cluster_contributors": 1})
    # the secure job's own rules run on the experiment's recipe: a group past SecAgg's largest
    with pytest.raises(ValueError, match="clients_per_round is 20,000"):
        LaddSimConfig(**{**QUICK, "secure": True, "clients_per_round": 20_000})
    assert LaddSimConfig(**{**QUICK, "clients_per_round": 20_000}).clients_per_round == 20_000   # not secure: fine
    assert LaddSimConfig(**{**QUICK, "secure": True}).secure_job_fields()["min_cluster_contributors"] == 2


def _request(url: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url + path, method="POST" if body is not None else "GET",
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_admin_api_advertises_and_enforces_at_least_two_contributors(tmp_path):
    server = ApiServer(create_app(Store(tmp_path / "state.db"), TOKEN)).start()
    try:
        status, schema = _request(server.url, "/openapi.json")
        assert status == 200
        field = schema["components"]["schemas"]["LaddSecureConfig"]["properties"]["min_cluster_contributors"]
        assert field["minimum"] == 2
        status, refused = _request(server.url, "/api/jobs",
                                   {"job_id": "one-slot", "kind": "ladd-secure", "config": ONE_DEVICE_SLOTS})
        assert status == 422 and "min_cluster_contributors" in json.dumps(refused)
        # 2 passes every check: this read-only API (no service) then has nowhere to create it
        status, _ = _request(server.url, "/api/jobs", {"job_id": "two-slot", "kind": "ladd-secure",
                                                       "config": {**ONE_DEVICE_SLOTS, "min_cluster_contributors": 2}})
        assert status == 503
        assert _request(server.url, "/api/jobs") == (200, [])
    finally:
        server.stop()
