"""DP Fed3R on shards without sockets (``aggregator/shards/coordinator_job.py``'s
``ShardedNoisyRoundsJob``, ``fed3r_sums.round_sum``): real device results (the device library's
Fed3R task, the private center, then centred rows) fed to K shard ingests with real stores; the
coordinator's job noises the root of its shards' round sums, one aggregator's job the root of its
own stored round (``aggregator/service/canonical.py``: what the service hands it). With the same
noise draws the releases, the center and the model are the same bytes for every K, and the
released sums are the devices' statistics (summed in numpy) plus that noise."""

import numpy as np
import pytest

from aggregator.jobs.registry import build_job
from aggregator.service.canonical import hand_round_sum
from aggregator.shards.buckets import shard_of
from aggregator.shards.coordinator_job import ACCEPTED, ShardedNoisyRoundsJob
from aggregator.shards.fed3r_sums import CENTRED_CLIP, Fed3RSums
from aggregator.shards.shard import Receipt, ShardIngest
from aggregator.shards.sum_tree import root_sum
from aggregator.storage.store import Store
from protocols import messages as M
from protocols.chunking import split
from protocols.envelope import EnvelopeError, decode, encode
from protocols.payloads.fed3r import KIND
from protocols.rounds import RoundClosed
from protocols.topics import Topics

from ssp_reference import grid_tolerance, release_noise
from test_dp_fed3r_center import config as center_config, handlers

DEVICES = [f"cam-{i}" for i in range(9)]
CONFIG = center_config(job_id="dp-shards")      # 3 devices release the center, the other 6 are centred
TOPICS = Topics()


def result_of(job, handler, device: str) -> bytes:
    params, tensors = job.task_for(device)
    task = decode(encode(M.task_message("aggregator", job.config.job_id, job.round, KIND, params, 1e9)))
    body, out = handler(task.body["params"], tensors)
    env = M.result_message(device, M.TaskRef(job.config.job_id, job.round, task.id), KIND, body, out)
    env.id = f"{job.round:04x}{int(device[4:]):028x}"
    return encode(env)


def feed(shard: ShardIngest, device: str, raw: bytes) -> Receipt:
    outs = [shard.feed(TOPICS.outbox(device), part) for part in split(raw, decode(raw).id, device, chunk_size=1024)]
    assert isinstance(outs[-1], Receipt), outs[-1]
    return outs[-1]


def dense_a(stats) -> np.ndarray:
    """A device's A_k in numpy from what it sent (packed, or the factor R over columns K)."""
    p = stats.p
    if stats.r_factor is None:
        A = np.zeros((p, p))
        A[np.triu_indices(p)] = stats.a_upper
        return A + np.triu(A, 1).T
    A, K = np.zeros((p, p)), np.asarray(stats.factor_columns)
    A[np.ix_(K, K)] = stats.r_factor.T @ stats.r_factor
    return A


def run(tmp_path, shards_count: int, restart: bool = False, config: dict = CONFIG):
    """(one aggregator's job, the coordinator's, the devices' A_k of the centred round) after the job;
    ``restart``: the coordinator dies halfway through the centred round and a new one resumes as the
    service restores a job (the last close's checkpoint, the open round's bookkeeping, its receipts
    replayed), its noise generator where the dead one's stood after the center's release."""
    shards = [ShardIngest(k, shards_count, Store(tmp_path / f"k{shards_count}-s{k}.db")) for k in range(shards_count)]
    for s in shards:
        s.set_job(config["job_id"], "fed3r", config)

    def round_root(job_id, ids):
        nodes = {}
        for s in shards:
            nodes.update(s.sums(job_id, ids))
        return root_sum(Fed3RSums(), nodes)

    def round_closed(job_id, round_, accepted, earlier):
        for s in shards:
            s.drop_orphans(job_id, round_, accepted, earlier)

    single, store = build_job("fed3r", config), Store(tmp_path / f"k{shards_count}-one.db")
    single.expect_round_sums()                  # as the service with a store: nothing summed on arrival
    coordinator = ShardedNoisyRoundsJob(build_job("fed3r", config), "fed3r", round_root, round_closed)
    single.strategy.rng, coordinator.inner.strategy.rng = np.random.default_rng(5), np.random.default_rng(5)
    h, centred = handlers(DEVICES, tmp_path / "windows"), []
    for index in range(2):
        chosen = single.next_participants(set(DEVICES))
        assert coordinator.next_participants(set(DEVICES)) == chosen
        opened, receipts = coordinator.bookkeeping(), []
        for device in reversed(chosen):          # arrival order is not the canonical order
            raw = result_of(single, h[device], device)
            receipts.append((device, decode(feed(shards[shard_of(device, shards_count)], device, raw).raw)))
            coordinator.apply(device, coordinator.parse_result(receipts[-1][1]))
            if restart and index == 1 and len(receipts) == len(chosen) // 2:
                coordinator = restarted(checkpoint, opened, receipts, round_root, round_closed, config)
            stats = single.parse_result(decode(raw))
            single.apply(device, stats)
            store.add_contribution(CONFIG["job_id"], single.round, device, decode(raw).id, raw)
            if single.strategy.center.released:
                centred.append(dense_a(stats))
        closed = RoundClosed(single.round, tuple(chosen), (), (), ())
        pending = single.strategy.center.pending if single.strategy.centering else single.strategy.pending
        assert pending.n_contributions == 0         # the release is the handed sum's alone
        hand_round_sum(single, store, "fed3r", CONFIG["job_id"], single.round)       # what the service does
        single.close_round(closed)
        coordinator.close_round(closed)
        checkpoint = coordinator.state_dict(), dict(coordinator.contributed)
    return single, coordinator, centred


def restarted(checkpoint, opened: dict, receipts: list, round_root, round_closed,
              config: dict) -> ShardedNoisyRoundsJob:
    """A new coordinator brought to where the dead one was, as ``aggregator/service/recovery.py`` does."""
    job = ShardedNoisyRoundsJob(build_job("fed3r", config), "fed3r", round_root, round_closed)
    state, contributed = checkpoint
    job.load_state_dict(state)
    job.contributed = dict(contributed)
    job.restore_bookkeeping(opened)
    for device, receipt in receipts:
        job.apply(device, job.parse_result(receipt))
    job.inner.strategy.rng = np.random.default_rng(5)
    job.inner.strategy.rng.normal(size=CONFIG["feature_dim"] + 1)       # the center's draw, made before the crash
    return job


@pytest.mark.parametrize("shards_count,restart,release", [(2, False, "round"), (3, False, "round"), (2, True, "round"),
                                                          (2, False, "end"), (2, True, "end")])
def test_shards_release_dp_fed3r_rounds_as_one_aggregators_bytes(tmp_path, shards_count, restart, release):
    single, coordinator, centred = run(tmp_path, shards_count, restart, {**CONFIG, "dp_release": release})
    if release == "end":        # the centred round's sum is held exactly until the job ends, on shards too
        assert single.strategy.releases == coordinator.inner.strategy.releases == 0
        assert "accuracy" not in single.evaluate(None, None) and single.evaluate(None, None)["held_until_job_end"]
        assert single.finalize() and coordinator.finalize() and not single.finalize()
    assert single.strategy.center.released and single.strategy.releases == 1 and len(centred) == 6
    state, got = single.state_dict(), coordinator.state_dict()
    assert sorted(got) == sorted([*state, ACCEPTED])
    for name, value in state.items():
        assert got[name].tobytes() == value.tobytes(), name        # the center and the released sums
    for name, value in single.model_arrays().items():
        assert coordinator.model_arrays()[name].tobytes() == value.tobytes(), name
    assert coordinator.evaluate(None, None) == single.evaluate(None, None)
    assert coordinator.contributions == single.contributions == 6          # the center round's are not in the model
    # and right: the released A is the centred devices' Σ A_k (numpy) plus the mechanism's noise
    rng = np.random.default_rng(5)
    rng.normal(size=CONFIG["feature_dim"] + 1)                               # the center's draw came first
    p = CONFIG["feature_dim"] + 1
    mechanism = single.strategy.mechanism
    noise_a, _ = release_noise(mechanism.scale(), p, CONFIG["num_classes"], rng)
    want = sum(centred)[np.triu_indices(p)] + noise_a[np.triu_indices(p)]
    np.testing.assert_allclose(single.strategy.released.packed_upper(), want, rtol=0,
                               atol=grid_tolerance(mechanism.sensitivity)[0])


def test_a_coordinator_refuses_a_receipt_outside_the_rounds_clip(tmp_path):
    """The shard receipts why a result breaks the centred rounds' clip F_c (the center round's F it
    checked itself); the coordinator's job refuses the breach in a centred round only, as one
    aggregator refuses the result; a receipt without the field is refused."""
    job = build_job("fed3r", CONFIG)
    sums = Fed3RSums()
    receipt = {"contributed": 1, "energy": 1.0, CENTRED_CLIP: "beyond F_c"}
    sums.check_receipt(job, "cam-0", receipt)                     # the center round: F_c does not apply
    job.strategy.center.value = np.zeros(CONFIG["feature_dim"])    # released: the centred rounds
    with pytest.raises(EnvelopeError, match="beyond F_c"):
        sums.check_receipt(job, "cam-0", receipt)
    sums.check_receipt(job, "cam-0", {**receipt, CENTRED_CLIP: ""})
    for bad in ({"contributed": 1, "energy": 1.0}, {**receipt, CENTRED_CLIP: ["", ""]}, {**receipt, CENTRED_CLIP: 0}):
        with pytest.raises(EnvelopeError, match="without its centred clip"):
            sums.check_receipt(job, "cam-0", bad)


def test_a_centred_clip_looser_than_the_feature_clip_is_refused():
    with pytest.raises(ValueError, match="must not exceed feature_clip_norm"):
        build_job("fed3r", center_config(dp_center_clip_norm=30.0))
