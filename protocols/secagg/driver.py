"""In-memory driver: one server and n clients run a whole round in one process.

Used by the tests and bench/secagg.py, and as the integration example for the transport layer:
every message goes through `to_wire()` -> JSON header bytes + raw little-endian array blobs ->
`messages.decode()`, exactly what an envelope over MQTT carries. Timeouts are emulated: when a
phase cannot close because some devices dropped out, the driver feeds Timeout(phase).

`dropouts` maps a device id to the first phase whose message it never sends (it goes silent
from then on): Phase.ADVERTISE_KEYS = never shows up, Phase.SHARE_KEYS = after advertising
keys, Phase.MASKED_INPUT = after sharing keys, Phase.CONSISTENCY_CHECK / Phase.UNMASK = after
sending its masked input.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from protocols.identity import DeviceIdentity, IdentityRegistry

from .client import ClientSecAgg, ClientState
from .config import RoundConfig
from .errors import SecAggError
from .events import AggregateReady, MemberOffline, Phase, RoundFailed, Timeout
from .messages import ForwardedShares, Message, decode
from .server import FINAL_STATES, MaskApplier, ServerSecAgg

_PHASE_ORDER = {phase: index for index, phase in enumerate(Phase)}


@dataclass(frozen=True)
class WireFrame:
    """A message as the transport sees it: JSON header bytes and named little-endian blobs."""

    header_json: bytes
    blobs: dict[str, tuple[str, tuple[int, ...], bytes]]

    @property
    def size(self) -> int:
        return len(self.header_json) + sum(len(blob) for _, _, blob in self.blobs.values())

    @classmethod
    def from_message(cls, message: Message) -> "WireFrame":
        header, arrays = message.to_wire()
        blobs = {}
        for name, array in arrays.items():
            little = array.astype(array.dtype.newbyteorder("<"), copy=False)
            blobs[name] = (little.dtype.str, tuple(little.shape), little.tobytes())
        return cls(json.dumps(header, separators=(",", ":")).encode(), blobs)

    def to_message(self) -> Message:
        arrays = {name: np.frombuffer(blob, dtype=np.dtype(dtype)).reshape(shape)
                  for name, (dtype, shape, blob) in self.blobs.items()}
        return decode(json.loads(self.header_json), arrays)


@dataclass
class RoundRun:
    outcome: AggregateReady | RoundFailed
    server: ServerSecAgg
    clients: dict[str, ClientSecAgg]
    errors: list[tuple[str, SecAggError]] = field(default_factory=list)  # (receiver, error)
    upload_bytes: int = 0      # client -> server, all clients
    download_bytes: int = 0    # server -> client, all clients
    # CPU time of this process (time.process_time: all its threads, so the server's mask-expansion
    # threads count), so that other load on a shared machine does not; clients and server take
    # turns on one thread here, so each interval holds only one side's work
    client_seconds: float = 0.0  # summed over clients: handle() + serialisation of their replies
    server_seconds: float = 0.0  # handle() + decoding of uploads + serialisation of its messages
    # wall clock of the same server intervals: what parallel mask expansion shortens
    server_wall_seconds: float = 0.0
    server_view: list[WireFrame] | None = None  # every frame the server received, if recorded
    timeouts: int = 0           # phases that had to be closed by a Timeout


def make_identities(n: int, prefix: str = "device") -> list[DeviceIdentity]:
    width = len(str(n - 1))
    return [DeviceIdentity.generate(f"{prefix}-{i:0{width}d}") for i in range(n)]


ClientFactory = Callable[[str, DeviceIdentity], Any]


def build_round(config: RoundConfig, server_identity: DeviceIdentity,
                client_identities: Mapping[str, DeviceIdentity],
                server_workers: int | None = None, server_mask_applier: MaskApplier | None = None,
                client_factory: ClientFactory | None = None) -> tuple[ServerSecAgg, dict[str, ClientSecAgg]]:
    """``client_factory(device, identity)`` may return another implementation of the client (with
    ``handle``, ``state`` and ``provide_input``) for some devices, e.g. the Java device's; None = ours."""
    registry = IdentityRegistry({device: identity.public_key_bytes for device, identity in client_identities.items()})
    server = ServerSecAgg(config, server_identity, registry, workers=server_workers,
                          mask_applier=server_mask_applier)
    clients = {}
    for device, identity in client_identities.items():
        if device not in config.members:
            continue
        other = client_factory(device, identity) if client_factory else None
        clients[device] = other if other is not None else ClientSecAgg(
            identity, config.aggregator_id, server_identity.public_key_bytes,
            job_id=config.job_id, round_id=config.round_id, group_id=config.group_id)
    return server, clients


def run_round(config: RoundConfig, server_identity: DeviceIdentity,
              client_identities: Mapping[str, DeviceIdentity],
              inputs: Mapping[str, np.ndarray] | Callable[[str], np.ndarray], *,
              dropouts: Mapping[str, Phase] | None = None,
              intercept: Callable[[Message], list[Message]] | None = None,
              record_server_view: bool = False, server_workers: int | None = None,
              server_mask_applier: MaskApplier | None = None, client_factory: ClientFactory | None = None,
              report_offline: bool = False) -> RoundRun:
    """Run one round to its end. `inputs` is asked for a device's vector only when that device
    builds its masked input, so huge groups need not hold every vector at once. `intercept`
    sees every message before it is serialised and returns what to deliver instead (tests use
    it to corrupt, duplicate or drop messages). `server_workers` and `server_mask_applier` are
    ServerSecAgg's `workers` and `mask_applier`; `client_factory` as in :func:`build_round`. `report_offline`:
    the server is told MemberOffline as soon as a dropped-out device goes silent (as the aggregator
    is by its presence last will), instead of finding out at the phase's Timeout."""
    dropouts = dict(dropouts or {})
    get_input = inputs if callable(inputs) else inputs.__getitem__
    server, clients = build_round(config, server_identity, client_identities, server_workers, server_mask_applier,
                                  client_factory)
    run = RoundRun(outcome=None, server=server, clients=clients,  # type: ignore[arg-type]
                   server_view=[] if record_server_view else None)
    silent: set[str] = {d for d, phase in dropouts.items() if phase is Phase.ADVERTISE_KEYS}
    reported: set[str] = set()          # silent devices the server was told are offline

    def frames(messages: list[Message]) -> list[WireFrame]:
        out = []
        for message in messages:
            for delivered in (intercept(message) if intercept else [message]):
                out.append(WireFrame.from_message(delivered))
        return out

    started, started_wall = time.process_time(), time.perf_counter()
    outputs = server.start()
    to_clients = frames([m for m in outputs if isinstance(m, Message)])
    run.server_seconds += time.process_time() - started
    run.server_wall_seconds += time.perf_counter() - started_wall

    # Each reply reaches the server as soon as its device produced it, as on a real broker, so
    # at most one masked vector is in flight at a time.
    while server.state not in FINAL_STATES:
        phase = server.phase
        outputs: list = []
        for frame in to_clients:
            run.download_bytes += frame.size
            started = time.process_time()
            replies = client_step(frame, clients, silent, dropouts, get_input, run)
            uploads = frames(replies)
            run.client_seconds += time.process_time() - started
            started, started_wall = time.process_time(), time.perf_counter()
            for upload in uploads:
                run.upload_bytes += upload.size
                if run.server_view is not None:
                    run.server_view.append(upload)
                try:
                    outputs.extend(server.handle(upload.to_message()))
                except SecAggError as exc:
                    run.errors.append(("server", exc))
            if report_offline:
                for device in sorted(silent - reported):
                    reported.add(device)
                    outputs.extend(server.handle(MemberOffline(device)))
            run.server_seconds += time.process_time() - started
            run.server_wall_seconds += time.perf_counter() - started_wall
        started, started_wall = time.process_time(), time.perf_counter()
        if server.phase == phase and server.state not in FINAL_STATES:
            run.timeouts += 1
            outputs.extend(server.handle(Timeout(phase)))
        to_clients = frames([m for m in outputs if isinstance(m, Message)])
        run.server_seconds += time.process_time() - started
        run.server_wall_seconds += time.perf_counter() - started_wall
    run.outcome = server.outcome
    return run


def client_step(frame: WireFrame, clients: dict[str, ClientSecAgg], silent: set[str],
                 dropouts: Mapping[str, Phase], get_input: Callable[[str], np.ndarray], run: RoundRun) -> list[Message]:
    """Deliver one frame to its device; return the replies the device actually sends."""
    try:
        message = frame.to_message()
    except SecAggError as exc:
        run.errors.append(("client", exc))
        return []
    client = clients.get(message.recipient)
    if client is None or message.recipient in silent:
        return []
    if isinstance(message, ForwardedShares) and client.state is ClientState.SHARES_SENT:
        client.provide_input(get_input(message.recipient))
    try:
        replies = client.handle(message)
    except SecAggError as exc:
        run.errors.append((message.recipient, exc))
        return []
    kept = []
    for reply in replies:
        stop = dropouts.get(reply.sender)
        if stop is not None and _PHASE_ORDER[reply.PHASE] >= _PHASE_ORDER[stop]:
            silent.add(reply.sender)  # gone from here on
            break
        kept.append(reply)
    return kept


def plain_fixed_point_sum(config: RoundConfig, vectors: list[np.ndarray]) -> np.ndarray:
    """Reference: the plain modulo-2^r sum of the encoded vectors (what SecAgg must reproduce)."""
    total = np.zeros(config.vector_length, dtype=config.codec.word)
    for vector in vectors:
        total += config.codec.encode(vector)
    return total


def describe(run: RoundRun) -> dict[str, Any]:
    return {"outcome": type(run.outcome).__name__, "errors": [f"{who}: {type(e).__name__}: {e}" for who, e in run.errors],
            "upload_bytes": run.upload_bytes, "download_bytes": run.download_bytes,
            "client_seconds": run.client_seconds, "server_seconds": run.server_seconds,
            "server_wall_seconds": run.server_wall_seconds}
