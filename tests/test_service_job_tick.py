"""A job whose scheduling raises stops that job, with the reason, durably; the aggregator's service
goes on (a LADD style phase that could not cluster once raised out of every tick, and the tick's
error ended the service for every job it would serve)."""

from pathlib import Path

from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from aggregator.storage.schema import JobState
from aggregator.storage.store import Store
from protocols.mqtt_link import BrokerConfig


class SchedulingBreaks(Fed3RJob):
    """A job with a bug in its scheduling: the first time devices are online to pick from, it raises."""

    def next_participants(self, online):
        if online:
            raise ArithmeticError("the scheduler's own bug")
        return super().next_participants(online)


def test_a_job_whose_tick_raises_stops_with_the_reason_and_the_service_goes_on(broker, tmp_path: Path):
    store = Store(tmp_path / "state.db")
    cfg = Fed3RConfig(job_id="breaks", num_classes=3, feature_dim=4, clients_per_round=2, expected_devices=1,
                      start_timeout_s=0)
    svc = AggregatorService(SchedulingBreaks(cfg), BrokerConfig.from_url(broker.url), tmp_path / "out",
                            ServiceSettings(tick_s=0.01), enrolled={"d0"}, store=store)
    svc.fleet.presence("d0", True, {})
    for _ in range(5):
        svc.loop.serve_one()            # raised out of the service's loop before (run() ended)
        if svc.active.final_state:
            break
    assert svc.active.final_state == JobState.STOPPED
    row = store.job("breaks")
    assert row["state"] == JobState.STOPPED and "ArithmeticError: the scheduler's own bug" in row["summary"]["error"]
    svc.loop.serve_one()                # the loop itself still serves
