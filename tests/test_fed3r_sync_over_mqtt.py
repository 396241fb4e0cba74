"""Fed3R-Sync end to end over mosquitto: devices' statistics are summed under SecAgg, the
aggregator sees only masked vectors and group sums, one device drops out mid-round, and the
classifier equals centralized ridge over the surviving devices' data."""

import time

import numpy as np
import pytest
from ops_fleet import Features, RecordingService, in_memory_keys
from sklearn.linear_model import Ridge

from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from edge_client.agent import AgentHooks, DeviceAgent, DroppedOut
from edge_client.tasks.fed3r_stats import Fed3RStatsTask
from edge_client.tasks.secure_fed3r import SecureFed3R
from protocols.identity import DeviceIdentity, IdentityRegistry
from protocols.mqtt_link import BrokerConfig
from protocols.payloads.secagg import SECAGG_TYPE, SYNC_KIND

D, C, N = 5, 3, 40


def device_data(i):
    rng = np.random.default_rng(100 + i)
    return rng.uniform(0, 6, size=(N, D)).astype(np.float32), rng.integers(0, C, N)


def run_sync_job(broker, tmp_path, dropper: str, devices: int = 8, **cfg_over):
    """A Fed3R-Sync job over mosquitto whose ``dropper`` leaves for good after computing; returns
    (result, job, service, device ids)."""
    ids = [f"dev{i}" for i in range(devices)]
    identities, agg, registry = in_memory_keys(ids)
    cfg = Fed3RSyncConfig(**{**dict(job_id="sync", num_classes=C, feature_dim=D, clients_per_round=4,
                                    expected_devices=devices, round_timeout_s=60, phase_timeout_s=3,
                                    max_samples=100, max_attempts=1), **cfg_over})
    job = Fed3RSyncJob(cfg, identity=agg, registry=registry)
    # records everything the aggregator receives on device outboxes
    service = RecordingService(job, broker.url, tmp_path, set(ids), timeout_s=120)

    def drop(elapsed):
        raise DroppedOut()

    agents = []
    for i, d in enumerate(ids):
        imgs, labels = device_data(i)
        stats = Fed3RStatsTask(imgs, labels, lambda b, s, w: Features(D))
        handler = SecureFed3R(identities[d], agg.public_key_bytes, stats)
        hooks = AgentHooks(after_compute=drop, offline_after_dropout_s=600) if d == dropper else AgentHooks()
        agents.append(DeviceAgent(d, BrokerConfig.from_url(broker.url), {}, hooks=hooks,
                                  protocol_handlers={SYNC_KIND: handler, SECAGG_TYPE: handler}).start())
    result = service.join(120)
    for a in agents:
        a.stop()
    return result, job, service, ids


def assert_centralized_ridge(job, ids, survivors):
    """The classifier equals centralized ridge on the survivors' data (independent: sklearn, bias as a column)."""
    Z = np.vstack([device_data(ids.index(d))[0] for d in survivors]).astype(np.float64)
    y = np.concatenate([device_data(ids.index(d))[1] for d in survivors])
    Za = np.hstack([Z, np.ones((len(Z), 1))])
    W_ref = Ridge(alpha=job.config.lam, fit_intercept=False, solver="cholesky").fit(Za, np.eye(C)[y]).coef_.T
    W = job.strategy.solve().raw_weights_
    assert np.linalg.norm(W - W_ref) / np.linalg.norm(W_ref) <= 1e-6


def test_secure_fed3r_sync_equals_centralized_ridge_over_survivors(broker, tmp_path):
    dropper = "dev5"
    result, job, service, ids = run_sync_job(broker, tmp_path, dropper)
    assert result.get("state") == "done", result
    survivors = sorted(result["contributed"])
    assert dropper not in survivors and len(survivors) == 7
    assert_centralized_ridge(job, ids, survivors)
    # the aggregator never received a plain statistics vector: no float64 A_upper tensor ever arrived
    from protocols.chunking import MessageAssembler
    asm = MessageAssembler()
    kinds = set()
    for p in service.seen:
        try:
            env = asm.feed(p)
        except Exception:
            continue
        if env is not None:
            kinds.add(env.type)
            assert "A_upper" not in env.tensors
    assert SECAGG_TYPE in kinds and "result" not in kinds


def test_a_secure_round_stops_waiting_for_an_offline_member_and_no_straggler_is_left_out(broker, tmp_path):
    """Phases of 120 s: a member that went offline (its presence said so) is not waited for, so
    the job ends long before one phase timeout; groups of 3 of 8 devices leave 2 for a last group,
    too few to sum securely: they join the group before, so every device but the one gone
    contributes exactly once."""
    t0 = time.monotonic()
    result, job, _, ids = run_sync_job(broker, tmp_path, "dev2", clients_per_round=3, phase_timeout_s=120,
                                       round_timeout_s=300)
    assert result.get("state") == "done" and time.monotonic() - t0 < 60, (result.get("state"), time.monotonic() - t0)
    survivors = sorted(result["contributed"])
    assert survivors == [d for d in ids if d != "dev2"], survivors
    assert len(job.group_samples) == 2 and sum(job.group_samples) == 7 * N      # groups of 3 and 5
    assert_centralized_ridge(job, ids, survivors)


def test_secure_jobs_need_checkpoints_to_run_with_a_durable_store(tmp_path):
    """Without checkpoints a restart would have to replay per-device results, which a secure job
    never has: refuse that combination instead of pretending (with checkpoints: see
    test_crash_recovery.py::test_secure_fed3r_sync_job_survives_sigkill)."""
    from aggregator.storage.store import Store

    ids = ["a", "b", "c"]
    reg = IdentityRegistry({d: DeviceIdentity.generate(d).public_key_bytes for d in ids})
    job = Fed3RSyncJob(Fed3RSyncConfig(job_id="s", num_classes=C, feature_dim=D, max_samples=10),
                       identity=DeviceIdentity.generate("aggregator"), registry=reg)
    with pytest.raises(TypeError, match="secure aggregation"):
        AggregatorService(job, BrokerConfig(), tmp_path, ServiceSettings(checkpoints=False),
                          store=Store(tmp_path / "s.db"))
    AggregatorService(job, BrokerConfig(), tmp_path, store=Store(tmp_path / "t.db"))     # checkpoints: accepted


def test_the_last_group_takes_the_stragglers_instead_of_leaving_too_few_for_a_group():
    """κ = 5 over 7 eligible devices would leave 2, who could never form a secure group (the job
    would end without them): the round takes all 7. Over 8 it takes 5 and leaves a group of 3."""
    ids = [f"d{i}" for i in range(8)]
    reg = IdentityRegistry({d: DeviceIdentity.generate(d).public_key_bytes for d in ids})

    def first_round(online):
        job = Fed3RSyncJob(Fed3RSyncConfig(job_id="s", num_classes=C, feature_dim=D, max_samples=10,
                                           clients_per_round=5), identity=DeviceIdentity.generate("aggregator"),
                           registry=reg)
        return job, job.next_participants(set(online))

    _, chosen = first_round(ids[:7])
    assert chosen == ids[:7]
    job, chosen = first_round(ids)
    assert len(chosen) == 5
    job.contributed.update({d: 0 for d in chosen})
    assert sorted(job.next_participants(set(ids))) == sorted(set(ids) - set(chosen))
    assert job.finished(set(ids), set(ids)) is False



def test_stragglers_that_would_pass_secaggs_largest_group_form_their_own():
    """κ = 10,000 (SecAgg's largest group) over 10,002 eligible devices: the two left over joined
    the group, 10,002 members, which RoundConfig refuses as the round opens (every try, so the job
    never summed anyone). Now the group takes 9,999 and leaves 3 for a last group; both open."""
    from protocols.secagg.config import MAX_GROUP_SIZE

    ids = [f"d{i:05d}" for i in range(MAX_GROUP_SIZE + 2)]
    key = DeviceIdentity.generate("any").public_key_bytes      # the draw reads membership, not keys
    job = Fed3RSyncJob(Fed3RSyncConfig(job_id="s", num_classes=C, feature_dim=D, max_samples=10,
                                       clients_per_round=MAX_GROUP_SIZE),
                       identity=DeviceIdentity.generate("aggregator"), registry=IdentityRegistry({d: key for d in ids}))
    chosen = job.next_participants(set(ids))
    assert len(chosen) == MAX_GROUP_SIZE - 1 and job.secure is not None      # its group opened
    job.contributed.update({d: 0 for d in chosen})
    assert sorted(job.next_participants(set(ids))) == sorted(set(ids) - set(chosen))

def test_the_last_group_waits_for_stragglers_offline_within_their_grace():
    """Six online and one eligible device offline for now (it dropped out and comes back): taking
    the six would strand it alone, so no round opens until it is back, or no longer reachable."""
    ids = [f"d{i}" for i in range(7)]
    reg = IdentityRegistry({d: DeviceIdentity.generate(d).public_key_bytes for d in ids})
    job = Fed3RSyncJob(Fed3RSyncConfig(job_id="s", num_classes=C, feature_dim=D, max_samples=10, clients_per_round=5),
                       identity=DeviceIdentity.generate("aggregator"), registry=reg)
    online = set(ids[:6])
    job.note_reachable(set(ids))                      # d6 is offline within its grace period
    assert job.next_participants(online) == [] and not job.finished(online, set(ids))
    job.note_reachable(online)                        # its grace ran out: the six go on without it
    assert job.next_participants(online) == ids[:6]
    job = Fed3RSyncJob(job.config, identity=DeviceIdentity.generate("aggregator"), registry=reg)
    job.note_reachable(set(ids))
    assert job.next_participants(set(ids)) == ids     # back online: all seven in the last group
