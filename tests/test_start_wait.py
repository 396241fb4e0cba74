"""The wait for devices before a job's first round in a process (``expected_devices``, or
``start_timeout_s`` with whoever is there), over mosquitto.

A job restarted from its store was once drawn from part of a fleet that was online all along: the
wait's clock ran from when the process took the job up, so a restored round that took longer than
``start_timeout_s`` to close (a loaded CI machine: 13–14 s, presences unread meanwhile) had spent
the wait before the service read the devices' retained presences; the first of them then started
the job, and the round was drawn from the one, two, four devices read so far, not the six online
(tests/test_crash_resume_state.py's sampled DP job: rounds 4 and 5 differed from the
uninterrupted run's). The clock now starts when the job first asks for devices.
"""

from __future__ import annotations

import json
import sqlite3
import time

from aggregator.jobs.registry import build_job
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from aggregator.storage.store import Store
from protocols.mqtt_link import BrokerConfig

from ops_fleet import C, D, Fleet, feature_handlers, with_secure

DEVICES = [f"dev{i:02d}" for i in range(6)]
START_TIMEOUT_S = 0.5


def test_a_job_taken_up_long_before_it_asks_for_devices_still_waits_for_the_fleet(broker, tmp_path):
    """The service takes the job up, then is busy for longer than ``start_timeout_s`` before it reads
    anything (as restoring and closing a round can be under load); the six devices are online all
    the while. Its first round is the seeded draw from all six, as a job built from the same config
    draws it, not from the first presence read."""
    config = {"job_id": "job", "num_classes": C, "feature_dim": D, "rounds": 1, "clients_per_round": 3,
              "local_epochs": 1, "batch_size": 8, "client_lr": 0.05, "round_timeout_s": 60,
              "expected_devices": len(DEVICES), "start_timeout_s": START_TIMEOUT_S, "seed": 3}
    want = build_job("fedavg", config).next_participants(set(DEVICES))
    assert len(want) == 3                   # not vacuous: one device read alone would make a round of one
    store = Store(tmp_path / "state.db")
    svc = AggregatorService(build_job("fedavg", config), BrokerConfig.from_url(broker.url), tmp_path / "out",
                            ServiceSettings(evaluate_every_contribution=False, tick_s=0.05),
                            enrolled=set(DEVICES), store=store)
    with Fleet(broker.url, DEVICES, handlers=with_secure(None, feature_handlers)):
        time.sleep(2 * START_TIMEOUT_S)     # taken up, not yet reading: the devices' presences wait unread
        summary = svc.run(timeout_s=60)
    assert summary.get("state") == "done", summary
    with sqlite3.connect(tmp_path / "state.db") as db:
        drawn = [json.loads(p) for (p,) in db.execute("SELECT participants FROM rounds ORDER BY round")]
    assert drawn == [want]
