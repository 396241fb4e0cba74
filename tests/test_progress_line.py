"""The simulation's progress line over a real broker: it follows the job's retained status and
redraws in place, padded so that a shorter line leaves nothing of the one it overwrites."""

from __future__ import annotations

import time

from fedfleet.progress import StatusWatcher
from protocols import messages as M
from protocols.envelope import Envelope, encode
from protocols.mqtt_link import BrokerConfig, MqttLink
from protocols.topics import Topics


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "the watcher never drew the status"
        time.sleep(0.02)


def test_a_shorter_status_line_blanks_the_tail_of_the_longer_one(broker, capsys):
    topics = Topics()
    watcher = StatusWatcher(broker.url, topics, total=10, job_id="job-1")
    publisher = MqttLink("status-publisher", BrokerConfig.from_url(broker.url), on_message=lambda t, p: None)
    publisher.start()
    try:
        drawn: list[str] = []

        def publish(body: dict) -> None:
            env = Envelope(type=M.STATUS, sender="aggregator", body={"job": "job-1", "devices_online": 10, **body})
            publisher.publish(topics.status, encode(env), retain=True)
            _wait_for(lambda: watcher.last.get("round") == body["round"])
            drawn.append(capsys.readouterr().out)

        publish({"round": 1, "contributions": 3, "accuracy": 0.8125, "state": "running"})
        publish({"round": 2, "contributions": 6, "state": "running"})   # held: no accuracy to show
        publish({"round": 3, "contributions": 10, "accuracy": 0.8070, "state": "done"})
        # the job of another run on the same broker is not drawn
        publisher.publish(topics.status, encode(Envelope(type=M.STATUS, sender="aggregator",
                                                         body={"job": "job-0", "round": 9})), retain=True)
        time.sleep(0.3)
    finally:
        publisher.stop()
        watcher.close()
    first, second, last = drawn
    assert first.startswith("\r") and "acc 0.8125" in first and "3/10 devices" in first
    assert "acc" not in second and "6/10 devices" in second
    assert len(second) == len(first), "the shorter line is padded to the one it overwrites"
    assert second.rstrip().endswith("online  10")
    assert last.endswith("acc 0.8070\n") and "[" + "#" * 30 + "]" in last
    assert watcher.last["round"] == 3 and capsys.readouterr().out == ""
