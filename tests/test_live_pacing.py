"""The admin API's live snapshot is retaken at most once per 20x its own cost (aggregator/service/reporting.py)."""

from aggregator.service import reporting


def test_a_costly_snapshot_waits_twenty_times_its_cost_and_a_cheap_one_its_interval(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(reporting.time, "monotonic", lambda: now[0])
    pacing = reporting.Pacing(every_s=0.2, cost_factor=20.0)
    assert pacing.due()
    with pacing.timed():
        now[0] += 0.1                     # a 0.1 s snapshot (a 100,000-device fleet)
    now[0] += 1.8
    assert not pacing.due()               # 100.0 + 20 x 0.1 = 102.0
    now[0] += 0.1
    assert pacing.due()
    with pacing.timed():
        now[0] += 0.001                   # a small fleet's: the 0.2 s interval rules
    now[0] += 0.15
    assert not pacing.due()
    now[0] += 0.05
    assert pacing.due()
