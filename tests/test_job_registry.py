"""One job registry for every kind: limits declared for every config field and refused for every
kind, every kind creatable through the admin API and offered by ``aggregator serve --kind``."""

import dataclasses

import numpy as np
import pytest
from starlette.testclient import TestClient

from aggregator.api.app import create_app
from aggregator.cli import build_parser
from aggregator.jobs.config_limits import Range, field_limit, undeclared_fields
from aggregator.jobs.ladd import LaddJob, save_initial_model
from aggregator.jobs.registry import KINDS, build_job, full_config, job_kind_name, validate_job_config

from test_admin_api import AUTH, TOKEN, start_service

ALL_KINDS = ["fed3r", "fed3r-sync", "fedncm", "fedncm-sync", "fedavg", "fedavg-async", "fedavg-secure", "fedavg-tail",
             "fedavg-tail-secure", "personalize", "pp", "pp-secure", "scaffold", "scaffold-secure",
             "scaffold-tail", "fedgloss", "ditto", "ditto-secure", "ladd", "ladd-secure"]
SEG = {"num_classes": 4, "image_size": 32}


def minimal_config(kind: str) -> dict:
    """The fewest fields a kind needs (what its config class refuses to default)."""
    if kind.startswith("ladd"):
        return {"model": dict(SEG)}
    if kind.startswith(("fedavg-tail", "scaffold-tail")):
        return {"tail_program_file": "bundle/tail_eval.pt2"}
    return {}


def test_every_kind_is_registered_once_with_every_field_limited():
    assert sorted(KINDS) == sorted(ALL_KINDS)
    assert len({k.config_cls for k in KINDS.values()}) == len(KINDS)      # one config class per kind
    for kind in KINDS.values():
        assert undeclared_fields(kind.config_cls) == [], kind.name
        assert kind.summary


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_limits_are_refused_for_every_kind(kind):
    fields = {f.name for f in dataclasses.fields(KINDS[kind].config_cls)}
    validate_job_config(kind, minimal_config(kind))                         # the defaults pass
    config_cls = KINDS[kind].config_cls
    ranged = [name for name in sorted(fields) if isinstance(field_limit(config_cls, name), Range)]
    assert ranged
    for name in ranged:
        limit = field_limit(config_cls, name)
        too_big = int(limit.hi) * 10 + 1 if limit.hi >= 1 else limit.hi * 10
        with pytest.raises(ValueError, match=name):
            validate_job_config(kind, {**minimal_config(kind), name: too_big})
    with pytest.raises(ValueError, match="no field"):
        validate_job_config(kind, {**minimal_config(kind), "no_such_field": 1})
    with pytest.raises(ValueError, match="job_id"):
        validate_job_config(kind, {**minimal_config(kind), "job_id": "../etc"})
    if "num_classes" in fields:                                              # the example
        with pytest.raises(ValueError, match="num_classes"):
            validate_job_config(kind, {"num_classes": 10 ** 9})


def test_serve_offers_every_registered_kind():
    parser = build_parser()
    for kind in ALL_KINDS:
        args = parser.parse_args(["serve", "--kind", kind, "--out", "x"])
        assert args.kind == kind


def test_ladd_builds_from_its_config_alone_with_a_checksummed_pretrained_network(tmp_path):
    from protocols.files import file_sha256

    arrays = {"head.w": np.arange(6, dtype=np.float32).reshape(2, 3), "enc.w": np.ones(4, np.float32)}
    path = tmp_path / "pretrained.npz"
    save_initial_model(path, arrays, ["head.w"])
    config = {"model": SEG, "clustering": "none", "initial_model_file": str(path),
              "initial_model_sha256": file_sha256(path)}
    job = build_job("ladd", config)
    assert isinstance(job, LaddJob) and job_kind_name(job) == "ladd" and job.trainable == ["head.w"]
    assert np.array_equal(job.pretrained["head.w"], arrays["head.w"])
    with pytest.raises(ValueError, match="sha256"):
        build_job("ladd", {**config, "initial_model_sha256": "0" * 64})
    with pytest.raises(ValueError, match="initial_model_file"):
        build_job("ladd", {"model": SEG})


def test_every_kind_is_created_through_the_admin_api(broker, tmp_path):
    svc, store, thread = start_service(broker, tmp_path, ["ghost"], expected_devices=1)
    try:
        client = TestClient(create_app(store, TOKEN, svc))
        for kind in ALL_KINDS:
            job_id = f"made-{kind}"
            resp = client.post("/api/jobs", headers=AUTH,
                               json={"job_id": job_id, "kind": kind, "config": minimal_config(kind)})
            assert resp.status_code == 201, (kind, resp.text)
            row = store.job(job_id)
            assert row["kind"] == kind and row["config"] == full_config(kind, {**minimal_config(kind), "job_id": job_id})
            over = client.post("/api/jobs", headers=AUTH,
                               json={"job_id": f"big-{kind}", "kind": kind,
                                     "config": {**minimal_config(kind), "round_timeout_s": 1e12}})
            assert over.status_code == 422 and store.job(f"big-{kind}") is None
        unknown = client.post("/api/jobs", headers=AUTH, json={"job_id": "x", "kind": "fedsgd", "config": {}})
        assert unknown.status_code == 422 and store.job("x") is None
    finally:
        svc.stop()
        thread.join(30)
