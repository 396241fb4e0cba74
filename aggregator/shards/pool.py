"""The coordinator's side of K shards, whatever runs them.

:class:`ShardPool` is all the service knows of its shards: start them, tell them the job, ask for
their sums over the accepted ids and reduce them, restart one that died (on the same store: it
resumes), stop them. Every shard runs the same loop (``local.py``'s :func:`shard_main` around a
:class:`~aggregator.shards.shard.ShardIngest`) and speaks the same messages; a subclass says only
how a shard is started, reached and found dead: a local process and a pipe (``local.py``,
``LocalShards``) or a Ray actor on a cluster's node (``ray_shards.py``, ``RayShards``).

Messages, coordinator → shard: ``("keys", device -> public key)`` (signatures required: sent
before the job, so a shard never reads a result unverified), ``("key", device, public key | None)``,
``("admit", devices | None, revoked)`` (who may contribute: a shard holds only their chunks; None: an
open fleet; never the revoked ones, in either mode), ``("admitted", device, bool)`` (an enrolment or a
revocation, in either mode),
``("refeed", topic, payload)`` (a message the shard refused before it heard of its device's admission or key),
``("job", job_id, kind, config)``, ``("closed", job_id, round, accepted, earlier)`` (a round's
close: its rows, and with ``earlier`` those of the rounds before, outside ``accepted`` are orphans,
deleted), ``("sums" | "statistics",
request, job_id, accepted, context)``, ``("group_open", round config, hosting context)``, ``("group_offline" |
"group_abort", round, device | reason)``, ``("stop",)``; shard → coordinator: ``("ready",)`` once
connected to the broker, ``("receipt", topic, raw)``, ``("forward", topic, payload)``, ``("unadmitted", topic, payload)`` (a
message of a device the shard had not been told was admitted, or whose key it lacks: handed back if it is),
``("refused", topic, detail, reason class)`` (a device's message refused there, counted by the coordinator
as one aggregator counts it: one that raised, "malformed"; a hosted group's refused secagg message,
"protocol" or "late"; a result its store could not hold, "malformed"), ``("sums",
request, node sums or statistics, or the reason it has none)``, ``("group", job_id, "refused", round, culprits,
{member: why})`` (members a hosted secure group refused, as it refuses them), ``("group", job_id, "sum", round,
culprits, total, survivors)`` or ``("group", job_id, "failed", round, culprits, reason)`` (a hosted secure group's end,
``secure_groups.py``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable

from protocols.mqtt_link import BrokerConfig
from protocols.topics import Topics

from aggregator.jobs.base import Job
from aggregator.shards.buckets import bucket_range, shard_of
from aggregator.shards.coordinator_job import ShardedJob, ShardedNoisyRoundsJob, ShardedOwnModelJob
from aggregator.shards.coordinator_ladd import ShardedLaddJob
from aggregator.shards.coordinator_rounds import ShardedRoundsJob
from aggregator.shards.group_placement import SecureGroupPlacement
from aggregator.shards.ladd_sums import LaddRoundSums
from aggregator.shards.partial_sums import additive, reduce_nodes, shard_capability
from aggregator.shards.shard import Admission
from aggregator.shards.sum_tree import root_sum
from aggregator.shards.secure_groups import ShardedSecureJob

log = logging.getLogger("fedfleet.aggregator.shards")


def check_shardable(job: Job, kind: str) -> None:
    """Refuse, with the reason, a job whose sums (or secure groups) shards cannot take."""
    reason = shard_capability(kind).refusal(job)
    if reason:
        raise ValueError(reason)


class ShardPool(ABC):
    """K shards, shard i owning bucket range i and the store ``store_path(i)``."""

    def __init__(self, shards: int, broker: BrokerConfig, store_dir: Path, topics: Topics = Topics(),
                 max_message_bytes: int = 256 * 1024 * 1024, reply_timeout_s: float = 600.0):
        bucket_range(0, shards)             # a count no bucket range fits is refused here
        self.shards, self.broker, self.topics = shards, broker, topics
        self.store_dir, self.max_message_bytes = Path(store_dir), max_message_bytes
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.reply_timeout_s = reply_timeout_s
        self._ready = [threading.Event() for _ in range(shards)]
        self._started_at = [0.0] * shards
        self._replies: queue.Queue = queue.Queue()
        self._deliver: Callable[[tuple], None] = lambda item: None
        self._job: tuple | None = None
        self._keys: dict[str, bytes] | None = None          # signatures required: the enrolled keys
        self._admission = Admission()                       # who may contribute (the enrolled; any: an open fleet)
        # held while a command is sent (a reader thread hands chunks back as the service thread sends)
        # and from an admission's change to its commands' sending: a chunk handed back is sent after
        # the admission that let it back, never between the change and its command
        self.send_lock = threading.RLock()
        self._request = 0
        self.restarts = 0
        self.placed: dict[int, int] = {}                    # secure round -> the shard hosting its group
        # (job, "sum", round, culprits, total, survivors) | (job, "failed", round, culprits, reason)
        self.group_outcomes: queue.Queue = queue.Queue()

    def store_path(self, index: int) -> Path:
        return self.store_dir / f"shard-{index}-of-{self.shards}.db"

    def shard_args(self, index: int) -> tuple:
        """What :func:`~aggregator.shards.local.shard_main` takes besides its channel."""
        return index, self.shards, self.broker, str(self.store_path(index)), self.topics, self.max_message_bytes

    # ---------------------------------------------------------------- how a shard runs: the subclass's
    @abstractmethod
    def _launch(self, index: int) -> None:
        """Start shard ``index`` (a dead one's successor: on the same store) and hand every message it
        sends to :meth:`_received`, from any thread."""

    @abstractmethod
    def _send(self, index: int, command: tuple) -> None:
        """Send ``command`` to shard ``index``, in order, under :attr:`send_lock`; one a dead shard
        misses is sent again after its restart (the job by :meth:`_start`, sums by :meth:`reduce`)."""

    @abstractmethod
    def _exited(self, index: int) -> str | None:
        """How shard ``index`` ended (its exit code, the error), or None while it runs."""

    @abstractmethod
    def _stop(self) -> None:
        """End every shard, after each was sent ``("stop",)``."""

    # ---------------------------------------------------------------- the coordinator's side
    def start(self, deliver: Callable[[tuple], None], timeout_s: float) -> None:
        """Start the shards and wait until each is connected (so no result reaches the broker before
        its shard can subscribe). ``deliver(("forward", topic, payload) | ("receipt", topic, raw))``
        runs on reader threads. ``timeout_s``: the service's ``shard_start_timeout_s`` (two Ray actors
        took over 120 s to start and connect on a loaded 2-core machine, a local shard process takes
        seconds; waiting longer costs a healthy start nothing)."""
        self._deliver = deliver
        for i in range(self.shards):
            self._start(i)
        deadline = time.monotonic() + timeout_s
        while not all(r.is_set() for r in self._ready):
            if time.monotonic() > deadline:
                self.close()
                waiting = [i for i, r in enumerate(self._ready) if not r.is_set()]
                raise ConnectionError(f"shards {waiting} did not start and connect to the broker within "
                                      f"{timeout_s:.0f}s")
            self.watch()                # one that failed to start (e.g. its connection) gets another try
            time.sleep(0.1)

    def _start(self, index: int) -> None:
        # under the lock: a message the dead one's reader still hands back is refed after these
        with self.send_lock:
            self._started_at[index] = time.monotonic()
            self._launch(index)
            if self._keys is not None:      # before the job: the shard holds every outbox message until then
                self._send(index, ("keys", dict(self._keys)))
            self._send(index, self._admit_command())
            if self._job is not None:
                self._send(index, ("job", *self._job))

    def _received(self, index: int, msg: tuple) -> None:
        if msg[0] == "ready":
            self._ready[index].set()
        elif msg[0] == "sums":
            self._replies.put((index, *msg[1:]))
        elif msg[0] == "group":
            self.group_outcomes.put(msg[1:])
        elif msg[0] == "unadmitted":
            self._unadmitted(index, *msg[1:])
        else:
            self._deliver(msg)

    def _unadmitted(self, index: int, topic: str, payload: bytes) -> None:
        """A message shard ``index`` refused, its device not admitted there (or its key not given): one
        the coordinator has admitted meanwhile (and, signatures required, given the key of) goes back
        to that shard, which by then has heard of it (this pipe's commands arrive in order), to be
        held with the device's other chunks; any other is refused on the coordinator's path. A
        message handed back is never handed back again."""
        device = self.topics.device_of(topic)
        with self.send_lock:
            if device is not None and self._admission.allows(device) and (self._keys is None or device in self._keys):
                return self._send(index, ("refeed", topic, payload))
        self._deliver(("forward", topic, payload))

    def require_signatures(self, keys: dict[str, bytes]) -> None:
        """Every shard verifies each message it reads against its sender's key (``--require-signatures``):
        ``keys`` is the fleet's enrolled keys, given before :meth:`start` (a restarted shard gets them again)."""
        if any(self._started_at):
            raise RuntimeError("the shards get the keys at their start: require signatures before start()")
        self._keys = dict(keys)

    def admit(self, devices: set[str] | None, revoked: set[str]) -> None:
        """The devices that may contribute (the fleet's enrolled ones; None: an open fleet), never the
        ``revoked`` ones: each shard holds chunks of these only. Sent to the running shards, and to
        each at its start."""
        with self.send_lock:
            self._admission = Admission(devices, revoked)
            self._tell_started(self._admit_command())

    def _admit_command(self) -> tuple:
        admitted = self._admission.admitted
        return "admit", None if admitted is None else sorted(admitted), sorted(self._admission.revoked)

    def admission(self):
        """Held around an enrolment, a revocation or a fleet mode change and its commands to the
        shards: a message a shard refused meanwhile is judged once they are all sent, never between
        the fleet's change and the shards' (the coordinator would take a chunk the shard then holds
        the rest of)."""
        return self.send_lock

    def admission_changed(self, device: str, admitted: bool) -> None:
        """A device enrolled (True) or revoked (False): every shard follows at once, an open fleet's
        too (a revoked device is refused there as well)."""
        with self.send_lock:
            self._admission.changed(device, admitted)
            self._tell_started(("admitted", device, admitted))

    def _tell_started(self, command: tuple) -> None:
        for i in range(self.shards):
            if self._started_at[i]:     # one not started yet is told at its start (_start)
                self._send(i, command)

    def key_changed(self, device: str, public_key: bytes | None) -> None:
        """A device enrolled (its key) or revoked (None): every shard's registry follows at once."""
        with self.send_lock:
            if self._keys is None:
                return
            self._keys.pop(device, None)
            if public_key is not None:
                self._keys[device] = public_key
            for i in range(self.shards):
                self._send(i, ("key", device, public_key))

    def set_job(self, job: Job, kind: str) -> None:
        """Serve ``job`` (refused, changing nothing, unless it is shardable)."""
        check_shardable(job, kind)
        self._job = (job.config.job_id, kind, job.config.to_dict())
        # the last job's groups end with it: none placed any more, and their outcomes (tagged with
        # that job's id, dropped by the coordinator) are never taken for the new job's rounds
        self.placed.clear()
        while not self.group_outcomes.empty():
            self.group_outcomes.get_nowait()
        for i in range(self.shards):
            self._send(i, ("job", *self._job))

    def round_closed(self, job_id: str, round_: int, accepted: list[tuple[str, str]], earlier: bool = False) -> None:
        """The coordinator closed ``round_`` having accepted these (device, message id)s (any
        superset of the round's will do; with ``earlier``, every round's so far): every shard deletes
        its rows of that round (and of the earlier ones) outside them. A shard that was down at a
        close misses it: ``earlier`` closes catch up with it."""
        for i, mine in enumerate(self._by_shard(accepted)):
            self._send(i, ("closed", job_id, round_, mine, earlier))

    def _by_shard(self, accepted: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
        """``accepted`` split by the shard whose buckets hold each device: a shard reads only its own
        ids of a close or a request (it keeps no other), so each is sent only those."""
        split: list[list[tuple[str, str]]] = [[] for _ in range(self.shards)]
        for device, message_id in accepted:
            split[shard_of(device, self.shards)].append((device, message_id))
        return split

    def watch(self) -> None:
        """Restart every shard that died: it reopens its store and resumes."""
        for i in range(self.shards):
            ended = self._exited(i)
            # at most one start a second: a shard that cannot start does not spin the service
            if ended is not None and time.monotonic() - self._started_at[i] > 1.0:
                log.error("shard %d exited (%s): restarting it on its store", i, ended)
                self.restarts += 1
                self._groups_lost(i, ended)
                self._start(i)

    # ---------------------------------------------------------------- secure groups (secure_groups.py)
    def open_group(self, index: int, config, context: dict) -> None:
        """Shard ``index`` hosts ``config``'s group (a ``RoundConfig``; ``context``: the job's
        ``hosting_context``) from now on."""
        self.placed[config.round_id] = index
        self._send(index, ("group_open", config, context))

    def tell_group(self, round_id: int, command: str, *args) -> None:
        """``"group_offline", device`` or ``"group_abort", reason`` to the shard hosting the round's group."""
        if round_id in self.placed:
            self._send(self.placed[round_id], (command, round_id, *args))

    def group_ended(self, round_id: int) -> None:
        self.placed.pop(round_id, None)

    def _groups_lost(self, index: int, ended: str) -> None:
        """A shard died with the groups it hosted: their secrets (never persisted) died with it, so
        each fails now, with the reason, instead of at its round's deadline."""
        for round_id in sorted(r for r, holder in self.placed.items() if holder == index):
            self.group_outcomes.put((self._job[0], "failed", round_id, (),
                                     f"shard {index} hosting the group exited ({ended}): its secrets died with it"))

    def reduce(self, kind: str, config: dict, job_id: str, accepted: list[tuple[str, str]]) -> Job:
        """The canonical model of ``accepted`` (device, message id)s: the shards' node sums reduced."""
        return reduce_nodes(kind, config, self.ask("sums", job_id, accepted))

    def ask(self, what: str, job_id: str, accepted: list[tuple[str, str]], context: Any = None) -> dict:
        """Every shard's answer over the ``accepted`` ids it holds, merged: ``"sums"`` (its covering
        nodes' sums) or ``"statistics"`` (device -> the per-update statistic a round's close asks
        for); ``context``: what the close decided so far (None for a kind that needs nothing)."""
        self._request += 1
        request, merged, waiting = self._request, {}, set(range(self.shards))
        commands = [(what, request, job_id, mine, context) for mine in self._by_shard(accepted)]
        for i in waiting:
            self._send(i, commands[i])
        deadline = time.monotonic() + self.reply_timeout_s
        while waiting:
            try:
                index, got_request, answer = self._replies.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"shards {sorted(waiting)} did not send their {what}")
                dead = [i for i in waiting if self._exited(i) is not None]
                if dead:                            # restarted and asked again, each of them (a review's
                    self.watch()                    # finding: only the first was, the others never answered)
                    for i in dead:
                        if self._exited(i) is None:
                            self._send(i, commands[i])
                continue
            if got_request != request or index not in waiting:
                continue
            if isinstance(answer, str):
                raise RuntimeError(f"shard {index} cannot answer {what}: {answer}")
            merged.update(answer)
            waiting.discard(index)
        return merged

    def coordinator_job(self, job: Job, kind: str) -> Job:
        """``job`` as the coordinator serves it on these shards (after :meth:`set_job`)."""
        if isinstance(shard_capability(kind), SecureGroupPlacement):
            return ShardedSecureJob(job, kind, self)
        if isinstance(additive(kind), LaddRoundSums):          # a round's sums per slot, styles forwarded
            return ShardedLaddJob(job, kind, self)
        if additive(kind).per_round:
            return ShardedRoundsJob(job, kind, self)
        if additive(kind).model_from_receipts:  # personalization: its receipts are its reports
            return ShardedOwnModelJob(job, kind, self.round_closed)
        if job.canonical_round_sums:            # DP Fed3R: each round's sum, noised by the job
            return ShardedNoisyRoundsJob(job, kind, lambda job_id, ids: root_sum(additive(kind), self.ask(
                "sums", job_id, ids)), self.round_closed)
        return ShardedJob(job, kind, self.reduce, self.round_closed)

    def close(self) -> None:
        for i in range(self.shards):
            self._send(i, ("stop",))
        self._stop()
