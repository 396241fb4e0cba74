"""The Java device's SecAgg client behind tests/java_device/SecAggBridge.java, as a member of rounds
run by the Python server (protocols/secagg/driver.py): ``JavaClient`` (the driver's client
interface over the bridge's standard input/output), ``setup_round`` and ``round_with_java``.
tests/test_java_secagg.py and tests/test_java_secagg_leaving.py use them."""

from __future__ import annotations

import base64
import os
import subprocess

import numpy as np

import java_build
from protocols.chunking import MessageAssembler
from protocols.envelope import Envelope, encode
from protocols.identity import DeviceIdentity, sender_verifier
from protocols.payloads.secagg import from_envelope, to_envelope
from protocols.secagg import ClientState, RoundConfig
from protocols.secagg.driver import run_round
from protocols.secagg.errors import ProtocolViolation, ReleaseRefused, SecAggError

AGGREGATOR = DeviceIdentity.generate("aggregator")
JAVA = "dev-java"
M, BOUND = 64, 50.0


class JavaClient:
    """The driver's client interface (handle, state, provide_input) over the Java bridge."""

    def __init__(self, seed: bytes, config: RoundConfig, vector: np.ndarray, tmp_path, dp: bool = False, ledger=None,
                 ends: float | None = None, chunk: int | None = None, task: str | None = None):
        """``ledger``: the state folder of the device's secure-input ledger (None: no ledger);
        ``ends``: when the device's round ends (unix s on the bridge's clock; None: never);
        ``chunk``: the messages go through the device's sessions and its outbox's payloads of at most
        that many bytes (SecAggSessions.onMessage, OutboxParts), the round's end told (``round_ends``);
        ``task``: the round's task id (the messages go through SecAggSessions; its declines kept)."""
        self.key = DeviceIdentity.from_private_bytes(JAVA, seed).public_key_bytes
        (tmp_path / "input.f64").write_bytes(np.asarray(vector, "<f8").tobytes())
        self.proc = subprocess.Popen(
            java_build.java_command("-cp", java_build.built(), "SecAggBridge", JAVA, seed.hex(),
                                    AGGREGATOR.public_key_bytes.hex(), config.job_id, str(config.round_id),
                                    config.group_id, str(tmp_path / "input.f64"), *(["dp"] if dp else []),
                                    *([f"ledger={ledger}"] if ledger is not None else []),
                                    *([f"ends={ends!r}"] if ends is not None else []),
                                    *([f"chunk={chunk}"] if chunk is not None else []),
                                    *([f"task={task}"] if task is not None else [])),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.state = ClientState.WAITING_CONFIG
        self.refusals: list[str] = []
        self.declines: list[str] = []            # "<job> <round> <task id> <reason>" (task mode)
        self.round_ends: list[bool] = []         # what the round's RoundEnd was told (chunk mode)
        self.replies = MessageAssembler(sender_verifier(JAVA, self.key))   # whole replies, or chunks

    def provide_input(self, values) -> None:
        """The bridge got the same vector at start."""

    def handle(self, message):
        return self.send(to_envelope(message))

    def send(self, envelope: Envelope):
        wire = encode(envelope, signer=AGGREGATOR.sign)
        self.proc.stdin.write(base64.b64encode(wire).decode() + "\n")
        self.proc.stdin.flush()
        replies, error = [], None
        while True:
            line = self.proc.stdout.readline().strip()
            assert line, self.proc.stderr.read()[-3000:]
            kind, _, rest = line.partition(" ")
            if kind == "REPLY":
                whole = self.replies.feed(base64.b64decode(rest))
                if whole is not None:
                    replies.append(from_envelope(whole))
            elif kind == "DECLINE":
                self.declines.append(rest)
            elif kind == "ENDED":
                self.round_ends.append(rest == "true")
            elif kind == "ERROR":
                error = rest
            else:
                self.state = ClientState[rest]
                break
        if error is not None:
            self.refusals.append(error)
            cls, _, why = error.partition(" ")
            raise {"ProtocolViolation": ProtocolViolation, "ReleaseRefused": ReleaseRefused}.get(cls, SecAggError)(why)
        return replies

    def retask(self, config: RoundConfig | None = None):
        """The bridge's device gets its task again (SecAggSessions.open with a fresh client), or,
        with ``config``, the task of that round for the same input."""
        where = "" if config is None else f" {config.job_id} {config.round_id} {config.group_id}"
        self.proc.stdin.write(("RETASK" if config is None else "TASK") + where + "\n")
        self.proc.stdin.flush()
        self._read_state()

    def tick(self, now: float) -> tuple[bool, int]:
        """The device's clock at ``now`` and its sessions ticked: (secrets held, rounds open)."""
        self.proc.stdin.write(f"CLOCK {now!r}\n")
        self.proc.stdin.flush()
        kind, _, rest = self.proc.stdout.readline().strip().partition(" ")
        assert kind == "HELD", self.proc.stderr.read()[-3000:]
        held, open_rounds = rest.split()
        self._read_state()
        return held == "true", int(open_rounds)

    def _read_state(self) -> None:
        """The bridge's answer up to its STATE line, a round's ends told on the way (chunk mode)."""
        while True:
            kind, _, rest = self.proc.stdout.readline().strip().partition(" ")
            if kind != "ENDED":
                break
            self.round_ends.append(rest == "true")
        assert kind == "STATE", self.proc.stderr.read()[-3000:]
        self.state = ClientState[rest]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(10)


def setup_round(tmp_path, graph: str, n: int = 6, seed: int = 0, ring_bits: int = 64, dp: bool = False, m: int = M,
                ends: float | None = None, chunk: int | None = None):
    rng = np.random.default_rng(seed)
    python_ids = {f"dev-py{i}": DeviceIdentity.generate(f"dev-py{i}") for i in range(n - 1)}
    java_seed = os.urandom(32)
    identities = {**python_ids, JAVA: DeviceIdentity.from_private_bytes(JAVA, java_seed)}
    config = RoundConfig.create(job_id="job", round_id=3, group_id="g3", aggregator_id="aggregator",
                                members=list(identities), vector_length=m, bound=BOUND, graph=graph,
                                degree=4 if graph == "regular" else None, ring_bits=ring_bits)
    inputs = {d: rng.uniform(-BOUND, BOUND, m) for d in identities}
    java = JavaClient(java_seed, config, inputs[JAVA], tmp_path, dp=dp, ends=ends, chunk=chunk)
    return config, identities, inputs, java


def round_with_java(java, config, identities, inputs, **options):
    """One round of ``config`` (``run_round``'s ``options``) with the Java device as its JAVA member;
    the Java process is closed after it."""
    try:
        return run_round(config, AGGREGATOR, identities, inputs, **options,
                         client_factory=lambda d, i: java if d == JAVA else None)
    finally:
        java.close()
