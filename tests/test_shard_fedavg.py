"""FedAvg(ψ) rounds on shards without sockets (aggregator/shards/fedavg_sums.py,
coordinator_rounds.py): real head-update envelopes (chunked) fed to K shard ingests with real
stores, a coordinator job closing each round on their statistics and sums, against one
aggregator's job given the same updates. The models must be the same bytes for every K, with the
norm and contribution bounds on (they close in phases), and the round's mean must be the layers'
own (the vectorised, unsplit ``RobustAggregation``) to rounding."""

import json

import numpy as np
import pytest

from aggregator.jobs.registry import build_job
from aggregator.shards.buckets import shard_of
from aggregator.shards.coordinator_rounds import ShardedRoundsJob
from aggregator.shards.shard import Forward, Receipt, ShardIngest
from aggregator.storage.store import Store
from protocols import messages as M
from protocols.chunking import split
from protocols.envelope import decode, encode
from protocols.payloads.ditto import KIND as DITTO_KIND, encode_ditto_update
from protocols.payloads.fedavg import KIND, encode_head_update, encode_model_update
from protocols.payloads.fedgloss import KIND as FEDGLOSS_KIND
from protocols.payloads.partial import KIND as PP_KIND, PersonalReport, encode_partial_update
from protocols.payloads.scaffold import DELTA_CONTROL, KIND as SCAFFOLD_KIND
from protocols.rounds import RoundClosed
from protocols.topics import Topics

C, D = 3, 5
DEVICES = [f"dev{i:02d}" for i in range(10)]
CONFIG = {"job_id": "sharded-fedavg", "num_classes": C, "feature_dim": D, "clients_per_round": 9, "rounds": 2,
          "direction_screen": False, "server_optimizer": "yogi", "server_lr": 0.5, "seed": 3}
TOPICS = Topics()


class InProcessShards:
    """What ShardedRoundsJob asks of a ShardPool, answered by shard ingests in this process."""

    def __init__(self, shards: list[ShardIngest]):
        self.shards, self.asked = shards, []

    def ask(self, what: str, job_id: str, accepted, context=None) -> dict:
        self.asked.append(what)
        merged = {}
        for s in self.shards:
            merged.update(s.sums(job_id, accepted, context) if what == "sums" else s.statistics(job_id, accepted, context))
        return merged

    def round_closed(self, job_id: str, round_: int, accepted, earlier: bool = False) -> None:
        for s in self.shards:
            s.drop_orphans(job_id, round_, accepted, earlier)


# each kind's config besides CONFIG: Scaffold's Δc clip bites on dev01's; FedGloSS steps with SGD
# (its own server step) and perturbs the head it sends from round 2 on (ρ > 0)
KIND_CONFIG = {"scaffold": {"control_clip_norm": 0.5, "total_devices": 12},
               "fedgloss": {"server_optimizer": "sgd", "server_lr": 0.8, "fedgloss_rho": 0.05}}
# DP-FedAvg: a C that clips some updates (dev01's always), adaptive clipping moving it between rounds
DP = {"dp_noise_multiplier": 0.8, "dp_clip_norm": 0.6, "dp_population": len(DEVICES)}
DP_ADAPTIVE = {**DP, "dp_adaptive_clip": True, "dp_count_stddev": 2.0}


def config_of(kind: str, extra: dict | None = None) -> dict:
    return {**CONFIG, **KIND_CONFIG.get(kind, {}), **(extra or {})}


def update_message(device: str, round_: int, head: dict, rng, kind: str = "fedavg", still: bool = False) -> bytes:
    """A device's trained head: the served one moved by noise; dev01 pushes 40 times harder. A
    ``pp`` device sends the shared weight only, with its held-out report (dev02 holds none out), a
    ``ditto`` device its head with that report, a ``scaffold`` one its head and Δc (0 if ``still``)."""
    scale = 40.0 if device == "dev01" else 1.0
    weight = head["weight"] + scale * rng.normal(scale=0.1, size=(C, D))
    bias = head["bias"] + scale * rng.normal(scale=0.1, size=C)
    n = int(rng.integers(5, 60))
    n_test = 0 if device == "dev02" else int(rng.integers(1, 20))
    report = PersonalReport(n_test, int(rng.integers(0, n_test + 1)), int(rng.integers(0, n_test + 1)), False)
    if kind == "pp":
        (body, tensors), wire = encode_partial_update(weight, n, report), PP_KIND
    elif kind == "ditto":
        (body, tensors), wire = encode_ditto_update(weight, bias, n, report), DITTO_KIND
    elif kind == "scaffold":
        delta = {DELTA_CONTROL + "weight": (0 if still else scale) * rng.normal(scale=0.1, size=(C, D)),
                 DELTA_CONTROL + "bias": (0 if still else scale) * rng.normal(scale=0.1, size=C)}
        (body, tensors), wire = encode_model_update({"weight": weight, "bias": bias, **delta}, n), SCAFFOLD_KIND
    else:
        (body, tensors), wire = encode_head_update(weight, bias, n), FEDGLOSS_KIND if kind == "fedgloss" else KIND
    env = M.result_message(device, M.TaskRef(CONFIG["job_id"], round_, "t"), wire, body, tensors)
    env.id = f"{round_:04x}{int(device[3:]):028x}"
    return encode(env)


def feed(shard: ShardIngest, device: str, raw: bytes) -> Receipt:
    outs = [shard.feed(TOPICS.outbox(device), part) for part in split(raw, decode(raw).id, device, chunk_size=256)]
    assert isinstance(outs[-1], Receipt)
    return outs[-1]


def run_rounds(tmp_path, shards_count: int, late: str, kind: str = "fedavg", extra: dict | None = None,
               silent_round: int = 0, late_after_close: bool = False, restart_round: int = 0, still_rounds: int = 0):
    """(one aggregator's job, the coordinator's job, what the coordinator asked) after the job's
    rounds (``silent_round``: one in which no update arrives; ``still_rounds``: Scaffold's Δc are 0
    in the rounds up to this one; ``late_after_close``: a round-1 update
    of a device round 1 did not choose reaches its shard after round 1 closed; ``restart_round``:
    the coordinator is rebuilt as a restart does, from the last close's checkpoint and the round's
    stored bookkeeping, once that round has opened)."""
    shards = [ShardIngest(k, shards_count, Store(tmp_path / f"k{shards_count}-s{k}.db")) for k in range(shards_count)]
    config = config_of(kind, extra)
    for s in shards:
        s.set_job(CONFIG["job_id"], kind, config)
    pool = InProcessShards(shards)
    single, coordinator = build_job(kind, config), ShardedRoundsJob(build_job(kind, config), kind, pool)
    if single.dp is not None:               # the same noise draws: seeded only in tests
        single.dp.rng, coordinator.inner.dp.rng = np.random.default_rng(5), np.random.default_rng(5)
    coordinator.inner._rng.setstate(single._rng.getstate())     # one participant draw (secret under sampled DP)
    if hasattr(single, "device_state"):     # one run of the job (its devices' state binding), not two
        coordinator.inner.device_state.run = single.device_state.run
    rng = np.random.default_rng(7)
    for index in range(config["rounds"]):
        if kind == "fedgloss" and index:        # from round 2 the devices train from w̃ ≠ w: it is tested
            start = single.round_start()
            assert any(not np.array_equal(start[k], single.params[k]) for k in start)
        chosen = single.next_participants(set(DEVICES))
        assert coordinator.next_participants(set(DEVICES)) == chosen
        if single.round == restart_round:
            coordinator = restarted(coordinator, checkpoint, build_job(kind, config), pool)
        for device in reversed(chosen if single.round != silent_round else []):   # not the canonical order
            raw = update_message(device, single.round, single.task_for(device)[1], rng, kind,
                                 single.round <= still_rounds)
            receipt = feed(shards[shard_of(device, shards_count)], device, raw)
            if device == late:                  # receipted, but the coordinator refused it: in no sum
                continue
            single.apply(device, single.parse_result(decode(raw)))
            coordinator.apply(device, coordinator.parse_result(decode(receipt.raw)))
        closed = RoundClosed(single.round, tuple(d for d in chosen if d != late and single.round != silent_round),
                             (), (), ())
        single.close_round(closed)
        coordinator.close_round(closed)
        checkpoint = (coordinator.state_dict(), dict(coordinator.contributed))      # the service's, at a close
        if index == 0 and late_after_close:     # its round is closed: the coordinator's to answer (late)
            device = next(d for d in DEVICES if d not in chosen)        # not round 1's: no row of it there
            late_raw = update_message(device, 1, single.params, rng, kind)
            outs = [shards[shard_of(device, shards_count)].feed(TOPICS.outbox(device), part)
                    for part in split(late_raw, decode(late_raw).id, device, chunk_size=256)]
            assert isinstance(outs[-1], Forward), outs[-1]
    if late_after_close:                        # the next close took that orphan: every row is an accepted one
        rows = {(c.device, c.message_id) for s in shards for c in s.store.contributions(CONFIG["job_id"],
                                                                                       with_payload=False)}
        assert len(rows) == sum(coordinator.contributed.values())
    return single, coordinator, pool.asked


def restarted(coordinator: ShardedRoundsJob, checkpoint, fresh_job, pool) -> ShardedRoundsJob:
    """The coordinator as aggregator/service/recovery.py rebuilds it mid round: a fresh job, the
    last close's checkpoint, the open round's bookkeeping as stored (JSON)."""
    fresh = ShardedRoundsJob(fresh_job, coordinator.kind_name, pool)
    fresh.load_state_dict(checkpoint[0])
    fresh.contributed = dict(checkpoint[1])
    fresh.restore_bookkeeping(json.loads(json.dumps(coordinator.bookkeeping())))
    return fresh


def test_a_coordinator_restarted_after_a_close_still_has_the_shards_drop_that_rounds_late_rows(tmp_path):
    """The last close rides in the next round's bookkeeping: restarted mid round 2, the coordinator's
    close of round 2 still drops round 1's row stored after round 1 closed (run_rounds counts the
    shards' rows against the accepted ones), and the model stays one aggregator's."""
    single, coordinator, _ = run_rounds(tmp_path, 2, late="dev04", late_after_close=True, restart_round=2)
    for name, value in single.state_dict().items():
        assert coordinator.state_dict()[name].tobytes() == value.tobytes(), name
    assert coordinator.contributed == single.contributed


@pytest.mark.parametrize("kind", ["fedavg", "pp", "scaffold", "ditto", "fedgloss"])
@pytest.mark.parametrize("shards_count", [2, 3])
def test_shards_close_fedavg_rounds_to_one_aggregators_bytes(tmp_path, shards_count, kind):
    """pp (FedSim/FedAlt) and Ditto: the shared weight's (the global head's) rounds, and the
    held-out WMA from the receipts' reports the same as from the results' (each device's latest;
    one without a split reports none). Scaffold: the server control c too (the clipped Δc's sum
    up the tree). FedGloSS: its own server step, the bound layers measuring from w̃."""
    single, coordinator, asked = run_rounds(tmp_path, shards_count, late="dev04", kind=kind, late_after_close=True)
    # norm, weight and contribution bounds (Scaffold: and its Δc's norm bound), then sums
    phases = 4 if kind == "scaffold" else 3
    assert asked == (["statistics"] * phases + ["sums"]) * CONFIG["rounds"]
    assert sorted(coordinator.state_dict()) == sorted(single.state_dict())
    for name, value in single.state_dict().items():
        assert coordinator.state_dict()[name].tobytes() == value.tobytes(), name
    assert coordinator.contributed == single.contributed and "dev04" not in single.contributed
    assert coordinator.inner.samples == single.samples and coordinator.round == single.round == 2
    assert coordinator.evaluate(None, None) == single.evaluate(None, None)
    shard_book = coordinator.bookkeeping()
    assert shard_book.pop(ShardedRoundsJob.LAST_CLOSE) == [2, [list(pair) for pair in coordinator.last_close[1]]]
    assert shard_book == single.bookkeeping()
    if kind == "scaffold":                  # c moved (test_scaffold.py checks its step against numpy's mean)
        assert np.abs(single.control["weight"]).max() > 0
    if kind in ("pp", "ditto"):
        assert coordinator.inner.heldout == single.heldout and "dev02" not in single.heldout
        assert sorted(single.heldout) == sorted(set(single.contributed) - {"dev02"})
        assert "personal_wma" in single.evaluate(None, None)


@pytest.mark.parametrize("kind", ["fedavg", "pp"])
@pytest.mark.parametrize("dp", [DP, DP_ADAPTIVE], ids=["fixed-clip", "adaptive-clip"])
def test_shards_close_dp_fedavg_rounds_to_one_aggregators_bytes(tmp_path, kind, dp):
    """DP-FedAvg: the shards sum the deltas clipped at the round's C (with how many were within it)
    in one phase, the coordinator adds the noise once: the model, C and the releases are one
    aggregator's bytes, and the step is the clipped deltas' sum plus that noise over κ. Three rounds,
    the second without any update: it still releases noise and moves C."""
    rounds = {"rounds": 3, "server_optimizer": "sgd", "server_lr": 1.0, "server_momentum": 0.0}
    single, coordinator, asked = run_rounds(tmp_path, 2, late="dev04", kind=kind, extra={**dp, **rounds},
                                            silent_round=2)
    assert asked == ["sums", "sums"]                    # no statistics phase; the silent round asks nothing
    for name, value in single.state_dict().items():
        assert coordinator.state_dict()[name].tobytes() == value.tobytes(), name
    assert single.dp.releases == coordinator.inner.dp.releases == 3
    if dp.get("dp_adaptive_clip"):
        assert single.dp.clip.value != dp["dp_clip_norm"]
    assert coordinator.evaluate(None, None) == single.evaluate(None, None)
    assert coordinator.evaluate(None, None)["privacy"]["releases"] == 3


@pytest.mark.parametrize("kind,still_rounds", [("fedavg", 0), ("scaffold", 0), ("scaffold", 3)])
def test_shards_close_rounds_of_one_update_on_one_aggregators_reference(tmp_path, kind, still_rounds):
    """κ = 1: each round's one update is bounded by the reference of earlier rounds as well
    (``SmallRoundReference``): the first rounds move nothing until three devices have answered, the
    later ones are clipped to it (dev01 pushes 40 times harder). The coordinator keeps the reference
    from the shards' statistics as one aggregator keeps it from its updates: the same bytes, through
    a restart from a checkpoint; a round that moves nothing asks for no sums, and moves no
    Scaffold c. Scaffold's Δc are bounded by the reference of its Δc bound likewise; with Δc 0 in
    the first three rounds, that reference is 0 (no bound) when the model's is made, and the lone
    rounds after it move the model but no c until three devices' nonzero Δc have made it anew."""
    from aggregator.strategies.small_round_reference import SmallRoundReference

    rounds = 8
    single, coordinator, asked = run_rounds(tmp_path, 2, late="none", kind=kind, restart_round=5,
                                            still_rounds=still_rounds, extra={"clients_per_round": 1, "rounds": rounds})
    assert sorted(coordinator.state_dict()) == sorted(single.state_dict())
    for name, value in single.state_dict().items():
        assert coordinator.state_dict()[name].tobytes() == value.tobytes(), name
    moved = [entry["updates"] for entry in single.round_log]
    assert moved[0] == 0 and moved[-1] == 1 and SmallRoundReference.LIMITS in single.state_dict()
    assert asked.count("sums") == sum(moved) < rounds
    if kind == "scaffold":
        assert np.abs(single.control["weight"]).max() > 0
        assert "unreleased_scaffold.control_bounds.reference" in single.state_dict()
        assert single.control_rounds.usable() and coordinator.inner.control_rounds.usable()


def test_a_dp_fedavg_round_is_the_clipped_deltas_plus_the_noise_over_kappa():
    """The tree's DP step against plain numpy: Σ_k clip(θ_k − x, C), plus the seeded noise of
    multiplier z C on each tensor, over κ, moves x (SGD at lr 1); C clips some deltas, not all."""
    z, clip_norm = DP["dp_noise_multiplier"], 0.42
    config = {**CONFIG, **DP, "dp_clip_norm": clip_norm, "rounds": 1, "server_optimizer": "sgd", "server_lr": 1.0,
              "server_momentum": 0.0}
    job = build_job("fedavg", config)
    job.dp.rng = np.random.default_rng(9)
    chosen = job.next_participants(set(DEVICES))
    start = {k: job.params[k].astype(np.float64) for k in ("weight", "bias")}
    rng, deltas = np.random.default_rng(1), []
    for device in chosen:
        update = job.parse_result(decode(update_message(device, 1, job.task_for(device)[1], rng)))
        job.apply(device, update)
        deltas.append(np.concatenate([update.update.tensors()[k].ravel() - start[k].ravel() for k in start]))
    norms = [np.linalg.norm(d) for d in deltas]
    assert min(norms) < clip_norm < max(norms)
    job.close_round(RoundClosed(1, tuple(chosen), (), (), ()))
    noise_rng = np.random.default_rng(9)
    noise = np.concatenate([noise_rng.normal(0.0, z * clip_norm, start[k].shape).ravel() for k in start])
    clipped = sum(d * min(1.0, clip_norm / n) for d, n in zip(deltas, norms))
    want = np.concatenate([start[k].ravel() for k in start]) + (clipped + noise) / len(chosen)
    got = np.concatenate([job.params[k].ravel() for k in start])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)       # the head is stored in float32


def test_a_shard_sums_every_bucket_with_its_own_job_not_a_new_one_each(tmp_path, monkeypatch):
    """FedAvg's round sums only read the job (its parser, its config): a shard builds its job once,
    at ``set_job``, not once per bucket and phase (FT(φ)'s build loads its tail program)."""
    import aggregator.shards.partial_sums as partial_sums
    import aggregator.shards.shard as shard_module

    built = []

    def counted(kind, config):
        built.append(kind)
        return build_job(kind, config)
    monkeypatch.setattr(shard_module, "build_job", counted)
    monkeypatch.setattr(partial_sums, "build_job", counted)
    single, coordinator, asked = run_rounds(tmp_path, 2, late="dev04")
    assert asked.count("sums") == CONFIG["rounds"] and built == ["fedavg", "fedavg"]     # one per shard
    assert coordinator.state_dict()["weight"].tobytes() == single.state_dict()["weight"].tobytes()


def test_one_aggregators_tree_mean_is_the_bound_layers_mean(tmp_path):
    """The canonical tree sum is the unsplit layers' result (another code path: vectorised norms,
    a BLAS product) up to rounding, with the outlier bounded."""
    job = build_job("fedavg", CONFIG)
    rng = np.random.default_rng(1)
    chosen = job.next_participants(set(DEVICES))
    for device in chosen:
        job.apply(device, job.parse_result(decode(update_message(device, 1, job.task_for(device)[1], rng))))
    current = {k: job.params[k] for k in ("weight", "bias")}
    updates = [job._updates[d] for d in sorted(job._updates)]
    want, report = job.config.robust_aggregation().aggregate(current, updates)
    assert report["norm_bounded"] >= 1 and report["weight_bounded"] >= 1        # both layers bite
    got, count, samples = job.round_mean()
    assert count == len(chosen) and samples == sum(n for _, n in updates)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-15)


def test_simulate_shards_each_job_shards_can_sum_and_says_why_not_for_the_others():
    """``fedfleet simulate --shards K``: the aggregator options each job of a pipeline gets."""
    import dataclasses

    from fedfleet.sim_config import PRESETS


    from fedfleet.simulate import aggregator_shards

    cfg = dataclasses.replace(PRESETS["smoke"], shards=2)
    fed3r = {"job_id": "f", "num_classes": C, "feature_dim": D}
    assert aggregator_shards(cfg, "fed3r", fed3r) == (["--shards", "2"], "")
    assert aggregator_shards(dataclasses.replace(cfg, ray="auto"), "fedavg", CONFIG) == (
        ["--shards", "2", "--ray", "auto"], "")
    options, why = aggregator_shards(cfg, "fedavg", {**CONFIG, "direction_screen": True})
    assert options == [] and "direction_screen" in why
    assert aggregator_shards(cfg, "pp", {**CONFIG, "job_id": "p"}) == (["--shards", "2"], "")
    assert aggregator_shards(cfg, "ditto", {**CONFIG, "job_id": "d"}) == (["--shards", "2"], "")
    options, why = aggregator_shards(cfg, "scaffold", {**CONFIG, "job_id": "s", "direction_screen": True})
    assert options == [] and "direction_screen" in why
    options, why = aggregator_shards(cfg, "fedavg-async", {**CONFIG, "job_id": "a"})
    assert options == [] and "fedavg-async" in why
    assert aggregator_shards(dataclasses.replace(cfg, shards=0), "fed3r", fed3r) == ([], "")


def test_a_device_message_carrying_a_shard_receipt_is_refused_and_changes_nothing(tmp_path):
    """Only the shards' own pipe carries receipts: a device that writes one into its result (on its
    outbox, which a shard forwards when the result fails its checks, or on its presence topic, which
    reaches the coordinator directly) would otherwise be taken for a validated, stored update."""
    import time

    from aggregator.service.loop import AggregatorService
    from aggregator.shards.shard import RECEIPT
    from protocols.mqtt_link import BrokerConfig

    config = {**CONFIG, "clients_per_round": 2, "expected_devices": 2, "rounds": 1}
    svc = AggregatorService(build_job("fedavg", config), BrokerConfig(port=1), tmp_path / "out",
                            enrolled={"dev00", "dev01"}, store=Store(tmp_path / "state.db"))   # never connects
    for device in ("dev00", "dev01"):
        svc._on_payload(TOPICS.presence(device), encode(M.presence_message(device, "online", {})))
    svc._tick(time.monotonic())
    job = svc.active.job
    assert job.round == 1
    forged = M.result_message("dev00", M.TaskRef(config["job_id"], 1, "t"), KIND, {"n": 10**6}, {})
    forged.body[RECEIPT] = {"shard": 0, "bytes": 1, "job": {"n": 10**6}}
    before = svc._stats().rejections["malformed"]
    for topic in (TOPICS.outbox("dev00"), TOPICS.presence("dev00")):
        svc._on_payload(topic, encode(forged))
    assert svc._stats().rejections["malformed"] == before + 2
    assert job.contributed == {} and job.samples == 0 and not list(svc.store.contributions(config["job_id"]))


def test_only_the_kinds_that_declare_shard_sums_have_them_none_inherits_them():
    """A kind is shardable by its own registry entry: FedAvg's subclasses that step otherwise
    (FedBuff's arrivals, the secure kinds' SecAgg rounds) have none, and a new kind starts
    unshardable until it declares how its sums split. FT(φ)/FT(M) and FedGloSS declare FedAvg's
    round sums, pp and Ditto FedAvg's with the held-out report in the receipt, Scaffold(ψ/φ/M)
    FedAvg's with Σ Δc_k, FedNCM Fed3R's; plain LADD its per-slot sums (tests/test_shard_ladd.py);
    personalization none, its reports in the receipts (tests/test_shard_reports.py)."""
    from aggregator.jobs.registry import KINDS
    from aggregator.shards.control_sums import ControlledRoundSums
    from aggregator.shards.fed3r_sums import Fed3RSums
    from aggregator.shards.fedavg_sums import FedAvgRoundSums
    from aggregator.shards.ladd_sums import LaddRoundSums
    from aggregator.shards.partial_sums import additive
    from aggregator.shards.personal_sums import PersonalRoundSums
    from aggregator.shards.report_receipts import PersonalizationReports

    declared = {name: type(kind.shard_sums) for name, kind in KINDS.items() if kind.shard_sums is not None}
    assert declared == {"fed3r": Fed3RSums, "fedncm": Fed3RSums, "fedavg": FedAvgRoundSums,
                        "fedavg-tail": FedAvgRoundSums, "fedgloss": FedAvgRoundSums, "pp": PersonalRoundSums,
                        "ditto": PersonalRoundSums, "scaffold": ControlledRoundSums,
                        "scaffold-tail": ControlledRoundSums, "ladd": LaddRoundSums,
                        "personalize": PersonalizationReports}
    for name in ("fedavg-async", "fedavg-secure", "ladd-secure"):
        with pytest.raises(ValueError, match="no additive state"):
            additive(name)
