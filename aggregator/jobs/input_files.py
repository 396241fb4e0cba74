"""The files a job's config names on the aggregator's host (a Fed3R model.npz to start from, a
tail program, a pretrained network, SecAgg key files), checked before they are read.

A config is an operator's input, sent through the admin API: a path that names a device
(``/dev/zero``), a FIFO or a directory would make the service thread that builds the job read
forever, block, or fail obscurely, and a huge file would fill its memory. Only a regular file of
bounded size is read; anything else is one clear error, and the job does not start. The checks
run on the opened file and its bytes are read once (:func:`read_job_input`, on
``protocols/regular_file.py``, which the admin client's files share): whoever hashes them
loads those same bytes, so a file swapped after a check is never what is used.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from protocols.files import check_sha256, read_npz
from protocols.regular_file import read_regular_file

MAX_JOB_FILE_BYTES = 1 << 30        # a pretrained segmentation network or tail program is ~10-100 MB


def read_job_input(path: str | Path, what: str, max_bytes: int = MAX_JOB_FILE_BYTES) -> bytes:
    """The bytes of ``path``, a regular file of at most ``max_bytes`` (ValueError otherwise)."""
    return read_regular_file(path, what, max_bytes)


def read_job_arrays(path: str | Path, what: str, expected_sha256: str = "") -> dict[str, np.ndarray]:
    """The arrays of an .npz job input (a model to start from, a pretrained network): its bytes read
    once as :func:`read_job_input` reads them, pinned by ``expected_sha256`` when one is given, and
    inflated to no more than a job file may hold on disk (a small archive of zeros inflates to GBs)."""
    raw = read_job_input(path, what)
    check_sha256(raw, expected_sha256, f"{what} {str(path)[:200]}")
    try:
        return read_npz(raw, max_bytes=MAX_JOB_FILE_BYTES)
    except ValueError as exc:
        raise ValueError(f"{what} {str(path)[:200]!r}: {exc}") from None
