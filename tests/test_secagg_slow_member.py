"""A member that answers every phase just before the phase's timeout (a review's finding).

Each phase waits for every member expected in it until ``phase_timeout_s`` passes without progress,
and each accepted answer is progress. One member sitting on each of its answers for almost the
timeout held every one of the round's five phases open for almost 30 s: 145 s in all, past the
round's 120 s deadline (the defaults), so the round failed for everyone at its deadline, nothing
applied and nobody named, in every round that member was drawn into. Dropping out instead costs a
round one phase timeout. Every phase now also closes at its share of the time left before the
round's deadline (``aggregator/jobs/phase_clock.py``): the slow member is a dropout, and the
others' sum is made in time.
"""

from __future__ import annotations

import numpy as np
import pytest

from protocols.payloads.secagg import from_envelope, to_envelope

from test_secagg_upload_window import _group


def _run(job, clients, slow: dict[str, float], until: float):
    """Ticks every 0.5 s on a fake clock: honest members answer at once, each ``slow`` one its delay
    after each message reaches it. Returns (the survivors or None, the time it settled)."""
    round_id = job.secure.config.round_id
    later: list[tuple[float, str, object]] = []

    def deliver(sends, now):
        for device, env in sends:
            for reply in clients[device].handle(from_envelope(env)):
                if device in slow:
                    later.append((now + slow[device], device, reply))
                else:
                    deliver(job.on_protocol(device, to_envelope(reply), now), now)

    now = 0.0
    while now <= until:
        deliver(job.on_protocol_tick(now), now)
        for item in sorted(i for i in later if i[0] <= now):
            later.remove(item)
            try:
                deliver(job.on_protocol(item[1], to_envelope(item[2]), now), now)
            except Exception:            # refused (its phase closed): the slow member is a dropout
                pass
        settled = job.settled(round_id)
        if settled is not None:
            return settled, now
        now += 0.5
    return None, now


@pytest.mark.parametrize("delays", [(29.0,), (29.0, 29.0), (29.0, 58.0)], ids=["one", "two", "two-in-turn"])
def test_members_answering_each_phase_just_before_its_timeout_cannot_push_the_round_past_its_deadline(delays):
    """One member 29 s late in every phase, two together, or two in turn (each answer restarts the
    idle timer, so the second one's comes 29 s after the first's)."""
    job, clients, stats = _group(upload_window_bytes=2**30, n=9)
    timeout, deadline = job.config.phase_timeout_s, job.config.round_timeout_s     # the defaults: 30 s, 120 s
    assert 5 * timeout > deadline and max(delays) - min(delays) < timeout
    slow = dict(zip(sorted(clients), delays))
    survivors, at = _run(job, clients, slow, deadline)
    assert survivors is not None, f"round still running at its {deadline:.0f} s deadline: it fails for everyone"
    assert at < deadline
    honest = sorted(set(clients) - set(slow))
    assert set(honest) <= set(survivors)
    np.testing.assert_allclose(job.strategy.packed_upper(), sum(stats[d][0] for d in survivors), atol=1e-6)


def test_honest_members_are_not_cut_off_by_the_round_budget():
    """Without a slow member every phase closes on its last answer, long before its budget."""
    job, clients, stats = _group(upload_window_bytes=2**30, n=9)
    survivors, at = _run(job, clients, {}, job.config.round_timeout_s)
    assert sorted(survivors) == sorted(clients) and at == 0.0


def test_the_phase_budgets_end_the_round_by_its_target_however_the_phases_are_stretched():
    """Each phase's budget ends by the target, every later phase keeps a share, and a phase that
    closes at once leaves the next ones their time."""
    from aggregator.jobs.phase_clock import FINISH_SHARE, PhaseClock

    for idle, round_s, phases in ((30.0, 120.0, 5), (3.0, 60.0, 4), (60.0, 9000.0, 5)):
        target = round_s * (1 - FINISH_SHARE)
        clock = PhaseClock(idle, round_s, phases)
        clock.start(0.0)
        now, budgets = 0.0, []
        for _ in range(phases):                 # every phase stretched to its budget
            budgets.append(clock.closes_at - now)
            assert not clock.due(clock.closes_at - 1e-9) or clock.closes_at - 1e-9 - now > idle
            now = clock.closes_at
            assert clock.due(now) and now <= target + 1e-9
            clock.opened(now)
        assert all(b > 0 for b in budgets) and abs(now - target) < 1e-6
        quick = PhaseClock(idle, round_s, phases)
        quick.start(0.0)
        quick.opened(0.5)                       # the first phase closed on its last answer
        assert quick.closes_at - 0.5 >= (target - 0.5) / 2      # the open phase keeps half the time left
        assert not quick.due(0.5 + idle) and quick.due(0.5 + idle + 0.01)   # idle: as before


def test_the_first_phase_waits_for_the_members_local_work_up_to_its_budget_not_the_idle_limit():
    """A device trains (or computes its statistics) on its task before it reads the RoundStart, so
    the first phase holds the members' local work: with the idle limit there, a fleet training longer
    than phase_timeout_s lost every member at the first phase. It ends at its budget only; every
    later phase keeps the idle limit."""
    from aggregator.jobs.phase_clock import PhaseClock

    idle, round_s, phases = 5.0, 120.0, 5
    clock = PhaseClock(idle, round_s, phases)
    clock.start(0.0)
    budget = clock.closes_at
    assert budget > 10 * idle
    assert not clock.due(idle + 1) and not clock.due(budget - 1e-6) and clock.due(budget)
    clock.progress(3.0)                         # some members answered: the others may still be training
    assert not clock.due(3.0 + idle + 1)
    clock.opened(40.0)                          # the last one answered at 40 s: the second phase opens
    assert not clock.due(40.0 + idle) and clock.due(40.0 + idle + 0.01)
