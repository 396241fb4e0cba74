"""The export's writing and reporting on small inputs (no export runs): what ``--overwrite`` may
replace, what a killed writer leaves and the next write mends, the CLI's summary of every artifact
kind, and the head weights an export takes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from export.cli import _summary
from export.manifest import describe_artifact, write_bundle
from protocols.bundle_manifest import (
    MANIFEST_FILENAME,
    BatchSpec,
    InputNormalisation,
    Manifest,
    TailSpec,
    TensorSpec,
    read_manifest,
)

FEATURES, CLASSES, SIZE = 8, 3, 32
TAIL = TailSpec(stages=1, activation_shape=(4, 1, 1), parameters={"tail.weight": (FEATURES, 4)})
IMAGES = (TensorSpec("image", "float32", (None, 3, SIZE, SIZE)),)
ACTIVATIONS = (TensorSpec("activations", "float32", (None, 4, 1, 1)),)


def small_manifest(artifacts=()) -> Manifest:
    return Manifest(backbone="mobilenet_v2", weights_sha256="0" * 64, feature_dim=FEATURES, num_classes=CLASSES,
                    temperature=0.1, output="features", input=InputNormalisation(SIZE, (0.5,) * 3, (0.25,) * 3),
                    artifacts=tuple(artifacts), created_with={}, tail=TAIL)


def inference(data: bytes = b"program"):
    return describe_artifact("inference", "eager", "1", "inference_eager.pt", data, BatchSpec(None), IMAGES,
                             (TensorSpec("features", "float32", (None, FEATURES)),), {},
                             {"max_abs_error": 2.5e-6, "tolerance": 1e-4})


def write_small_bundle(out_dir, overwrite=False, data: bytes = b"program"):
    return write_bundle(out_dir, small_manifest([inference(data)]), {"inference_eager.pt": data}, overwrite)


@pytest.mark.parametrize("other_manifest", [
    b'{"manifest_version": 3, "name": "an extension", "background": {"service_worker": "background.js"}}',
    b'{"name": "a web app", "start_url": "/", "display": "standalone"}',
    b"\xff\xfe not JSON, not UTF-8",
    b'{"format": "fedfleet-export", "format": "another tool"}',        # a key twice: no manifest of ours
])
def test_overwrite_never_replaces_a_folder_whose_manifest_json_is_not_an_export(tmp_path, other_manifest):
    """A review's finding: any file named manifest.json (browser extensions and web apps have one)
    made a folder "an earlier export", and --overwrite deleted it whole."""
    folder = tmp_path / "my-extension"
    folder.mkdir()
    (folder / MANIFEST_FILENAME).write_bytes(other_manifest)
    (folder / "background.js").write_text("the user's work")
    with pytest.raises(FileExistsError, match="holds no bundle"):
        write_small_bundle(folder, overwrite=True)
    assert (folder / "background.js").read_text() == "the user's work"
    assert (folder / MANIFEST_FILENAME).read_bytes() == other_manifest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-extension"]      # no staging left behind


def test_overwrite_never_takes_a_linked_manifest_for_an_earlier_export(tmp_path):
    """A link named manifest.json to a real bundle's manifest does not make the user's folder a bundle."""
    write_small_bundle(tmp_path / "real")
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    (folder / MANIFEST_FILENAME).symlink_to(tmp_path / "real" / MANIFEST_FILENAME)
    with pytest.raises(FileExistsError, match="holds no bundle"):
        write_small_bundle(folder, overwrite=True)
    assert (folder / "notes.txt").read_text() == "mine"


def test_overwrite_replaces_an_earlier_export_whole(tmp_path):
    out = tmp_path / "bundle"
    write_small_bundle(out, data=b"first")
    (out / "stale.txt").write_text("an earlier export's leftover")
    with pytest.raises(FileExistsError, match="not empty"):
        write_small_bundle(out, data=b"second")
    path = write_small_bundle(out, overwrite=True, data=b"second")
    assert sorted(p.name for p in out.iterdir()) == ["inference_eager.pt", MANIFEST_FILENAME]
    assert read_manifest(path).artifacts[0].sha256 == hashlib.sha256(b"second").hexdigest()
    assert (out / "inference_eager.pt").read_bytes() == b"second"
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]


REPO = Path(__file__).resolve().parents[1]
# A writer in a process of its own, SIGKILLed right after a call of write_bundle's: argv[2] names it
# (os.replace or os.fsync) and its 1-based count, then "kill"; or "wait": it creates the file argv[3]
# there and waits for argv[4] to appear (a live writer caught mid-staging).
KILLED_WRITER = """
import os, signal, sys, time
from test_export_writes import write_small_bundle
call, nth, then = sys.argv[2].split(":")
real, calls = getattr(os, call), []
def stop_here(*args):
    calls.append(args)
    result = real(*args)
    if len(calls) == int(nth):
        if then == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        open(sys.argv[3], "w").close()
        while not os.path.exists(sys.argv[4]):
            time.sleep(0.01)
    return result
setattr(os, call, stop_here)
write_small_bundle(sys.argv[1], overwrite=True, data=b"the killed writer's")
"""


def writer_process(out, stop_at: str, *flags) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    return subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(out), stop_at, *map(str, flags)], env=env,
                            stderr=subprocess.PIPE, text=True)


def killed_writer(out, stop_at: str) -> None:
    process = writer_process(out, stop_at)
    _, err = process.communicate(timeout=60)
    assert process.returncode == -9, err


def test_a_writer_killed_between_its_two_renames_is_mended_by_the_next_write(tmp_path):
    """Killed after moving the previous bundle aside and before renaming its own into place, a writer
    left the destination missing and the previous bundle hidden in .bundle.old-*/bundle for good."""
    out = tmp_path / "bundle"
    write_small_bundle(out, data=b"first")
    killed_writer(out, "replace:1:kill")
    (retired,) = tmp_path.glob(".bundle.old-*")                     # as the kill left it
    assert not out.exists() and (retired / "bundle" / "inference_eager.pt").read_bytes() == b"first"
    assert len(list(tmp_path.glob(".bundle.partial-*"))) == 1
    # the previous bundle is put back first, so a write that may not replace it is refused
    with pytest.raises(FileExistsError, match="not empty"):
        write_small_bundle(out, data=b"third")
    assert (out / "inference_eager.pt").read_bytes() == b"first"
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]
    path = write_small_bundle(out, overwrite=True, data=b"third")
    assert read_manifest(path).artifacts[0].sha256 == hashlib.sha256(b"third").hexdigest()
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]


@pytest.mark.parametrize("stop_at,left", [("fsync:1:kill", ".bundle.partial-*"), ("replace:2:kill", ".bundle.old-*")])
def test_what_a_killed_writer_leaves_beside_a_bundle_is_deleted_by_the_next_write(tmp_path, stop_at, left):
    """Killed mid-staging (a .bundle.partial-* with half the files), or after its new bundle was in
    place but before the previous one was deleted (.bundle.old-*/bundle beside it)."""
    out = tmp_path / "bundle"
    write_small_bundle(out, data=b"first")
    killed_writer(out, stop_at)
    (folder,) = tmp_path.glob(left)
    assert next(folder.rglob("inference_eager.pt")).read_bytes() == b"the killed writer's" if "partial" in left \
        else (folder / "bundle" / "inference_eager.pt").read_bytes() == b"first"
    write_small_bundle(out, overwrite=True, data=b"third")
    assert (out / "inference_eager.pt").read_bytes() == b"third"
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]


def test_a_bundle_replaced_before_its_writer_was_killed_is_never_put_back(tmp_path):
    """Killed after both renames, a writer's retired folder holds the bundle it replaced: a destination
    deleted since is written anew, not refilled with that older bundle."""
    out = tmp_path / "bundle"
    write_small_bundle(out, data=b"first")
    killed_writer(out, "replace:2:kill")
    shutil.rmtree(out)                                          # the user deletes the bundle
    write_small_bundle(out, data=b"third")
    assert (out / "inference_eager.pt").read_bytes() == b"third"
    assert [p.name for p in tmp_path.iterdir()] == ["bundle"]


def wait_for_staging(process: subprocess.Popen, staging: Path) -> None:
    """Until the writer ``process`` (``fsync:1:wait``) has staged its first file and waits."""
    deadline = time.monotonic() + 60
    while not staging.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert staging.exists(), process.stderr.read() if process.poll() is not None else "no staging in 60 s"


def test_a_live_writers_staging_is_left_alone_and_a_second_writer_waits_for_it(tmp_path):
    out, staging, go = tmp_path / "bundle", tmp_path / "staging", tmp_path / "go"
    write_small_bundle(out, data=b"first")
    process = writer_process(out, "fsync:1:wait", staging, go)
    try:
        wait_for_staging(process, staging)
        (partial,) = tmp_path.glob(".bundle.partial-*")
        second = threading.Thread(target=write_small_bundle, args=(out,), kwargs=dict(overwrite=True, data=b"2nd"))
        second.start()
        second.join(timeout=1.0)
        assert second.is_alive() and partial.is_dir()      # waiting for the lock, the staging untouched
        go.touch()
        assert process.wait(timeout=60) == 0, process.stderr.read()
        second.join(timeout=60)
    finally:
        go.touch()
        process.wait(timeout=60)
    assert not second.is_alive()
    assert (out / "inference_eager.pt").read_bytes() == b"2nd"           # written after the other one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle", "go", "staging"]


@pytest.mark.parametrize("stop_at,old_bundle", [
    ("fsync:1:kill", b"first"),                     # mid-staging
    ("replace:1:kill", b"first"),                   # between the renames: the destination missing
    ("replace:2:kill", b"the killed writer's"),     # after them: the replaced bundle retired beside it
])
def test_a_killed_writers_leftovers_are_mended_by_a_write_to_another_bundle_beside_it(tmp_path, stop_at,
                                                                                      old_bundle):
    """Only a write to the same destination mended a killed writer's leftovers, so those of a name never
    written again stayed for good: fedfleet.bundles names its folders after the exporter's revision and
    the weights' digest, so a killed export's staging outlived every later one. A folder merely named
    like a leftover, with no writer's lock file beside it, is none of the exporter's and stays."""
    old, new = tmp_path / "old", tmp_path / "new"
    write_small_bundle(old, data=b"first")
    killed_writer(old, stop_at)
    assert (tmp_path / ".old.write-lock").is_file() and len(list(tmp_path.glob(".old.*-*"))) >= 1
    # the last beside a lock file of a destination ".." (its parent: no bundle's name)
    lookalikes = [tmp_path / name for name in (".notes.partial-abcd1234", ".cache.old-20240101", "....partial-abcd1234")]
    for folder in lookalikes:
        folder.mkdir()
        (folder / "mine.txt").write_text("the user's")
    (tmp_path / "....write-lock").touch()
    write_small_bundle(new, data=b"second")
    assert (old / "inference_eager.pt").read_bytes() == old_bundle
    assert (new / "inference_eager.pt").read_bytes() == b"second"
    expected = ["new", "old", "....write-lock"] + [folder.name for folder in lookalikes]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(expected)
    assert all((folder / "mine.txt").read_text() == "the user's" for folder in lookalikes)


def test_a_live_writers_staging_is_left_alone_by_a_write_to_another_bundle(tmp_path):
    old, new = tmp_path / "old", tmp_path / "new"
    staging, go = tmp_path / "staging", tmp_path / "go"
    write_small_bundle(old, data=b"first")
    process = writer_process(old, "fsync:1:wait", staging, go)
    try:
        wait_for_staging(process, staging)
        (partial,) = tmp_path.glob(".old.partial-*")
        write_small_bundle(new, data=b"second")          # does not wait for the other destination's writer
        assert partial.is_dir() and (tmp_path / ".old.write-lock").is_file()
        go.touch()
        assert process.wait(timeout=60) == 0, process.stderr.read()
    finally:
        go.touch()
        process.wait(timeout=60)
    assert (old / "inference_eager.pt").read_bytes() == b"the killed writer's"     # its write completed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["go", "new", "old", "staging"]


def test_the_summary_names_every_artifact_kind_of_a_tail_bundle(tmp_path):
    """A review's finding: ``fedfleet export --tail-stages N`` wrote its bundle, then its summary read
    a training program's errors from the trunk's and tail_eval's parity (KeyError): exit 2, "error"."""
    def spec(kind, runtime, file, inputs, outputs, parity, details=None, batch=BatchSpec(None)):
        return describe_artifact(kind, runtime, "1", file, file.encode(), batch, inputs, outputs, details or {},
                                 parity)

    fixed, b = BatchSpec(4, fixed=True), 4
    training_io = ((TensorSpec("features", "float32", (b, FEATURES)), TensorSpec("labels", "int64", (b,)),
                    TensorSpec("sample_weight", "float32", (b,))),
                   (TensorSpec("loss", "float32", ()), TensorSpec("logits", "float32", (b, CLASSES))))
    head = {"weight": [CLASSES, FEATURES], "bias": [CLASSES]}
    artifacts = [
        inference(b"inference_eager.pt"),
        spec("trunk", "eager", "trunk_eager.pt", IMAGES, ACTIVATIONS, {"max_abs_error": 3.0e-7}),
        spec("tail_eval", "eager", "tail_eval.pt2", ACTIVATIONS,
             (TensorSpec("logits", "float32", (None, CLASSES)),), {"max_abs_error": 4.0e-8},
             {"parameters": {"tail.weight": [FEATURES, 4], **head}}),
        spec("training", "eager", "head_training_eager.pt", *training_io,
             {"gradient_max_abs_error": 5.0e-9, "sgd_max_abs_error": 6.0e-9},
             {"trainable_parameters": head}, fixed),
    ]
    manifest = small_manifest(artifacts)
    path = write_bundle(tmp_path / "bundle", manifest, {a.file: a.file.encode() for a in artifacts})
    lines = {line.split()[0]: line for line in _summary(path).splitlines()[2:]}
    assert set(lines) == {a.file for a in artifacts}
    assert "max abs error vs eager 2.50e-06" in lines["inference_eager.pt"]
    assert "max abs error vs eager 3.00e-07" in lines["trunk_eager.pt"]
    assert "max abs error vs eager 4.00e-08" in lines["tail_eval.pt2"]
    assert "gradient error 5.00e-09, SGD error 6.00e-09" in lines["head_training_eager.pt"]


def test_head_weights_beyond_float32_are_refused_not_exported_as_infinities(tmp_path):
    """A review's finding: float64 head weights past float32's range passed the finiteness check and
    became inf in the training programs, whose parity check starts from parameters of its own."""
    from edge_client.runtime.base import check_parameter_dict
    from export.pipeline import ExportError, _load_head

    shapes = {"weight": (CLASSES, FEATURES), "bias": (CLASSES,)}
    huge = {"weight": np.full(shapes["weight"], 1e39), "bias": np.zeros(CLASSES)}
    assert np.isfinite(huge["weight"]).all() and 1e39 > float(np.finfo(np.float32).max)
    with pytest.raises(ValueError, match="'weight' contains NaN or infinite values"):
        check_parameter_dict(huge, shapes)
    np.savez(tmp_path / "head.npz", **huge)
    with pytest.raises(ExportError, match="weight"):
        _load_head(tmp_path / "head.npz", CLASSES, FEATURES)
    # float64 within float32's range is taken, as float32
    fine = {"weight": np.full(shapes["weight"], 3e38), "bias": np.full(CLASSES, -1.5)}
    checked = check_parameter_dict(fine, shapes)
    assert checked["weight"].dtype == np.float32 and np.all(checked["weight"] == np.float32(3e38))
    assert json.dumps(checked["bias"].tolist()) == "[-1.5, -1.5, -1.5]"
