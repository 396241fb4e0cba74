"""Secure aggregation on the device for any task whose answer is one fixed-shape vector.

On the task the device computes its update with the plain task's handler, turns it into the
vector the job sums (``vector``: one subclass per kind), and becomes a ``ClientSecAgg`` for
(job, round, group). Every ``secagg`` message from the aggregator is fed to that client; its
replies go back as envelopes. The aggregator never sees the vector, only masked values and the
group sum. A vector outside the round's signed bound is refused by the client before anything
is sent (the device declines the task).

Subclasses: ``SecureFed3R`` (statistics, ``secure_fed3r.py``) and ``SecureFedAvgTraining``
(FedAvg updates of the head or the backbone tail, ``secure_fedavg_training.py``) and
``SecureLaddTraining`` (``secure_ladd_training.py``).

Across rounds: the device's ``SecureInputLedger`` (``edge_client/secure_inputs.py``) lets one
input be revealed in sums over one member set only (each round's release guard: a round of
other members is left, the reason logged); an unreadable ledger declines the task. A
task re-sent for a (job, round, group) whose round is still live is a duplicate: answered with
nothing, the live round kept (replacing it would drop the device out with fresh keys). A task
of a later round of the same job ends the job's earlier rounds still open here: the aggregator
runs a job's rounds one at a time, so those can no longer sum this device's input.

A device whose input cannot enter its round as the aggregator's RoundStart configures it (encoded:
a value non-finite or beyond the round's bound, another length; or a ring other than its input
needs) leaves the round and declines the task that opened it (``INPUT_DOES_NOT_FIT``, fixed words:
the encoder's own message may quote the input's largest value, which the aggregator must not learn).
The aggregator turns the decline into ``MemberOffline``, so the first phase closes as soon as the
other members have answered; a silent device held it to its budget, at least half the round
(``aggregator/jobs/phase_clock.py``). Only an authenticated RoundStart gets that far, and the
round is left: a replay of it finds no session and costs nothing.

A task kind is told how each of its rounds ended for this device (:meth:`SecureUpdate.round_end`,
called with whether the round FINISHED here: the device answered the unmask request as a
survivor, so its masked input is in the unmasked sum); secure Scaffold keeps its new c_k only then.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Callable

import numpy as np

from protocols import messages as M
from protocols.clipping import clip_update
from protocols.envelope import Envelope, EnvelopeError
from protocols.identity import DeviceIdentity
from protocols.payloads.secagg import UnsendableMessage, from_envelope, to_envelope
from protocols.payloads.secure_tasks import SecureUpdateRound
from protocols.payloads.task_params import DpRound, WireParams
from protocols.secagg import (ClientSecAgg, ClientState, ConfigError, InputError, ReleaseRefused, SecAggError,
                              Timeout)
from protocols.secagg.distributed_dp import add_skellam_noise
from protocols.secagg.fixedpoint import RING_BITS

from ..agent import MessageHandler, SecureTaskHandler, TaskDeclined
from ..secure_inputs import LOST_REASON, SecureInputLedger, input_key
from ..work_deadline import round_over_at, task_at_work
from .params import read_params

# told once, when a secure round's session ends on the device, whether the round FINISHED there
# (True: the device answered the unmask request as a survivor, its input is in the unmasked sum)
# or ended any other way (False: aborted, declared dropped, past its deadline, pushed out, its
# answer unsendable): the aggregator's step then never counted this device's input
RoundEnd = Callable[[bool], None]

# the decline of a task whose input cannot enter its round (the Java device's SecAggSessions says the same)
INPUT_DOES_NOT_FIT = ("this device's input does not fit the secure round's configuration (its length, its bound "
                      "or its ring): it leaves the round")

log = logging.getLogger("fedfleet.device.secagg")

RoundKey = tuple[str, int, str]     # (job, round, group)


@dataclass(frozen=True)
class OpenRound:
    """What the device holds for one open secure round: one entry, so opening, ending and expiring
    the round touch it whole."""

    client: ClientSecAgg
    ends_at: float | None = None            # unix s, the device's clock; None: no end but max_sessions
    round_end: RoundEnd | None = None       # the task kind that asked to be told how the round ended
    task: M.TaskRef | None = None           # the task that opened it: declined if the device leaves at its start


class RoundClients(Mapping):
    """A read-only, live view of the open rounds' clients by key (``SecAggSessions.sessions``)."""

    def __init__(self, rounds: dict[RoundKey, OpenRound]):
        self._rounds = rounds

    def __getitem__(self, key: RoundKey) -> ClientSecAgg:
        return self._rounds[key].client

    def __iter__(self) -> Iterator[RoundKey]:
        return iter(self._rounds)

    def __len__(self) -> int:
        return len(self._rounds)


class SecAggSessions(MessageHandler):
    """A device's open secure-aggregation sessions, keyed by (job, round, group).

    Register it as the agent's ``secagg`` message handler; every ``SecureUpdate`` of the device
    opens its sessions here, so one device can serve several secure task kinds. ``inputs``: the
    device's secure-input ledger, shared by those kinds (default: one in memory).

    Each open round is one ``OpenRound`` in ``rounds`` (its client, its end, its kind's RoundEnd,
    its task); ``sessions`` views their clients. A session ends where its round can no longer
    complete: at its task's deadline plus the clocks' grace (``ends_at``, ``edge_client/
    work_deadline.py``: the aggregator gives the round up at its deadline), or when ``max_sessions``
    newer rounds push it out, or at once where its answer cannot be sent (``unsendable``: the
    agent's outbox refused it). SecAgg's security assumes a round's secrets (its private keys, its
    neighbours' shares, its input) are erased when the round ends, so an ending session is fed a
    Timeout: the client's own abort path erases them, and the session is forgotten (a late message
    for it is refused, as for a round the aggregator aborted). The agent calls :meth:`expire` on
    every tick; each message and task checks ``clock`` (unix s, the device's: what the deadline is
    read on) first too, so a late message finds its round over between ticks."""

    def __init__(self, device_id: str, max_sessions: int = 4, inputs: SecureInputLedger | None = None,
                 clock: Callable[[], float] = time.time):
        self.device_id, self.max_sessions = device_id, max_sessions
        self.rounds: dict[RoundKey, OpenRound] = {}     # oldest first: the first pushed out
        self.inputs = SecureInputLedger() if inputs is None else inputs
        self.clock = clock

    @property
    def sessions(self) -> Mapping[RoundKey, ClientSecAgg]:
        """The open rounds' clients by key (a read-only view that follows ``rounds``)."""
        return RoundClients(self.rounds)

    def live(self, key: RoundKey) -> bool:
        """Whether the round ``key`` is open here and not over."""
        opened = self.rounds.get(key)
        return opened is not None and opened.client.state not in (ClientState.FINISHED, ClientState.ABORTED)

    @property
    def expiring(self) -> bool:
        """Whether a session waits for its end (the agent then ticks even when otherwise idle)."""
        # asked of every device on every tick of an emulated host: an idle device answers at once
        return bool(self.rounds) and any(opened.ends_at is not None for opened in self.rounds.values())

    def open(self, key: RoundKey, client: ClientSecAgg, ends_at: float | None = None,
             round_end: RoundEnd | None = None, task: M.TaskRef | None = None) -> bool:
        """Open ``key``'s round with ``client`` until ``ends_at`` (unix s, the device's clock; None:
        no end but ``max_sessions``), ``round_end`` told how it ended, ``task`` (None: none named)
        declined if the device leaves the round at its start; False (nothing changed) where a live
        one holds it."""
        self.expire()
        if self.live(key):
            return False
        self._end(key, "over")
        self.rounds[key] = OpenRound(client, None if ends_at is None else float(ends_at), round_end, task)
        while len(self.rounds) > self.max_sessions:          # the oldest rounds: this device leaves them
            self._end(next(iter(self.rounds)), "pushed out by newer rounds")
        return True

    def expire(self, now: float | None = None) -> None:
        """End every session whose round is over by ``now`` (default: the clock)."""
        now = self.clock() if now is None else now
        for key in [key for key, opened in self.rounds.items() if opened.ends_at is not None and now > opened.ends_at]:
            self._end(key, "past its deadline")

    def leave_earlier_rounds(self, job: str, round_: int) -> None:
        """End the sessions of ``job``'s rounds before ``round_`` (its task came: they are over)."""
        for key in [key for key in self.rounds if key[0] == job and key[1] < round_]:
            self._end(key, f"over (round {round_} of its job began)")

    def _end(self, key: RoundKey, why: str) -> None:
        """Forget ``key``'s session, a live one through its client's abort path (secrets erased),
        and tell its task kind whether the round finished here (its ``round_end``, once)."""
        opened = self.rounds.pop(key, None)
        if opened is None:
            return
        client = opened.client
        if client.phase is not None:
            client.handle(Timeout(client.phase))
            log.info("%s: secure round %s/%s/%s %s: left, its secrets erased", self.device_id, *key, why)
        if opened.round_end is not None:
            opened.round_end(client.state is ClientState.FINISHED)

    def on_message(self, env: Envelope) -> list[Envelope]:
        msg = from_envelope(env)
        self.expire()
        key = (msg.job_id, msg.round_id, msg.group_id)
        opened = self.rounds.get(key)
        if opened is None:
            log.info("%s: secagg message for an unknown session %s/%s/%s", self.device_id, *key)
            return []
        client = opened.client
        try:
            replies = [to_envelope(r) for r in client.handle(msg)]
        except ReleaseRefused as exc:       # the round is aborted: the input does not leave
            self._end(key, "refused by the release guard")
            log.warning("%s: leaves secure round %s/%s: %s", self.device_id, msg.job_id, msg.round_id, exc)
            return []
        except (InputError, ConfigError) as exc:    # the RoundStart's, raised once it is authenticated
            return self._leave_at_start(key, exc)
        except SecAggError as exc:
            log.warning("%s: secagg error: %s", self.device_id, exc)
            if client.state is ClientState.ABORTED:     # a ProtocolViolation (e.g. declared dropped): over
                self._end(key, "aborted")
            return []
        except UnsendableMessage as exc:       # its answer cannot travel: sit the round out (a dropout)
            self._sit_out(key, exc)
            return []
        if client.state in (ClientState.FINISHED, ClientState.ABORTED):
            # done, or the server aborted the round (its secrets are already erased)
            self._end(key, "over")
            if client.abort_reason is not None:
                log.info("%s: secure round %s/%s aborted by the aggregator: %s", self.device_id, msg.job_id,
                         msg.round_id, client.abort_reason)
        return replies

    def unsendable(self, env: Envelope, exc: EnvelopeError) -> None:
        """The agent's outbox refused an answer to ``env`` before any was sent (more chunks at its chunk
        size than a reassembler takes, over the envelope's limits): the round sits out at once, as
        where ``to_envelope`` refuses one, rather than keep its secrets until its deadline."""
        msg = from_envelope(env)
        self._sit_out((msg.job_id, msg.round_id, msg.group_id), exc)

    def _sit_out(self, key: RoundKey, exc: EnvelopeError) -> None:
        """``key``'s answer cannot travel: the device leaves the round, a dropout (its secrets erased, its
        kind told the round did not finish here); a round that finished with that answer is over already."""
        self._end(key, "its answer cannot be sent")
        log.warning("%s: secure round %s/%s/%s: its answer cannot be sent, none is: %s", self.device_id, *key, exc)

    def _leave_at_start(self, key: RoundKey, exc: SecAggError) -> list[Envelope]:
        """The aggregator's RoundStart configures a round this device's input cannot enter: the
        round is left (its secrets erased) and its task declined, so the first phase stops waiting
        for this device at once. The encoder's words stay in the device's log."""
        task = self.rounds[key].task
        self._end(key, "its input does not fit the round")
        log.warning("%s: leaves secure round %s/%s/%s at its start: %s", self.device_id, *key, exc)
        return [] if task is None else [M.decline_message(self.device_id, task, INPUT_DOES_NOT_FIT)]


class SecureUpdate(SecureTaskHandler, MessageHandler):
    """A protocol handler for the agent: ``on_task`` and ``on_message`` return envelopes to send.

    ``sessions``: shared with the device's other secure task kinds (default: its own).
    ``noise_rng``: the source of the device's share of DP noise; None (what a device runs): a
    generator seeded afresh from the operating system (256 bits, ``os.urandom``) for each share.
    Why not one generator for the process's life: PCG64 is not cryptographic, so whoever inferred
    its state once (from any draw it learned) would know every later share of that device's noise,
    and could take it out of the sums; a fresh seed per share confines that to one share, as the
    aggregator's central noise does (``aggregator/strategies/dp_noise.py``). Tests pass a seeded one."""

    def __init__(self, identity: DeviceIdentity, aggregator_public_key: bytes,
                 sessions: SecAggSessions | None = None, noise_rng: np.random.Generator | None = None):
        self.identity = identity
        self.aggregator_public_key = aggregator_public_key
        self.sessions = sessions or SecAggSessions(identity.device_id)
        self.noise_rng = noise_rng

    def noise_generator(self) -> np.random.Generator:
        """The generator of one share: the test's, else seeded afresh from the operating system."""
        if self.noise_rng is not None:
            return self.noise_rng
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence(int.from_bytes(os.urandom(32), "big"))))

    def add_noise(self, vector: np.ndarray, dp: DpRound, noised: slice | None = None) -> np.ndarray:
        """Distributed DP: the device's Skellam share on ``noised`` (default: every entry but the
        last, the count), at the round's scale (``protocols.secagg.distributed_dp``)."""
        try:
            return add_skellam_noise(vector, float(dp.stddev), int(dp.scale_bits), self.noise_generator(),
                                     noised=slice(0, len(vector) - 1) if noised is None else noised)
        except (ValueError, SecAggError) as exc:
            raise TaskDeclined(f"bad dp params {dp!r}: {exc}") from exc

    @staticmethod
    def clipped_delta(clip_norm: float | None, trained: dict[str, np.ndarray],
                      start: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The update θ_k − θ_t over every tensor the device trained, clipped to ``clip_norm`` as
        one vector (``protocols.clipping``): distributed DP's clip, or bounded influence's."""
        return SecureUpdate.clipped_delta_and_norm(clip_norm, trained, start)[0]

    @staticmethod
    def clipped_delta_and_norm(clip_norm: float | None, trained: dict[str, np.ndarray],
                               start: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float]:
        """:meth:`clipped_delta` and the update's norm before the clip (adaptive clipping's bit)."""
        if not set(trained) <= set(start):
            raise TaskDeclined("the task did not send every tensor the device trained")
        if clip_norm is None or not (np.isfinite(clip_norm) and clip_norm > 0):
            raise TaskDeclined(f"bad clip norm {clip_norm!r}")
        if any(np.shape(v) != np.shape(start[k]) for k, v in trained.items()):
            raise TaskDeclined("a trained tensor's shape differs from the task's")
        return clip_update({k: np.asarray(v, np.float64) - np.asarray(start[k], np.float64)
                            for k, v in trained.items()}, clip_norm)

    # the secure round's fields this wrapper reads (the plain handler it wraps reads the plain kind's)
    round_type: type[WireParams] = SecureUpdateRound
    kind: str               # the wire kind served: it names the task's input (input_key), as on the Java device

    def vector(self, params: dict, tensors: dict[str, np.ndarray]) -> np.ndarray:
        """The float vector this device contributes to the group sum (raise TaskDeclined to refuse)."""
        raise NotImplementedError

    def contribution(self, params: dict, tensors: dict[str, np.ndarray]) -> tuple[np.ndarray, str]:
        """The vector and its input key (``edge_client/secure_inputs.py``): by default the task's
        (its kind, params and tensors), for an update that differs each time it is computed."""
        return self.vector(params, tensors), input_key(self.kind, params, tensors)

    def on_task(self, job: str, round_: int, params: dict, tensors: dict[str, np.ndarray] | None = None
                ) -> list[Envelope]:
        tensors = tensors or {}
        secure = read_params(self.round_type, params)
        key = (job, round_, secure.group)
        self.sessions.expire()                  # a round over by now is no live one to keep
        if self.sessions.live(key):             # a re-sent task: its round goes on with the keys it has
            log.info("%s: task for the live secure round %s/%s/%s again: a duplicate", self.identity.device_id, *key)
            return []
        # before training: an earlier round of the job still open here ends first, so a kind whose
        # state follows the sum (secure Scaffold) has put back a step that round never summed
        self.sessions.leave_earlier_rounds(job, round_)
        # before the contribution: computing it trains, and the stateful kinds (secure Scaffold's c_k,
        # Ditto's v_k) keep their new state as they train; a task declined afterwards would leave it
        # advanced for a round this device never joined
        if self.sessions.inputs.lost is not None and self.sessions.inputs.reload() is not None:
            raise TaskDeclined(LOST_REASON)
        round_end = self.round_end(params)      # reads the kind's state as it is before training
        vector, named = self.contribution(params, tensors)
        try:
            # a distributed-DP share is scaled for the 64-bit ring (distributed_dp.py): no other ring
            client = ClientSecAgg(self.identity, "aggregator", self.aggregator_public_key, job_id=job,
                                  round_id=round_, group_id=key[2], input_vector=vector,
                                  ring_bits=None if secure.dp is None else RING_BITS,
                                  release_guard=self.sessions.inputs.release(named))
        except SecAggError as exc:
            raise TaskDeclined(f"secure aggregation refused the update: {exc}") from exc
        # the session ends with the task's round: the agent runs on_task until that moment
        if not self.sessions.open(key, client, ends_at=round_over_at(), round_end=round_end, task=task_at_work()):
            # opened meanwhile by the same task
            log.info("%s: task for the live secure round %s/%s/%s again: a duplicate", self.identity.device_id, *key)
        return []

    def round_end(self, params: dict) -> RoundEnd | None:
        """What this task's round tells the kind when it ends (``RoundEnd``), built before the
        device trains; None (the default): nothing to do, the kind keeps no state that must follow
        the sum (Ditto's and pp's personal parts are the device's own either way)."""
        return None

    def on_message(self, env: Envelope) -> list[Envelope]:
        return self.sessions.on_message(env)

    def unsendable(self, env: Envelope, exc: EnvelopeError) -> None:
        self.sessions.unsendable(env, exc)

    # registered as the ``secagg`` handler too (a device of one secure kind): its sessions' clock
    @property
    def expiring(self) -> bool:
        return self.sessions.expiring

    def expire(self, now: float | None = None) -> None:
        self.sessions.expire(now)
