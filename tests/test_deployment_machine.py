"""The deployment state machine, its guard and its cohorts (issue 29), without I/O: the module's
docstring is its transition table; every path through the table; metrics against plain sums."""

import hashlib

import numpy as np
import pytest

from aggregator.deployments import machine as M
from aggregator.deployments.cohort import CohortRule, in_fraction, parse_percent
from aggregator.deployments.guard import DeviceReport, Guard, stage_metrics


def deployment(stages=(0.5, 1.0), guard="wma_drop<=1.0", bake_s=10.0, min_reports=2, patience_s=5.0):
    return M.Deployment("d1", 7, "ab" * 32, CohortRule.parse("10%"), stages, Guard.parse(guard), bake_s, min_reports,
                        patience_s)


def good(n=10):
    return DeviceReport(n=n, correct_candidate=9, correct_current=9)


def test_the_docstring_is_the_transition_table():
    assert M.render_table() in M.__doc__
    for state, row in M.DEPLOYMENT_TABLE.entries():
        assert state in M.STATES and set(row.goes_to) <= set(M.STATES)
        assert getattr(M, row.event.__name__) is row.event


def test_a_passing_guard_widens_stage_by_stage_after_the_bake_time_then_completes():
    d = deployment()
    assert d.handle(M.Start(100.0)) == [M.Assign(0)] and d.state == "canary"
    assert d.handle(M.Tick(105.0, {"a": good(), "b": good()})) == []          # still baking
    assert d.handle(M.Tick(110.0, {"a": good(), "b": good()})) == [M.Assign(1)]
    assert (d.state, d.stage, d.stage_fraction) == ("widening", 1, 0.5)
    assert d.handle(M.Tick(115.0, {"a": good(), "b": good()})) == []          # the new stage bakes anew
    assert d.handle(M.Tick(120.0, {"a": good(), "b": good(), "c": good()})) == [M.Assign(2)]
    assert d.stage_fraction == 1.0 and d.last_stage
    assert d.handle(M.Tick(130.0, {"a": good(), "b": good()})) == [M.Complete()] and d.state == "complete"
    assert d.handle(M.Tick(140.0, {})) == []
    assert [h["to"] for h in d.history] == ["canary", "widening", "widening", "complete"]


def test_a_failing_guard_or_too_few_reports_roll_back_with_the_reason():
    d = deployment()
    d.handle(M.Start(0.0))
    worse = DeviceReport(n=10, correct_candidate=5, correct_current=9)
    (act,) = d.handle(M.Tick(10.0, {"a": worse, "b": good()}))
    assert isinstance(act, M.RolledBack) and d.state == "rolled_back"
    assert "wma_drop 20 is not <= 1" in d.reason and d.history[-1]["metrics"]["wma_drop"] == pytest.approx(20.0)
    d = deployment()
    d.handle(M.Start(0.0))
    too_few = {"a": good(), "b": DeviceReport(refused="sha256 differs")}
    assert d.handle(M.Tick(14.0, too_few)) == [] and d.state == "canary"          # patience: more may report
    (act,) = d.handle(M.Tick(15.0, too_few))
    assert isinstance(act, M.RolledBack) and "1 report(s)" in act.reason and "fewer than 2" in act.reason


def test_the_operator_promotes_and_rolls_back_and_other_events_are_refused_changing_nothing():
    d = deployment(stages=(1.0,))
    with pytest.raises(M.DeploymentError, match="draft: cannot promote"):
        d.handle(M.Promote(0.0))
    d.handle(M.Start(0.0))
    with pytest.raises(M.DeploymentError, match="canary: cannot start"):
        d.handle(M.Start(1.0))
    assert d.handle(M.Promote(1.0)) == [M.Assign(1)] and d.stage_fraction == 1.0    # no bake wait
    assert d.handle(M.Promote(1.5)) == [M.Complete()] and d.state == "complete"     # the last stage done
    before = d.to_dict()
    with pytest.raises(M.DeploymentError):
        d.handle(M.Promote(2.0))
    assert d.to_dict() == before
    assert d.handle(M.RollBack(3.0, "operator")) == [M.RolledBack("operator")] and d.state == "rolled_back"
    with pytest.raises(M.DeploymentError):
        d.handle(M.RollBack(4.0, "again"))
    assert M.Deployment.from_dict(d.to_dict()).to_dict() == d.to_dict()


@pytest.mark.parametrize("bad", [dict(stages=(0.5,)), dict(stages=(0.5, 0.25, 1.0)), dict(bake_s=-1), dict(patience_s=-1)])
def test_a_bad_deployment_is_refused(bad):
    with pytest.raises(ValueError):
        deployment(**bad)


def test_guard_metrics_are_pooled_counts():
    rng = np.random.default_rng(0)
    n = rng.integers(1, 50, 6)
    cand, cur = (np.array([rng.integers(0, k + 1) for k in n]) for _ in range(2))
    reports = {f"d{i}": DeviceReport(int(n[i]), int(cand[i]), int(cur[i])) for i in range(6)}
    reports["x"] = DeviceReport(refused="no")
    m = stage_metrics(reports)
    assert m["reports"] == 6 and m["refused"] == 1
    assert m["wma_candidate"] == pytest.approx(100 * cand.sum() / n.sum())
    assert m["wma_drop"] == pytest.approx(100 * (cur.sum() - cand.sum()) / n.sum())
    g = Guard.parse("wma_drop <= 1.5, refused<1")
    assert g.text == "wma_drop<=1.5,refused<1" and len(g.failures(m)) == (m["wma_drop"] > 1.5) + 1
    empty = stage_metrics({"a": DeviceReport(n=0)})            # reports, but no held-out sample at all
    assert empty["wma_drop"] is None and g.failures(empty) == ["wma_drop unknown (no held-out samples) is not <= 1.5"]
    for text in ("", "accuracy<=1", "wma_drop=<1", "wma_drop<=x"):
        with pytest.raises(ValueError):
            Guard.parse(text)


def test_cohorts_are_seeded_nested_and_follow_tags_or_lists():
    devices = {f"cam-{i:03d}": (("north",) if i % 4 == 0 else ()) for i in range(400)}
    point = {d: int.from_bytes(hashlib.sha256(f"3:{d}".encode()).digest()[:8], "big") / 2 ** 64 for d in devices}
    rule = CohortRule.parse("10%", seed=3)
    canary = rule.canary(devices)
    assert canary == {d for d, p in point.items() if p < 0.1} and 20 <= len(canary) <= 60
    quarter = rule.stage(0.25, devices)
    assert canary <= quarter and quarter == {d for d, p in point.items() if p < 0.25}
    assert rule.stage(1.0, devices) == set(devices)
    assert CohortRule.parse("10%", seed=4).canary(devices) != canary
    assert CohortRule.parse("tags:north").canary(devices) == {d for d, t in devices.items() if "north" in t}
    assert CohortRule.parse("devices:cam-001,cam-002,ghost").canary(devices) == {"cam-001", "cam-002"}
    assert in_fraction("x", 1.0, 0) and not in_fraction("x", 0.0, 0)
    assert parse_percent("5%") == 0.05 and parse_percent("0.25") == 0.25
    for bad in ("0%", "150%", "five", "devices:", "devices:a/b"):
        with pytest.raises(ValueError):
            CohortRule.parse(bad)


def test_the_median_drop_and_bounded_weights_keep_a_minority_of_liars_from_moving_the_verdict():
    """Per-device drops against numpy's median; a liar's weight is capped (counts scaled to the cap,
    same accuracy); with k < n/2 liars claiming anything at all, the median stays within the honest
    devices' drops, so the verdict of honest devices that agree is unchanged (issue 37)."""
    rng = np.random.default_rng(1)
    n = rng.integers(20, 60, 5)
    cand, cur = (np.array([rng.integers(0, k + 1) for k in n]) for _ in range(2))
    honest = {f"d{i}": DeviceReport(int(n[i]), int(cand[i]), int(cur[i])) for i in range(5)}
    drops = 100 * (cur - cand) / n
    m = stage_metrics(honest)
    assert m["median_drop"] == pytest.approx(np.median(drops))
    assert m["evidence"]["d0"] == {"n": int(n[0]), "weight": int(n[0]), "drop": pytest.approx(drops[0])}

    liars = {"inflate": DeviceReport(10 ** 9, 10 ** 9, 0), "deflate": DeviceReport(10 ** 9, 0, 10 ** 9)}
    caps = {d: int(k) for d, k in zip(honest, n)} | {"inflate": 50, "deflate": 50}
    for k in (1, 2):                                          # 1 or 2 liars among 6 or 7 devices: k < n/2
        for side in ("inflate", "deflate"):
            reports = {**honest, **{f"{side}{j}": liars[side] for j in range(k)}}
            got = stage_metrics(reports, {**caps, **{f"{side}{j}": 50 for j in range(k)}})
            assert drops.min() <= got["median_drop"] <= drops.max()
            assert got["evidence"][f"{side}0"]["weight"] == 50 and got["evidence"][f"{side}0"]["n"] == 10 ** 9
            # the pooled drop: the liar weighs its cap, as plain sums with its counts scaled to 50 say
            lc, lr = (50, 0) if side == "inflate" else (0, 50)
            pooled = 100 * (cur.sum() + k * lr - cand.sum() - k * lc) / (n.sum() + 50 * k)
            assert got["wma_drop"] == pytest.approx(pooled)
    # uncapped, one liar owns the pooled metric (what the guard used to decide on)
    assert stage_metrics({**honest, "x": liars["deflate"]})["wma_drop"] > 99
    assert DeviceReport(100, 37, 81).bounded(10) == DeviceReport(10, 4, 8)
    assert DeviceReport(refused="sig").bounded(1) == DeviceReport(refused="sig")


def test_a_halted_deployment_keeps_its_reason_and_takes_no_further_event_but_ticks():
    d = deployment()
    d.handle(M.Start(0.0))
    assert d.handle(M.Halt(1.0, "halted: model 7's head no longer hashes")) == []
    assert d.state == "halted" and d.reason.startswith("halted: model 7") and d.history[-1]["to"] == "halted"
    assert d.handle(M.Tick(100.0, {"a": good(), "b": good()})) == [] and d.state == "halted"
    for event in (M.Promote(2.0), M.RollBack(2.0, "x"), M.Halt(2.0, "y")):
        with pytest.raises(M.DeploymentError):
            d.handle(event)
    assert M.Deployment.from_dict(d.to_dict()).state == "halted"


def test_every_table_row_fires_in_every_state_it_names():
    """Random event sequences (seeded) through fresh deployments: each (state, row) of the table is
    reached, so no rule is dead and the guards order as the table prints them."""
    rng = np.random.default_rng(3)
    worse = DeviceReport(n=10, correct_candidate=5, correct_current=9)
    fired = set()
    for _ in range(600):
        d, now = deployment(stages=(0.5, 1.0) if rng.random() < 0.5 else (1.0,)), 0.0
        for _ in range(int(rng.integers(1, 12))):
            now += float(rng.choice([1.0, 6.0, 12.0]))
            reports = {f"d{i}": (good() if rng.random() < 0.8 else worse) for i in range(int(rng.integers(0, 4)))}
            event = [M.Start(now), M.Tick(now, reports), M.Tick(now, reports), M.Promote(now),
                     M.RollBack(now, "operator"), M.Halt(now, "corrupt")][int(rng.choice(6, p=[.2, .25, .25, .14, .08, .08]))]
            try:
                fired.add((d.state, M.DEPLOYMENT_TABLE.select(d, event)))
            except M.IllegalTransition:
                continue
            d.handle(event)
    names = lambda pairs: {(s.name, M.DEPLOYMENT_TABLE.describe(row)) for s, row in pairs}
    assert names(M.DEPLOYMENT_TABLE.entries()) - names(fired) == set()
