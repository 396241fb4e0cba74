"""Where ``fedfleet device`` keeps its state when no option says (fedfleet/device_state_path.py): a
private folder per device under the XDG state home; ``--state-dir`` overrides it, ``--no-state`` keeps
none; an id that would leave the folder, or a home where nothing can be created, is one line of error."""

import errno
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from edge_client.state import DeviceStateStore
from fedfleet.cli import main
from fedfleet.device_state_path import default_state_dir, make_private_dir
from fedfleet.errors import UserError


def test_the_default_folder_follows_the_xdg_state_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    both = {"FEDFLEET_STATE_HOME": "/srv/fleet", "XDG_STATE_HOME": "/var/xdg"}
    assert default_state_dir("cam1", both) == Path("/srv/fleet/cam1")
    assert default_state_dir("cam1", {"XDG_STATE_HOME": "/var/xdg"}) == Path("/var/xdg/fedfleet/devices/cam1")
    home = tmp_path / "home" / ".local" / "state" / "fedfleet" / "devices" / "cam1"
    assert default_state_dir("cam1", {}) == home
    # empty is unset; a relative XDG_STATE_HOME is invalid by the spec and ignored
    assert default_state_dir("cam1", {"FEDFLEET_STATE_HOME": "", "XDG_STATE_HOME": ""}) == home
    assert default_state_dir("cam1", {"XDG_STATE_HOME": "relative/state"}) == home
    assert default_state_dir("cam.1-a_b", {"XDG_STATE_HOME": "/x"}) == Path("/x/fedfleet/devices/cam.1-a_b")


@pytest.mark.parametrize("device_id", [".", "..", "../x", "a/b", "/abs", "", "x" * 65, "cam\n1"])
def test_an_id_that_would_leave_its_folder_is_refused(device_id):
    with pytest.raises(UserError, match="cannot name a state folder") as refused:
        default_state_dir(device_id, {"FEDFLEET_STATE_HOME": "/srv/fleet"})
    assert "\n" not in str(refused.value) and "--state-dir" in str(refused.value)


@pytest.mark.parametrize("device_id", [".", ".."])
def test_fedfleet_device_refuses_a_dot_id_in_one_line(device_id, tmp_path, monkeypatch, capsys):
    home = tmp_path / "fleet" / "devices"
    monkeypatch.setenv("FEDFLEET_STATE_HOME", str(home))
    assert main(["device", "--id", device_id, "--idx", "a", "b"]) != 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "cannot name a state folder" in err[0] and "--no-state" in err[0], err
    assert not (tmp_path / "fleet").exists()              # nothing made, neither the folder nor the one above


def test_the_folder_and_those_made_above_it_are_private(tmp_path):
    (tmp_path / "kept").mkdir(mode=0o755)
    (tmp_path / "kept").chmod(0o755)
    old = os.umask(0)                                      # the umask is not what makes them private
    try:
        make_private_dir(tmp_path / "kept" / "fedfleet" / "devices" / "cam1")
    finally:
        os.umask(old)
    modes = {p: stat.S_IMODE((tmp_path / p).stat().st_mode)
             for p in ("kept", "kept/fedfleet", "kept/fedfleet/devices", "kept/fedfleet/devices/cam1")}
    assert modes == {"kept": 0o755, "kept/fedfleet": 0o700, "kept/fedfleet/devices": 0o700,
                     "kept/fedfleet/devices/cam1": 0o700}
    make_private_dir(tmp_path / "kept")                    # one that exists: left as it is
    assert stat.S_IMODE((tmp_path / "kept").stat().st_mode) == 0o755


@pytest.mark.parametrize("blocked", ["a file in the way", "a read-only file system"])
def test_a_state_home_where_nothing_can_be_made_is_one_line(blocked, tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("FEDFLEET_STATE_HOME", str(tmp_path / "file" / "fleet"))
    if blocked == "a read-only file system":             # the tests run as root: no mode refuses them
        monkeypatch.setenv("FEDFLEET_STATE_HOME", str(tmp_path / "home"))

        def read_only(self, *a, **k):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        monkeypatch.setattr(Path, "mkdir", read_only)
    assert main(["device", "--id", "cam1", "--idx", "a", "b"]) != 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "cannot create the device's state folder" in err[0], err
    assert "--state-dir" in err[0] and "--no-state" in err[0] and "Traceback" not in err[0]


def test_state_dir_and_no_state_exclude_each_other(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["device", "--id", "cam1", "--idx", "a", "b", "--state-dir", str(tmp_path), "--no-state"])
    assert stop.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_forget_state_uses_the_default_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FEDFLEET_STATE_HOME", str(tmp_path / "fleet"))
    store = DeviceStateStore(tmp_path / "fleet" / "cam1")
    store.save("job-1", "ab" * 8, 1, {"c": np.zeros(3, np.float32)})
    DeviceStateStore(tmp_path / "fleet" / "cam2").save("job-1", "ab" * 8, 1, {"c": np.zeros(3, np.float32)})
    assert main(["device", "--id", "cam1", "--idx", "a", "b", "--forget-state"]) == 0
    assert f"device state in {tmp_path / 'fleet' / 'cam1'}: 1 file(s) removed" in capsys.readouterr().out
    assert DeviceStateStore(tmp_path / "fleet" / "cam1").jobs() == []
    assert DeviceStateStore(tmp_path / "fleet" / "cam2").jobs() == ["job-1"]       # another device's stays
    for argv, words in ((["--forget-state"], "--forget-state needs --id"),
                        (["--id", "cam1", "--no-state", "--forget-state"], "no state folder to forget")):
        assert main(["device", "--idx", "a", "b", *argv]) != 0
        assert words in capsys.readouterr().err
