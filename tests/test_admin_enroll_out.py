"""``fedfleet admin device enroll ID --out FILE`` (fedfleet/admin_enroll.py): the one-time credentials
are shown once and a second enrolment is refused until a revocation, so where they go is checked
before anything is enrolled, a link planted at FILE is replaced (never written through), and a
write that still fails after the enrolment says how to recover. The API is a stub that records what
was posted; the reference for the file is its bytes and mode as the OS reports them."""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedfleet.admin import _device

CREDS = {"device_id": "cam-1", "mqtt_username": "cam-1", "mqtt_password": "one-time-secret", "public_key": "00"}


class StubAPI:
    def __init__(self, on_enrol=lambda: None):
        self.posted, self.on_enrol = [], on_enrol

    def post(self, path, body=None):
        self.posted.append(path)
        self.on_enrol()
        return dict(CREDS)


def enrol(out: Path, api: StubAPI):
    return _device(SimpleNamespace(action="enroll", device_id="cam-1", public_key=None, tags=None, out=out), api)


@pytest.mark.parametrize("target", ["a missing folder", "an existing folder"])
def test_an_out_that_cannot_be_written_is_refused_before_anything_is_enrolled(tmp_path, target):
    out = tmp_path / "nonexistent" / "x.json" if target == "a missing folder" else tmp_path
    api = StubAPI()
    with pytest.raises(OSError, match=str(out)):
        enrol(out, api)
    assert api.posted == [], "enrolled, and its credentials lost"


def test_a_link_planted_at_out_is_replaced_not_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("the operator's file")
    out = tmp_path / "cam-1.json"
    out.symlink_to(victim)
    enrol(out, StubAPI())
    assert victim.read_text() == "the operator's file"
    status = out.lstat()
    assert stat.S_ISREG(status.st_mode) and stat.S_IMODE(status.st_mode) == 0o600
    assert json.loads(out.read_text()) == CREDS


def test_a_write_that_fails_after_the_enrolment_says_how_to_recover(tmp_path):
    folder = tmp_path / "creds"
    folder.mkdir()
    api = StubAPI(on_enrol=lambda: shutil.rmtree(folder))         # gone between the check and the write
    with pytest.raises(OSError) as refused:
        enrol(folder / "cam-1.json", api)
    assert api.posted == ["/api/devices"]
    said = str(refused.value)
    assert "cam-1 is enrolled" in said and str(folder / "cam-1.json") in said
    assert "fedfleet admin device revoke cam-1" in said and "enrol it again" in said
