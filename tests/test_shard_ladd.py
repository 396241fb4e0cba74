"""Plain LADD on shards without sockets (aggregator/shards/ladd_sums.py, coordinator_ladd.py): real
style and ``ladd.train`` envelopes (chunked) fed to K shard ingests with real stores, a coordinator
job running the style phase on the forwarded styles and closing each training round on the
shards' per-slot statistics and sums, against one aggregator's job given the same results. The
models must be the same bytes for every K, with the bound layers on (they close in phases); one
aggregator's canonical round must be the layers' own per-slot mean (the vectorised, unsplit
``RobustClusterAveraging``) to rounding; what shards cannot sum is refused with the reason."""

import dataclasses
import json

import numpy as np
import pytest

from aggregator.jobs.ladd import save_initial_model
from aggregator.jobs.registry import build_job
from aggregator.shards.buckets import shard_of
from aggregator.shards.coordinator_ladd import ShardedLaddJob
from aggregator.shards.partial_sums import shard_capability
from aggregator.shards.shard import Forward, Receipt, ShardIngest
from aggregator.storage.store import Store
from aggregator.strategies.robust_ladd import RobustClusterAveraging
from protocols import messages as M
from protocols.chunking import split
from protocols.envelope import EnvelopeError, decode, encode
from protocols.files import file_sha256
from protocols.payloads.ladd import KIND_STYLE, KIND_TRAIN, encode_style, encode_update, make_layout
from protocols.rounds import RoundClosed
from protocols.topics import Topics

from test_ladd_aggregation import INITIAL, TRAINABLE, style_of
from test_shard_fedavg import InProcessShards

DEVICES = [f"d{i}" for i in range(9)]           # test_ladd_aggregation's: three style clusters of three
JOB = "sharded-ladd"
TOPICS = Topics()
LATE, OUTLIER = "d4", "d1"


def config_of(tmp_path, **over) -> dict:
    path = tmp_path / "initial.npz"
    save_initial_model(path, INITIAL, TRAINABLE)
    return {"job_id": JOB, "model": {"num_classes": 5, "image_size": 64}, "clustering": "styles", "k_min": 3,
            "k_max": 3, "n_init": 2, "rounds": 3, "clients_per_round": 9, "kd_lambda": 0.0, "teacher_every": 1,
            "swa_start": 2, "seed": 3, "initial_model_file": str(path), "initial_model_sha256": file_sha256(path),
            **over}


def message(device: str, round_: int, kind: str, body: dict, tensors: dict, salt: int = 0) -> bytes:
    env = M.result_message(device, M.TaskRef(JOB, round_, "t"), kind, body, tensors)
    env.id = f"{round_:04x}{salt:04x}{int(device[1:]):024x}"
    return encode(env)


def feed(shard: ShardIngest, device: str, raw: bytes):
    outs = [shard.feed(TOPICS.outbox(device), part) for part in split(raw, decode(raw).id, device, chunk_size=200)]
    return outs[-1]


def trained(job, device: str, rng) -> tuple[dict, int]:
    """The device's cluster model moved by noise (the outlier 40 times harder), and its n_k."""
    model = job.cluster_model(job.assignment[device])
    scale = 40.0 if device == OUTLIER else 1.0
    arrays = {k: (model[k] + scale * rng.normal(scale=0.1, size=model[k].shape)).astype(np.float32)
              for k in job.trainable}
    return arrays, int(rng.integers(5, 60))


def style_round(job, online) -> None:
    job.next_participants(online)
    for d in sorted(online):
        job.apply(d, job.parse_result(decode(message(d, job.round, KIND_STYLE, *encode_style(style_of(d), 4, 1)))))
    job.close_round(RoundClosed(job.round, tuple(sorted(online)), (), (), ()))


def restarted(coordinator: ShardedLaddJob, checkpoint, bookkeeping: dict, applied: list) -> ShardedLaddJob:
    """The coordinator as a restart rebuilds it (aggregator/service/recovery.py): a fresh job, the
    last close's checkpoint (none before the first), the open round's bookkeeping, then the
    round's receipts replayed from its store."""
    fresh = ShardedLaddJob(build_job("ladd", coordinator.config.to_dict()), "ladd", coordinator.pool)
    if coordinator.inner.dp is not None:
        fresh.inner.dp.rng = coordinator.inner.dp.rng
    if checkpoint is not None:
        fresh.load_state_dict(checkpoint[0])
        fresh.contributed = dict(checkpoint[1])
    fresh.restore_bookkeeping(bookkeeping)
    for device, env in applied:
        fresh.apply(device, fresh.parse_result(env))
    return fresh


def run_job(tmp_path, shards_count: int, silent_round: int = 0, restart_round: int = 0, **over):
    """(one aggregator's job, the coordinator's job, what the coordinator asked, the shards) after
    every round (``silent_round``: one no device answers; ``restart_round``: the coordinator is
    rebuilt as a restart would halfway through it)."""
    config = config_of(tmp_path, **over)
    shards = [ShardIngest(k, shards_count, Store(tmp_path / f"k{shards_count}-s{k}.db")) for k in range(shards_count)]
    for s in shards:
        s.set_job(JOB, "ladd", config)
    pool = InProcessShards(shards)
    single, coordinator = build_job("ladd", config), ShardedLaddJob(build_job("ladd", config), "ladd", pool)
    if single.dp is not None:               # the same noise draws: seeded only in tests
        single.dp.rng, coordinator.inner.dp.rng = np.random.default_rng(5), np.random.default_rng(5)
    rng, checkpoint = np.random.default_rng(7), None
    while True:
        chosen = single.next_participants(set(DEVICES))
        assert coordinator.next_participants(set(DEVICES)) == chosen
        if not chosen:
            break
        accepted, applied, bookkeeping = [], [], coordinator.bookkeeping()
        for device in reversed(chosen if single.round != silent_round else []):     # not the canonical order
            if single.round == restart_round and len(applied) == len(chosen) // 2:
                coordinator = restarted(coordinator, checkpoint, bookkeeping, applied)
            shard = shards[shard_of(device, shards_count)]
            if single.kind == KIND_STYLE:
                raw = message(device, single.round, KIND_STYLE, *encode_style(style_of(device), 4, 1))
                out = feed(shard, device, raw)
                assert isinstance(out, Forward)         # a style is the coordinator's, whole
                via_shard = decode(out.payload)
            else:
                arrays, n = trained(single, device, rng)
                raw = message(device, single.round, KIND_TRAIN,
                              *encode_update(arrays, single.trainable_layout, n, single.assignment[device]))
                out = feed(shard, device, raw)
                assert isinstance(out, Receipt) and out.topic == TOPICS.outbox(device)
                via_shard = decode(out.raw)
                if device == LATE:                      # stored and receipted, but naming a round not open: refused
                    late = coordinator.parse_result(via_shard)
                    coordinator.apply(device, dataclasses.replace(late, round=late.round + 1))
                    single.apply(device, dataclasses.replace(single.parse_result(decode(raw)), round=single.round + 1))
                    continue
            single.apply(device, single.parse_result(decode(raw)))
            coordinator.apply(device, coordinator.parse_result(via_shard))
            accepted.append(device)
            applied.append((device, via_shard))
        closed = RoundClosed(single.round, tuple(accepted), (), (), ())
        single.close_round(closed)
        coordinator.close_round(closed)
        checkpoint = (coordinator.state_dict(), dict(coordinator.contributed))
        assert coordinator.inner.assignment == single.assignment
        stored = {c.device for s in shards for c in s.store.contributions(JOB, with_payload=False)
                  if c.round == closed.round}
        assert stored == (set(accepted) if single.kind != KIND_STYLE else set())      # the late row dropped
    return single, coordinator.inner, pool.asked, shards


def assert_same_job(want, got, restarted: bool = False):
    """The same state bytes, round log and contributions (``restarted``: a restart keeps the
    late-result counter as of its checkpoint, and the service, not the job, the earlier rounds' log)."""
    assert want.state_dict().keys() == got.state_dict().keys()
    for key, value in want.state_dict().items():
        if key == "meta" and restarted:
            meta = [{k: v for k, v in json.loads(job.state_dict()["meta"].tobytes()).items() if k != "late_discarded"}
                    for job in (want, got)]
            assert meta[0] == meta[1]
            continue
        assert np.asarray(value).tobytes() == np.asarray(got.state_dict()[key]).tobytes(), key
    logs = want.round_log[-len(got.round_log):] if restarted else want.round_log
    assert len(logs) == len(got.round_log) and got.round_log
    for a, b in zip(logs, got.round_log):
        assert {k: v for k, v in a.items() if k != "aggregate_s"} == {k: v for k, v in b.items() if k != "aggregate_s"}
    assert want.contributed == got.contributed


# DP-LADD: a C that clips some deltas (the outlier's always), adaptive clipping moving it between rounds
DP = {"dp_noise_multiplier": 0.8, "dp_clip_norm": 0.6, "dp_population": len(DEVICES)}
VARIANTS = {"styles": {}, "one cluster": {"clustering": "none"}, "every tensor per cluster": {"cluster_scope": "all"},
            "contribution bound": {"contribution_bound_multiplier": 0.5},
            "no bound": {"norm_bound_multiplier": 0.0}, "dp": DP,
            "dp adaptive": {**DP, "dp_adaptive_clip": True, "dp_count_stddev": 2.0}}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shards_count", [2, 3])
def test_ladd_on_shards_gives_one_aggregators_model_bit_for_bit(tmp_path, shards_count, variant):
    over = VARIANTS[variant]
    single, coordinated, asked, shards = run_job(tmp_path, shards_count, **over)
    assert single.train_round == 3 and single.n_clusters == (1 if over.get("clustering") == "none" else 3)
    model = {**single.phi, **single.theta[0]}            # the rounds moved the trained tensors
    assert all(not np.array_equal(model[k], INITIAL[k]) for k in TRAINABLE)
    assert_same_job(single, coordinated)
    # the norm and weight bounds' statistics (LADD's defaults), the contribution bound's, then the sums
    phases = {"no bound": ["statistics", "sums"], "contribution bound": ["statistics"] * 3 + ["sums"],
              "dp": ["sums"], "dp adaptive": ["sums"]}.get(variant, ["statistics", "statistics", "sums"])
    assert asked == phases * 3
    if "dp" in variant:                     # every round a release; adaptive clipping moved C
        assert single.dp.releases == 3 and (single.dp.clip.value != DP["dp_clip_norm"]) == ("adaptive" in variant)
    assert single.late_discarded == 3           # the late result of each training round (in both jobs' state)
    # each shard stored its own devices' training results only
    for k, shard in enumerate(shards):
        rows = shard.store.contributions(JOB, with_payload=False)
        assert rows and all(shard_of(c.device, shards_count) == k for c in rows)


def test_a_receipt_for_another_cluster_is_refused_by_the_coordinator(tmp_path):
    """A shard checks an update against the cluster it names (it holds no assignment); the
    coordinator, which does, refuses the receipt with the parser's reason, as one aggregator
    refuses the result."""
    config = config_of(tmp_path, clustering="none")
    shard = ShardIngest(0, 1, Store(tmp_path / "s.db"))
    shard.set_job(JOB, "ladd", config)
    single, coordinator = build_job("ladd", config), ShardedLaddJob(build_job("ladd", config), "ladd", None)
    chosen = coordinator.next_participants(set(DEVICES))
    single.next_participants(set(DEVICES))
    arrays, n = trained(single, chosen[0], np.random.default_rng(0))
    raw = message(chosen[0], single.round, KIND_TRAIN, *encode_update(arrays, single.trainable_layout, n, 1))
    receipt = feed(shard, chosen[0], raw)
    assert isinstance(receipt, Receipt)
    for job, env in ((coordinator, decode(receipt.raw)), (single, decode(raw))):
        with pytest.raises(EnvelopeError, match="update for cluster 1, the device belongs to 0"):
            job.parse_result(env)
    with pytest.raises(EnvelopeError, match="receipts only"):      # a training result not through a shard
        coordinator.parse_result(decode(raw))
    # a KD digest that is not a sha256 is not carried into the receipt (it could be 64 KiB of anything)
    hostile = message(chosen[2], single.round, KIND_TRAIN,
                      *encode_update(arrays, single.trainable_layout, n, 0, kd_sha256="x" * 5000))
    kept = coordinator.receipt(decode(feed(shard, chosen[2], hostile).raw))
    assert kept["kd_sha256"] == "" and kept["cluster"] == 0
    # an update whose layout is not the model's is the shard's to refuse (forwarded, refused there)
    wrong = {k: v[..., :1] if v.ndim else v for k, v in arrays.items()}
    bad = message(chosen[1], single.round, KIND_TRAIN, *encode_update(wrong, make_layout(wrong, TRAINABLE), n, 0))
    assert isinstance(feed(shard, chosen[1], bad), Forward)


@pytest.mark.parametrize("small_clusters", [False, True], ids=["clusters of three", "a cluster of one and of two"])
def test_one_aggregators_canonical_round_is_the_bound_layers_per_slot_mean(tmp_path, small_clusters):
    """The tree's per-slot arithmetic against the vectorised layers over each slot's updates in
    one place (independent code): equal to float32 rounding, for the norm and contribution bounds,
    also where a cluster sent fewer than three updates (bounded on every cluster's θ updates)."""
    config = config_of(tmp_path, contribution_bound_multiplier=0.5)
    job = build_job("ladd", config)
    rng = np.random.default_rng(3)
    style_round(job, set(DEVICES))
    online = set(DEVICES)
    if small_clusters:              # the outlier alone in its cluster, another cluster down to two
        mine = job.assignment[OUTLIER]
        second = min(c for c in job.assignment.values() if c != mine)
        online = {OUTLIER} | {d for d in DEVICES if job.assignment[d] != mine}
        online.discard(min(d for d in DEVICES if job.assignment[d] == second))
    chosen = job.next_participants(online)
    reference = RobustClusterAveraging(job.is_theta, job.config.robust_aggregation())
    for d in chosen:
        arrays, n = trained(job, d, rng)
        reference.add(job.assignment[d], arrays, n)
        job.apply(d, job.parse_result(decode(message(d, job.round, KIND_TRAIN,
                                                     *encode_update(arrays, job.trainable_layout, n,
                                                                    job.assignment[d])))))
    want_phi, want_theta = reference.result(job.phi, job.theta)
    job.close_round(RoundClosed(job.round, tuple(chosen), (), (), ()))
    for k, v in want_phi.items():
        np.testing.assert_allclose(job.phi[k], v, rtol=2e-6, atol=1e-7)
    for c, part in want_theta.items():
        for k, v in part.items():
            np.testing.assert_allclose(job.theta[c][k], v, rtol=2e-6, atol=1e-7)
    assert any(not np.array_equal(job.theta[c]["head.conv.weight"], INITIAL["head.conv.weight"]) for c in want_theta)


def test_one_aggregators_canonical_dp_round_is_dp_ladds_clipped_mean(tmp_path):
    """DP-LADD's tree (joint clip per device, per-slot sums, one release) against the mechanism's own
    round (``DPClusterAveraging``, independent code), with noise too small to matter (z = 1e-9): the
    same clipped means over the selected devices, to float32 rounding."""
    from aggregator.strategies.dp_ladd import DPClusterAveraging

    config = config_of(tmp_path, clustering="none", dp_noise_multiplier=1e-9, dp_clip_norm=0.6, dp_population=len(DEVICES))
    job = build_job("ladd", config)
    chosen = job.next_participants(set(DEVICES))
    reference = DPClusterAveraging(job.dp, job.is_theta, job.trainable, job.phi, job.theta, job.selected_clusters())
    rng = np.random.default_rng(3)
    for d in chosen[:-2]:                   # two selected devices never answer: the means are over m, not who sent
        arrays, n = trained(job, d, rng)
        reference.add(0, arrays, n)
        job.apply(d, job.parse_result(decode(message(d, job.round, KIND_TRAIN,
                                                     *encode_update(arrays, job.trainable_layout, n, 0)))))
    want_phi, want_theta = reference.result(job.phi, job.theta)
    job.close_round(RoundClosed(job.round, tuple(chosen[:-2]), tuple(chosen[-2:]), (), ()))
    for k, v in {**want_phi, **want_theta[0]}.items():
        np.testing.assert_allclose({**job.phi, **job.theta[0]}[k], v, rtol=2e-6, atol=1e-7)
    assert job.dp.releases == 2 and any(not np.array_equal(job.phi[k], INITIAL[k]) for k in job.phi)


@pytest.mark.parametrize("over", [{"clustering": "none"}, {}, DP], ids=["one cluster", "styles", "dp"])
def test_a_coordinator_restarted_mid_round_and_a_silent_round_keep_one_aggregators_bytes(tmp_path, over):
    """Rebuilt from its checkpoint, bookkeeping and the round's receipts halfway through a training
    round (with one cluster, round 1: no checkpoint yet, the devices' cluster given at their
    selection), and a round no device answers (DP releases noise on zero sums): the same bytes."""
    restart = 1 if over.get("clustering") == "none" else 2
    single, coordinated, asked, _ = run_job(tmp_path, 2, restart_round=restart, silent_round=restart + 1, **over)
    assert_same_job(single, coordinated, restarted=True)
    assert single.round_log[restart]["accepted"] == 0          # the silent round
    if "dp_noise_multiplier" in over:
        assert single.dp.releases == 3


@pytest.mark.parametrize("over,reason", [
    ({"aggregator": "median"}, "needs every update"),
    ({"direction_screen": True}, "direction_screen"),
])
def test_what_shards_cannot_sum_is_refused_with_the_reason(tmp_path, over, reason):
    """``fedfleet simulate --shards K`` (``aggregator_shards``) and ``serve --shards K`` refuse it alike."""
    import dataclasses

    from fedfleet.sim_config import PRESETS


    from fedfleet.simulate import aggregator_shards

    cfg = dataclasses.replace(PRESETS["smoke"], shards=2)
    assert aggregator_shards(cfg, "ladd", config_of(tmp_path)) == (["--shards", "2"], "")
    options, why = aggregator_shards(cfg, "ladd", config_of(tmp_path, **over))
    assert options == [] and reason in why
    assert reason in shard_capability("ladd").refusal(build_job("ladd", config_of(tmp_path, **over)))


@pytest.mark.parametrize("over", [{}, {"aggregator": "median"}, {"direction_screen": True}],
                         ids=["canonical mean", "median rule", "direction screen"])
def test_a_device_alone_in_its_cluster_is_bounded_by_the_rounds_theta_updates(tmp_path, over):
    """A review's finding (carried since stop 58): a θ_c's norm bound was a multiple of its own
    cluster's median, and the median of one update is that update: a device alone in its cluster
    (or with one other) moved its cluster's head as far as it liked. A cluster with fewer than three
    updates is now bounded on every cluster's θ updates: the outlier, alone in its cluster and 40
    times harder than the others, moves θ_c by at most 3x the median θ update norm; every path
    (the canonical sums, a robust rule, the direction screen) decides the same bound."""
    config = config_of(tmp_path, **over)
    job = build_job("ladd", config)
    style_round(job, set(DEVICES))
    outlier_cluster = job.assignment[OUTLIER]
    others = [d for d in DEVICES if job.assignment[d] != outlier_cluster]
    online = {OUTLIER, *others}                     # the outlier's cluster: the outlier only
    chosen = job.next_participants(online)
    assert sorted(chosen) == sorted(online)
    rng, updates = np.random.default_rng(3), {}
    for d in chosen:
        updates[d] = trained(job, d, rng)
        job.apply(d, job.parse_result(decode(message(d, job.round, KIND_TRAIN, *encode_update(
            *updates[d][:1], job.trainable_layout, updates[d][1], job.assignment[d])))))
    before = {c: {k: v.astype(np.float64) for k, v in p.items()} for c, p in job.theta.items()}
    job.close_round(RoundClosed(job.round, tuple(chosen), (), (), ()))

    def theta_norm(d, tensors) -> float:
        c = job.assignment[d]
        return float(np.linalg.norm(np.concatenate([(tensors[k].astype(np.float64) - before[c][k]).ravel()
                                                    for k in before[c] if k in tensors])))

    honest = [theta_norm(d, updates[d][0]) for d in others]
    pooled_limit = 3.0 * float(np.median(honest + [theta_norm(OUTLIER, updates[OUTLIER][0])]))
    moved = theta_norm(OUTLIER, job.theta[outlier_cluster])
    assert theta_norm(OUTLIER, updates[OUTLIER][0]) > 10 * pooled_limit      # what it sent
    assert moved <= pooled_limit * (1 + 1e-5), (moved, pooled_limit)
    assert moved >= 0.5 * pooled_limit                                        # bounded, not dropped
