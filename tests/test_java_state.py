"""The Java device's state store (clients/java DeviceStateStore) against the Python device's
(edge_client/state.py): one script of operations (save, load with run/round/staleness, expiry on
open, the byte budget, drop, forget, a torn file) run through both on a fake clock answers the same
line for line, and each library opens the files the other wrote (the same .npz format)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import java_build
from edge_client.state import DeviceStateStore, StateBudgetExceeded

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))

RUN_A, RUN_B = "0123abcd", "feedbeef"


@pytest.fixture(scope="module", autouse=True)
def java_cp() -> str:
    return java_build.built()          # compiled once per test run (shared with the other Java tests)

SCRIPT = f"""clock 1000
open 400
save sc-1 {RUN_A} 3 100 10
save pp-1 {RUN_A} 1 50 20
used
load sc-1 {RUN_A} 4 5
load sc-1 {RUN_A} 9 5
load sc-1 {RUN_A} 8 5
load sc-1 - - -
save big {RUN_A} 1 100 30
save sc-1 {RUN_A} 4 100 30
load sc-1 {RUN_B} 4 5
load sc-1 {RUN_A} 4 5
save dt-1 {RUN_B} 2 200 5
clock 1060
open 400
load pp-1 {RUN_A} 1 5
load dt-1 {RUN_B} 2 0
drop dt-1
drop dt-1
save a/../b {RUN_A} 0 100 3
load a/../b {RUN_A} 0 0
open 400
forget
open 400
load a/../b - - -
"""


def python_answers(folder: Path, script: str) -> list[str]:
    """The script through edge_client.state.DeviceStateStore (the reference)."""
    now, store, out = [0.0], None, []
    for line in script.strip().splitlines():
        a = line.split()
        if a[0] == "clock":
            now[0] = float(a[1])
            out.append("OK")
        elif a[0] == "open":
            store = DeviceStateStore(folder, int(a[1]), clock=lambda: now[0])
            out.append("JOBS " + ",".join(sorted(store.jobs())))
        elif a[0] == "save":
            x = np.arange(int(a[5]), dtype=np.float32) / np.float32(2) + np.float32(int(a[3]))
            try:
                store.save(a[1], a[2], int(a[3]), {"x": x, "y": -x[None, :]}, float(a[4]))
                out.append("SAVED")
            except StateBudgetExceeded as exc:
                out.append(f"BUDGET {exc}")
        elif a[0] == "load":
            opt = [None if v == "-" else v for v in a[2:]]
            e = store.load(a[1], opt[0], None if opt[1] is None else int(opt[1]), None if opt[2] is None else int(opt[2]))
            out.append("NONE" if e is None else f"ENTRY {e.run} {e.round} " + " ".join(repr(float(v)) for v in e.arrays["x"])
                       + f" | {list(e.arrays['y'].shape)}")
        elif a[0] == "drop":
            out.append(f"DROPPED {str(store.drop(a[1])).lower()}")
        elif a[0] == "forget":
            out.append(f"FORGOT {store.forget()}")
        elif a[0] == "used":
            out.append(f"USED {store.used_bytes()}")
    return out


def java_answers(folder: Path, script: str, tmp_path: Path) -> list[str]:
    (tmp_path / "script").write_text(script)
    proc = subprocess.run(java_build.java_command("-cp", java_build.built(), "StateRunner", str(folder),
                                                  str(tmp_path / "script")),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines()


def test_the_java_store_answers_the_script_as_the_python_store(tmp_path):
    want = python_answers(tmp_path / "py", SCRIPT)
    got = java_answers(tmp_path / "java", SCRIPT, tmp_path)
    assert got == want
    # the script exercised every rule: staleness, another run dropped, the budget, expiry on open, drop, forget
    assert "NONE" in want and any(a.startswith("BUDGET") for a in want) and "DROPPED true" in want \
        and "DROPPED false" in want and any(a.startswith("FORGOT") and a != "FORGOT 0" for a in want)
    assert want[-1] == "NONE" and sum(a.startswith("ENTRY") for a in want) >= 4


def test_each_library_opens_the_state_the_other_wrote_and_drops_a_torn_file(tmp_path):
    folder = tmp_path / "state"
    java_answers(folder, f"clock 1000\nopen 100000\nsave sc-1 {RUN_A} 3 100 6\nsave torn {RUN_A} 1 100 2\n", tmp_path)
    store = DeviceStateStore(folder, 100000, clock=lambda: 1001.0)
    entry = store.load("sc-1", RUN_A, 3, 0)
    x = np.arange(6, dtype=np.float32) / 2 + 3
    assert entry is not None and entry.round == 3 and entry.expires_at == 1100.0
    assert entry.arrays["x"].dtype == np.float32 and np.array_equal(entry.arrays["x"], x)
    assert np.array_equal(entry.arrays["y"], -x[None, :])
    store.save("pp-2", RUN_B, 7, {"x": np.float32([1.5, -2.0]), "y": np.float32([[2.5]])}, 10.0)
    torn = store._path("torn")
    torn.write_bytes(torn.read_bytes()[:40])            # a device killed mid-write (without the rename)
    got = java_answers(folder, f"clock 1005\nopen 100000\nload pp-2 {RUN_B} 7 0\nload torn - - -\n", tmp_path)
    assert got == ["OK", "JOBS pp-2,sc-1", "ENTRY feedbeef 7 1.5 -2.0 | [1, 1]", "NONE"]
    assert not torn.exists()


def test_forget_state_removes_each_java_devices_kept_state(tmp_path):
    """HeadlessDevices --forget-state (the Java side of `fedfleet device --forget-state`): every
    job's state of the named devices goes, another device's stays."""
    from test_java_device import write_features

    for device in ("java0", "java1"):
        java_answers(tmp_path / "state" / device, f"clock {time.time()}\nopen 100000\nsave sc-1 {RUN_A} 3 3600 6\n"
                     f"save dt-1 {RUN_A} 1 3600 2\n", tmp_path)
    feats = write_features(tmp_path / "f.feat", np.zeros((2, 3), np.float32), np.array([0, 1]))
    proc = subprocess.run(java_build.java_command("-cp", java_build.built(), "org.fedfleet.device.HeadlessDevices",
                                                  "--state-dir", str(tmp_path / "state"), "--forget-state",
                                                  "--device", "java0", str(feats), "-", "--device", "java9",
                                                  str(feats), "-"), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["FORGOT java0 2", "FORGOT java9 0"]
    assert DeviceStateStore(tmp_path / "state" / "java0").jobs() == []
    assert sorted(DeviceStateStore(tmp_path / "state" / "java1").jobs()) == ["dt-1", "sc-1"]


# header fields of the wrong JSON type (what neither store writes): the Python store once coerced them
# (int("3"), str(12345678), float("2e9"); a NaN expiry never expires) where the Java store drops the
# file; found by tests/fuzz_stateful.py ("loose header")
LOOSE_HEADERS = {"round-float": {"round": 3.0}, "round-string": {"round": "3"}, "round-bool": {"round": True},
                 "expires-string": {"expires_at": "2000000000"}, "expires-nan": {"expires_at": float("nan")},
                 "run-number": {"run": 12345678}, "expires-huge-int": {"expires_at": 10 ** 400}}


def malformed_state_files(folder: Path) -> list[str]:
    """Files every store must drop: each loose header, and a zip cut right before its central
    directory (every entry whole: Java's ZipInputStream once read it as whole, numpy refuses it).
    Returns their jobs; one well-formed job, "ok", stays."""
    import io
    import json

    store = DeviceStateStore(folder, 100000, clock=lambda: 1000.0)
    x = {"x": np.float32([1.5, -2.0]), "y": np.float32([[2.5]])}
    for job in [*LOOSE_HEADERS, "cut", "ok"]:
        store.save(job, "12345678", 3, x, 1000.0)
    for job, change in LOOSE_HEADERS.items():
        path = store._path(job)
        with np.load(path) as data:
            header = {**json.loads(bytes(data["__state_header__"]).decode()), **change}
        buffer = io.BytesIO()
        np.savez(buffer, **x, __state_header__=np.frombuffer(json.dumps(header).encode(), np.uint8))
        path.write_bytes(buffer.getvalue())
    raw = store._path("cut").read_bytes()
    store._path("cut").write_bytes(raw[:raw.index(b"PK\x01\x02")])
    return [*LOOSE_HEADERS, "cut"]


def test_both_stores_drop_state_files_whose_header_has_wrong_types_or_whose_zip_is_cut_short(tmp_path):
    import shutil

    jobs = malformed_state_files(tmp_path / "python")
    shutil.copytree(tmp_path / "python", tmp_path / "java")
    script = "clock 1001\nopen 100000\n" + "".join(f"load {job} - - -\n" for job in [*jobs, "ok"])
    got = java_answers(tmp_path / "java", script, tmp_path)
    assert got == ["OK", "JOBS ok", *["NONE"] * len(jobs), "ENTRY 12345678 3 1.5 -2.0 | [1, 1]"], got
    store = DeviceStateStore(tmp_path / "python", 100000, clock=lambda: 1001.0)
    assert [store.load(job, None) for job in jobs] == [None] * len(jobs) and store.jobs() == ["ok"]
    assert len(list((tmp_path / "java").iterdir())) == len(list((tmp_path / "python").iterdir())) == 1


def test_both_stores_drop_a_fifo_under_a_state_files_name_and_keep_a_folder_there(tmp_path):
    """A FIFO named as a job's state file is not read (opening it waited for a writer for ever: the
    Java store's start, which reads every state file, hung) but dropped as a foreign file, as the
    Python store drops it (edge_client/state.py read_state_arrays, open_regular); a folder under
    such a name is left alone by both (not the store's to remove)."""
    import os

    stores = {}
    for side in ("python", "java"):
        store = stores[side] = DeviceStateStore(tmp_path / side, 100000, clock=lambda: 1000.0)
        store.save("ok", RUN_A, 3, {"x": np.float32([1.5, -2.0]), "y": np.float32([[2.5]])}, 1000.0)
        os.mkfifo(store._path("fifo"))
        store._path("folder").mkdir()
    got = java_answers(tmp_path / "java", "clock 1001\nopen 100000\nload fifo - - -\nload folder - - -\n", tmp_path)
    assert got == ["OK", "JOBS ok", "NONE", "NONE"]
    reopened = DeviceStateStore(tmp_path / "python", 100000, clock=lambda: 1001.0)
    assert [reopened.load("fifo", None), reopened.load("folder", None)] == [None, None]
    for side in ("python", "java"):
        left = stores[side]
        assert not left._path("fifo").exists() and left._path("folder").is_dir(), side
