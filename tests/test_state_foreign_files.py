"""State files a device's store must drop as foreign, as the Java store drops them (a review's
findings in DeviceStateStore._read, which read them with numpy's loader): a member that is no
array (numpy hands it back as bytes; every later budget check then raised AttributeError, so no
stateful task ran until the state was wiped), big-endian, Fortran-order and signed-integer
arrays, a member without the .npy magic, a file over the budget + 1 MiB, and a small deflated file
whose arrays claim far more than the budget (it was inflated whole on every admit)."""

from __future__ import annotations

import io
import json
import tracemalloc
import zipfile

import numpy as np
import pytest

import java_build
from edge_client.state import DeviceStateStore

RUN = "12345678"
HEADER = "__state_header__"


def _header(job: str) -> np.ndarray:
    return np.frombuffer(json.dumps({"job_id": job, "run": RUN, "round": 3, "expires_at": 2000.0}).encode(), np.uint8)


def _write(store: DeviceStateStore, job: str, arrays: dict, compress: bool = False) -> None:
    buffer = io.BytesIO()
    (np.savez_compressed if compress else np.savez)(buffer, **arrays, **{HEADER: _header(job)})
    store._path(job).write_bytes(buffer.getvalue())


def test_a_state_file_with_a_non_array_member_is_dropped_not_fatal(tmp_path):
    store = DeviceStateStore(tmp_path, 100000, clock=lambda: 1000.0)
    store.save("other", RUN, 1, {"x": np.float32([1, 2])}, 100)
    _write(store, "poisoned", {"x": np.float32([1.5, -2.0])})
    with zipfile.ZipFile(store._path("poisoned"), "a") as z:
        z.writestr("notes.txt", b"not an array")
    # (a) every other job's budget check goes through this file
    try:
        store.admit("scaffold-job", 16)
    except AttributeError as exc:
        pytest.fail(f"admit raised {type(exc).__name__}: {exc} (a foreign state file is fatal to every stateful task)")
    assert store.load("poisoned", None) is None, "a state file with a non-array member is kept as a valid entry"


def _foreign_files(folder) -> list[str]:
    store = DeviceStateStore(folder, 100000, clock=lambda: 1000.0)
    x = np.float32([1.5, -2.0])
    _write(store, "bigendian", {"x": x.astype(">f4"), "y": np.float32([[2.5]])})
    _write(store, "fortran", {"x": x, "y": np.asfortranarray(np.float32([[1, 2], [3, 4]]))})
    _write(store, "int64", {"x": x, "y": np.int64([[7]])})
    _write(store, "oversized", {"x": x, "y": np.zeros((1, 300_000), np.float32)})   # 1.2 MB > budget + 1 MiB
    _write(store, "npymagicless", {"x": x, "y": np.float32([[2.5]])})
    raw = io.BytesIO(store._path("npymagicless").read_bytes())
    out = io.BytesIO()
    with zipfile.ZipFile(raw) as zin, zipfile.ZipFile(out, "w") as zout:
        for item in zin.infolist():
            zout.writestr(item, b"garbage, no NUMPY magic" if item.filename == "y.npy" else zin.read(item))
    store._path("npymagicless").write_bytes(out.getvalue())
    return ["bigendian", "fortran", "int64", "oversized", "npymagicless"]


@pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))
def test_python_and_java_stores_agree_on_foreign_state_files(tmp_path):
    import shutil

    from test_java_state import java_answers

    jobs = _foreign_files(tmp_path / "python")
    shutil.copytree(tmp_path / "python", tmp_path / "java")
    got = java_answers(tmp_path / "java", "clock 1001\nopen 100000\n" + "".join(f"load {j} - - -\n" for j in jobs),
                       tmp_path)
    assert got == ["OK", "JOBS ", *["NONE"] * len(jobs)], got          # Java drops every one of them
    store = DeviceStateStore(tmp_path / "python", 100000, clock=lambda: 1001.0)
    python = {job: ("NONE" if store.load(job, None) is None else "ENTRY") for job in jobs}
    assert python == {job: "NONE" for job in jobs}, f"Python keeps what Java drops: {python}"


def test_a_deflate_bomb_state_file_is_not_expanded_in_memory(tmp_path):
    store = DeviceStateStore(tmp_path, 1 << 20, clock=lambda: 1000.0)       # a 1 MiB budget
    _write(store, "bomb", {"x": np.zeros(64 << 20, np.uint8)}, compress=True)   # ~64 KB on disk, 64 MiB inside
    assert store._path("bomb").stat().st_size < 200_000
    tracemalloc.start()
    try:
        store.admit("job", 10)
    except Exception:
        pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 << 20, f"admit() expanded a {store._path('bomb').stat().st_size}-byte state file to a peak of {peak >> 20} MiB"


def test_a_fifo_or_a_folder_under_a_state_files_name_is_no_state_and_never_hangs_the_store(tmp_path):
    """A review's finding: a FIFO named like a state file (<32 hex>.npz) hung the device's start
    (and --forget-state) in the store's sweep, which opened it for reading."""
    import os
    import threading

    name = "0" * 32 + ".npz"
    os.mkfifo(tmp_path / name)
    (tmp_path / ("1" * 32 + ".npz")).mkdir()
    opened = []
    worker = threading.Thread(target=lambda: opened.append(DeviceStateStore(tmp_path)), daemon=True)
    worker.start()
    worker.join(10)
    assert opened, "the store hung on the FIFO"
    store = opened[0]
    assert store.jobs() == [] and not (tmp_path / name).exists()       # dropped as foreign
    assert (tmp_path / ("1" * 32 + ".npz")).is_dir()                    # a folder: left alone
    store.save("j", RUN, 1, {"x": np.zeros(3)})
    assert store.jobs() == ["j"]
