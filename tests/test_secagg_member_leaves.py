"""A secure round's member whose input cannot enter the round leaves it, declining its task
(``edge_client/tasks/secure_update.py``, ``INPUT_DOES_NOT_FIT``).

A device trains (or computes its statistics) on its task before it reads the RoundStart, so the
round's first phase waits for every member up to its budget, at least half the round
(``aggregator/jobs/phase_clock.py``); a member that declines or goes offline closes it at once (the
aggregator turns a decline into ``MemberOffline``). A device whose input the RoundStart's config
could not encode (a Fed3R-Sync device whose features are beyond the job's ``max_abs_feature``: its
statistics beyond the round's bound) only logged it: silent, it held the phase, and the whole
group, to that budget every round it was drawn into. It now leaves the round (its secrets erased)
and declines the task with fixed words (the encoder's words quote the input's largest value), and
the phase closes as soon as the others have answered.

Real devices (``DeviceAgent`` running ``SecureFed3R`` over a link that records what it publishes),
a real Fed3R-Sync job run by the service's ``JobRunner``, the messages carried as the service
carries them (``aggregator/service/loop.py``: a decline to the round's coordinator, a ``secagg``
message to the job).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import java_build

from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob
from aggregator.security.fleet import Fleet
from aggregator.service.active_job import ActiveJob
from aggregator.service.crash_points import CrashPoints
from aggregator.service.job_runner import JobRunner, RunnerServices
from edge_client.agent import AgentHooks, DeviceAgent
from edge_client.tasks.fed3r_stats import Fed3RStatsTask
from edge_client.tasks.secure_fed3r import SecureFed3R
from edge_client.tasks.secure_update import INPUT_DOES_NOT_FIT, SecAggSessions
from edge_client.work_deadline import working_until
from protocols import messages as M
from protocols.envelope import decode, encode
from protocols.identity import DeviceIdentity, IdentityRegistry
from protocols.mqtt_link import BrokerConfig
from protocols.payloads.secagg import SECAGG_TYPE, SYNC_KIND, from_envelope, to_envelope
from protocols.rounds import Declined
from protocols.secagg import ClientSecAgg, ClientState, KeyDirectory, Phase, RoundConfig, RoundStart
from protocols.secagg.driver import make_identities
from protocols.secagg.fixedpoint import RING_BITS

from ops_fleet import Features
from java_secagg_bridge import AGGREGATOR as BRIDGE_AGGREGATOR, JAVA, JavaClient
from test_secagg_session_expiry import secrets_held

AGGREGATOR = DeviceIdentity.generate("aggregator")
D, C, N = 2, 2, 6
MAX_ABS_FEATURE = 6.0          # the job's: the round's bound is max_samples · 36
OUTSIDE = "dev-2"              # its features are 100 times larger: its statistics beyond the bound


class RecordingLink:
    """An agent's link that keeps what the agent publishes (envelopes) instead of sending it."""

    def __init__(self, **kwargs):
        self.sent: list = []

    def publish_envelope(self, topic, env, **kwargs) -> int:
        self.sent.append(env)
        return 0

    def publish_parts(self, topic, parts, **kwargs) -> int:     # an answer to a secagg message, encoded
        self.sent.extend(decode(part) for part in parts)          # (one part each: none is near the chunk size)
        return 0

    def take(self) -> list:
        sent, self.sent = self.sent, []
        return sent


def _device(identity: DeviceIdentity, scale: float) -> DeviceAgent:
    rng = np.random.default_rng(int(identity.device_id[4:]))
    stats = Fed3RStatsTask(rng.uniform(-1, 1, (N, D)).astype(np.float32) * scale, rng.integers(0, C, N),
                           lambda b, s, w: Features(D))
    secure = SecureFed3R(identity, AGGREGATOR.public_key_bytes, stats, SecAggSessions(identity.device_id))
    agent = DeviceAgent(identity.device_id, BrokerConfig(), {}, link_factory=RecordingLink,
                        hooks=AgentHooks(always_available=True), aggregator_key=AGGREGATOR.public_key_bytes,
                        protocol_handlers={SYNC_KIND: secure, SECAGG_TYPE: secure.sessions})
    agent.online = True
    return agent


class Service:
    """The job's runner and the devices, the messages carried between them as the service does."""

    def __init__(self, tmp_path, n: int = 5):
        identities = {i.device_id: i for i in make_identities(n, prefix="dev")}
        registry = IdentityRegistry({d: i.public_key_bytes for d, i in identities.items()})
        job = Fed3RSyncJob(Fed3RSyncConfig(job_id="leave", num_classes=C, feature_dim=D, clients_per_round=n,
                                           max_samples=10, max_abs_feature=MAX_ABS_FEATURE),
                           identity=AGGREGATOR, registry=registry)
        self.a = ActiveJob(job, "fed3r-sync", tmp_path / "out")
        self.a.out_dir.mkdir()
        self.to_devices: list[tuple[str, object]] = []
        self.runner = JobRunner(self.a, RunnerServices(
            fleet=Fleet(None, None, set(identities), False), store=None, crash=CrashPoints(),
            send=lambda device, env: self.to_devices.append((device, env)), publish_status=lambda body: None,
            bytes_sent=lambda: 0, on_fatal=lambda reason, stop=False: None))
        self.agents = {d: _device(i, 100.0 if d == OUTSIDE else 1.0) for d, i in identities.items()}
        chosen = job.next_participants(set(identities))
        assert sorted(chosen) == sorted(identities)
        self.runner._open_round(chosen, time.monotonic())
        self.round = job.round

    def deliver(self) -> list[str]:
        """Every message for the devices delivered (signed by the aggregator, as on the wire), and
        every answer back to the runner or the job; the types of what the devices answered."""
        answered = []
        sends, self.to_devices = self.to_devices, []
        for device, env in sends:
            self.agents[device]._handle(("inbox", encode(env, signer=AGGREGATOR.sign)))
        for device, agent in self.agents.items():
            for env in (decode(encode(e)) for e in agent.link.take()):
                answered.append(env.type)
                if env.type == M.DECLINE:           # the service's _on_result
                    ref, _ = M.parse_result_ref(env)
                    self.runner.handle(self.a.rounds[ref.round], Declined(device, env.body["reason"], ref.task))
                else:                                # the service's _on_protocol
                    self.to_devices += self.a.job.on_protocol(device, env, time.monotonic())
        return answered

    def protocol_tick(self) -> None:
        self.to_devices += self.a.job.on_protocol_tick(time.monotonic())


def test_a_member_whose_input_cannot_enter_the_round_declines_and_the_first_phase_closes_at_once(tmp_path):
    service = Service(tmp_path)
    job, started = service.a.job, time.monotonic()
    assert service.deliver() == []                  # the tasks: statistics computed, sessions opened, nothing sent
    outside = service.agents[OUTSIDE].protocol_handlers[SECAGG_TYPE]
    [client] = outside.sessions.values()
    service.protocol_tick()                         # the RoundStart to every member
    assert [type(from_envelope(env)) for _, env in service.to_devices] == [RoundStart] * 5
    budget = job._clock.closes_at                   # the first phase's: half the round at least
    assert budget - started >= job.config.round_timeout_s / 2 * 0.9
    answered = service.deliver()
    # the first phase closed at once, long before its budget (it waited there for the silent member)
    assert job.secure.phase is Phase.SHARE_KEYS
    assert time.monotonic() - started < (budget - started) / 4
    # the others advertised their keys; the member whose input does not fit declined its task
    assert sorted(answered) == [M.DECLINE] + [SECAGG_TYPE] * 4
    assert service.a.rounds[service.round].declined == {OUTSIDE: INPUT_DOES_NOT_FIT}
    # ... and the key directory is out to the others
    directories = [(d, from_envelope(env)) for d, env in service.to_devices]
    assert sorted(d for d, m in directories if isinstance(m, KeyDirectory)) == sorted(set(service.agents) - {OUTSIDE})
    # the device left the round: its client aborted, no secret held, its session forgotten
    assert client.state is ClientState.ABORTED and secrets_held(client) == [] and outside.sessions == {}
    assert service.agents[OUTSIDE].stats.tasks_declined == 1
    # the others' round goes on to its sum, without the member that left
    settled = None
    while settled is None and service.to_devices:
        service.deliver()
        settled = job.settled(service.round)
    assert sorted(settled) == sorted(set(service.agents) - {OUTSIDE})


def test_a_replayed_round_start_costs_nothing_and_a_device_outside_an_agent_names_no_task(tmp_path):
    """The round is left at its first RoundStart: the same message again finds no session (no
    second decline for a replayer to draw). A session opened outside an agent (no task under way)
    is left the same way, with nothing to decline."""
    service = Service(tmp_path)
    service.deliver()
    service.protocol_tick()
    start = next(env for d, env in service.to_devices if d == OUTSIDE)
    service.deliver()
    agent = service.agents[OUTSIDE]
    agent._handle(("inbox", encode(start, signer=AGGREGATOR.sign)))
    assert agent.link.take() == [] and agent.stats.tasks_declined == 1

    secure = agent.protocol_handlers[SYNC_KIND]
    params, _ = service.a.job.task_for(OUTSIDE)
    with working_until(time.time() + 600):         # no task named: what a test or a bench runs
        assert secure.on_task("leave", service.round, params, {}) == []
    [client] = secure.sessions.sessions.values()
    assert secure.sessions.on_message(start) == []
    assert client.state is ClientState.ABORTED and secure.sessions.sessions == {}


@pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))
@pytest.mark.parametrize("cause", ["bound", "non-finite", "length", "ring"])
def test_the_python_and_the_java_device_leave_a_round_their_input_does_not_fit_with_the_same_decline(tmp_path, cause):
    """The same RoundStart (signed by the aggregator) to a Python device and to the Java device
    (SecAggSessions over its bridge, tests/java_device/SecAggBridge.java), each holding an input the
    round cannot take: a value beyond the bound, a NaN, one entry too many, or distributed-DP noise
    (the 64-bit ring) in a 32-bit round. Each leaves the round (no secret held, no round open) and
    declines its task in the same words; the RoundStart again costs nothing."""
    seed = os.urandom(32)
    identities = {**{d: DeviceIdentity.generate(d) for d in ("dev-py0", "dev-py1", "dev-py2")},
                  JAVA: DeviceIdentity.from_private_bytes(JAVA, seed)}
    m, bound = 8, 50.0
    config = RoundConfig.create(job_id="job", round_id=3, group_id="g3", aggregator_id="aggregator",
                                members=list(identities), vector_length=m, bound=bound,
                                ring_bits=32 if cause == "ring" else 64)
    vector = np.linspace(-bound, bound, m + (cause == "length"))
    vector[1] = {"bound": 2 * bound, "non-finite": np.nan}.get(cause, vector[1])
    dp = cause == "ring"
    start = RoundStart(job_id="job", round_id=3, group_id="g3", sender="aggregator", recipient=JAVA,
                       config=config).signed(BRIDGE_AGGREGATOR)
    ref = M.TaskRef("job", 3, "t-1")

    sessions = SecAggSessions(JAVA)
    sessions.open(("job", 3, "g3"), ClientSecAgg(identities[JAVA], "aggregator", BRIDGE_AGGREGATOR.public_key_bytes,
                                                 job_id="job", round_id=3, group_id="g3", input_vector=vector,
                                                 ring_bits=RING_BITS if dp else None), task=ref)
    [decline] = sessions.on_message(to_envelope(start))
    assert M.parse_result_ref(decline)[0] == ref and decline.body["reason"] == INPUT_DOES_NOT_FIT
    assert sessions.sessions == {} and sessions.on_message(to_envelope(start)) == []

    java = JavaClient(seed, config, vector, tmp_path, dp=dp, task=ref.task)
    try:
        assert java.handle(start) == [] and java.state is ClientState.ABORTED
        assert java.declines == [f"job 3 t-1 {INPUT_DOES_NOT_FIT}"]
        assert java.handle(start) == [] and len(java.declines) == 1         # the round is left: no session
        assert java.tick(0.0) == (False, 0)                                 # no secret held, no round open
    finally:
        java.close()
