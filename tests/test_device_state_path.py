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


@pytest.mark.parametrize("blocked", ["a file in the way", "a read-only file system", "a name too long"])
def test_a_state_home_where_nothing_can_be_made_is_one_line(blocked, tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("FEDFLEET_STATE_HOME", str(tmp_path / "file" / "fleet"))
    if blocked == "a name too long":                     # ENAMETOOLONG from the first stat: was a traceback
        monkeypatch.setenv("FEDFLEET_STATE_HOME", str(tmp_path / ("a" * 300)))
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


def _loose(tmp_path: Path, how: str) -> Path:
    """A device's default folder (under $FEDFLEET_STATE_HOME) that another user could change."""
    home = tmp_path / "fleet"
    home.mkdir(mode=0o700)
    if how == "the folder writable by others":
        (home / "cam1").mkdir()
        (home / "cam1").chmod(0o777)
    elif how == "the folder writable by its group":
        (home / "cam1").mkdir()
        (home / "cam1").chmod(0o770)
    elif how == "the folder another user's":
        (home / "cam1").mkdir(mode=0o700)
        os.chown(home / "cam1", 4242, -1)
    elif how == "a symlink to another user's folder":
        (tmp_path / "theirs").mkdir(mode=0o700)
        os.chown(tmp_path / "theirs", 4242, -1)
        (home / "cam1").symlink_to(tmp_path / "theirs")
    else:                                                  # one above it that others may write to (no sticky bit)
        home.chmod(0o777)
    return home


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root (the suite runs as root)")
@pytest.mark.parametrize("how", ["the folder writable by others", "the folder writable by its group",
                                 "the folder another user's", "a symlink to another user's folder",
                                 "a folder above it writable by others"])
def test_a_state_folder_another_user_could_change_is_refused_in_one_line(how, tmp_path, monkeypatch, capsys):
    """As ssh refuses a loose ~/.ssh: another user who could write the folder, or rename it and put
    their own in its place, could roll the sample-window ledger back or read the personal parts."""
    monkeypatch.setenv("FEDFLEET_STATE_HOME", str(_loose(tmp_path, how)))
    assert main(["device", "--id", "cam1", "--idx", "a", "b"]) != 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "state folder" in err[0] and "is not private" in err[0], err
    assert "--state-dir" in err[0] and "Traceback" not in err[0]
    # a folder the refused start made itself goes again (one under a loose folder stayed behind)
    assert (tmp_path / "fleet" / "cam1").exists() == (how != "a folder above it writable by others")


@pytest.mark.parametrize("data", ["a missing file", "a file that is no IDX"])
def test_a_device_whose_data_cannot_be_loaded_leaves_no_state_folder_behind(data, tmp_path, monkeypatch, capsys):
    """The state folder was made before the data loaded: a bad --idx path or file left an empty one,
    with the folders made above it, behind (a review's finding). Those this start made go again; a
    folder that was there before it stays."""
    home = tmp_path / "fleet" / "devices"
    monkeypatch.setenv("FEDFLEET_STATE_HOME", str(home))
    images, labels = tmp_path / "images.idx", tmp_path / "labels.idx"
    if data == "a file that is no IDX":
        images.write_bytes(b"not an IDX file")
        labels.write_bytes(b"nor this")
    assert main(["device", "--id", "cam1", "--idx", str(images), str(labels)]) != 0
    out, err = capsys.readouterr()
    assert f"keeps its state in {home / 'cam1'}" in out and "Traceback" not in err     # made, then taken back
    assert not (tmp_path / "fleet").exists()
    home.mkdir(parents=True)
    assert main(["device", "--id", "cam1", "--idx", str(images), str(labels)]) != 0
    assert [p.name for p in home.iterdir()] == []                # what this start made, and only that, went
    (home / "cam1").mkdir(mode=0o700)
    assert main(["device", "--id", "cam1", "--idx", str(images), str(labels)]) != 0
    assert (home / "cam1").is_dir()                              # there before: kept


def test_a_shared_sticky_folder_above_is_fine(tmp_path):
    """/tmp's kind (others may write, only an entry's owner may rename it): the device's own folder
    in it is made private and taken."""
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared").chmod(0o1777)
    make_private_dir(tmp_path / "shared" / "cam1")
    assert stat.S_IMODE((tmp_path / "shared" / "cam1").stat().st_mode) == 0o700


def test_forget_state_refuses_an_id_the_credentials_contradict(tmp_path, monkeypatch, capsys):
    """--id cam1 with cam2's enrolment: `fedfleet device` refuses it at start, so --forget-state must
    too, not empty cam1's folder (it did, the credentials unread once an --id was given)."""
    monkeypatch.setenv("FEDFLEET_STATE_HOME", str(tmp_path / "fleet"))
    for device in ("cam1", "cam2"):
        DeviceStateStore(tmp_path / "fleet" / device).save("job-1", "ab" * 8, 1, {"c": np.zeros(3, np.float32)})
    creds = tmp_path / "cam2.credentials.json"
    creds.write_text('{"device_id": "cam2", "mqtt_username": "cam2", "mqtt_password": "pw"}')
    assert main(["device", "--id", "cam1", "--credentials", str(creds), "--idx", "a", "b", "--forget-state"]) != 0
    assert "differs from the credentials' device 'cam2'" in capsys.readouterr().err
    assert DeviceStateStore(tmp_path / "fleet" / "cam1").jobs() == ["job-1"]
    assert main(["device", "--credentials", str(creds), "--idx", "a", "b", "--forget-state"]) == 0
    assert DeviceStateStore(tmp_path / "fleet" / "cam2").jobs() == [] and \
        DeviceStateStore(tmp_path / "fleet" / "cam1").jobs() == ["job-1"]


def test_a_relative_state_home_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """A relative FEDFLEET_STATE_HOME named a folder that moved with the working folder: a device
    started elsewhere, or --forget-state run from elsewhere, found another (a review's finding)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="must be an absolute path"):
        default_state_dir("cam1", {"FEDFLEET_STATE_HOME": "fleet/state"})
    monkeypatch.setenv("FEDFLEET_STATE_HOME", "fleet/state")
    assert main(["device", "--id", "cam1", "--idx", "a", "b"]) != 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "FEDFLEET_STATE_HOME must be an absolute path" in err[0], err
    assert not (tmp_path / "fleet").exists()
