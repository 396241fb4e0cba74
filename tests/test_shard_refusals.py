"""What a shard refuses, as one aggregator refuses it: a revoked device's messages in an open fleet
(one aggregator refuses a revoked sender in either fleet mode), a device's message that raised
in the shard (one aggregator counts it ``malformed``), and a result its store cannot hold. Real shard processes, a real mosquitto, the
service's own wiring."""

import shutil
import time

from aggregator.jobs.registry import build_job
from aggregator.storage.store import Store
from protocols import messages as M
from protocols.envelope import decode, encode

from ops_fleet import wait_for
from test_shard_ingest import CONFIG, DEVICES, TOPICS, result


class ShardedService:
    """An :class:`AggregatorService` (not run: its loop is served by hand) on one local shard, with
    device links that announce themselves; what the shard tells the coordinator is recorded on its
    way to the service."""

    def __init__(self, broker, tmp_path, store: Store | None, devices: list[str]):
        from aggregator.service.loop import AggregatorService
        from aggregator.service.settings import ServiceSettings
        from aggregator.shards.local import LocalShards
        from protocols.mqtt_link import BrokerConfig, MqttLink

        self.pool = LocalShards(1, BrokerConfig.from_url(broker.url), tmp_path / "shards")
        self.svc = AggregatorService(None, BrokerConfig.from_url(broker.url), tmp_path / "out", ServiceSettings(),
                                     store=store, shards=self.pool)
        self.told: list[tuple] = []
        to_service = self.pool._deliver
        self.pool._deliver = lambda item: (self.told.append(item), to_service(item))
        self.links = {}
        self.pool.set_job(build_job("fed3r", CONFIG), "fed3r")
        for device in devices:
            self.links[device] = link = MqttLink(device, BrokerConfig.from_url(broker.url), on_message=lambda t, p: None)
            link.start(timeout=30)
            link.publish(TOPICS.presence(device), encode(M.presence_message(device, "online")), retain=True, wait=True)
        time.sleep(1.0)                             # the shard subscribes to the devices' outboxes

    def send(self, device: str, round_: int, message_id: str | None = None) -> str:
        """The device's (unchunked) result of ``round_`` (its id: ``message_id``, else one of its own);
        what the shard told the coordinator of it."""
        env = decode(result(DEVICES.index(device), round_=round_))
        env.id = message_id or f"{DEVICES.index(device):016x}{round_:016x}"
        outbox, before = TOPICS.outbox(device), len(self.told)
        self.links[device].publish(outbox, encode(env), wait=True)
        wait_for(lambda: any(it[1] == outbox for it in self.told[before:]), timeout=10, what=f"the shard's word on {device}")
        [said] = [it[0] for it in self.told[before:] if it[1] == outbox]
        return said

    def restart_shard(self) -> None:
        self.pool._send(0, ("stop",))
        wait_for(lambda: self.pool._exited(0) is not None, what="the shard's exit")
        self.pool._ready[0].clear()
        time.sleep(1.1)
        self.pool.watch()
        wait_for(self.pool._ready[0].is_set, what="the restarted shard connected")
        time.sleep(1.0)                             # and subscribed again (the presences are retained)

    def close(self) -> None:
        for link in self.links.values():
            link.stop()
        self.pool.close()


def test_an_open_fleets_shards_refuse_a_revoked_device_as_one_aggregator_does(broker, tmp_path):
    """A review's finding: in an open fleet the shards were never told of a revocation (the pool's
    admission was an enrolled fleet's only), so a revoked device's results were validated and
    stored there, and a hosted secure group took its messages in, where one aggregator refuses a
    revoked sender in either mode ("revoked device", ``AggregatorService._on_payload``). Now a
    device revoked before the service started, one revoked while it runs, and both after a shard's
    restart are handed to the coordinator's path (which refuses them); one enrolled again is taken."""
    store = Store(tmp_path / "state.db")
    for device in DEVICES[:2]:
        store.enroll_device(device, None, None)
    store.revoke_device(DEVICES[0])
    store.set_setting("fleet_mode", "open")
    run = ShardedService(broker, tmp_path, store, DEVICES[:3])
    try:
        assert run.svc.fleet.mode == "open" and run.svc.fleet.revoked == {DEVICES[0]}
        assert run.send(DEVICES[0], 1) == "forward"         # revoked before the start
        assert run.send(DEVICES[1], 1) == "receipt"
        run.svc.revoke(DEVICES[1])
        time.sleep(0.5)                                     # the command reaches the shard
        assert run.send(DEVICES[1], 2) == "forward"         # revoked while it runs
        run.restart_shard()
        assert [run.send(d, 2) for d in DEVICES[:3]] == ["forward", "forward", "receipt"]
        run.svc.enroll(DEVICES[0])                          # enrolled again: taken again
        time.sleep(0.5)
        assert run.send(DEVICES[0], 2) == "receipt"
    finally:
        run.close()


def test_a_message_that_raises_in_a_shard_is_refused_and_counted_as_one_aggregator_counts_it(broker, tmp_path):
    """A review's finding: a device's message that raised in the shard (here its store's payload
    folder gone) was logged there and dropped, unheard of by the coordinator, where one aggregator
    counts a message that raised on its path as a ``malformed`` rejection (``_refused``). Now the
    shard tells the coordinator, which counts it; the shard lives on and takes the re-sent result
    once its store is back."""
    run = ShardedService(broker, tmp_path, None, DEVICES[:1])
    blobs = run.pool.store_path(0).with_name(run.pool.store_path(0).name + ".blobs")
    try:
        assert blobs.is_dir()
        blobs.rename(blobs.with_name("moved"))
        blobs.write_bytes(b"")                              # the payload folder is a file now: writing raises
        assert run.send(DEVICES[0], 1) == "refused"
        [detail] = [it[2] for it in run.told if it[0] == "refused"]
        assert "NotADirectoryError" in detail
        run.svc.loop.serve_pending()
        assert run.svc.stats.rejections["malformed"] == 1
        blobs.unlink()
        shutil.move(blobs.with_name("moved"), blobs)
        assert run.send(DEVICES[0], 1) == "receipt"
        assert run.pool._exited(0) is None and run.pool.restarts == 0
    finally:
        run.close()


def test_a_result_its_shard_cannot_store_is_refused_and_counted_and_taken_when_re_sent(broker, tmp_path):
    """A review's finding: a result whose store write failed with no row of its (round, device)
    stored (its message id held by another of the job's rows) was dropped with a warning, the
    coordinator never told. Now it is refused as a write that raises is (the test above): counted
    ``malformed`` and not answered, so its device re-sends it, and the re-send is taken once the
    store can hold it (the row holding its id, dev00's unaccepted round 1 result, an orphan deleted
    at round 1's close)."""
    run = ShardedService(broker, tmp_path, None, DEVICES[:2])
    taken = f"{0:016x}{1:016x}"                              # dev00's round 1 result's id
    try:
        assert run.send(DEVICES[0], 1) == "receipt"
        assert run.send(DEVICES[1], 2, message_id=taken) == "refused"
        [(_, topic, detail, reason_class)] = [it for it in run.told if it[0] == "refused"]
        assert (topic, reason_class) == (TOPICS.outbox(DEVICES[1]), "malformed") and "already stored" in detail
        run.svc.loop.serve_pending()
        assert run.svc.stats.rejections["malformed"] == 1
        run.pool._send(0, ("closed", CONFIG["job_id"], 1, [], False))    # round 1 closed without dev00's result
        shard_store = Store(run.pool.store_path(0))
        wait_for(lambda: shard_store.contribution_of(CONFIG["job_id"], 1, DEVICES[0]) is None, what="the orphan deleted")
        assert run.send(DEVICES[1], 2, message_id=taken) == "receipt"
        assert shard_store.contribution_of(CONFIG["job_id"], 2, DEVICES[1]).message_id == taken
        assert run.pool._exited(0) is None and run.pool.restarts == 0
    finally:
        run.close()
