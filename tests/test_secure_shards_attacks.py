"""Modified devices in a secure job on shards, over a real mosquitto with real SecAgg, handled as one
aggregator handles them: a device sending undecryptable share rows is named by the host, left out
of later rounds by the coordinator, with the same model bytes; a forged count slot fails the
coordinator's group-sum check and the group is discarded, nothing applied."""

import json

from edge_client.tasks.secure_fedavg_training import SecureScaffoldTraining
from protocols.payloads.secagg import SECAGG_TYPE

from ops_fleet import SecureKeys
from secure_shard_runs import (DEVICES, SHARDS, STATEFUL, assert_same_bytes, device_states, outputs, run_secure,
                               state_feature_handlers)


def test_a_device_sending_undecryptable_share_rows_is_left_out_on_shards_as_by_one_aggregator(tmp_path):
    """dev03 flips every share row it sends. Round 1 (all six, hosted by shard 1): the other five
    accuse it, the host names it and fails the round at the unmasking; the coordinator learns the
    name with the outcome and leaves dev03 out of rounds 2 and 3, as one aggregator does: the
    same failure, the same contributors, the same model bytes."""
    from protocols.payloads.secagg import SECURE_FEDAVG_KIND
    from test_secagg_share_accusation_over_mqtt import CorruptingSessions

    def attacker(device, protocol):
        if device == "dev03":
            sessions = CorruptingSessions(protocol[SECURE_FEDAVG_KIND].identity)
            protocol[SECURE_FEDAVG_KIND].sessions = protocol[SECAGG_TYPE] = sessions
        return protocol

    keys = SecureKeys.create(tmp_path, DEVICES)
    fields = {"rounds": 3, "clients_per_round": len(DEVICES), "local_epochs": 1, "max_abs_param": 50.0}
    runs = []
    for name, extra in (("one", ()), ("sharded", SHARDS)):
        (tmp_path / name).mkdir()
        rc, log = run_secure(tmp_path / name, keys, "fedavg-secure", extra, secure=attacker, **fields)
        assert rc == 0, log[-3000:]
        assert "dev03 sent share rows a majority of their recipients could not decrypt" in log, log[-3000:]
        runs.append(outputs(tmp_path / name / "out", ("model.npz",)))
    (want, want_results), (got, results) = runs
    for r in (want_results, results):
        rounds = {e["round"]: e for e in r["rounds"]}
        assert "could not decrypt: dev03" in rounds[1]["secure_failure"] and rounds[1]["accepted"] == []
        assert [sorted(rounds[k]["accepted"]) for k in (2, 3)] == [DEVICES[1:]] * 2
    assert results["contributed"] == want_results["contributed"] and "dev03" not in results["contributed"]
    assert_same_bytes(got, want)


class InflatedCount(SecureScaffoldTraining):
    """Modified device code: its honest [n·y | clip(Δc) | n] with the count slot forged to twice
    what the whole fleet may hold (within SecAgg's fixed-point bound, so only the group-sum check
    can catch it: Σ n_k > |S| · max_samples; test_secure_stateful's "inflated count" attack)."""

    def vector(self, params, tensors):
        vector = super().vector(params, tensors)
        vector[-1] = 2 * len(DEVICES) * params["max_samples"]
        return vector


def test_a_forged_count_slot_is_discarded_on_shards_as_by_one_aggregator(tmp_path):
    """Secure Scaffold, one round of all six devices on shard 1, dev08 (shard 1's bucket) forging
    its count slot. The host unmasks the sum; the coordinator's job checks it (``group_summed``:
    the count and the mean, then Σ Δc) before anything is kept, as one aggregator does: the
    group is discarded with the reason, and neither w nor c nor the counts move (the job's only
    round summed nobody: it ends failed, saying so)."""
    from aggregator.jobs.registry import build_job
    from protocols.payloads.secagg import SECURE_SCAFFOLD_KIND

    def forger(device, protocol):
        if device == "dev08":
            honest = protocol[SECURE_SCAFFOLD_KIND]
            protocol[SECURE_SCAFFOLD_KIND] = InflatedCount(honest.identity, honest.aggregator_public_key,
                                                           honest.training, honest.sessions)
        return protocol

    keys, workdir = SecureKeys.create(tmp_path, DEVICES), tmp_path / "sharded"
    fields = {**STATEFUL["scaffold-secure"], "rounds": 1, "clients_per_round": len(DEVICES), "local_epochs": 1,
              "max_abs_param": 50.0}
    rc, log = run_secure(workdir, keys, "scaffold-secure", SHARDS, state_feature_handlers, forger, **fields)
    assert rc == 1 and "job ops failed: no device contributed" in log, log[-3000:]
    assert "secure round 1: group sum discarded: the group's Σ n_k = " in log and "rejected message" not in log
    (got,), results = outputs(workdir / "out", ("model.npz",))
    assert results["contributed"] == {} and results["state"] == "failed"
    (entry,) = results["rounds"]
    assert entry["secure_failure"].startswith("group sum out of bound: the group's Σ n_k = ")
    initial = build_job("scaffold-secure", json.loads((workdir / "job.json").read_text())).model_arrays()
    assert_same_bytes([{k: got[k] for k in initial}], [initial])        # w and c as they started
    assert device_states(workdir)                                       # the members did train
