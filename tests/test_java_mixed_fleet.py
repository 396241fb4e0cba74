"""A mixed fleet over mosquitto: Java and Python devices in one FedAvg(ψ) job (then a
personalization job of its head), and in one secure FedAvg(ψ) job, all of them in every round, give
the head of an in-process replay in which Python devices hold the Java devices' data."""

from __future__ import annotations

import os

import numpy as np
import pytest

import java_build
from aggregator.service.settings import ServiceSettings
from java_tasks import (C, D, HEAD_ATOL, JAVA_IDS, PY_IDS, device_data, java_cp,  # noqa: F401 (java_cp: a fixture)
                        personal_data, serve, start_java_devices, stop_mixed_fleet, two_rounds_done)

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))


def test_mixed_java_and_python_fleet_runs_fedavg_head_then_personalization(java_cp, broker, tmp_path):
    """Three Java devices (one JVM) and two Python devices in one FedAvg(ψ) job over mosquitto,
    all five in each of 3 rounds: every device contributes every round, and the final head equals
    an in-process replay of the same rounds in which Python devices hold the Java devices' data.
    Then a personalization job (OLL + FP(ψ)) of that head: every device reports, and each Java
    device's report is what the Python device computes on its data."""
    from ops_fleet import Features, replay_round

    from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob
    from aggregator.jobs.personalize import PersonalizeConfig, PersonalizeJob
    from edge_client.agent import DeviceAgent
    from edge_client.tasks.head_training import HeadTrainingTask
    from edge_client.tasks.personalization import PersonalizeTask
    from protocols.mqtt_link import BrokerConfig

    ids = JAVA_IDS + PY_IDS
    cfg = dict(job_id="ft-mixed", num_classes=C, feature_dim=D, rounds=3, clients_per_round=len(ids),
               round_timeout_s=60, local_epochs=2, batch_size=8, client_lr=0.05, expected_devices=len(ids),
               start_timeout_s=30, seed=5)
    job = FedAvgJob(FedAvgConfig(**cfg))
    fedavg = serve(job, broker.url, tmp_path / "fedavg", ids)
    jvm = start_java_devices(java_cp, broker.url, tmp_path, [])
    tasks = {d: HeadTrainingTask(*device_data(i), lambda b, s, w: Features(D)) for i, d in enumerate(ids)}
    personalize = {d: PersonalizeTask(*device_data(i), *personal_data(50 + i, 30, list(range(C))),
                                      lambda b, s, w: Features(D)) for i, d in enumerate(ids)}
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url),
                          {"fedavg.head": tasks[d], "oll.personalize": personalize[d]}).start() for d in PY_IDS]
    try:
        fedavg["thread"].join(120)
        result = fedavg["result"]
        assert result.get("state") == "done" and len(result["rounds"]) == 3, result
        assert all(sorted(r["accepted"]) == sorted(ids) for r in result["rounds"]), result["rounds"]
        pjob = PersonalizeJob(PersonalizeConfig(job_id="oll-mixed", num_classes=C, feature_dim=D, fp_epochs=4,
                                                batch_size=16, fp_lrs=[0.001, 0.01], fp_folds=3,
                                                clients_per_round=len(ids), expected_devices=len(ids),
                                                start_timeout_s=30, round_timeout_s=60),
                              head={k: job.params[k].astype(np.float32) for k in ("weight", "bias")})
        personal = serve(pjob, broker.url, tmp_path / "oll", ids)
        personal["thread"].join(120)
        assert personal["result"].get("state") == "done", personal["result"]
    finally:
        out, err = stop_mixed_fleet(agents, jvm)
    assert jvm.returncode == 0, err[-3000:]
    for d in JAVA_IDS:
        assert f"STATS {d} done=4 declined=0" in out, (out, err[-3000:])

    replay = FedAvgJob(FedAvgConfig(**cfg))
    for r in result["rounds"]:
        chosen = replay.next_participants(set(ids))
        assert chosen == sorted(r["accepted"])
        replay_round(replay, chosen, tasks)
    for k in ("weight", "bias"):
        assert np.abs(job.params[k] - replay.params[k]).max() <= HEAD_ATOL, k
    assert not np.allclose(job.params["weight"], FedAvgJob(FedAvgConfig(**cfg)).params["weight"])   # it trained

    assert sorted(pjob.contributed) == sorted(ids)
    params, head = pjob.task_for("java0")
    for d in JAVA_IDS:          # what a Python device on the Java device's data reports
        body, _ = personalize[d](params, head)
        assert pjob.contributed[d] == body, d


def test_mixed_java_and_python_fleet_runs_secure_fedavg(java_cp, broker, tmp_path):
    """Secure FedAvg(ψ): Java and Python devices in one SecAgg group per round (the SecAgg messages
    signed by each device's key, the tasks by the aggregator's); the aggregator sees only masked vectors and its head equals a plain in-process FedAvg
    replay over the devices in each sum. One Java device's features are huge, so its trained head
    breaks the round's max_abs_param: it declines and the rounds go on without it."""
    from ops_fleet import Features, RecordingService, replay_round, start_secure_fedavg_agents

    from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob
    from aggregator.jobs.secure_fedavg import SecureFedAvgConfig, SecureFedAvgJob
    from aggregator.jobs.robustness_fields import PLAIN_MEAN
    from edge_client.tasks.head_training import HeadTrainingTask
    from protocols.identity import DeviceIdentity, IdentityRegistry
    from protocols.payloads.secagg import SECURE_FEDAVG_KIND

    ids, outlier = JAVA_IDS + PY_IDS, "java2"
    seeds = {d: os.urandom(32) for d in JAVA_IDS}
    keys = {**{d: DeviceIdentity.from_private_bytes(d, s) for d, s in seeds.items()},
            **{d: DeviceIdentity.generate(d) for d in PY_IDS}}
    agg = DeviceIdentity.generate("aggregator")
    plain = dict(job_id="sft-mixed", num_classes=C, feature_dim=D, rounds=2, clients_per_round=len(ids),
                 round_timeout_s=60, local_epochs=2, batch_size=8, client_lr=0.05, expected_devices=len(ids),
                 start_timeout_s=30, seed=4)
    job = SecureFedAvgJob(SecureFedAvgConfig(**plain, max_samples=100, max_abs_param=20.0, phase_timeout_s=4),
                          identity=agg, registry=IdentityRegistry({d: k.public_key_bytes for d, k in keys.items()}))
    service = RecordingService(job, broker.url, tmp_path / "out", set(ids),
                               ServiceSettings(evaluate_every_contribution=False), identity=agg)
    scale = {outlier: 1000.0}
    jvm = start_java_devices(java_cp, broker.url, tmp_path, ["--aggregator-key", agg.public_key_bytes.hex()],
                             seeds=seeds, scale=scale)
    tasks = {d: HeadTrainingTask(device_data(i)[0] * scale.get(d, 1.0), device_data(i)[1],
                                 lambda b, s, w: Features(D)) for i, d in enumerate(ids)}
    agents = start_secure_fedavg_agents(broker.url, {d: keys[d] for d in PY_IDS}, agg.public_key_bytes,
                                        SECURE_FEDAVG_KIND, {d: tasks[d] for d in PY_IDS})
    result, out = two_rounds_done(service, job, agents, jvm)
    # the secure sum is FedAvg's plain mean of the accepted updates: the replay bounds nothing
    replay = FedAvgJob(FedAvgConfig(**plain, **PLAIN_MEAN))
    for r in result["rounds"]:
        chosen = replay.next_participants(set(ids))
        assert sorted(r["accepted"]) == sorted(set(ids) - {outlier}) == sorted(set(chosen) - {outlier}), r
        replay_round(replay, sorted(r["accepted"]), tasks)
    for k in ("weight", "bias"):
        assert np.abs(job.params[k] - replay.params[k]).max() <= HEAD_ATOL, k
    received = service.received_envelopes()
    assert {env.type for env in received} <= {"secagg", "decline", "presence"}   # no head in the clear
    masked = {env.sender for env in received if env.type == "secagg" and env.body["secagg"]["type"] == "secagg.masked_input"}
    assert masked == set(ids) - {outlier}
    declines = [env for env in received if env.type == "decline" and env.sender == outlier]
    assert len(declines) == 2 and all("> the round's bound 20" in env.body["reason"] for env in declines)
    assert f"STATS {outlier} done=0 declined=2" in out, out

