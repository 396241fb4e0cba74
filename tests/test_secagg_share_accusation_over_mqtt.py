"""A device that sends share rows nobody can decrypt, in a secure FedAvg job over mosquitto.

Before ShareAccusation, every member it was grouped with sat out silently: its rounds failed, and
nobody could tell the aggregator who caused it, so it could do so every round it was drawn into.
Now each member that cannot decrypt a row names its sender (``secagg.share_accusation``) and goes
on; a sender accused by a majority of its recipients is a culprit (``ServerSecAgg.culprits``),
which the job leaves out of its later rounds: the attacker costs the job one round, and the
rounds after it equal a plain FedAvg replay over the honest devices."""

import dataclasses

import numpy as np

from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from aggregator.jobs.secure_fedavg import SecureFedAvgConfig, SecureFedAvgJob
from aggregator.service.settings import ServiceSettings
from edge_client.tasks.secure_fedavg_training import SecureFedAvgTraining
from edge_client.tasks.secure_update import SecAggSessions
from ops_fleet import DeviceAgent, RecordingService, in_memory_keys, replay_round
from protocols.identity import DeviceIdentity
from protocols.mqtt_link import BrokerConfig
from protocols.rounds import RoundClosed
from protocols.payloads.secagg import SECAGG_TYPE, SECURE_FEDAVG_KIND, from_envelope, to_envelope
from protocols.secagg import EncryptedShares
from test_fedavg_secure_over_mqtt import C, D, device_task

ATTACKER = "dev0"


class CorruptingSessions(SecAggSessions):
    """A device whose every share row is flipped after encryption, its message validly re-signed:
    no recipient can decrypt what it sends, and the signature says it sent exactly that."""

    def __init__(self, identity: DeviceIdentity):
        super().__init__(identity.device_id)
        self.identity = identity

    def on_message(self, env):
        return [self._corrupt(out) for out in super().on_message(env)]

    def _corrupt(self, env):
        message = from_envelope(env)
        if not isinstance(message, EncryptedShares):
            return env
        ciphertexts = message.ciphertexts.copy()
        ciphertexts[:, 20] ^= 0xFF
        changed = dataclasses.replace(message, ciphertexts=ciphertexts, signature=b"")
        return to_envelope(changed.signed(self.identity))


def test_a_device_sending_undecryptable_shares_is_named_and_left_out_of_later_rounds(broker, tmp_path):
    ids = [f"dev{i}" for i in range(6)]
    identities, agg, registry = in_memory_keys(ids)
    plain = dict(job_id="accusation", num_classes=C, feature_dim=D, rounds=3, clients_per_round=5,
                 round_timeout_s=60, local_epochs=2, batch_size=8, client_lr=0.05, expected_devices=6, seed=4)
    job = SecureFedAvgJob(SecureFedAvgConfig(**plain, max_samples=100, max_abs_param=20.0, phase_timeout_s=3),
                          identity=agg, registry=registry)
    service = RecordingService(job, broker.url, tmp_path, set(ids), ServiceSettings(evaluate_every_contribution=False))
    tasks = {d: device_task(i) for i, d in enumerate(ids)}
    agents = []
    for device, task in tasks.items():
        sessions = CorruptingSessions(identities[device]) if device == ATTACKER else SecAggSessions(device)
        secure = SecureFedAvgTraining(identities[device], agg.public_key_bytes, task, sessions, kind=SECURE_FEDAVG_KIND)
        agents.append(DeviceAgent(device, BrokerConfig.from_url(broker.url), {},
                                  protocol_handlers={SECURE_FEDAVG_KIND: secure, SECAGG_TYPE: sessions}).start())
    try:
        result = service.join(150)
    finally:
        for a in agents:
            a.stop()
    assert result.get("state") == "done", result
    # the attacker's round failed as its masked phase closed (nobody held a share of its self-mask
    # seed, so no unmasking could succeed), naming it: every other member of the round accused it
    [(failed_round, reason)] = job.failed_rounds
    assert f"could not decrypt: {ATTACKER}" in reason and reason.startswith("masked_input"), reason
    assert job.culprits == {ATTACKER}
    accusations = [env.body["secagg"] for env in service.received_envelopes()
                   if env.type == SECAGG_TYPE and env.body["secagg"]["type"] == "secagg.share_accusation"]
    assert len(accusations) == 4 and all(a["accused"] == [ATTACKER] for a in accusations)
    # every later round: the five honest devices, summed; the model is the plain replay of those rounds
    summed = [r for r in result["rounds"] if r["accepted"]]
    assert len(summed) == 2 and all(sorted(r["accepted"]) == ids[1:] for r in summed)
    assert all(r["round"] > failed_round for r in summed)
    replay = FedAvgJob(FedAvgConfig(**plain, **PLAIN_MEAN))       # the same seeded draws
    assert failed_round == 1 and ATTACKER in replay.next_participants(set(ids))
    replay.close_round(RoundClosed(1, (), (), (), ()))             # the failed round: nothing applied
    for r in summed:
        assert sorted(replay.next_participants(set(ids) - {ATTACKER})) == ids[1:]
        replay_round(replay, ids[1:], tasks)
    for k in ("weight", "bias"):
        np.testing.assert_allclose(job.params[k], replay.params[k], rtol=0, atol=1e-6)
