"""A device's own store of per-job state: what a stateful algorithm keeps between its rounds.

Partial personalization (FedSim/FedAlt: the personal part v_k), Scaffold (the control variate
c_k) and ADMM-style methods (duals) need a device to remember something from one task of a job
to the next. Handlers are rebuilt per task (an emulated host keeps nothing in memory between
tasks, a phone's app may be killed between rounds), so the state lives on the device's disk:

* **one file per job**, ``<sha256(job id)[:32]>.npz`` in the device's state folder: the job's
  arrays plus a JSON header (job id, the round it was written at, the job's ``run``, when it
  expires); loaded with ``allow_pickle=False`` (a state file is data, never code);
* **atomic**: written to a temporary file in the same folder, fsynced, renamed over the old one
  and the folder fsynced, so a device killed mid-write finds the previous state or the new one,
  never a torn file (a torn or foreign file reads as "no state" and is removed);
* **bound** to (job id, run, round): a task names its job, the job's run (a new job with a
  reused id starts from nothing, never from an older job's state) and the round; an entry of
  another run is dropped on sight;
* **bounded**: the store has a byte budget for all jobs together; :meth:`DeviceStateStore.admit`
  refuses a job whose state would not fit next to the other jobs' (the handler declines the
  task with that reason, and the aggregator records it); nothing is ever evicted to make room.
  A file larger than the whole budget and FILE_SLACK_BYTES (its framing), left by a run with a
  larger ``--state-budget-mb``, is not read (it could be a small deflated file claiming gigabytes)
  and goes as a foreign one: its job could not keep it anyway, since its next save would not fit;
* **dropped** when the aggregator says the job ended (``job.ended``, protocols/payloads/job_end.py:
  :meth:`DeviceStateStore.drop_run`, only the run that ended), when it expires (each task says
  for how long the job may still need it, the job's horizon: the fallback for a device that
  missed the notice; expired entries go on the next open), when the job's run changes, and all
  at once by :meth:`DeviceStateStore.forget` (the operator forgot the device; ``fedfleet device
  --forget-state``);
* **never sent**: nothing here publishes anything; a handler uploads only what its algorithm
  uploads (FedSim's Δu, Scaffold's Δy and Δc), never the stored arrays themselves.

Staleness (a device sampled again after many rounds, the cross-device norm): an entry written
more than ``max_staleness`` rounds before the task's round is treated as absent
(:meth:`DeviceStateStore.load` with ``max_staleness``): FedSim/FedAlt restart the personal part
from the global value, Scaffold restarts c_k from 0, which is the value of a device never
sampled. Reset rather than decay: a decayed c_k still points along gradients of a model that
is many server steps away, while 0 is the unbiased choice the algorithm itself makes for a
newcomer; the cost (a stale device's first step is plain FedAvg's) is measured in
``bench/claims/personalization.py``.

Numpy only, so the torch-free device (``fedfleet[device]``) keeps state too.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from protocols.files import read_npy_header, write_atomic
from protocols.regular_file import open_regular

DEFAULT_BUDGET_BYTES = 16 * 2**20          # all jobs together; a 10-class head on 1,280-d features is 51 KB
DEFAULT_TTL_S = 7 * 24 * 3600.0            # a task that names no horizon: a week
FILE_SLACK_BYTES = 2**20                   # a state file's framing and header beyond its budget (as Java's)
_HEADER = "__state_header__"
_SUFFIX = ".npz"
# The folder may be one the operator also keeps other files in: the store reads, sweeps and forgets
# only the names it writes (a job's file, a temporary file of its own), never another *.npz or
# .tmp-* (a review found `--state-dir` pointed at a folder deleted the user's model.npz at start-up).
TEMP_PREFIX = ".fedfleet-tmp-"
_OWN_NAME = re.compile(r"[0-9a-f]{32}" + re.escape(_SUFFIX))
_OWN_TEMP = re.compile(re.escape(TEMP_PREFIX) + r"[a-z0-9_]{8}")     # tempfile.mkstemp's 8 characters


class StateBudgetExceeded(Exception):
    """A job's state would not fit in the device's state budget (the task is declined)."""


@dataclass(frozen=True)
class StateEntry:
    """One job's state as stored: its arrays, the round it was written at, the job's run."""

    job_id: str
    run: str
    round: int
    arrays: dict[str, np.ndarray]
    expires_at: float

    def too_stale_for(self, round_: int | None, max_staleness: int | None) -> bool:
        """Written more than ``max_staleness`` rounds before ``round_`` (either None: never)."""
        return round_ is not None and max_staleness is not None and round_ - self.round > max_staleness

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def state_bytes(arrays: dict[str, np.ndarray]) -> int:
    """Bytes the arrays take in the store (their data; the header and npz framing are small)."""
    return sum(np.asarray(a).nbytes for a in arrays.values())


def _header_fields(header) -> tuple[str, str, int, float]:
    """(job_id, run, round, expires_at) of a state file's header, each of the JSON type the stores
    write (ValueError otherwise): strings, an integer round within ±2^62, a finite number. Nothing is
    coerced: a round of "3" or 3.7, a run of 12345678, a NaN expiry (never expired) make the file
    foreign, dropped as the Java device's store drops it (clients/java DeviceStateStore.read)."""
    job_id, run, round_, expires_at = (header[k] for k in ("job_id", "run", "round", "expires_at"))
    if not isinstance(job_id, str) or not isinstance(run, str):
        raise ValueError("state header: job_id and run must be strings")
    if type(round_) is not int or not -2**62 <= round_ < 2**62:
        raise ValueError(f"state header: round must be an integer, got {round_!r}")
    if isinstance(expires_at, bool) or not isinstance(expires_at, (int, float)) or not math.isfinite(expires_at):
        raise ValueError(f"state header: expires_at must be a finite number, got {expires_at!r}")
    return job_id, run, round_, float(expires_at)


def read_state_arrays(path: Path, max_bytes: int) -> dict[str, np.ndarray]:
    """The arrays of a state file, read as the Java store reads them (clients/java Npz.read):
    ValueError unless the file and its arrays' declared sizes are at most ``max_bytes`` (checked
    before anything is inflated: a small deflated file may claim gigabytes) and every member is an
    ``.npy`` array, little-endian float or unsigned integer, in C order, of exactly its shape's
    bytes. numpy's own loader takes members that are no array (as bytes), big-endian, Fortran-order
    and signed arrays, which then broke every later budget check or disagreed with Java."""
    with open_regular(path) as handle:        # OSError for a FIFO (it waited for a writer for ever), a device
        if os.fstat(handle.fileno()).st_size > max_bytes:
            raise ValueError(f"{path.name} is larger than {max_bytes} bytes")
        arrays = {}
        with zipfile.ZipFile(handle) as archive:
            members = archive.infolist()
            if sum(m.file_size for m in members) > max_bytes:
                raise ValueError(f"{path.name}'s arrays are larger than {max_bytes} bytes")
            for member in members:
                if not member.filename.endswith(".npy"):
                    raise ValueError(f"{member.filename!r} is not an array")
                with archive.open(member) as stream:
                    shape, fortran_order, dtype = read_npy_header(stream)
                    if fortran_order or dtype.kind not in "fu" or dtype.itemsize not in (1, 2, 4, 8) \
                            or dtype.byteorder == ">" or (dtype.byteorder == "=" and sys.byteorder != "little"):
                        raise ValueError(f"{member.filename}: not a little-endian float or unsigned array in C order")
                    data = stream.read()
                    if len(data) != math.prod(shape) * dtype.itemsize:
                        raise ValueError(f"{member.filename}: {len(data)} bytes of data for shape {shape}")
                arrays[member.filename[:-len(".npy")]] = np.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
    return arrays


class DeviceStateStore:
    """Per-job state of one device in ``root`` (created if absent), within ``budget_bytes``."""

    def __init__(self, root: str | os.PathLike, budget_bytes: int = DEFAULT_BUDGET_BYTES,
                 clock=time.time):
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be an integer >= 0, got {budget_bytes!r}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = budget_bytes
        self._clock = clock
        self.sweep()

    # ------------------------------------------------------------------ files
    def _path(self, job_id: str) -> Path:
        # hashed: a job id never becomes a path component (no traversal, no odd characters)
        return self.root / (hashlib.sha256(job_id.encode()).hexdigest()[:32] + _SUFFIX)

    def _own_files(self, temporary: bool = False) -> list[Path]:
        """The files of the folder this store wrote: its jobs' files, or its temporary ones."""
        own = _OWN_TEMP if temporary else _OWN_NAME
        return sorted(path for path in self.root.iterdir() if own.fullmatch(path.name))

    def _read(self, path: Path) -> StateEntry | None:
        """The entry in ``path``, or None (and the file removed) when it is torn or not ours."""
        try:
            arrays = read_state_arrays(path, self.budget_bytes + FILE_SLACK_BYTES)
            header = json.loads(bytes(arrays.pop(_HEADER)).decode())
            job_id, run, round_, expires_at = _header_fields(header)
            return StateEntry(job_id, run, round_, arrays, expires_at)
        except FileNotFoundError:
            return None
        except Exception:           # torn, foreign or tampered: never trusted, never fatal
            try:
                path.unlink(missing_ok=True)
            except OSError:         # a directory under a state file's name: not ours to remove
                pass
            return None

    def _entries(self, skip: Path | None = None) -> list[tuple[Path, StateEntry]]:
        out = []
        for path in self._own_files():
            entry = self._read(path) if path != skip else None
            if entry is not None:
                out.append((path, entry))
        return out

    def sweep(self) -> int:
        """Remove expired entries (and leftover temporary files); how many entries went."""
        for tmp in self._own_files(temporary=True):
            tmp.unlink(missing_ok=True)
        now, gone = self._clock(), 0
        for path, entry in self._entries():
            if entry.expires_at <= now:
                path.unlink(missing_ok=True)
                gone += 1
        return gone

    def used_bytes(self, excluding: str | None = None) -> int:
        """Bytes of state held for every job (but ``excluding``, whose own file is not even read:
        a task admits its job's state twice, and the file it will replace is no other job's)."""
        own = self._path(excluding) if excluding is not None else None
        return sum(e.nbytes for _, e in self._entries(skip=own) if e.job_id != excluding)

    # ------------------------------------------------------------------ the API handlers use
    def admit(self, job_id: str, nbytes: int) -> None:
        """Raise :class:`StateBudgetExceeded` unless ``nbytes`` of state for ``job_id`` fit next
        to the other jobs' state."""
        others = self.used_bytes(excluding=job_id)
        if others + nbytes > self.budget_bytes:
            raise StateBudgetExceeded(
                f"job {job_id}'s device state needs {nbytes} bytes; this device's state budget is "
                f"{self.budget_bytes} bytes with {others} held by other jobs")

    def load(self, job_id: str, run: str | None, round_: int | None = None,
             max_staleness: int | None = None) -> StateEntry | None:
        """The job's entry, or None: none stored, another run's (dropped), expired, or (with
        ``round_`` and ``max_staleness``) written more than ``max_staleness`` rounds earlier.
        ``run`` None: whichever run's the store holds (a later job reading what this one left,
        e.g. the OLL job evaluating each device with its personal part)."""
        path = self._path(job_id)
        entry = self._read(path)
        if entry is None:
            return None
        if entry.job_id != job_id or (run is not None and entry.run != run) or entry.expires_at <= self._clock():
            path.unlink(missing_ok=True)
            return None
        if entry.too_stale_for(round_, max_staleness):
            return None         # too old to trust: the caller restarts (overwritten on save)
        return entry

    def save(self, job_id: str, run: str, round_: int, arrays: dict[str, np.ndarray],
             ttl_s: float = DEFAULT_TTL_S) -> StateEntry:
        """Store the job's state atomically (after :meth:`admit` of its size)."""
        arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
        if _HEADER in arrays or any(a.dtype == object for a in arrays.values()):
            raise ValueError("state arrays must be numeric and not named " + _HEADER)
        self.admit(job_id, state_bytes(arrays))
        entry = StateEntry(job_id, run, int(round_), arrays, self._clock() + float(ttl_s))
        header = json.dumps({"job_id": job_id, "run": run, "round": entry.round, "expires_at": entry.expires_at})
        buffer = io.BytesIO()
        np.savez(buffer, **arrays, **{_HEADER: np.frombuffer(header.encode(), dtype=np.uint8)})
        write_atomic(self._path(job_id), buffer.getvalue(), temp_prefix=TEMP_PREFIX)
        return entry

    def restore(self, entry: StateEntry) -> None:
        """Put back an entry :meth:`load` returned (its run, round, arrays and expiry): what a task
        that declined after its handler had saved leaves behind, so the next round starts where
        this one did."""
        self.save(entry.job_id, entry.run, entry.round, entry.arrays,
                  max(entry.expires_at - self._clock(), 1e-3))

    def drop(self, job_id: str) -> bool:
        """Remove the job's state (its job ended); whether there was any."""
        path = self._path(job_id)
        existed = path.exists()
        path.unlink(missing_ok=True)
        return existed

    def drop_run(self, job_id: str, run: str) -> bool:
        """Remove the job's state if it is ``run``'s (that run of the job ended); whether it was.
        State of another run stays: a notice replayed from an older run never wipes a newer one's."""
        path = self._path(job_id)
        entry = self._read(path)
        if entry is None or entry.job_id != job_id or entry.run != run:
            return False
        path.unlink(missing_ok=True)
        return True

    def forget(self) -> int:
        """Remove every job's state (the operator forgot this device); how many entries went."""
        entries = self._own_files() + self._own_files(temporary=True)
        for path in entries:
            path.unlink(missing_ok=True)
        return len(entries)

    def jobs(self) -> list[str]:
        return [entry.job_id for _, entry in self._entries()]
