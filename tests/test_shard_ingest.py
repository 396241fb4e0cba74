"""One shard's ingest without sockets (aggregator/shards/shard.py): what it stores, what it
receipts, what it forwards to the coordinator, and its sums against one aggregator's canonical
model. Real envelopes (chunked), a real store."""

import time

import numpy as np
import pytest

from aggregator.jobs.registry import build_job
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from aggregator.shards.buckets import NUM_BUCKETS, bucket_range, shard_of
from aggregator.shards.coordinator_job import ShardedJob
from aggregator.shards.partial_sums import canonical_sum, reduce_nodes
from aggregator.shards.shard import RECEIPT, Forward, Receipt, Refused, ShardIngest
from aggregator.storage.store import Store, StoreError
from protocols import messages as M
from protocols.chunking import split
from protocols.envelope import decode, encode
from protocols.payloads.fed3r import encode_stats
from protocols.topics import Topics

P, C = 16, 3
CONFIG = {"job_id": "sharded", "num_classes": C, "feature_dim": P - 1, "clients_per_round": 12}
DEVICES = [f"dev{i:02d}" for i in range(12)]
TOPICS = Topics()


def result(i: int, job: str = "sharded", corrupt: bool = False, signer=None, from_sample: int | None = None,
           round_: int = 1) -> bytes:
    rng = np.random.default_rng(i)
    n = 4 + i
    Z = np.hstack([rng.normal(size=(n, P - 1)), np.ones((n, 1))])
    y = rng.integers(0, C, n)
    ids = np.unique(y)
    A = Z.T @ Z
    if corrupt:
        A[0, 0] = -1.0                          # not a Gram matrix: the job's check refuses it
    body, tensors = encode_stats(A, ids, np.stack([Z[y == c].sum(0) for c in ids]), n, C)
    if from_sample is not None:                 # a streaming increment: the samples the job held before it
        body["from_sample"] = from_sample
    env = M.result_message(DEVICES[i], M.TaskRef(job, round_, "t"), "fed3r.stats", body, tensors)
    env.id = f"{i:032x}" if from_sample is None else f"{i:016x}{from_sample:08x}{len(tensors):08x}"
    return encode(env, signer)


def feed(shard: ShardIngest, i: int, raw: bytes, signer=None):
    """Every chunk of device i's message (each signed by ``signer``, as a device signs them); the
    shard's answer to the last one."""
    outs = [shard.feed(TOPICS.outbox(DEVICES[i]), part)
            for part in split(raw, decode(raw).id, DEVICES[i], chunk_size=2048, signer=signer)]
    assert all(o is None for o in outs[:-1])
    return outs[-1]


def test_a_shard_stores_and_receipts_its_devices_once_and_forwards_the_rest(tmp_path):
    shard = ShardIngest(0, 2, Store(tmp_path / "s0.db"))
    shard.set_job("sharded", "fed3r", CONFIG)
    mine = [i for i in range(len(DEVICES)) if shard_of(DEVICES[i], 2) == 0]
    other = next(i for i in range(len(DEVICES)) if shard_of(DEVICES[i], 2) == 1)
    assert mine and shard.owns(DEVICES[mine[0]]) and not shard.owns(DEVICES[other])
    first = feed(shard, mine[0], result(mine[0]))
    again = feed(shard, mine[0], result(mine[0]))            # the device re-sends: not acked yet
    assert isinstance(first, Receipt) and isinstance(again, Receipt)
    def what(r):                # the same result (its bytes on the wire differ: each send has its timestamp)
        env = decode(r.raw)
        return env.id, {k: v for k, v in env.body.items() if k != RECEIPT}, env.body[RECEIPT]["job"]
    assert what(first) == what(again)
    receipt = decode(first.raw)
    assert receipt.id == f"{mine[0]:032x}" and not receipt.tensors and receipt.body[RECEIPT]["job"]["contributed"] == 4 + mine[0]
    assert shard.stored == 1 and len(list(shard.store.contributions("sharded"))) == 1
    assert isinstance(feed(shard, mine[1], result(mine[1], job="other")), Forward)           # not the active job
    assert isinstance(feed(shard, mine[1], result(mine[1], corrupt=True)), Forward)          # refused by the job
    assert isinstance(shard.feed(TOPICS.outbox(DEVICES[other]), result(other)), Forward)     # not its device
    assert shard.stored == 1


def test_a_shard_requiring_signatures_receipts_only_results_signed_by_the_enrolled_key(tmp_path):
    """``--require-signatures`` on shards: the coordinator's enrolled keys reach each shard before
    the job; a result signed by its sender's key is receipted, one unsigned, signed by another key
    or by a revoked device goes to the coordinator (which refuses it as "bad signature"), never
    into the shard's store; an enrolment or revocation at the coordinator takes effect at once."""
    from protocols.identity import DeviceIdentity

    def refused(i: int, signer=None, not_admitted: bool = False) -> bool:
        """Every chunk the shard does not take goes to the coordinator, marked as refused only for want
        of the device's key (``not_admitted``: handed back once the key is there) or not."""
        raw = result(i, signer=signer)
        outs = [shard.feed(TOPICS.outbox(DEVICES[i]), part)
                for part in split(raw, decode(raw).id, DEVICES[i], chunk_size=2048, signer=signer)]
        return all(isinstance(o, Forward) and o.not_admitted == not_admitted for o in outs)

    shard = ShardIngest(0, 2, Store(tmp_path / "s0.db"))
    mine = [i for i in range(len(DEVICES)) if shard_of(DEVICES[i], 2) == 0]
    ids = {i: DeviceIdentity.generate(DEVICES[i]) for i in mine}
    late = mine.pop()                                   # enrolled only later
    shard.require_signatures({DEVICES[i]: ids[i].public_key_bytes for i in mine})
    shard.set_job("sharded", "fed3r", CONFIG)
    good, forged, unsigned, revoked = mine[:4]
    assert isinstance(feed(shard, good, result(good, signer=ids[good].sign), ids[good].sign), Receipt)
    impostor = DeviceIdentity.generate(DEVICES[forged])
    assert refused(forged, impostor.sign) and refused(unsigned)
    assert refused(late, ids[late].sign, not_admitted=True)              # its key not here yet
    shard.key_changed(DEVICES[revoked], None)
    assert refused(revoked, ids[revoked].sign, not_admitted=True)       # the pool forwards it: no key there either
    # the key arrives after the first chunk was refused for want of it: that chunk, handed back
    # (the pool's refeed), is held with the others and the result receipted
    raw = result(late, signer=ids[late].sign)
    parts = split(raw, decode(raw).id, DEVICES[late], chunk_size=2048, signer=ids[late].sign)
    assert shard.feed(TOPICS.outbox(DEVICES[late]), parts[0]).not_admitted
    shard.key_changed(DEVICES[late], ids[late].public_key_bytes)
    outs = [shard.feed(TOPICS.outbox(DEVICES[late]), part) for part in parts[1:] + parts[:1]]
    assert outs[:-1] == [None] * (len(parts) - 1) and isinstance(outs[-1], Receipt)
    assert sorted(c.device for c in shard.store.contributions("sharded")) == sorted([DEVICES[good], DEVICES[late]])


def test_a_rounds_close_deletes_the_shards_orphans_and_nothing_the_coordinator_accepted(tmp_path):
    """Rows of the closed round outside the coordinator's accepted ids (a refused receipt, a result
    re-sent under a new id after a kill) go, their files too; the accepted rows, later rounds' rows
    and another job's close leave the store as it was; earlier rounds' only when asked."""
    shard = ShardIngest(0, 2, Store(tmp_path / "s0.db"))
    shard.set_job("sharded", "fed3r", CONFIG)
    mine = [i for i in range(len(DEVICES)) if shard_of(DEVICES[i], 2) == 0][:3]
    for i in mine:
        assert isinstance(feed(shard, i, result(i)), Receipt)
    rows = {(c.device, c.message_id): c.seq for c in shard.store.contributions("sharded", with_payload=False)}
    accepted = [(DEVICES[i], f"{i:032x}") for i in mine[:2]]
    assert shard.drop_orphans("other-job", 1, accepted) == 0 and shard.drop_orphans("sharded", 2, accepted) == 0
    assert len(list(shard.store.contributions("sharded", with_payload=False))) == 3
    other_shards = [(d, "x" * 32) for d in DEVICES if shard_of(d, 2) == 1]      # not its devices: ignored
    assert shard.drop_orphans("sharded", 1, accepted + other_shards) == 1
    left = {(c.device, c.message_id) for c in shard.store.contributions("sharded", with_payload=False)}
    assert left == set(accepted)
    orphan_seq = rows[(DEVICES[mine[2]], f"{mine[2]:032x}")]
    assert not shard.store.blobs.path(orphan_seq).exists()
    assert all(shard.store.contribution_payload("sharded", rows[key]) for key in accepted)
    again = feed(shard, mine[2], result(mine[2]))           # its device re-sends after the close: the
    assert isinstance(again, Forward)                        # coordinator's to answer (late), never stored
    assert len(list(shard.store.contributions("sharded", with_payload=False))) == 2
    # a row of round 1 kept past its close (a shard that was down at it): it stays at round 2's close
    # unless the coordinator names every round's ids (``earlier``, Fed3R's closes)
    shard.store.add_contribution("sharded", 1, DEVICES[mine[2]], "y" * 32, result(mine[2]))
    assert shard.drop_orphans("sharded", 2, accepted) == 0
    assert shard.drop_orphans("sharded", 2, accepted, earlier=True) == 1
    assert {(c.device, c.message_id) for c in shard.store.contributions("sharded", with_payload=False)} == set(accepted)


def test_a_shard_coordinator_takes_a_streaming_increment_only_where_its_devices_count_ends(tmp_path):
    """Streaming Fed3R on shards: a shard checks what the message alone shows and receipts an
    increment with the sample it starts at; the coordinator refuses one that does not start at its
    count of the device (a replayed increment, a gap), as one aggregator refuses the result."""
    from protocols.envelope import EnvelopeError

    config = {**CONFIG, "streaming": True}
    shard = ShardIngest(0, 1, Store(tmp_path / "s.db"))             # one shard: every device is its
    shard.set_job("sharded", "fed3r", config)
    coordinator = ShardedJob(build_job("fed3r", config), "fed3r", reduce=lambda *_: None)
    n0 = 4                                                          # device 0's increment: rows 0 .. 3

    def receipted(start: int):                  # each increment its round's (a device sends one a round)
        shard.closed = start                    # the rounds before it closed (a shard stores the open ones')
        out = shard.feed(TOPICS.outbox(DEVICES[0]), result(0, from_sample=start, round_=start + 1))
        assert isinstance(out, Receipt) and decode(out.raw).body[RECEIPT]["job"]["from_sample"] == start
        return decode(out.raw)

    first = receipted(0)
    coordinator.apply(DEVICES[0], coordinator.parse_result(first))
    assert coordinator.inner.contributed == {DEVICES[0]: n0} and coordinator.accepted == [(DEVICES[0], first.id)]
    for start in (0, n0 + 1):                                       # replayed; a gap
        with pytest.raises(EnvelopeError, match=f"increment from sample {start}, the job holds {n0}"):
            coordinator.parse_result(receipted(start))
    coordinator.apply(DEVICES[0], coordinator.parse_result(receipted(n0)))
    assert coordinator.inner.contributed == {DEVICES[0]: 2 * n0} and len(coordinator.accepted) == 2


@pytest.mark.parametrize("kind", ["fed3r", "fedncm"])       # FedNCM: Fed3R's statistics, solved as class means
def test_shards_sum_the_coordinators_accepted_ids_to_one_aggregators_bytes(tmp_path, kind):
    shards = [ShardIngest(k, 3, Store(tmp_path / f"s{k}.db")) for k in range(3)]
    for s in shards:
        s.set_job("sharded", kind, CONFIG)
    receipts = {}
    for i in reversed(range(len(DEVICES))):
        receipts[i] = feed(shards[shard_of(DEVICES[i], 3)], i, result(i))
    late = 5                                                # receipted, but the coordinator refused it
    coordinator = ShardedJob(build_job(kind, CONFIG), kind,
                             lambda kind, config, job_id, accepted: reduce_nodes(kind, config, {
                                 n: v for s in shards for n, v in s.sums(job_id, accepted).items()}))
    for i in range(len(DEVICES)):
        if i != late:
            coordinator.apply(DEVICES[i], coordinator.parse_result(decode(receipts[i].raw)))
    reference = canonical_sum(kind, CONFIG, [(DEVICES[i], 1, lambda job, i=i: job.parse_result(decode(result(i))))
                                                for i in range(len(DEVICES)) if i != late])
    got = coordinator.model_arrays()
    for k, v in reference.model_arrays().items():
        assert got[k].tobytes() == v.tobytes(), k
    assert coordinator.contributed == {d: 4 + i for i, d in enumerate(DEVICES) if i != late}
    direct = build_job(kind, CONFIG)                        # the fleet screen's input, as one aggregator keeps it
    for i in (i for i in range(len(DEVICES)) if i != late):
        direct.apply(DEVICES[i], direct.parse_result(decode(result(i))))
    assert direct.energies and coordinator.inner.energies == direct.energies
    assert sorted(coordinator.reduced().contributed) == sorted(coordinator.contributed)
    with pytest.raises(StoreError, match="lacks accepted"):      # an accepted id no shard holds
        shards[0].sums("sharded", [(d, "f" * 32) for d in DEVICES if shard_of(d, 3) == 0])
    assert [bucket_range(k, 3) for k in range(3)] == [(0, 21), (21, 42), (42, NUM_BUCKETS)]


def test_jobs_shards_cannot_sum_and_impossible_shard_counts_are_refused_with_the_reason(tmp_path):
    from aggregator.shards.local import LocalShards
    from aggregator.shards.pool import check_shardable
    from protocols.mqtt_link import BrokerConfig

    check_shardable(build_job("fed3r", CONFIG), "fed3r")
    fedavg = {"job_id": "f", "num_classes": C, "feature_dim": P - 1, "clients_per_round": 3, "rounds": 1}
    check_shardable(build_job("fedavg", {**fedavg, "direction_screen": False}), "fedavg")    # the norm and weight bounds split
    with pytest.raises(ValueError, match="direction_screen"):                                 # its median needs every update
        check_shardable(build_job("fedavg", fedavg), "fedavg")
    with pytest.raises(ValueError, match="'median' needs every update"):
        check_shardable(build_job("fedavg", {**fedavg, "direction_screen": False, "aggregator": "median"}), "fedavg")
    for dp_fedavg in ({**fedavg, **PLAIN_MEAN}, fedavg):        # DP clips and sums: no layer needs every update
        check_shardable(build_job("fedavg", {**dp_fedavg, "dp_noise_multiplier": 1.0, "dp_clip_norm": 1.0}), "fedavg")
    with pytest.raises(ValueError, match="no additive state"):
        check_shardable(build_job("fedavg-async", fedavg), "fedavg-async")  # a FedAvg subclass: shardable by name only
    check_shardable(build_job("fed3r", {**CONFIG, "dp_noise_multiplier": 1.0, "max_samples": 10,   # its round sums
                                        "feature_clip_norm": 1.0}), "fed3r")
    check_shardable(build_job("fed3r", {**CONFIG, "streaming": True}), "fed3r")   # the coordinator checks increments
    check_shardable(build_job("fedncm", CONFIG), "fedncm")                  # Fed3R's sums, its own solve
    check_shardable(build_job("fedncm", {**CONFIG, "streaming": True}), "fedncm")
    for kind in ("scaffold", "ditto", "fedgloss"):                          # FedAvg's round sums, and more
        check_shardable(build_job(kind, {**fedavg, "direction_screen": False}), kind)
        with pytest.raises(ValueError, match="direction_screen"):
            check_shardable(build_job(kind, fedavg), kind)
    for count in (0, NUM_BUCKETS + 1):
        with pytest.raises(ValueError, match="between 1 and"):
            LocalShards(count, BrokerConfig.from_url("mqtt://127.0.0.1:1"), tmp_path)


def test_a_close_and_a_sums_request_send_each_shard_only_its_own_devices_ids(tmp_path):
    """The pool splits a round's accepted ids by shard (a shard reads only its own): each shard gets
    exactly the ids of the devices in its buckets, and together they are every id once."""
    from aggregator.shards.local import LocalShards
    from protocols.mqtt_link import BrokerConfig

    pool = LocalShards(3, BrokerConfig.from_url("mqtt://127.0.0.1:1"), tmp_path)
    sent = []
    pool._send = lambda index, command: sent.append((index, command))       # the pipe, not started here
    accepted = [(d, f"id-{d}") for d in DEVICES]
    pool.round_closed("sharded", 2, accepted, True)
    for index in range(3):                      # the replies are waiting already: ask returns at once
        pool._replies.put((index, pool._request + 1, {}))
    pool.ask("sums", "sharded", accepted)
    closes = [(i, c) for i, c in sent if c[0] == "closed"]
    asks = [(i, c) for i, c in sent if c[0] == "sums"]
    for commands, ids_at in ((closes, 3), (asks, 3)):
        assert sorted(i for i, _c in commands) == [0, 1, 2]
        for index, command in commands:
            assert all(shard_of(d, 3) == index for d, _m in command[ids_at])
        assert sorted(x for _i, c in commands for x in c[ids_at]) == sorted(accepted)
    assert all(c[1:3] == ("sharded", 2) and c[4] is True for _i, c in closes)
    assert all(len(c[3]) < len(accepted) for _i, c in closes)       # never the whole list


def test_a_shard_receipts_only_an_id_it_holds(tmp_path):
    """A device's round already holds another result of it (sent ahead of its round, or stored
    before a kill and re-sent under a new id): the shard receipts the one it holds, with that one's
    contents, never the new id (the round's close would ask for a row no shard has and stop the
    job). A result carrying another device's stored id is not receipted at all: refused."""
    shard = ShardIngest(0, 2, Store(tmp_path / "s0.db"))
    shard.set_job("sharded", "fed3r", CONFIG)
    mine = [i for i in range(len(DEVICES)) if shard_of(DEVICES[i], 2) == 0]
    first, second = mine[0], mine[1]
    held = feed(shard, first, result(first))                  # stored and receipted: id f"{first:032x}"
    env = decode(result(second))                              # another device's result, under the first's id...
    env.sender, env.id = DEVICES[first], f"{first + 100:032x}"     # ...sent as the first device's, a new id
    again = feed(shard, first, encode(env))
    got = decode(again.raw)
    assert got.id == decode(held.raw).id == f"{first:032x}"
    assert got.body[RECEIPT]["job"] == decode(held.raw).body[RECEIPT]["job"]      # the stored one's contents
    assert shard.stored == 1
    stolen = decode(result(second))
    stolen.id = f"{first:032x}"                               # the first device's id, from the second device
    refused = shard.feed(TOPICS.outbox(DEVICES[second]), encode(stolen))   # counted by the coordinator
    assert isinstance(refused, Refused) and refused.reason_class == "malformed" and "already stored" in refused.detail
    assert [c.device for c in shard.store.contributions("sharded", with_payload=False)] == [DEVICES[first]]


def test_a_re_sent_result_is_receipted_again_without_being_validated_again(tmp_path, monkeypatch):
    """A review's finding: every re-send of a result the shard held (a device without its ack, or
    one re-sending at will) was validated in full before the store said it held one, and one under
    a new id twice (its own, then the stored one's): a 13 MB Fed3R check each, for as long as the
    round was open, as one aggregator's round machine never does."""
    from aggregator.shards.partial_sums import additive

    adder = type(additive("fed3r"))
    checks = []
    real_check = adder.check
    monkeypatch.setattr(adder, "check", lambda self, *a, **k: checks.append(1) or real_check(self, *a, **k))
    shard = ShardIngest(0, 2, Store(tmp_path / "s0.db"))
    shard.set_job("sharded", "fed3r", CONFIG)
    i = next(i for i in range(len(DEVICES)) if shard_of(DEVICES[i], 2) == 0)
    held = feed(shard, i, result(i))
    env = decode(result(i))
    env.id = f"{i + 100:032x}"                                 # the same round's result under a new id
    again = [feed(shard, i, result(i)) for _ in range(3)] + [feed(shard, i, encode(env)) for _ in range(2)]
    assert len(checks) == 1 and all(r.raw == held.raw for r in again) and shard.stored == 1
    shard.drop_orphans("sharded", 1, [(DEVICES[i], decode(held.raw).id)])
    assert isinstance(feed(shard, i, result(i)), Forward) and len(checks) == 1      # round 1 closed: the coordinator's


def test_a_shard_stores_results_of_the_open_rounds_only_and_remembers_the_last_close(tmp_path):
    """A review's attacks: a result naming round 2**63 raised OverflowError out of the shard (its
    process died, and again on every re-send); results naming rounds that never open were stored
    for ever (one row per round named, up to max_message_bytes each). Both go to the coordinator,
    which answers them; the last close survives a shard's restart."""
    shard = ShardIngest(0, 1, Store(tmp_path / "s.db"))
    shard.set_job("sharded", "fed3r", CONFIG)
    honest = feed(shard, 0, result(0))                      # round 1
    assert isinstance(honest, Receipt)
    for round_ in (2 ** 63, 10 ** 6, 4, 0, -1):
        env = decode(result(1, round_=round_))
        env.id = f"{round_ % 2 ** 64:032x}"
        assert isinstance(shard.feed(TOPICS.outbox(DEVICES[1]), encode(env)), Forward), round_
    assert [c.device for c in shard.store.contributions("sharded", with_payload=False)] == [DEVICES[0]]
    assert isinstance(feed(shard, 1, result(1, round_=2)), Receipt)      # the next round's (a close not yet heard)
    shard.drop_orphans("sharded", 1, [(DEVICES[0], decode(honest.raw).id)])
    restarted = ShardIngest(0, 1, Store(tmp_path / "s.db"))
    restarted.set_job("sharded", "fed3r", CONFIG)
    assert restarted.closed == 1
    assert isinstance(feed(restarted, 2, result(2, round_=1)), Forward)       # late now: not stored
    assert isinstance(feed(restarted, 2, result(2, round_=3)), Receipt)


def test_a_shard_process_survives_a_result_naming_a_round_sqlite_cannot_hold(broker, tmp_path):
    import time

    from aggregator.shards.local import LocalShards
    from protocols.mqtt_link import BrokerConfig, MqttLink
    from ops_fleet import wait_for

    pool = LocalShards(1, BrokerConfig.from_url(broker.url), tmp_path / "shards")
    got = []
    pool.start(got.append, timeout_s=120)
    try:
        pool.set_job(build_job("fed3r", CONFIG), "fed3r")
        link = MqttLink(DEVICES[0], BrokerConfig.from_url(broker.url), on_message=lambda t, p: None)
        link.start(timeout=30)
        link.publish(TOPICS.presence(DEVICES[0]), encode(M.presence_message(DEVICES[0], "online")), retain=True,
                     wait=True)
        time.sleep(1.0)                             # the shard subscribes to the device's outbox
        env = decode(result(0))
        env.body["round"] = 2 ** 63
        link.publish(TOPICS.outbox(DEVICES[0]), encode(env), wait=True)
        wait_for(lambda: any(item[0] == "forward" and item[1] == TOPICS.outbox(DEVICES[0]) for item in got),
                 what="the poisoned result forwarded to the coordinator")
        link.stop()
        assert pool._exited(0) is None and pool.restarts == 0
    finally:
        pool.close()


def test_shard_processes_hold_chunks_only_of_the_devices_their_coordinator_admits(broker, tmp_path):
    """An enrolled fleet's shards held every chunk of any id in their buckets until the message was
    whole (the coordinator refused it only then): anyone on an open broker could fill their memory
    under invented ids. Now a chunk of a device that may not contribute goes to the coordinator at
    once (refused there, with the reason), and enrolling, revoking and the fleet mode reach the
    shards, a restarted one too; a chunk refused before the shard heard of its device's enrolment is
    handed back to it. Real shard processes, a real mosquitto, the service's own wiring."""
    from aggregator.service.loop import AggregatorService
    from aggregator.service.settings import ServiceSettings
    from aggregator.shards.local import LocalShards
    from protocols.mqtt_link import BrokerConfig, MqttLink
    from ops_fleet import wait_for

    pool = LocalShards(1, BrokerConfig.from_url(broker.url), tmp_path / "shards")
    got = []
    svc = AggregatorService(None, BrokerConfig.from_url(broker.url), tmp_path / "out", ServiceSettings(),
                            enrolled={DEVICES[0]}, store=Store(tmp_path / "state.db"), shards=pool)
    pool._deliver = got.append              # what the shard tells the coordinator, read here
    links = {}
    try:
        pool.set_job(build_job("fed3r", CONFIG), "fed3r")
        for i in range(3):
            links[i] = MqttLink(DEVICES[i], BrokerConfig.from_url(broker.url), on_message=lambda t, p: None)
            links[i].start(timeout=30)
            links[i].publish(TOPICS.presence(DEVICES[i]), encode(M.presence_message(DEVICES[i], "online")),
                             retain=True, wait=True)
        time.sleep(1.0)                             # the shard subscribes to the devices' outboxes

        def send(i: int, round_: int) -> tuple[int, int]:
            """Device i's chunked result; (forwards, receipts) the shard sent for it."""
            env = decode(result(i, round_=round_))
            env.id = f"{i:016x}{round_:016x}"
            parts = split(encode(env), env.id, DEVICES[i], chunk_size=256)
            before = len(got)
            for part in parts:
                links[i].publish(TOPICS.outbox(DEVICES[i]), part, wait=True)
            outbox = TOPICS.outbox(DEVICES[i])
            wait_for(lambda: sum(it[1] == outbox for it in got[before:]) in (1, len(parts)), what="the shard's answer")
            time.sleep(0.3)                         # a forward of every chunk arrives in order: all of them
            mine = [it for it in got[before:] if it[1] == outbox]
            assert len(parts) > 2
            return sum(it[0] == "forward" for it in mine), sum(it[0] == "receipt" for it in mine)

        assert send(0, 1) == (0, 1)                 # enrolled: held until whole, stored, receipted
        assert send(1, 1)[0] > 2                    # not enrolled: every chunk forwarded as it comes
        # The shard learns of an enrolment over its pipe and of chunks over MQTT, in no order between
        # the two: a device sending at once after its enrolment can find its first chunk refused (a
        # CI run's loss: that chunk forwarded, the rest held, the result lost until sent again). Made
        # certain here: what the shard sends for a chunk it refused before it heard is handed to the
        # pool by hand, the other chunks come over MQTT; the pool hands it back, the shard holds it
        # with the others and receipts the whole result.
        svc.enroll(DEVICES[1])
        env = decode(result(1, round_=2))
        env.id = f"{1:016x}{2:016x}"
        parts, outbox, before = split(encode(env), env.id, DEVICES[1], chunk_size=256), TOPICS.outbox(DEVICES[1]), len(got)
        pool._received(0, ("unadmitted", outbox, parts[0]))
        for part in parts[1:]:
            links[1].publish(outbox, part, wait=True)
        wait_for(lambda: any(it[0] == "receipt" and it[1] == outbox for it in got[before:]), what="the result receipted")
        assert [it[0] for it in got[before:] if it[1] == outbox] == ["receipt"]
        svc.revoke(DEVICES[0])
        time.sleep(1.0)
        assert send(0, 2)[0] > 2
        pool._send(0, ("stop",))                    # a restarted shard is told who may contribute
        wait_for(lambda: pool._exited(0) is not None, what="the shard's exit")
        pool._ready[0].clear()
        time.sleep(1.1)
        pool.watch()
        wait_for(pool._ready[0].is_set, what="the restarted shard connected")
        time.sleep(1.0)                             # and subscribed again (the presences are retained)
        assert send(2, 1)[0] > 2
        svc.set_fleet_mode("open")                  # anyone may contribute: everyone's chunks held
        time.sleep(1.0)
        assert send(2, 2) == (0, 1)
    finally:
        for link in links.values():
            link.stop()
        pool.close()


def test_messages_before_the_job_are_kept_in_order_up_to_a_byte_budget():
    """A shard with no job yet holds what its outbox subscriptions deliver; a flood of them was
    kept without bound. Beyond the budget the oldest go (their devices re-send)."""
    from aggregator.shards.local import HeldMessages

    held = HeldMessages(budget=10 * (4 + 100 + 128))
    for i in range(30):
        held.add((f"t/{i:02d}", bytes(100)))        # 4-character topics
    assert held.dropped == 20
    assert [t for t, _ in held.drain()] == [f"t/{i:02d}" for i in range(20, 30)]
    for _ in range(10_000):                         # empty payloads are legal MQTT: they count too
        held.add(("t/00", b""))
    assert len(held.drain()) == 10 * (4 + 100 + 128) // (4 + 128)
    assert held.drain() == [] and held.size == 0
    held.add(("big", bytes(5000)))            # one message over the budget is not kept either
    assert held.drain() == []


def test_a_request_reaches_every_shard_that_died_while_the_coordinator_waited(broker, tmp_path):
    """A review's finding: the coordinator, waiting for the shards' sums, restarted every dead
    shard but asked only the first of them again; a second that died with it was restarted, no
    longer looked dead, and was never asked: the close waited out its whole reply timeout and
    failed. Two real shard processes, both SIGKILLed, then asked for their sums."""
    import os
    import signal

    from aggregator.shards.local import LocalShards
    from protocols.mqtt_link import BrokerConfig

    pool = LocalShards(2, BrokerConfig.from_url(broker.url), tmp_path / "shards", reply_timeout_s=45.0)
    pool.start(lambda item: None, timeout_s=120)
    try:
        pool.set_job(build_job("fed3r", CONFIG), "fed3r")
        for proc in pool._procs:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
        sums = pool.ask("sums", "sharded", [])
        assert sorted(sums) == [bucket_range(0, 2), bucket_range(1, 2)] and pool.restarts == 2   # both answered
    finally:
        pool.close()
