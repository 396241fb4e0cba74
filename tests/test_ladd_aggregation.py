"""LADD server side: cluster-specific averaging, SWA teachers, and the job's round logic."""

import numpy as np
import pytest

from aggregator.jobs.ladd import LaddConfig, LaddJob
from aggregator.strategies.ladd import ClusterSpecificAveraging, SwaTeacher, cluster_specific_predicate
from protocols import messages as M
from protocols.envelope import EnvelopeError, decode, encode
from protocols.payloads.ladd import (StyleParams, encode_style, encode_update, layout_digest, make_layout, pack, packed_digest,
                                     parse_train_task, unpack)
from protocols.rounds import RoundClosed

RNG = np.random.default_rng(0)
INITIAL = {"tail.conv.weight": RNG.normal(size=(4, 3)).astype(np.float32),
           "tail.bn.running_mean": RNG.normal(size=4).astype(np.float32),
           "head.conv.weight": RNG.normal(size=(5, 4)).astype(np.float32),
           "head.classifier.bias": RNG.normal(size=5).astype(np.float32),
           "head.bn.weight": RNG.normal(size=5).astype(np.float32)}
TRAINABLE = ["tail.conv.weight", "head.conv.weight", "head.classifier.bias"]
STYLE_CENTRES = {0: 1.0e4, 1: 5.0e4, 2: 9.0e4}


def weighted_mean(items):
    total = sum(n for _, n in items)
    return sum(n * x.astype(np.float64) for x, n in items) / total


def test_cluster_specific_averaging_matches_numpy():
    is_theta = cluster_specific_predicate("head")
    phi = {k: v for k, v in INITIAL.items() if not is_theta(k)}
    theta = {c: {k: v + c for k, v in INITIAL.items() if is_theta(k)} for c in range(3)}
    updates = [(c, {k: RNG.normal(size=INITIAL[k].shape).astype(np.float32) for k in TRAINABLE}, n)
               for c, n in ((0, 3), (0, 7), (2, 5), (0, 1), (2, 2))]
    agg = ClusterSpecificAveraging(is_theta)
    for c, t, n in updates:
        agg.add(c, t, n)
    new_phi, new_theta = agg.result(phi, theta)
    np.testing.assert_allclose(new_phi["tail.conv.weight"],
                               weighted_mean([(t["tail.conv.weight"], n) for _, t, n in updates]), rtol=1e-6)
    np.testing.assert_array_equal(new_phi["tail.bn.running_mean"], phi["tail.bn.running_mean"])  # not trained
    for c in (0, 2):
        mine = [(t, n) for cc, t, n in updates if cc == c]
        for name in ("head.conv.weight", "head.classifier.bias"):
            np.testing.assert_allclose(new_theta[c][name], weighted_mean([(t[name], n) for t, n in mine]), rtol=1e-6)
        np.testing.assert_array_equal(new_theta[c]["head.bn.weight"], theta[c]["head.bn.weight"])
    for name in theta[1]:                     # no participant: θ_1 kept bit for bit
        np.testing.assert_array_equal(new_theta[1][name], theta[1][name])
    assert agg.participants == {0: 3, 2: 2}
    # scope "all": nothing is global
    agg_all = ClusterSpecificAveraging(cluster_specific_predicate("all"))
    agg_all.add(0, updates[0][1], 3)
    phi_all, _ = agg_all.result({}, {0: dict(INITIAL)})
    assert phi_all == {}


def test_bad_updates_change_nothing():
    agg = ClusterSpecificAveraging(cluster_specific_predicate("head"))
    bad = {k: np.zeros(INITIAL[k].shape, np.float32) for k in TRAINABLE}
    bad["head.conv.weight"][0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        agg.add(0, bad, 3)
    assert agg.count == 0
    with pytest.raises(ValueError, match="weight"):
        agg.add(0, {k: np.zeros(INITIAL[k].shape, np.float32) for k in TRAINABLE}, 0)
    agg.add(5, {"head.conv.weight": np.zeros((5, 4), np.float32)}, 1)
    with pytest.raises(ValueError, match="unknown cluster"):
        agg.result({}, {0: {"head.conv.weight": INITIAL["head.conv.weight"]}})


def test_swa_teacher_is_a_running_mean():
    models = [{"w": np.full(3, v, np.float32)} for v in (1.0, 4.0, 10.0)]
    t = SwaTeacher({"w": np.zeros(3, np.float32)})
    t.copy_from(models[0])
    np.testing.assert_array_equal(t.params["w"], models[0]["w"])
    for m in models:
        t.average_in(m)
    np.testing.assert_allclose(t.params["w"], np.full(3, 5.0))
    assert t.averaged == 3 and t.version == 4
    with pytest.raises(ValueError):
        t.average_in({"other": np.zeros(3)})


# ----------------------------------------------------------------------------- the job
DEVICES = [f"d{i}" for i in range(9)]
TRUE_CLUSTER = {d: i % 3 for i, d in enumerate(DEVICES)}


def make_job(**over):
    cfg = dict(model={"num_classes": 5, "image_size": 64}, rounds=4, clients_per_round=4, k_min=2, k_max=4,
               teacher_every=1, swa_start=3, kd_lambda=10.0, seed=3)
    return LaddJob(LaddConfig(**{**cfg, **over}), initial=(INITIAL, TRAINABLE))


def send(job, device, kind, body, tensors):
    ref = M.TaskRef(job.config.job_id, job.round, "t")
    env = decode(encode(M.result_message(device, ref, kind, body, tensors)))
    env.sender = device
    return job.parse_result(env)


def style_of(device):
    s = np.full((3, 3, 3), 10.0, np.float32)
    s[:, 1, 1] = STYLE_CENTRES[TRUE_CLUSTER[device]] + RNG.normal(0, 50, 3)
    return s


def run_style_round(job, online):
    parts = job.next_participants(online)
    assert job.kind == "ladd.style" and parts == sorted(online)
    for d in parts:
        params, tensors = job.task_for(d)
        assert StyleParams.from_params(params) == StyleParams(b=1, image_size=64) and tensors == {}
        job.apply(d, send(job, d, "ladd.style", *encode_style(style_of(d), 4, 1)))
    job.close_round(RoundClosed(job.round, tuple(parts), (), (), ()))
    return parts


def test_job_rounds_mix_only_devices_of_one_cluster():
    job = make_job()
    run_style_round(job, set(DEVICES))
    assert job.phase == "train" and job.n_clusters == 3
    labels = job.assignment
    for a in DEVICES:                       # the clustering recovers the true groups
        for b in DEVICES:
            assert (labels[a] == labels[b]) == (TRUE_CLUSTER[a] == TRUE_CLUSTER[b])
    trainable_layout = make_layout(INITIAL, TRAINABLE)
    kd_sent = set()
    for t in range(1, 5):
        before_phi = {k: v.copy() for k, v in job.phi.items()}
        before_theta = {c: {k: v.copy() for k, v in p.items()} for c, p in job.theta.items()}
        parts = job.next_participants(set(DEVICES))
        assert job.kind == "ladd.train" and len(parts) == 4 and job.train_round == t
        sent = []
        for d in parts:
            params, tensors = job.task_for(d)
            layout, flats = parse_train_task(params, tensors)
            assert unpack(flats["model"], layout).keys() == INITIAL.keys()
            np.testing.assert_array_equal(flats["model"], pack(job.cluster_model(labels[d]), layout))
            assert ("kd_model" in flats) == (d not in kd_sent)
            if "kd_model" in flats:
                assert packed_digest(flats["kd_model"]) == params["kd_sha256"]
            update = {k: RNG.normal(size=INITIAL[k].shape).astype(np.float32) for k in TRAINABLE}
            # within LADD's default weight bound (2x the round's median n): the plain weighted mean is then
            # the reference, whatever state the module's RNG is in (n from 1..19 failed for 21 of 30 states)
            n = int(RNG.integers(5, 10))
            body, out = encode_update(update, trainable_layout, n, labels[d], params["kd_sha256"])
            job.apply(d, send(job, d, "ladd.train", body, out))
            sent.append((d, update, n))
            kd_sent.add(d)
        job.close_round(RoundClosed(job.round, tuple(parts), (), (), ()))
        np.testing.assert_allclose(job.phi["tail.conv.weight"],
                                   weighted_mean([(u["tail.conv.weight"], n) for _, u, n in sent]), rtol=1e-6)
        np.testing.assert_array_equal(job.phi["tail.bn.running_mean"], before_phi["tail.bn.running_mean"])
        for c in range(3):
            mine = [(u, n) for d, u, n in sent if labels[d] == c]
            for name in job.theta[c]:
                if not mine or name not in TRAINABLE:          # no participant / frozen: kept exactly
                    np.testing.assert_array_equal(job.theta[c][name], before_theta[c][name])
                else:                                           # only this cluster's devices
                    np.testing.assert_allclose(job.theta[c][name], weighted_mean([(u[name], n) for u, n in mine]),
                                               rtol=1e-6)
        # teachers: copies of w_c before t_START (3), then the running mean of the w_c
        for c in range(3):
            if t < 3:
                for k, v in job.cluster_model(c).items():
                    np.testing.assert_array_equal(job.teachers[c].params[k], v)
    assert job.finished(set(DEVICES), set(DEVICES))
    assert job.next_participants(set(DEVICES)) == []



def test_one_fabricated_style_is_screened_and_the_fleet_keeps_its_clusters():
    """A review's finding: one enrolled device whose style has every entry at the parser's bound
    255·S² (accepted) made the clustering k = 2, itself alone and all 20 honest devices of the
    synthetic benchmark's 4 domains in the other cluster, for the whole job. Now its style is
    screened with the reason (the style round's entry, the report, the checkpoint), left out of the
    clustering and of the pretrainer's bank, and its device goes to the nearest centroid, as a late
    device does; the honest devices keep one cluster per domain, whose centroids are the numpy
    means of their styles."""
    from edge_client.style import extract_style
    from fedfleet.emulation.synthetic_scenes import make_benchmark

    bench = make_benchmark(seed=3, image_size=32, n_source=1, devices_per_domain=5, images_per_device=(6, 10),
                           test_per_domain=0)
    honest = {d.device_id: extract_style(d.images) for d in bench.devices}
    domain = {d.device_id: d.domain for d in bench.devices}
    evil = np.full((3, 3, 3), 255.0 * 32 * 32, np.float32)
    banks = []

    def pretrainer(bank):
        banks.append(np.array(bank))
        return INITIAL, TRAINABLE

    def style_phase(config):
        job = LaddJob(config, pretrainer=pretrainer)
        parts = job.next_participants(set(honest) | {"evil"})
        for d in parts:
            job.apply(d, send(job, d, "ladd.style", *encode_style(evil if d == "evil" else honest[d], 8, 1)))
        job.close_round(RoundClosed(job.round, tuple(parts), (), (), ()))       # the parser took every style
        assert job.phase == "train"
        return job

    cfg = LaddConfig(model={"num_classes": 5, "image_size": 32}, rounds=2, clients_per_round=4, kd_lambda=0.0, seed=3)
    job = style_phase(cfg)
    assert job.n_clusters == 4
    assert cfg.style_screen_multiple == 4.0 and (cfg.k_min, cfg.k_max) == (2, 8)       # on by default
    for a in honest:
        for b in honest:
            assert (job.assignment[a] == job.assignment[b]) == (domain[a] == domain[b])
    for name in set(domain.values()):
        members = [honest[d].reshape(-1).astype(np.float64) for d in honest if domain[d] == name]
        label = job.assignment[next(d for d in honest if domain[d] == name)]
        np.testing.assert_allclose(job.clustering.cluster_centers_[label], np.mean(members, axis=0), rtol=1e-6)
    nearest = np.argmin(((job.clustering.cluster_centers_ - evil.reshape(-1).astype(np.float64)) ** 2).sum(axis=1))
    assert job.assignment["evil"] == nearest
    assert list(job.styles_screened) == ["evil"]
    assert job.styles_screened["evil"].startswith("style screened: its nearest other style is")
    assert job.round_log[-1]["styles_screened"] == job.styles_screened == job.report()["styles_screened"]
    np.testing.assert_array_equal(banks[0], np.stack([honest[d] for d in sorted(honest)]))
    restored = LaddJob(cfg, pretrainer=pretrainer)
    restored.load_state_dict(job.state_dict())
    assert restored.styles_screened == job.styles_screened and restored.assignment == job.assignment
    # the screen off: the review's collapse, every honest device in one cluster
    plain = style_phase(LaddConfig(**{**vars(cfg), "style_screen_multiple": 0.0}))
    assert plain.n_clusters == 2 and plain.styles_screened == {}
    assert len({plain.assignment[d] for d in honest}) == 1 and plain.assignment["evil"] not in \
        {plain.assignment[d] for d in honest}
    with pytest.raises(ValueError, match="screen multiple"):
        LaddConfig(model={"num_classes": 5, "image_size": 32}, style_screen_multiple=1.5)

def test_swa_teacher_inside_the_job_and_teacher_tensor():
    job = make_job(rounds=4, clients_per_round=9, swa_start=2)
    run_style_round(job, set(DEVICES))
    layout = make_layout(INITIAL, TRAINABLE)
    history = {c: [] for c in range(3)}
    for t in range(1, 5):
        parts = job.next_participants(set(DEVICES))
        for d in parts:
            params, tensors = job.task_for(d)
            # copies after rounds 1 and 2 (the first SWA step starts the mean at w_c); a mean after 3
            assert params["teacher"] == ("model" if t <= 3 else "tensor")
            assert ("teacher" in tensors) == (t > 3)
            body, out = encode_update({k: RNG.normal(size=INITIAL[k].shape).astype(np.float32) for k in TRAINABLE},
                                      layout, 3, job.assignment[d], params["kd_sha256"])
            job.apply(d, send(job, d, "ladd.train", body, out))
        job.close_round(RoundClosed(job.round, tuple(parts), (), (), ()))
        for c in range(3):
            history[c].append(job.cluster_model(c))
    for c in range(3):       # rounds 2..4 are >= t_START: g_c = mean(w_c(2), w_c(3), w_c(4))
        for k in INITIAL:
            np.testing.assert_allclose(job.teachers[c].params[k],
                                       np.mean([history[c][i][k].astype(np.float64) for i in (1, 2, 3)], axis=0),
                                       rtol=1e-5, atol=1e-6)


def test_bad_and_late_results():
    job = make_job(rounds=2)
    run_style_round(job, set(DEVICES))
    parts = job.next_participants(set(DEVICES))
    d = parts[0]
    params, _ = job.task_for(d)
    layout = make_layout(INITIAL, TRAINABLE)
    good = {k: np.zeros(INITIAL[k].shape, np.float32) for k in TRAINABLE}
    wrong_cluster = (job.assignment[d] + 1) % 3
    with pytest.raises(EnvelopeError, match="cluster"):
        send(job, d, "ladd.train", *encode_update(good, layout, 3, wrong_cluster))
    with pytest.raises(EnvelopeError, match="layout"):
        send(job, d, "ladd.train", *encode_update({k: good[k] for k in TRAINABLE[:2]},
                                                  make_layout(INITIAL, TRAINABLE[:2]), 3, job.assignment[d]))
    body, out = encode_update(good, layout, 3, job.assignment[d])
    with pytest.raises(EnvelopeError, match="NaN"):
        send(job, d, "ladd.train", body, {"update": np.full_like(out["update"], np.nan)})
    with pytest.raises(EnvelopeError, match="magnitude"):
        send(job, d, "ladd.train", body, {"update": np.full_like(out["update"], 1e6)})
    with pytest.raises(EnvelopeError, match="n="):
        send(job, d, "ladd.train", {**body, "n": -1}, out)
    with pytest.raises(ValueError, match="NaN"):
        encode_update({**good, "head.conv.weight": np.full((5, 4), np.nan, np.float32)}, layout, 3, 0)
    late = send(job, d, "ladd.train", body, out)
    job.close_round(RoundClosed(job.round, tuple(parts), (), (), ()))
    theta_before = {c: {k: v.copy() for k, v in p.items()} for c, p in job.theta.items()}
    job.apply(d, late)                       # the round is closed: discarded, never averaged later
    assert job.late_discarded == 1
    job.next_participants(set(DEVICES))
    job.apply(d, late)                       # names round 2, the open round is 3
    assert job.late_discarded == 2
    job.close_round(RoundClosed(job.round, (), tuple(job._participants), (), ()))
    for c in job.theta:                      # nobody answered: everything kept
        for k in job.theta[c]:
            np.testing.assert_array_equal(job.theta[c][k], theta_before[c][k])


def test_new_device_is_routed_to_its_nearest_centroid_and_declines_reset_kd():
    job = make_job(rounds=3)
    run_style_round(job, set(DEVICES[:6]))
    late_comer = DEVICES[7]
    parts = job.next_participants(set(DEVICES[:6]) | {late_comer})
    assert job.kind == "ladd.style" and parts == [late_comer]
    job.apply(late_comer, send(job, late_comer, "ladd.style", *encode_style(style_of(late_comer), 2, 1)))
    job.close_round(RoundClosed(job.round, (late_comer,), (), (), ()))
    assert job.assignment[late_comer] == job.assignment[DEVICES[TRUE_CLUSTER[late_comer]]]
    assert job.train_round == 0
    job.kd_confirmed.add(DEVICES[0])
    parts = job.next_participants({DEVICES[0]})
    job.close_round(RoundClosed(job.round, (), (), tuple(parts), ()))
    assert DEVICES[0] not in job.kd_confirmed


def test_fedavg_st_has_one_cluster_and_no_style_round():
    job = make_job(clustering="none", rounds=1, clients_per_round=3)
    parts = job.next_participants(set(DEVICES))
    assert job.kind == "ladd.train" and len(parts) == 3 and job.n_clusters == 1
    assert set(job.phi) == {"tail.conv.weight", "tail.bn.running_mean"}
    assert all(job.assignment[d] == 0 for d in parts)
    assert layout_digest(make_layout(INITIAL)) == job.task_for(parts[0])[0]["layout_sha256"]


def test_config_and_construction_errors():
    with pytest.raises(ValueError, match="clustering"):
        LaddConfig(model={"num_classes": 2, "image_size": 16}, clustering="kmeans")
    with pytest.raises(ValueError, match="cluster scope"):
        LaddConfig(model={"num_classes": 2, "image_size": 16}, cluster_scope="bn")
    with pytest.raises(ValueError, match="model must have the keys"):
        LaddConfig(model={})
    with pytest.raises(ValueError, match="pretrainer"):
        LaddJob(LaddConfig(model={"num_classes": 2, "image_size": 16}))
    with pytest.raises(ValueError, match="trainable"):
        LaddJob(LaddConfig(model={"num_classes": 2, "image_size": 16}, clustering="none"),
                initial=(INITIAL, ["nope"]))


def test_style_phase_ends_when_silent_devices_go_offline():
    job = make_job(rounds=1)
    online = set(DEVICES)
    parts = job.next_participants(online)
    for d in parts[:-1]:
        job.apply(d, send(job, d, "ladd.style", *encode_style(style_of(d), 4, 1)))
    job.close_round(RoundClosed(job.round, tuple(parts[:-1]), (parts[-1],), (), ()))
    assert job.phase == "styles"                        # the silent device still has attempts left
    assert job.next_participants(online) == [parts[-1]]  # asked again while it is online
    job.close_round(RoundClosed(job.round, (), (parts[-1],), (), ()))
    train = job.next_participants(online - {parts[-1]})   # gone: cluster without it and start
    assert job.phase == "train" and job.kind == "ladd.train" and train
    assert parts[-1] not in job.assignment and len(job.assignment) == len(DEVICES) - 1


def test_ladd_config_refuses_a_recipe_the_devices_would_refuse():
    """The recipe's defaults and limits are the wire contract's (SelfTrainingRecipe), checked when
    the job is configured rather than when every device declines its first task."""
    from aggregator.jobs.ladd import LaddConfig
    from protocols.payloads.ladd import SelfTrainingRecipe

    model = {"num_classes": 3, "image_size": 32}
    cfg = LaddConfig(model=model)
    assert cfg.recipe(seed=5) == SelfTrainingRecipe(seed=5)          # same defaults on both sides
    for bad in ({"lr": -0.1}, {"pseudo_cap": 1.5}, {"momentum": 1.0}, {"local_epochs": 0}, {"batch_size": True}):
        with pytest.raises(ValueError):
            LaddConfig(model=model, **bad)


@pytest.mark.parametrize("case", ["one style", "identical styles"])
def test_styles_too_few_or_alike_to_split_train_as_one_cluster(case):
    """k_min = 2 asks for a silhouette, which needs 2 <= k <= n - 1 and styles that split: with one
    style in (the other device went offline, attempts left) or styles all alike, the job trains
    every device as one cluster and says why, instead of raising at every scheduling tick (which
    ended the aggregator's service for every job)."""
    job = LaddJob(LaddConfig(model={"num_classes": 5, "image_size": 64}, rounds=2, clients_per_round=3,
                             kd_lambda=0.0), initial=(INITIAL, TRAINABLE))
    assert job.config.k_min == 2
    answering = ["A"] if case == "one style" else ["A", "B", "C", "D"]
    everyone = set(answering) | {"Z"}
    parts = job.next_participants(everyone)
    for d in answering:
        job.apply(d, send(job, d, "ladd.style", *encode_style(np.full((3, 3, 3), 10.0, np.float32), 4, 1)))
    job.close_round(RoundClosed(job.round, tuple(answering), ("Z",), (), ()))
    assert sorted(parts) == sorted(everyone) and job.phase == "styles"
    train = job.next_participants(set(answering))       # Z gone: cluster what is in
    assert job.phase == "train" and job.n_clusters == 1 and len(train) == min(3, len(answering))
    assert set(train) <= set(answering)
    assert job.assignment == {d: 0 for d in answering}
    assert "cannot cluster" in job.clustering_fallback


def test_a_claimed_sample_count_counts_as_at_most_two_typical_devices():
    """A review's finding: LADD ran without the weight bound, so one of six devices claiming
    n = 10^7 (the parser's cap) with a step of honest norm in its own direction made the round's
    mean its step. With the default bound its weight is 2 x the round's median: the mean is the
    numpy mean of the steps at weights (100, 100, 100, 100, 100, 200)."""
    job = LaddJob(LaddConfig(model={"num_classes": 5, "image_size": 64}, rounds=2, clients_per_round=6,
                             clustering="none", kd_lambda=0.0), initial=(INITIAL, TRAINABLE))
    assert job.config.weight_bound_multiplier == 2.0
    devices = job.next_participants({f"dev{i}" for i in range(6)})
    rng = np.random.default_rng(0)
    direction = {k: rng.normal(size=INITIAL[k].shape) for k in TRAINABLE}
    unit = np.sqrt(sum(np.sum(v ** 2) for v in direction.values()))
    start = {k: job.cluster_model(0)[k].astype(np.float64) for k in TRAINABLE}
    steps, weights = {}, {}
    for d in devices:
        sign, n = (-1, 10**7) if d == "dev0" else (1, 100)
        steps[d] = {k: sign * 0.1 * direction[k] / unit for k in TRAINABLE}
        arrays = {k: (start[k] + steps[d][k]).astype(np.float32) for k in TRAINABLE}
        job.apply(d, send(job, d, "ladd.train", *encode_update(arrays, job.trainable_layout, n, 0)))
        weights[d] = 200 if d == "dev0" else 100
        steps[d] = {k: arrays[k].astype(np.float64) - start[k] for k in TRAINABLE}
    job.close_round(RoundClosed(job.round, tuple(devices), (), (), ()))
    for k in TRAINABLE:
        expected = start[k] + sum(weights[d] * steps[d][k] for d in devices) / sum(weights.values())
        np.testing.assert_allclose(job.cluster_model(0)[k], expected, rtol=1e-5, atol=1e-6)
