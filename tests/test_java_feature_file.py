"""The Java device's FeatureFile refuses a bad feature file with the IOException its callers report,
before allocating anything the file does not hold (a review's findings): a header whose byte count
overflows an int (n=2^28, d=1 was a NegativeArraySizeException), a header promising far more than
the file holds (n=2^27, d=2 in an 8-byte file allocated 1.6 GB before the short read), and a FIFO
in the file's place (the open waited for a writer for ever)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import java_build

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))


def header(n: int, d: int) -> bytes:
    return np.array([n, d], "<i4").tobytes()


def feature_file(rows: np.ndarray, labels: np.ndarray) -> bytes:
    """int32 n, int32 d, n·d float32 (row-major), n int32 labels, little-endian."""
    return header(*rows.shape) + rows.astype("<f4").tobytes() + labels.astype("<i4").tobytes()


def java_reads(paths: list[Path]) -> list[str]:
    # a small heap: a header-sized allocation of gigabytes fails the run instead of passing by luck
    proc = subprocess.run(java_build.java_command("-Xmx64m", "-cp", java_build.built(), "FeatureFileBytes"),
                          input="".join(f"{p}\n" for p in paths), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.splitlines()


def test_bad_feature_files_are_refused_before_any_allocation_and_a_good_one_read(tmp_path: Path):
    rows = np.array([[0.5, -1.25, 3.0], [2.0, 0.0, -0.75]], np.float32)
    labels = np.array([4, 0])
    good = feature_file(rows, labels)
    files = {
        "good": good,
        "int overflow (2^28, 1)": header(1 << 28, 1),
        "huge promise (2^27, 2)": header(1 << 27, 2),
        "one row short": header(3, 3) + good[8:],
        "trailing bytes": good + b"\0" * 4,
        "short header": good[:5],
    }
    paths = []
    for name, data in files.items():
        paths.append(tmp_path / name.replace(" ", "_").replace("^", "").replace(",", "").strip("()"))
        paths[-1].write_bytes(data)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    answers = dict(zip([*files, "fifo"], java_reads([*paths, fifo])))
    expected_values = ",".join(str(float(v)) for v in rows.ravel())
    assert answers["good"] == f"OK 2 3 {expected_values} 4,0"
    refused = {name: answer.split()[0] for name, answer in answers.items() if name != "good"}
    assert refused == {name: "REFUSED" for name in refused}, answers
    assert "not a regular file" in answers["fifo"]
    assert "needs" in answers["int overflow (2^28, 1)"] and "needs" in answers["huge promise (2^27, 2)"]
