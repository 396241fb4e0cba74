"""The draw rule for a device whose clock runs ahead (aggregator/service/clock_ahead.py): once its
round's machine recorded its decline saying so, the job draws it no more — after a restart too
(the store's round events) — while a decline for another reason, one naming a task the device
was not given (another device's, or a replay from another job) and the next job leave it drawn.
Over mosquitto with a secure job: tests/test_fedavg_secure_over_mqtt.py."""

import math
import time

import pytest

from aggregator.jobs.registry import build_job
from aggregator.security.fleet import Fleet
from aggregator.service.active_job import ActiveJob
from aggregator.service.clock_ahead import ClockAhead
from aggregator.service.crash_points import CrashPoints
from aggregator.service.job_runner import JobRunner, RunnerServices
from aggregator.service.recovery import open_stored
from aggregator.storage.store import Store
from protocols.device_session import EXPIRED_AT_WORK_DECLINE, EXPIRED_DECLINE
from protocols.rounds import Declined, Tick

DEVICES = ("ahead", "camera", "fine", "other")


@pytest.mark.parametrize("reason,stops", [
    (EXPIRED_DECLINE, True), (EXPIRED_AT_WORK_DECLINE, True),
    ("no camera", False), (EXPIRED_DECLINE + " ", False), (EXPIRED_DECLINE[:40], False)])
def test_only_the_devices_own_clock_ahead_words_stop_its_draw(reason, stops):
    ahead = ClockAhead()
    assert ahead.note_decline("d", reason, 3) is stops
    assert ahead.rounds == ({"d": 3} if stops else {}) and ahead.declined_in(3) == (["d"] if stops else [])
    assert ahead.note_decline("d", EXPIRED_DECLINE, 5) is not stops      # once: the first round stays
    assert ahead.rounds == {"d": 3 if stops else 5}


def serve(store: Store, tmp_path, job_id: str, rounds: int = 3) -> tuple[ActiveJob, JobRunner, list]:
    """A fedavg job of ``rounds`` (all four devices a round) on the store, its fleet online, its runner."""
    cfg = {"job_id": job_id, "num_classes": 3, "feature_dim": 8, "clients_per_round": 4, "rounds": rounds,
           "expected_devices": 4, "round_timeout_s": 60}
    a = ActiveJob(build_job("fedavg", cfg), "fedavg", tmp_path / job_id)
    a.out_dir.mkdir(exist_ok=True)
    open_stored(a, store, True, CrashPoints())
    fleet = Fleet(store, None, set(DEVICES), False)
    for device in DEVICES:
        fleet.presence(device, True, {})
    fatal: list = []
    runner = JobRunner(a, RunnerServices(fleet=fleet, store=store, crash=CrashPoints(), send=lambda d, env: None,
                                         publish_status=lambda body: None, bytes_sent=lambda: 0,
                                         on_fatal=lambda reason, stop=False: fatal.append(reason)))
    return a, runner, fatal


def drawn(a: ActiveJob, runner: JobRunner) -> list[str]:
    """The round the runner's next tick opens: its participants."""
    runner.tick(time.monotonic())
    return sorted(a.current.participants)


def test_a_recorded_clock_ahead_decline_stops_the_devices_draw_for_the_rest_of_its_job(tmp_path):
    store = Store(tmp_path / "agg.db")
    a, runner, fatal = serve(store, tmp_path, "j")
    assert drawn(a, runner) == sorted(DEVICES)
    coord = a.current
    # another device's task named: refused by the round's machine, nobody's draw changes
    runner.handle(coord, Declined("other", EXPIRED_DECLINE, coord.tasks["ahead"]))
    runner.handle(coord, Declined("camera", "no camera", coord.tasks["camera"]))
    runner.handle(coord, Declined("ahead", EXPIRED_DECLINE, coord.tasks["ahead"]))
    runner.handle(coord, Tick(math.inf))               # the others never answered: the deadline
    expected = sorted(set(DEVICES) - {"ahead"})
    assert drawn(a, runner) == expected
    entry = a.round_log[-1]
    assert entry["round"] == 1 and entry["declined"] == ["ahead", "camera"] and entry["clock_ahead"] == ["ahead"]
    runner.handle(a.current, Tick(math.inf))
    assert "clock_ahead" not in a.round_log[-1]
    assert not fatal

    # restarted: the store's round events say so again (the open round 3 taken back as it was)
    assert drawn(a, runner) == expected
    again, runner_again, _ = serve(store, tmp_path, "j")
    assert again.clock_ahead.rounds == {"ahead": 1}
    assert again.drawable(set(DEVICES)) == set(expected)

    # the next job asks it again; its round-1 decline of job j, replayed there, is refused
    nxt, next_runner, _ = serve(store, tmp_path, "k")
    assert drawn(nxt, next_runner) == sorted(DEVICES)
    next_runner.handle(nxt.current, Declined("ahead", EXPIRED_DECLINE, coord.tasks["ahead"]))
    assert not nxt.clock_ahead.rounds and nxt.current.is_pending("ahead")


def test_an_operators_start_of_the_stopped_job_asks_the_clock_ahead_device_again(tmp_path):
    """Starting a stopped job again (start or resume: queued again) is the moment to probe the
    device again (the operator may have set its clock): only clock-ahead declines recorded since
    count. A restart of the service (the job restored running) or a pause and resume keep the
    exclusion; a decline after the start excludes it again, and that one survives a restart."""
    from aggregator.service.job_lifecycle import control_job, take_up
    from aggregator.storage.schema import JobState

    store = Store(tmp_path / "agg.db")
    a, runner, _ = serve(store, tmp_path, "j", rounds=9)          # stored running
    assert drawn(a, runner) == sorted(DEVICES)
    runner.handle(a.current, Declined("ahead", EXPIRED_DECLINE, a.current.tasks["ahead"]))
    runner.handle(a.current, Tick(math.inf))
    expected = sorted(set(DEVICES) - {"ahead"})
    control_job(store, None, "j", "pause")                  # not served here: paused, then queued again
    control_job(store, None, "j", "resume")
    take_up(store, "j")                                     # the service picks the queued job up
    assert serve(store, tmp_path, "j", rounds=9)[0].clock_ahead.rounds == {"ahead": 1}     # a pause is no new start

    for action in ("start", "resume"):
        store.set_job_state("j", JobState.STOPPED)          # stopped (given up, say), then started again
        control_job(store, None, "j", action)
        take_up(store, "j")
        again, runner_again, fatal = serve(store, tmp_path, "j", rounds=9)
        assert not again.clock_ahead.rounds and again.drawable(set(DEVICES)) == set(DEVICES)
        assert drawn(again, runner_again) == sorted(DEVICES)           # asked again
        coord = again.current
        runner_again.handle(coord, Declined("ahead", EXPIRED_DECLINE, coord.tasks["ahead"]))     # still ahead
        runner_again.handle(coord, Tick(math.inf))
        assert drawn(again, runner_again) == expected and not fatal
        restored = serve(store, tmp_path, "j", rounds=9)[0]             # a restart keeps this start's exclusion
        assert restored.clock_ahead.rounds == {"ahead": coord.round}
        runner_again.handle(again.current, Tick(math.inf))
