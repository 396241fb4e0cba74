"""What the Java device task tests share (tests/test_java_fedavg_head.py,
test_java_secure_vectors.py, test_java_fed3r_tasks.py, test_java_personalization.py,
test_java_mixed_fleet.py, test_java_fed3r_sync_fleet.py, test_java_stateful.py): the JVM (the
module's classpath fixture, TaskRunner on one task), the devices' data, a task's bytes, and the
mixed fleet over mosquitto (the aggregator service on a thread, the Java devices in one JVM).

Tolerance. Both devices keep the head in float32 between steps and apply the same update; the
Python device computes each step's logits, softmax and gradients in float32 (numpy/torch), the
Java device in double, rounded once into the float32 update. How far two correct steppers may
part after S steps is derived from that arithmetic in ``test_differential_fuzz.head_tolerance``
(float32 rounding of the logits and of the gradient's sums, times lr, plus one rounding of θ per
step): the single-task checks use it, and check that it is far below what training moves
the head. It grows with lr·S/T: at lr 0.3, T 0.1 and 24 steps an OLL fine-tune legitimately
drifts 2.6e-5, past the 1e-5 once asserted. HEAD_ATOL = 1e-5 stays for the fleet replays
(a few steps at lr 0.05, where the derived bound is below it).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import subprocess
import threading
import time

import numpy as np
import pytest

import java_build
from test_java_device import write_features
from aggregator.service.settings import ServiceSettings

HEAD_ATOL = 1e-5
D, C = 6, 4


@pytest.fixture(scope="module")
def java_cp() -> str:
    return java_build.built()


def java(java_cp: str, *args) -> str:
    """What ``java TaskRunner ARGS`` prints, run in this worker's one TaskRunner JVM (``--serve``):
    a JVM started per run cost its start and warm-up, about 0.08 CPU-s a run
    (bench/java_task_runs.py), ~90 times a suite. A run that throws fails the test with its stack
    trace, as the JVM's exit status did."""
    status, text = _served(java_cp).run([str(a) for a in args])
    assert status == "OK", text[-3000:]
    return text


class ServedTaskRunner:
    """One ``TaskRunner --serve`` JVM: a run's arguments a tab-separated line on its stdin, its
    answer "OK|FAILED <bytes>" and that many bytes on its stdout."""

    # a hang guard, not a speed bound: 20,000 PTRS draws took 15-33 s on a loaded 2-core machine
    TIMEOUT_S = 240

    def __init__(self, java_cp: str):
        self.proc = subprocess.Popen(java_build.java_command("-cp", java_cp, "TaskRunner", "--serve"),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.buffer = b""

    def run(self, args: list[str]) -> tuple[str, str]:
        assert not any(c in a for a in args for c in "\t\n"), args
        try:
            self.proc.stdin.write(("\t".join(args) + "\n").encode())
            self.proc.stdin.flush()
            deadline = time.monotonic() + self.TIMEOUT_S
            head = self._read_until(lambda: b"\n" in self.buffer, deadline)
            line, _, self.buffer = head.partition(b"\n")
            status, size = line.decode().split(" ")
            self._read_until(lambda: len(self.buffer) >= int(size), deadline)
        except BaseException:
            # a run left unread (pytest-timeout's signal, a ^C, a garbled frame): its answer would be
            # read as the next test's, so the next run gets a fresh JVM
            self.close()
            raise
        body, self.buffer = self.buffer[:int(size)], self.buffer[int(size):]
        return status, body.decode()

    def _read_until(self, enough, deadline: float) -> bytes:
        while not enough():
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16) if ready else b""
            if not chunk:
                self.close()
                raise AssertionError("TaskRunner's JVM " + ("ended" if ready else f"took over {self.TIMEOUT_S} s"))
            self.buffer += chunk
        return self.buffer

    def close(self) -> None:
        """Its stdin closed, the JVM ends its serve loop and runs its exit hooks (freshWindows'
        temporary folders go); killed if it does not end soon (a hung run)."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_SERVED: dict[str, ServedTaskRunner] = {}         # this worker's JVM per classpath


def _served(java_cp: str) -> ServedTaskRunner:
    runner = _SERVED.get(java_cp)
    if runner is None or runner.proc.poll() is not None:
        runner = _SERVED[java_cp] = ServedTaskRunner(java_cp)
    return runner


@atexit.register
def _stop_served() -> None:
    for runner in _SERVED.values():
        runner.close()


def device_data(i: int, n: int = 37) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(900 + i)
    y = rng.integers(0, C, n)
    return (rng.normal(size=(n, D)) + 2 * np.eye(C, D)[y]).astype(np.float32), y


def task_bytes(params: dict, tensors: dict, kind: str = "fedavg.head") -> bytes:
    from protocols import messages as M
    from protocols.envelope import Envelope, encode

    task = M.task_message("aggregator", "ft", 1, kind, params, 1e10)
    return encode(Envelope(task.type, task.sender, task.body, tensors, id=task.id, ts=task.ts))


RECIPE = {"num_classes": C, "feature_dim": D, "backbone": "b", "image_size": 8, "weights_sha256": "",
          "epochs": 3, "batch_size": 8, "lr": 0.05, "weight_decay": 4e-5, "temperature": 0.1, "seed": 11}


def state_args(state) -> list:
    """TaskRunner's arguments for a device with the state folder ``state`` (made here; none when None):
    a Fed3R task that caps samples or streams is answered only with one (edge_client/sample_windows.py)."""
    if state is None:
        return []
    state.mkdir(parents=True, exist_ok=True)
    return ["-", state]


def run_java_task(java_cp, tmp_path, params, tensors, data, kind: str = "fedavg.head",
                  state=None) -> tuple[str, object]:
    """The Java handler of ``kind`` on one task: (its output lines, the result envelope or None)."""
    from protocols.envelope import decode

    (tmp_path / "task.bin").write_bytes(task_bytes(params, tensors, kind))
    feats = write_features(tmp_path / "f.feat", *data)
    out = java(java_cp, tmp_path / "task.bin", feats, tmp_path / "result.bin", *state_args(state))
    return out, (decode((tmp_path / "result.bin").read_bytes()) if out.startswith("DONE") else None)


FED3R_PARAMS = {"num_classes": C, "backbone": "b", "image_size": 8, "weights_sha256": "", "fit_intercept": True,
                "random_features": None, "format": "sparse", "dtype": "float64"}


def personal_data(seed: int, n: int, labels: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Overlapping class clusters (OLL and FP(ψ) both change answers) over ``labels``."""
    rng = np.random.default_rng(seed)
    y = rng.choice(labels, n)
    return (rng.normal(size=(n, D)) * 1.5 + 2 * np.eye(C, D)[y]).astype(np.float32), y


JAVA_IDS, PY_IDS = ["java0", "java1", "java2"], ["py0", "py1"]


def serve(job, broker_url: str, workdir, ids: list[str]) -> dict:
    """The aggregator service on a thread (as a deployment runs it), until the job ends."""
    from aggregator.service.loop import AggregatorService
    from protocols.mqtt_link import BrokerConfig

    workdir.mkdir(exist_ok=True)
    svc = AggregatorService(job, BrokerConfig.from_url(broker_url), workdir,
                            ServiceSettings(evaluate_every_contribution=False), enrolled=set(ids))
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=120)), daemon=True)
    thread.start()
    return {"thread": thread, "result": result}


def start_java_devices(java_cp, broker_url, tmp_path, extra: list[str], seeds: dict | None = None,
                       scale: dict | None = None, data=None) -> subprocess.Popen:
    """JAVA_IDS in one JVM (HeadlessDevices), each on data(i) (default device_data; times scale[d]),
    with a held-out split; signing with seeds[d] when given."""
    cmd = java_build.java_command("-cp", java_cp, "org.fedfleet.device.HeadlessDevices", "--stop-on-stdin-eof",
                                  "--broker", broker_url, "--retry-after", "2", "--tick", "0.1", *extra)
    for i, d in enumerate(JAVA_IDS):
        Z, y = (data or device_data)(i)
        feats = write_features(tmp_path / f"{d}.feat", Z * (scale or {}).get(d, 1.0), y)
        held = write_features(tmp_path / f"{d}-test.feat", *personal_data(50 + i, 30, list(range(C))))
        cmd += ["--holdout", d, str(held), "--device", d, str(feats), seeds[d].hex() if seeds else "-"]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop_mixed_fleet(agents, jvm: subprocess.Popen) -> tuple[str, str]:
    """Stops the Python agents, then the JVM's devices (their stdin closed): the JVM's stdout and stderr."""
    for a in agents:
        a.stop()
    return jvm.communicate(timeout=30)


def two_rounds_done(service, job, agents, jvm: subprocess.Popen, timeout_s: float = 150) -> tuple[dict, str]:
    """Waits for the job, then stops the fleet: (its result, the JVM's stdout), once the JVM ended
    cleanly and the job finished both its rounds with none failed."""
    try:
        result = service.join(timeout_s)
    finally:
        out, err = stop_mixed_fleet(agents, jvm)
    assert jvm.returncode == 0, err[-3000:]
    assert result.get("state") == "done" and len(result["rounds"]) == 2 and not job.failed_rounds, (result, err[-3000:])
    return result, out

