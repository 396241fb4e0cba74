"""Operator input that used to get past the admin API's checks, each refused with one clear error
now (a review's attacks): non-finite JSON numbers, job ids that name a directory, a log offset
past any file, a guard or cohort that would not parse back after a restart, a job file that is no
regular file, a head too large for memory, a noise multiplier with no privacy left, a deployment
report's count too large to weigh. The API runs for real (TestClient on the FastAPI app, a real
SQLite store); the deployment controller over mosquitto."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from starlette.testclient import TestClient

from aggregator.api.app import create_app
from aggregator.deployments.cohort import CohortRule
from aggregator.deployments.controller import DeploymentController
from aggregator.deployments.guard import Guard
from aggregator.jobs.registry import build_job, kind_of
from aggregator.storage.round_log import SETTING_PREFIX
from aggregator.storage.store import Store
from protocols.envelope import Envelope, EnvelopeError
from protocols.mqtt_link import BrokerConfig
from protocols.payloads.deployment import REPORT, parse_report
from protocols.topics import Topics

TOKEN = "test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"}


@pytest.fixture
def client(tmp_path):
    store = Store(tmp_path / "state.db")
    store.create_job("j1", "fed3r", {})
    log = tmp_path / "rounds.jsonl"
    log.write_text('{"event": "round_open", "round": 1}\n')
    store.set_setting(SETTING_PREFIX + "j1", str(log))
    return TestClient(create_app(store, TOKEN), raise_server_exceptions=True)


@pytest.mark.parametrize("path,body", [
    ("/api/jobs", b'{"job_id":"a3","kind":"fed3r","config":{"lam":NaN}}'),
    ("/api/jobs", b'{"job_id":"a4","kind":"fed3r","config":{"random_features":{"seed":1,"dim":4,"sigma":Infinity}}}'),
    ("/api/jobs", b'{"job_id":"a5","kind":"ladd","config":{"model":{"num_classes":2,"image_size":16,'
                  b'"aspp_rates":[Infinity]}}}'),
    ("/api/jobs", b'{"job_id":"a6","kind":"fed3r","config":{"lam":-Infinity}}'),
    ("/api/models/1/deploy", b'{"bake_s": NaN}'),
    ("/api/models/1/deploy", b'{"patience_s": Infinity}'),
])
def test_a_non_finite_json_number_is_a_422_that_names_the_field(client, path, body):
    """FastAPI's own 422 echoes the input, which JSON cannot hold when it is NaN: that was a 500."""
    r = client.post(path, content=body, headers=AUTH)
    assert r.status_code == 422, r.text
    assert r.json()["detail"] and all("loc" in e and "msg" in e and "input" not in e for e in r.json()["detail"])


@pytest.mark.parametrize("body,field", [
    ({"min_reports": True}, "min_reports"), ({"min_reports": "3"}, "min_reports"), ({"min_reports": 2.5}, "min_reports"),
    ({"bake_s": "0"}, "bake_s"), ({"seed": True}, "seed"), ({"cohort": 5}, "cohort"), ({"min_report": 3}, "min_report")])
def test_a_deploy_request_of_the_wrong_json_type_or_an_unknown_field_is_a_422_naming_it(client, body, field):
    """A review's finding: pydantic's lax mode took true as a min_reports of 1 (a weaker guard than
    asked), "3" as 3, and a misspelt field was dropped for its default: each was a 201."""
    r = client.post("/api/models/1/deploy", json=body, headers=AUTH)
    assert r.status_code == 422 and field in str(r.json()["detail"]), r.text
    for valid in ({"min_reports": 3, "bake_s": 0}, {"min_reports": 3.0, "seed": 7.0}):   # 3.0: JSON Schema's integer
        assert client.post("/api/models/1/deploy", json=valid, headers=AUTH).status_code != 422
    assert client.post("/api/deployments/d1/rollback", json={"reason": 7}, headers=AUTH).status_code == 422


@pytest.mark.parametrize("body,key", [
    (b'{"job_id":"dupa","job_id":"dupb","kind":"fed3r","config":{}}', "job_id"),
    (b'{"job_id":"dupa","kind":"fedavg","kind":"fed3r","config":{}}', "kind"),
    (b'{"job_id":"dupa","kind":"fed3r","config":{"lam":0.5,"lam":1000.0}}', "lam"),
    (b'{"job_id":"dupa","kind":"fed3r","config":{"random_features":{"seed":1,"dim":4,"sigma":2,"dim":8}}}', "dim")])
def test_a_json_key_named_twice_is_a_400_naming_it(client, body, key):
    """A review's finding: the last of two values was taken silently (json.loads), so what an
    operator reviewed was not what ran. (Without the repeat the same body is past every check:
    this API has no service to create it, 503.)"""
    r = client.post("/api/jobs", content=body, headers=AUTH)
    assert r.status_code == 400 and f"duplicate key {key!r}" in r.json()["detail"], r.text
    once = json.loads(body)                                   # the last value of each key
    assert client.post("/api/jobs", json=once, headers=AUTH).status_code == 503


def test_every_route_that_takes_a_json_body_refuses_a_repeated_key(client):
    from fastapi.routing import APIRoute
    from test_admin_api import sample_path

    with_body = [(method, route) for route in client.app.routes if isinstance(route, APIRoute) and route.body_field
                 for method in route.methods]
    assert len(with_body) >= 4
    for method, route in with_body:
        r = client.request(method, sample_path(route), content=b'{"a": 1, "a": 2}', headers=AUTH)
        assert r.status_code == 400 and "duplicate key 'a'" in r.json()["detail"], (route.path, r.text)


@pytest.mark.parametrize("job_id", [".", ".."])
def test_a_job_id_that_names_a_directory_is_refused(client, job_id):
    r = client.post("/api/jobs", headers=AUTH, json={"job_id": job_id, "kind": "fed3r", "config": {}})
    assert r.status_code == 422 and "job_id" in str(r.json()["detail"])
    with pytest.raises(ValueError, match="job_id"):
        build_job("fed3r", {"job_id": job_id})            # a stored one never starts either
    # "..." is a name like any other: past the checks (this API has no service to create it: 503)
    assert client.post("/api/jobs", headers=AUTH, json={"job_id": "...", "kind": "fed3r", "config": {}}).status_code == 503


@pytest.mark.parametrize("deployment_id", [".", ".."])
def test_a_deployment_id_that_no_path_can_reach_is_refused(client, deployment_id):
    """A review's finding: ``--deployment-id ..`` started a rollout that browsers, curl and httpx
    could not promote or roll back (they normalise ``/api/deployments/../rollback`` away), and
    while it was active every other deployment was refused. Its id now follows a job id's rule."""
    r = client.post("/api/models/1/deploy", headers=AUTH, json={"deployment_id": deployment_id})
    assert r.status_code == 422 and "deployment_id" in str(r.json()["detail"])
    assert client.post(f"/api/deployments/{deployment_id}x/rollback", headers=AUTH).status_code != 422


def test_a_body_over_the_limit_is_a_413_however_it_is_sent(client):
    """A review's findings: a chunked body (no Content-Length) past the 1 MiB cap got FastAPI's
    vague 400 "There was an error parsing the body", and a Content-Length of 5,000 digits raised
    (int() refuses to read it) instead of being refused."""
    def chunks():
        for _ in range(6):
            yield b"x" * (256 * 1024)

    streamed = client.post("/api/devices", headers=AUTH, content=chunks())
    assert streamed.status_code == 413 and "larger than 1048576 bytes" in streamed.text
    long_length = client.post("/api/devices", headers={**AUTH, "content-length": "1" * 5000}, content=b"{}")
    assert long_length.status_code == 413
    small = client.post("/api/devices", headers=AUTH, content=iter([b'{"device_id": "d1"}']))
    assert small.status_code == 503                        # read whole, past the guard (no service here)


@pytest.mark.parametrize("offset", [2 ** 62, 10 ** 18])
def test_a_log_offset_past_the_end_reads_nothing(client, offset):
    r = client.get(f"/api/jobs/j1/log?offset={offset}", headers=AUTH)
    assert r.status_code == 200 and r.json()["lines"] == [] and r.json()["next_offset"] == offset


@pytest.mark.parametrize("text", ["reports>=1000000", "wma_drop<=0.00001", "median_drop<=1.0,refused<=0"])
def test_a_guard_is_stored_as_text_that_parses_back_to_it(text):
    guard = Guard.parse(text)
    assert Guard.parse(guard.text) == guard
    with pytest.raises(ValueError, match="too large"):
        Guard.parse("wma_drop<=" + "9" * 400)


@pytest.mark.parametrize("text", ["12.3456789%", "5%", "0.05", "33%", "100%", "devices:b,a", "tags:x"])
def test_a_cohort_is_stored_as_text_that_parses_back_to_it(text):
    rule = CohortRule.parse(text, seed=7)
    assert CohortRule.parse(rule.text(), seed=7) == rule


def test_an_accepted_deployment_survives_a_restart_of_its_controller(broker, tmp_path):
    """Its guard and cohort were stored rounded ("reports>=1e+06"), which the next start of the
    aggregator could not parse: the controller, and with it the aggregator, failed to start."""
    store = Store(tmp_path / "state.db")
    store.create_job("j1", "fed3r", {})
    model = store.finish_job("j1", "done", {}, {}, {"coef": np.ones((3, 4)), "intercept": np.zeros(3)}, {}, 1)
    topics = Topics("tguard")
    controller = DeploymentController(store, BrokerConfig.from_url(broker.url), topics, tick_s=0.05).start()
    try:
        api = TestClient(create_app(store, TOKEN, None, controller))
        too_large = api.post(f"/api/models/{model}/deploy", headers=AUTH,
                             json={"guard": "wma_drop<=" + "9" * 400, "deployment_id": "d0"})
        assert too_large.status_code == 422 and "too large" in too_large.json()["detail"]
        r = api.post(f"/api/models/{model}/deploy", headers=AUTH,
                     json={"guard": "reports>=1000000,wma_drop<=0.00001", "deployment_id": "d1",
                           "cohort": "12.3456789%"})
        assert r.status_code == 201, r.text
    finally:
        controller.stop()
    again = DeploymentController(store, BrokerConfig.from_url(broker.url), topics, tick_s=0.05)
    shown = again.show("d1")
    assert Guard.parse(shown["guard"]) == Guard.parse("reports>=1000000,wma_drop<=0.00001")
    assert CohortRule.parse(shown["cohort"]).fraction == CohortRule.parse("12.3456789%").fraction


@pytest.mark.parametrize("kind,config", [
    ("ladd", {"model": {"num_classes": 2, "image_size": 16}, "initial_model_file": "/dev/zero",
              "initial_model_sha256": "0" * 64}),
    ("fedavg", {"init": "fed3r", "initial_head_file": "/dev/zero"}),
    ("fedavg-secure", {"identity_file": "/dev/zero", "device_keys_file": "/dev/zero"}),
    ("ladd", {"model": {"num_classes": 2, "image_size": 16}, "initial_model_file": "/"}),
])
def test_a_job_file_that_is_no_regular_file_is_refused_at_once(kind, config):
    """Building the job hashed or read /dev/zero forever on the service thread (every later admin
    request answered 503), or read a directory; now one error, at once."""
    outcome: list[BaseException | None] = []

    def build() -> None:
        try:
            build_job(kind, config).load_identities() if kind == "fedavg-secure" else build_job(kind, config)
            outcome.append(None)
        except BaseException as exc:        # what the service's start would report
            outcome.append(exc)

    worker = threading.Thread(target=build, daemon=True)
    worker.start()
    worker.join(20)
    assert outcome, "building the job did not finish"
    assert isinstance(outcome[0], ValueError) and "regular file" in str(outcome[0])


def test_a_head_too_large_for_memory_is_refused_before_anything_is_allocated():
    with pytest.raises(ValueError, match="head parameters"):
        build_job("fed3r", {"num_classes": 100_000, "feature_dim": 8192, "b_format": "dense"})
    build_job("fed3r", {"num_classes": 2028, "feature_dim": 1280})          # the many-class regime fits


@pytest.mark.parametrize("kind", ["fed3r", "fed3r-sync", "fedncm"])
def test_random_features_count_in_the_head_size_they_set(kind):
    """Fed3R's B is (random_features.dim + 1) x C whatever feature_dim says: a small feature_dim
    with 8,192 random features and 8,000 classes passed the cap and allocated 0.5 GB at start."""
    rf = {"seed": 1, "dim": 8192, "sigma": 1.0}
    with pytest.raises(ValueError, match=r"random_features\.dim \+ 1\) = 65,544,000 head parameters"):
        build_job(kind, {"num_classes": 8000, "feature_dim": 1, "random_features": rf})
    assert kind_of(kind).config_cls(num_classes=10, feature_dim=1, random_features=rf).head_inputs == 8193


@pytest.mark.parametrize("mechanism,z", [("ssp", 1e-300), ("ssp", 0.05), ("gaussian", 1e-300)])
def test_a_noise_multiplier_its_accountant_cannot_account_is_refused(mechanism, z):
    """ε infinite (a report JSON cannot hold), or PLD accounting that does not finish."""
    fields = {"feature_clip_norm": 4.0, "max_samples": 5, "dp_mechanism": mechanism}
    with pytest.raises(ValueError, match="dp_noise_multiplier"):
        build_job("fed3r", {**fields, "dp_noise_multiplier": z})
    least = 0.1 if mechanism == "ssp" else 1e-100
    assert build_job("fed3r", {**fields, "dp_noise_multiplier": least}).config.dp


def test_a_deployment_report_counts_at_most_a_held_out_split_a_device_can_have():
    body = {"deployment": "d1", "seq": 1, "sha256": "a" * 64}
    huge = 10 ** 400
    with pytest.raises(EnvelopeError, match="held-out samples"):
        parse_report(Envelope(type=REPORT, sender="cam-0", body={**body, "n": huge, "correct_candidate": huge,
                                                                 "correct_current": huge}))
    ok = parse_report(Envelope(type=REPORT, sender="cam-0", body={**body, "n": 40, "correct_candidate": 30,
                                                                  "correct_current": 31}))
    assert ok["n"] == 40


def test_a_job_file_is_checked_and_loaded_from_one_read(tmp_path, monkeypatch):
    """A review's finding: the pretrained network was stat-ed, hashed and loaded in three opens, so
    a file swapped after its digest check was loaded (and one swapped after the stat, for a FIFO or
    a larger file, read regardless). Now its bytes are read once, checked and loaded; a FIFO is
    refused without blocking."""
    import hashlib
    import io
    import os
    from types import SimpleNamespace

    import aggregator.jobs.input_files as input_files
    import aggregator.jobs.ladd as ladd
    from aggregator.jobs.input_files import read_job_input

    def npz(value: float) -> bytes:
        buffer = io.BytesIO()
        np.savez(buffer, w=np.full(4, value, np.float32))
        return buffer.getvalue()

    genuine, evil = npz(1.0), npz(-666.0)
    path = tmp_path / "pretrained.npz"
    path.write_bytes(genuine)
    config = SimpleNamespace(initial_model_file=str(path), initial_model_sha256=hashlib.sha256(genuine).hexdigest())
    real_check = input_files.check_sha256

    def check_then_swap(data, expected, what):
        real_check(data, expected, what)
        path.write_bytes(evil)                  # replaced right after its digest was checked
    monkeypatch.setattr(input_files, "check_sha256", check_then_swap)
    arrays, _ = ladd.LaddJob.load_initial(config)
    assert np.array_equal(arrays["w"], np.full(4, 1.0, np.float32))
    with pytest.raises(ValueError, match="sha256 does not match"):
        ladd.LaddJob.load_initial(config)              # the swapped file itself is refused
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ValueError, match="not a regular file"):
        read_job_input(tmp_path / "fifo", "initial_model_file")
    with pytest.raises(ValueError, match="more than 10"):
        read_job_input(path, "initial_model_file", max_bytes=10)


def _zip_of(members: dict[str, bytes], compression=None) -> bytes:
    import io
    import zipfile

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression or zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def _npy_header(shape: tuple, descr: str = "<f8") -> bytes:
    import io

    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": descr, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


def test_an_npz_is_refused_before_it_inflates_past_its_bound():
    """The review's F03: a job file's bytes on disk were bounded (1 GiB) but not what they inflate
    to: a 1.5 MiB archive of zeros made the service allocate 1.5 GiB. The members' declared sizes
    are checked first, and a header declaring more data than its member holds (numpy allocates the
    declared shape before reading) is refused too; each error is a ValueError."""
    from protocols.files import read_npz

    zeros = _zip_of({"head.npy": _npy_header((2**21,)) + bytes(8 * 2**21)})       # 16 MiB inflated
    assert len(zeros) < 100_000
    assert read_npz(zeros)["head"].shape == (2**21,)
    with pytest.raises(ValueError, match=r"inflates to 16,777,344 bytes, more than 1,048,576"):
        read_npz(zeros, max_bytes=2**20)
    lying = _zip_of({"w.npy": _npy_header((10**12,)) + bytes(64)})
    with pytest.raises(ValueError, match=r"declares \(1000000000000,\) of float64, more than its 192 bytes"):
        read_npz(lying)
    with pytest.raises(ValueError, match=r"'notes.txt': every member must be one array named \*\.npy"):
        read_npz(_zip_of({"notes.txt": b"hello"}))
    for garbage in (b"", b"not a zip", b"PK\x03\x04" + bytes(40)):
        with pytest.raises(ValueError, match="not a readable .npz archive"):
            read_npz(garbage)


def test_read_npz_gives_numpys_arrays_and_refuses_short_data_and_objects():
    """read_npz reads each member in one pass (its header parsed once): the arrays numpy's own
    reader gives, dtype, shape, memory order and bytes, for every layout a model file may hold;
    a member whose data ends early, or that holds Python objects, is one ValueError."""
    import io

    from protocols.files import read_npz

    rng = np.random.default_rng(0)
    arrays = {"dense": rng.normal(size=(3, 4)), "fortran": np.asfortranarray(rng.normal(size=(5, 2, 3)).astype(">f4")),
              "empty": np.zeros((0, 3)), "scalar": np.array(3.5), "ints": np.arange(10, dtype=np.int16),
              "record": np.array([(1, 2.0)], dtype=[("x", "<i4"), ("y", "<f8")]), "text": np.array(["ab", "c"])}
    for save in (np.savez, np.savez_compressed):
        buffer = io.BytesIO()
        save(buffer, **arrays)
        got, expected = read_npz(buffer.getvalue()), dict(np.load(io.BytesIO(buffer.getvalue())))
        assert list(got) == list(expected) == list(arrays)
        for name, array in expected.items():
            assert got[name].dtype == array.dtype and got[name].shape == array.shape, name
            assert got[name].flags.f_contiguous == array.flags.f_contiguous and got[name].flags.writeable, name
            assert got[name].tobytes("A") == array.tobytes("A"), name
    short = _zip_of({"w.npy": _npy_header((20,)) + bytes(40)})      # 128 + 40 bytes: passes the size check
    with pytest.raises(ValueError, match=r"'w.npy': its data ends after 40 of 160 bytes"):
        read_npz(short)
    buffer = io.BytesIO()
    np.savez(buffer, objects=np.array([1, {}], dtype=object))
    with pytest.raises(ValueError, match="holds Python objects"):
        read_npz(buffer.getvalue())


@pytest.mark.parametrize("kind", ["fedavg", "ladd"])
def test_a_job_file_that_inflates_past_a_job_files_bound_is_refused(kind, tmp_path, monkeypatch):
    """The same through the jobs that read .npz inputs: the job is not built, with one error that
    names the file (the bound made small here: the real one is MAX_JOB_FILE_BYTES, 1 GiB)."""
    import aggregator.jobs.input_files as input_files

    monkeypatch.setattr(input_files, "MAX_JOB_FILE_BYTES", 2**20)
    path = tmp_path / "model.npz"
    path.write_bytes(_zip_of({"coef.npy": _npy_header((10, 1280)) + bytes(8 * 12_800),
                              "intercept.npy": _npy_header((10,)) + bytes(80),
                              "junk.npy": _npy_header((2**18,)) + bytes(8 * 2**18)}))
    config = ({"init": "fed3r", "initial_head_file": str(path)} if kind == "fedavg" else
              {"model": {"num_classes": 2, "image_size": 16}, "initial_model_file": str(path)})
    with pytest.raises(ValueError, match=r"model.npz'.*inflates to [0-9,]+ bytes, more than 1,048,576"):
        build_job(kind, config)


@pytest.mark.parametrize("kind", ["fedavg", "fedavg-secure", "ditto", "pp-secure"])
def test_a_fed3r_start_without_its_head_file_is_refused_at_create(client, kind):
    """The admin review's finding: a FedAvg-family job with init "fed3r" and no initial_head_file
    was stored, and refused only when started. Python may still hand the head itself
    (FedAvgJob.from_fed3r); a stored job has nothing beside its config."""
    refused = client.post("/api/jobs", headers=AUTH, json={"job_id": "ft1", "kind": kind, "config": {"init": "fed3r"}})
    assert refused.status_code == 422 and "initial_head_file" in refused.json()["detail"], refused.text
    assert client.get("/api/jobs/ft1", headers=AUTH).status_code == 404
    from aggregator.jobs.registry import full_config

    assert full_config(kind, {"init": "fed3r", "initial_head_file": "h.npz"})["initial_head_file"] == "h.npz"


def test_a_job_started_from_a_fed3r_object_needs_no_head_file():
    from aggregator.compute.ridge import ClosedFormRidge
    from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob

    rng = np.random.default_rng(0)
    ridge = ClosedFormRidge(lam=0.1).fit(rng.normal(size=(40, 4)), rng.integers(0, 3, 40))
    job = FedAvgJob.from_fed3r(FedAvgConfig(num_classes=3, feature_dim=4), ridge)
    assert job.config.init == "fed3r" and job.params["weight"].shape == (3, 4)


@pytest.mark.parametrize("text,why", [
    ('{"dev1": "KEY1", "dev1": "KEY2"}', "duplicate key 'dev1'"),    # the first key silently replaced
    ('["dev1"]', "expected an object"),                            # before: AttributeError (a traceback)
    ('{"dev1": 7}', "expected an object"),
    ('{"dev1": "not hex"}', "non-hexadecimal"),
    # RFC 8032's test key 1 with its first digit mistyped: no curve point, every message refused as forged
    ('{"dev1": "075a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"}', "no point of the curve"),
    ("[" * 100_000, "recursion"),
])
def test_a_bad_device_keys_file_is_one_error_naming_it(tmp_path, text, why):
    """``device_keys_file`` (the enrolled devices' public keys of a secure job) was parsed with no
    check of its shape: a device named twice kept its last key, a list raised AttributeError."""
    from ops_fleet import SecureKeys

    keys = SecureKeys.create(tmp_path, ["dev1"])
    text = text.replace("KEY1", keys.devices["dev1"].public_key_bytes.hex()).replace("KEY2", "ab" * 32)
    (tmp_path / "device_keys.json").write_text(text)
    with pytest.raises(ValueError, match="device_keys_file") as caught:      # building the job reads the keys
        build_job("fedavg-secure", {"num_classes": 2, "feature_dim": 4, **keys.job_fields(tmp_path)})
    assert why in str(caught.value).lower()


def test_a_devices_presence_carries_a_bounded_profile_and_only_on_its_presence_topic(tmp_path):
    """A review's findings: a presence's info was stored whole with the device (up to the 256 MiB
    message limit, shown on every device listing), and a presence topic took any message type past
    the enrolment check that an outbox applies (a result, an artifact request)."""
    from aggregator.service.loop import AggregatorService
    from protocols import messages as M
    from protocols.envelope import encode
    from protocols.mqtt_link import BrokerConfig
    from protocols.topics import Topics

    store = Store(tmp_path / "state.db")
    svc = AggregatorService(None, BrokerConfig(port=1), tmp_path / "out", store=store, enrolled={"dev00"})
    big = M.presence_message("dev00", "online", {"notes": "x" * 20_000})
    svc._on_payload(Topics().presence("dev00"), encode(big))
    assert svc.stats.rejections.get("presence") == 1 and not (store.device("dev00") or {}).get("profile")
    svc._on_payload(Topics().presence("dev00"), encode(M.presence_message("dev00", "online", {"tags": "lab"})))
    assert store.device("dev00")["profile"] == {"tags": "lab"}
    ask = M.decline_message("stranger", M.TaskRef("j", 1, "t"), "x")             # not enrolled, on its presence topic
    svc._on_payload(Topics().presence("stranger"), encode(ask))
    assert svc.stats.rejections.get("unexpected type") == 1


def _damaged(compression: int, at: float) -> bytes:
    """A one-member .npz of doubles that compress (Huffman-coded blocks, not stored ones: a bad
    byte there breaks the decoder, not only the CRC), 8 bytes of its compressed stream overwritten
    ``at`` that fraction of the archive."""
    import io

    buffer = io.BytesIO()
    np.save(buffer, np.arange(20_000) % 97 / 7.0)
    data = bytearray(_zip_of({"w.npy": buffer.getvalue()}, compression))
    start = int(len(data) * at)
    data[start:start + 8] = b"\xff" * 8
    return bytes(data)


@pytest.mark.parametrize("case", ["deflate", "lzma", "unterminated header"])
def test_a_damaged_npz_is_one_value_error_whatever_breaks(case):
    """A member whose compressed stream is damaged, or whose .npy header text is cut inside a
    bracket, is one ValueError naming the archive as unreadable, as every other bad .npz is; it
    raised zlib's, lzma's or tokenize's own error (a traceback where the caller said one line:
    ``--eval-features``, a job's head file, a stored model's head)."""
    import zipfile

    from protocols.files import read_npz

    if case == "unterminated header":
        text = b"{'descr': '<f8', 'fortran_order': False, 'shape': (3,"
        header = text + b" " * (64 - (10 + len(text) + 1) % 64) + b"\n"
        data = _zip_of({"w.npy": b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + bytes(24)})
        matched = "'w.npy' is not an .npy array"
    else:
        compression = zipfile.ZIP_DEFLATED if case == "deflate" else zipfile.ZIP_LZMA
        data = _damaged(compression, 0.2)
        matched = "not a readable .npz archive"
    with pytest.raises(ValueError, match=matched):
        read_npz(data)
