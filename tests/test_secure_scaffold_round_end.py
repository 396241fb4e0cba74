"""Secure Scaffold: a device keeps its c_k⁺ only when its secure round FINISHED on it
(``SecureScaffoldTraining.round_end``, told by ``SecAggSessions`` when a session ends).

The plain handler stores c_k⁺ as it trains, before the SecAgg round decides whether the device's
masked input is summed. A round that leaves the device's input out of the sum (its masked input
lost, so the aggregator declares it dropped; the aggregator aborting the round) never adds its Δc to
the server's c, so the device must keep the c_k it started from: else c drifts from the mean of
the devices' c_k (Scaffold's invariant, docs/algorithms.md). The references here are independent
of the device code under test: that invariant (c = Σ_k c_k / N, N = total_devices, every device
chosen each round and no Δc clipped) and a plain Scaffold device that never saw the left round.
In process, the real SecAgg client and server (tests/stateful_jobs.py)."""

import time

import numpy as np
import pytest

from edge_client.state import DeviceStateStore
from edge_client.tasks.scaffold_training import ScaffoldTrainingTask
from edge_client.tasks.secure_fedavg_training import SecureScaffoldTraining
from edge_client.work_deadline import working_until
from protocols.envelope import decode, encode
from protocols.payloads.scaffold import KIND as SCAFFOLD_KIND
from protocols.rounds import RoundClosed

from stateful_jobs import run_secure_round
from test_secure_stateful import DEVICES, EXTRACTOR, GRID, HEAD, keys, local_data, plain_handler, secure_job  # noqa: F401

ENDS = time.time() + 3600       # the tasks' rounds are surely over then (the agent runs them until it)
N = len(DEVICES)


class RecordedDevice(SecureScaffoldTraining):
    """A secure Scaffold device whose tasks are kept (to replay on a plain device), run until
    ``ENDS`` as the agent runs them; with ``lose_input`` its masked input never reaches the aggregator."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tasks, self.lose_input = [], False

    def on_task(self, job, round_, params, tensors=None):
        self.tasks.append((params, tensors))
        with working_until(ENDS):
            return super().on_task(job, round_, params, tensors)

    def on_message(self, env):
        replies = super().on_message(env)
        if self.lose_input:
            return [r for r in replies if r.body["secagg"]["type"] != "secagg.masked_input"]
        return replies


def fleet(tmp_path, keys):
    """Every device chosen each round (κ = N = total_devices) and Δc never clipped: c = Σ c_k / N."""
    job = secure_job(SCAFFOLD_KIND, tmp_path, keys, clients_per_round=N, total_devices=N, control_clip_norm=1e3)
    clients = {d: RecordedDevice(keys.devices[d], keys.aggregator.public_key_bytes,
                                 plain_handler(SCAFFOLD_KIND, i, tmp_path / "secure")) for i, d in enumerate(DEVICES)}
    return job, clients


def controls(clients) -> dict[str, dict[str, np.ndarray]]:
    """Each device's stored c_k (absent: 0)."""
    out = {}
    for d, client in clients.items():
        entry = client.training.store.load("sec", None)
        out[d] = {k: (np.zeros(1, np.float32) if entry is None else entry.arrays[k]) for k in HEAD}
    return out


def assert_c_is_the_mean_of_the_devices_controls(job, clients):
    held = controls(clients)
    for k in HEAD:
        mean = sum(held[d][k].astype(np.float64) for d in DEVICES) / N
        np.testing.assert_allclose(job.control[k], mean, rtol=0, atol=10 * GRID)
    assert np.abs(job.control["weight"]).max() > 1000 * GRID      # c moved: the check is not 0 = 0


def assert_same_entry(kept, want):
    assert (kept.run, kept.round, sorted(kept.arrays)) == (want.run, want.round, sorted(want.arrays))
    for name, value in want.arrays.items():
        assert kept.arrays[name].tobytes() == value.tobytes(), name


@pytest.mark.parametrize("ends", ["at the next round's task", "at its deadline"])
def test_a_device_whose_masked_input_is_not_summed_keeps_the_control_it_started_from(tmp_path, keys, ends):
    """Round 2: one device's masked input is lost, the aggregator sums the other four. Its session
    ends (its next task, or its deadline on the agent's tick) without FINISHED: its c_k goes back to
    round 1's, byte for byte, and c stays the mean of the c_k; the four others, whose rounds
    finished, hold their c_k⁺. Round 3 measures its Δc from round 1's c_k: its c_k then equals that
    of a plain device that skipped round 2. Before, it kept round 2's c_k⁺ and c drifted."""
    job, clients = fleet(tmp_path, keys)
    assert len(run_secure_round(job, clients)) == N
    assert_c_is_the_mean_of_the_devices_controls(job, clients)
    after_first = {d: c.training.store.load("sec", None) for d, c in clients.items()}

    lost = DEVICES[1]
    clients[lost].lose_input = True
    survivors = run_secure_round(job, clients)
    assert lost not in survivors and len(survivors) == N - 1
    clients[lost].lose_input = False
    for d in survivors:             # finished: c_k⁺ kept
        assert clients[d].training.store.load("sec", None).round == after_first[d].round + 1
    assert len(clients[lost].sessions.sessions) == 1     # still waits for an unmask request that never comes
    if ends == "at its deadline":
        clients[lost].sessions.expire(ENDS + 1)         # the agent's tick
        assert clients[lost].sessions.sessions == {}
        assert_same_entry(clients[lost].training.store.load("sec", None), after_first[lost])
        assert_c_is_the_mean_of_the_devices_controls(job, clients)

    assert len(run_secure_round(job, clients)) == N
    assert_c_is_the_mean_of_the_devices_controls(job, clients)
    skipped = ScaffoldTrainingTask(*local_data(1), lambda *a, **k: EXTRACTOR, DeviceStateStore(tmp_path / "skipped"))
    for params, tensors in (clients[lost].tasks[0], clients[lost].tasks[2]):
        skipped(params, tensors)
    assert_same_entry(clients[lost].training.store.load("sec", None), skipped.store.load("sec", None))


def test_a_round_the_aggregator_aborts_leaves_every_members_control_where_it_was(tmp_path, keys):
    """Round 2 is given up (its deadline) after the members' shares went out: the abort notices
    reach the members, whose c_k all go back to round 1's; c, which never moved, is still their mean."""
    job, clients = fleet(tmp_path, keys)
    run_secure_round(job, clients)
    after_first = {d: c.training.store.load("sec", None) for d, c in clients.items()}
    control = {k: v.copy() for k, v in job.control.items()}

    chosen = job.next_participants(set(clients))
    for d in chosen:
        clients[d].on_task("sec", job.round, *job.task_for(d))
    pending = job.on_protocol_tick(0.0)
    for _ in range(2):              # the keys advertised, the shares sent
        pending = [out for device, env in pending for reply in clients[device].on_message(decode(encode(env)))
                   for out in job.on_protocol(device, decode(encode(reply)), 0.0)]
    assert all(clients[d].training.store.load("sec", None).round == after_first[d].round + 1 for d in chosen)
    job.abort_secure_round(job.round, "deadline")
    for device, env in job.on_protocol_tick(0.0):
        assert clients[device].on_message(decode(encode(env))) == []
    job.close_round(RoundClosed(job.round, (), tuple(chosen), (), ()))

    for d in DEVICES:
        assert clients[d].sessions.sessions == {}
        assert_same_entry(clients[d].training.store.load("sec", None), after_first[d])
    for k in HEAD:
        np.testing.assert_array_equal(job.control[k], control[k])
    assert_c_is_the_mean_of_the_devices_controls(job, clients)
