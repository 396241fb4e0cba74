"""Secure groups on shards without a broker (sans-IO, real keys and envelopes): a shard takes only its
hosted group's secagg messages and refuses bad ones changing nothing; the coordinator tells the host
of a member gone before the group was placed, carries a copied key's refusal into its round log as
one aggregator does, keeps culprits named for a round it had closed out of later rounds; a group
its shard cannot build fails with the reason and the shard lives; the per-round bookkeeping stays
bounded; a revoked member's messages never reach its group's machine; ``fedfleet simulate --secure
--shards`` takes the kinds shards host and says why not for the others."""

import json

import numpy as np
import pytest

from protocols.payloads.secagg import SECAGG_TYPE

from ops_fleet import SecureKeys
from secure_shard_runs import DEVICES, SYNC_KINDS


def test_a_shard_takes_only_its_hosted_groups_secagg_messages_and_refuses_bad_ones_changing_nothing(tmp_path):
    """Sans-IO, real keys and envelopes: shard 1 (whose bucket holds dev08 alone) hosts round 1's
    group of dev03, dev04, dev08. It reads the members' outboxes, takes their secagg messages (a
    malformed one is refused for the coordinator to count, one claiming another sender left to its
    own shard, the group running on), leaves a foreign member's other messages to its own shard,
    forwards what its bucket's devices send; a shard hosting nothing drops every secagg message. An aborted group ends failed, with its reason."""
    from aggregator.jobs.registry import build_job
    from aggregator.shards.shard import Forward, Publish, Refused, ShardIngest
    from aggregator.storage.store import Store
    from protocols import messages as M
    from protocols.envelope import Envelope, encode
    from protocols.topics import Topics
    from ops_fleet import job_config

    keys, topics = SecureKeys.create(tmp_path, DEVICES), Topics()
    config = {**job_config(DEVICES, "fed3r-sync"), "max_samples": 100, **keys.job_fields(tmp_path)}
    coordinator = build_job("fed3r-sync", config)
    members = ["dev03", "dev04", "dev08"]
    assert sorted(coordinator.next_participants(set(members))) == members
    group, context = coordinator.release_group()
    assert context == {}                                # Fed3R-Sync's host needs nothing besides the config
    host, idle = ShardIngest(1, 2, Store(tmp_path / "s1.db")), ShardIngest(0, 2, Store(tmp_path / "s0.db"))
    for shard in (host, idle):
        shard.set_job(config["job_id"], "fed3r-sync", config)
    assert host.groups.open(group, context) == [] and host.reads("dev03") and not host.owns("dev03")
    started = host.groups.tick(0.0)                     # the server machine's first phase, to every member
    assert sorted(d for d, _ in started) == members

    def sent(shard, device, env):
        return shard.feed(topics.outbox(device), encode(env), 1.0)

    garbage = Envelope(type=SECAGG_TYPE, sender="dev03", body={"secagg": {"round_id": 1, "phase": "nonsense"}})
    refused = sent(host, "dev03", garbage)          # refused, for the coordinator to count ("protocol")
    assert isinstance(refused, Refused) and refused.reason_class == "protocol"
    forged = Envelope(type=SECAGG_TYPE, sender="dev04", body=garbage.body)       # on dev03's outbox
    assert sent(host, "dev03", forged) is None
    assert host.job_id and host.groups.job.secure_round_live(1) and host.groups.outcomes() == []
    decline = M.decline_message("dev03", M.TaskRef(config["job_id"], 1, "t"), "busy")
    assert sent(host, "dev03", decline) is None                  # dev03's own shard forwards it
    assert isinstance(sent(idle, "dev03", decline), Forward)
    assert sent(host, "dev05", decline) is None                  # not a member, not its bucket: its shard's
    assert sent(idle, "dev03", garbage) == Publish([])           # a group hosted elsewhere: dropped
    aborted = host.groups.abort(1, "deadline")                   # the members are told to erase their secrets
    assert sorted(d for d, _ in aborted) == members
    assert host.groups.outcomes() == [("group", host.job_id, "failed", 1, (), "aborted: deadline")] and host.groups.held is None
    assert not host.reads("dev03") and host.reads("dev08")      # the group's other buckets' devices are let go
    assert sent(host, "dev03", garbage) is None                  # a late message of theirs: their shards'
    assert isinstance(sent(host, "dev08", decline), Forward)     # its own bucket's, as ever


def test_simulate_shards_takes_the_secure_kinds_shards_host_and_says_why_not_for_the_others(tmp_path):
    """``fedfleet simulate --secure --shards K``: Fed3R-Sync, FedNCM-Sync and the secure FedAvg family
    (secure Scaffold and Ditto too) get the shard options (their registry entries' ``shard_groups``;
    secure LADD's: tests/test_secure_ladd_shards.py); FedBuff runs in one process and says why."""
    import dataclasses

    from fedfleet.sim_config import PRESETS

    from fedfleet.simulate import aggregator_shards
    from ops_fleet import C, D

    keys = SecureKeys.create(tmp_path, DEVICES)
    cfg = dataclasses.replace(PRESETS["smoke"], shards=2, secure=True)
    common = {"job_id": "s", "num_classes": C, "feature_dim": D, "max_samples": 100, **keys.job_fields(tmp_path)}
    for kind in SYNC_KINDS:
        assert aggregator_shards(cfg, kind, common) == (["--shards", "2"], ""), kind
    for kind in ("fedavg-secure", "pp-secure", "scaffold-secure", "ditto-secure"):
        assert aggregator_shards(cfg, kind, {**common, "rounds": 1}) == (["--shards", "2"], ""), kind
    options, why = aggregator_shards(cfg, "fedavg-async", {**common, "rounds": 1})
    assert options == [] and "'fedavg-async'" in why and "no additive state" in why
    from aggregator.jobs.registry import build_job
    from aggregator.shards.pool import check_shardable
    dp = build_job("fed3r-sync", {**common, "dp_noise_multiplier": 1.0, "feature_clip_norm": 8.0})
    with pytest.raises(ValueError, match="differential privacy"):     # a dropped group's devices would be re-noised
        check_shardable(dp, "fed3r-sync")


def _sharded_coordinator(tmp_path, members, **over):
    """A Fed3R-Sync job's shard coordinator with round 1's group released, its pool recording what
    it is told (the coordinator's decisions, sans-IO), and the job's config (``over``: its changes)."""
    import queue

    from aggregator.jobs.registry import build_job
    from aggregator.shards.secure_groups import ShardedSecureJob
    from ops_fleet import job_config

    class RecordingPool:
        shards = 2

        def __init__(self):
            self.placed, self.told, self.group_outcomes = {}, [], queue.Queue()

        def open_group(self, shard, config, context):
            self.placed[config.round_id] = shard
            self.told.append(("open", config.round_id, config, context))

        def tell_group(self, round_id, command, *args):
            if round_id in self.placed:
                self.told.append((command, round_id, *args))

        def group_ended(self, round_id):
            self.placed.pop(round_id, None)

    keys = SecureKeys.create(tmp_path, DEVICES)
    config = {**job_config(DEVICES, "fed3r-sync", **over), "max_samples": 100, **keys.job_fields(tmp_path)}
    pool = RecordingPool()
    coordinator = ShardedSecureJob(build_job("fed3r-sync", config), "fed3r-sync", pool)
    assert sorted(coordinator.next_participants(set(members))) == members
    return coordinator, pool, config, keys


def _hosting_shard(tmp_path, members, admitted=None):
    """Round 1's group of ``members`` released by a Fed3R-Sync coordinator and opened on shard 1 of
    2 (its store in ``tmp_path``; ``admitted``: the fleet it is told, None: open), and the same job
    built as one aggregator's, its participants the same: (coordinator, pool, config, keys, host, one)."""
    from aggregator.jobs.registry import build_job
    from aggregator.shards.shard import ShardIngest
    from aggregator.storage.store import Store

    coordinator, pool, config, keys = _sharded_coordinator(tmp_path, members, clients_per_round=len(members))
    coordinator.on_protocol_tick(1.0)
    _, _, group, context = pool.told[0]
    host = ShardIngest(1, 2, Store(tmp_path / "s1.db"))
    host.set_job(config["job_id"], "fed3r-sync", config)
    if admitted is not None:
        host.admit(admitted)
    host.groups.open(group, context)
    one = build_job("fed3r-sync", config)
    assert sorted(one.next_participants(set(members))) == members
    return coordinator, pool, config, keys, host, one


def test_a_member_gone_before_its_group_is_placed_is_told_to_the_shard_that_hosts_it(tmp_path):
    """A review's finding: a member that went offline (or declined) between the round's tasks and
    the tick that places its group on a shard was forgotten, so the host held the advertise phase
    open for it until the phase's timeout, where one aggregator closes it when the others answer."""
    from aggregator.jobs.registry import build_job
    from aggregator.shards.shard import ShardIngest
    from aggregator.storage.store import Store
    from protocols.payloads.secagg import from_envelope, to_envelope
    from protocols.secagg import ClientSecAgg

    members = ["dev03", "dev04", "dev08"]
    coordinator, pool, config, keys = _sharded_coordinator(tmp_path, members)
    assert coordinator.secure_round_live(1)
    coordinator.member_offline("dev04", 0.5)                  # before the group's first tick
    coordinator.on_protocol_tick(1.0)                         # places it
    assert [told[0] for told in pool.told] == ["open", "group_offline"] and pool.told[1][1:] == (1, "dev04")
    _, _, group, context = pool.told[0]
    host = ShardIngest(1, 2, Store(tmp_path / "s1.db"))
    host.set_job(config["job_id"], "fed3r-sync", config)
    host.groups.open(group, context)
    one = build_job("fed3r-sync", config)                     # one aggregator, told the same at the same time
    assert sorted(one.next_participants(set(members))) == members
    one.member_offline("dev04", 0.5)
    machines = {"one aggregator": (one.on_protocol_tick(1.0), one.on_protocol),
                "sharded": (_host_told(host, pool.told[1:], 1.0), host.groups.job.on_protocol)}
    for name, (started, on_protocol) in machines.items():
        for device, env in started:
            if device == "dev04":
                continue
            start = from_envelope(env)
            client = ClientSecAgg(keys.devices[device], "aggregator", keys.aggregator.public_key_bytes,
                                  job_id=start.job_id, round_id=start.round_id, group_id=start.group_id)
            for reply in client.handle(start):
                on_protocol(device, to_envelope(reply), 1.0)
    assert one.secure.state.value == host.groups.job.secure.state.value == "wait_shares"


def _host_told(host, told, now):
    """The host's first phase after the coordinator's notices reached it, as the pool delivers them."""
    for command, round_id, device in told:
        assert command == "group_offline"
        host.groups.offline(round_id, device, now)
    return host.groups.tick(now)


def _group_with_a_copied_key(start, on_protocol, keys, vectors, owner, copier, now=1.0) -> None:
    """Round 1's group from its first messages (``start``) to its end through ``on_protocol``, each
    member a real SecAgg client of its Fed3R-Sync ``vectors``; ``copier`` advertises ``owner``'s cipher
    key (signed by itself), after the owner, and then goes silent."""
    from protocols.payloads.secagg import from_envelope, to_envelope
    from protocols.secagg import ClientSecAgg
    from secagg_rounds import resign

    clients, adverts = {}, {}
    for device, env in start:
        first = from_envelope(env)
        clients[device] = ClientSecAgg(keys.devices[device], "aggregator", keys.aggregator.public_key_bytes,
                                       job_id=first.job_id, round_id=first.round_id, group_id=first.group_id,
                                       input_vector=vectors[device])
        [adverts[device]] = clients[device].handle(first)
    adverts[copier] = resign(adverts[copier], keys.devices[copier], cipher_public_key=adverts[owner].cipher_public_key)
    sends = []
    for device in sorted(adverts):
        sends += on_protocol(device, to_envelope(adverts[device]), now)
    while sends:
        replies = [(device, reply) for device, env in sends if device != copier
                   for reply in clients[device].handle(from_envelope(env))]
        sends = [out for device, reply in replies for out in on_protocol(device, to_envelope(reply), now)]


def test_a_copied_key_on_shards_is_in_the_round_log_as_on_one_aggregator(tmp_path):
    """A review's finding: a member advertising another member's public key is refused by the
    group's server machine, and one aggregator's round log names it (``secure_refused``, with why);
    on shards that machine runs on the host, and the coordinator's round log left it out. The same
    group run by one aggregator and by a host for the coordinator: the same survivors, the same
    sum, the same ``secure_refused``."""
    from aggregator.jobs.registry import build_job
    from aggregator.service.active_job import ActiveJob
    from aggregator.shards.shard import ShardIngest
    from aggregator.storage.store import Store
    from protocols.payloads.secagg import pack_sync_vector
    from protocols.rounds import RoundClosed
    from ops_fleet import C, D

    members = ["dev03", "dev04", "dev05", "dev06", "dev08"]
    owner, copier = "dev04", "dev06"
    coordinator, pool, config, keys = _sharded_coordinator(tmp_path, members, clients_per_round=len(members))
    rng = np.random.default_rng(3)
    vectors = {}
    for device in members:
        z = np.hstack([rng.uniform(-1, 1, (4, D)), np.ones((4, 1))])
        vectors[device] = pack_sync_vector((z.T @ z)[np.triu_indices(D + 1)], np.eye(C)[rng.integers(0, C, 4)].T @ z, 4)

    one = build_job("fed3r-sync", config)
    assert sorted(one.next_participants(set(members))) == members
    _group_with_a_copied_key(one.on_protocol_tick(1.0), one.on_protocol, keys, vectors, owner, copier)

    coordinator.on_protocol_tick(1.0)                         # places the group on its host
    _, _, group, context = pool.told[0]
    host = ShardIngest(1, 2, Store(tmp_path / "s1.db"))
    host.set_job(config["job_id"], "fed3r-sync", config)
    host.groups.open(group, context)
    _group_with_a_copied_key(host.groups.tick(1.0), host.groups.feed, keys, vectors, owner, copier)
    for outcome in host.groups.outcomes():                   # what the host's loop sends its coordinator
        assert outcome[0] == "group"
        pool.group_outcomes.put(outcome[1:])
    coordinator.on_protocol_tick(2.0)

    survivors = tuple(sorted(set(members) - {copier}))
    entries = {}
    for name, job in (("one aggregator", one), ("shards", coordinator)):
        assert job.settled(1) == survivors, name
        entries[name] = ActiveJob(job=job, kind="fed3r-sync", out_dir=None).round_entry(
            RoundClosed(1, survivors, (copier,), (), ()), 0.0, 3.0)
    assert one.strategy.packed_upper().tobytes() == coordinator.inner.strategy.packed_upper().tobytes()
    refused = entries["one aggregator"].get("secure_refused")
    assert refused is not None and set(refused) == {copier} and owner in refused[copier] and "cipher" in refused[copier]
    assert entries["shards"].get("secure_refused") == refused


def test_culprits_a_host_names_for_a_round_closed_meanwhile_are_kept_out_of_later_rounds(tmp_path):
    """A review's finding: a host's failure report for a round the coordinator had closed at its
    deadline was dropped before its culprits were noted, so the device they named was drawn again."""
    coordinator, pool, _, _ = _sharded_coordinator(tmp_path, ["dev03", "dev04", "dev08"])
    coordinator.on_protocol_tick(1.0)
    coordinator.abort_secure_round(1, "deadline")             # the coordinator closed it first
    pool.group_outcomes.put((coordinator.inner.config.job_id, "failed", 1, ("dev04",), "aborted: deadline"))
    coordinator.on_protocol_tick(2.0)
    assert coordinator.culprits == {"dev04"}
    assert "dev04" not in coordinator.inner.next_participants(set(DEVICES))


def test_a_group_its_shard_cannot_build_fails_with_the_reason_and_the_shard_lives(tmp_path):
    """A review's finding: a member the shard's device keys lack (the key file edited, the shard
    restarted) raised SecAgg's ConfigError out of ShardGroups.open, which ended the shard process."""
    from aggregator.jobs.registry import build_job
    from aggregator.shards.shard import ShardIngest
    from aggregator.storage.store import Store
    from ops_fleet import job_config

    config = {**job_config(DEVICES, "fed3r-sync"), "max_samples": 100,
              **SecureKeys.create(tmp_path, DEVICES).job_fields(tmp_path)}
    coordinator = build_job("fed3r-sync", config)
    coordinator.next_participants({"dev03", "dev04", "dev08"})
    group, context = coordinator.release_group()
    keys_file = tmp_path / "device_keys.json"
    keys = json.loads(keys_file.read_text())
    keys.pop("dev04")
    keys_file.write_text(json.dumps(keys))
    host = ShardIngest(1, 2, Store(tmp_path / "s1.db"))
    host.set_job(config["job_id"], "fed3r-sync", config)
    assert host.groups.open(group, context) == []
    assert host.groups.job.secure_failure(1).startswith("its shard cannot host it: ")
    assert "dev04" in host.groups.job.secure_failure(1)


def test_a_jobs_per_round_secure_bookkeeping_nobody_reads_stays_bounded():
    """A review's finding: a shard hosting groups never read its phases' times, and a round aborted
    after it closed left its (empty) survivors: a few hundred bytes a round, for the job's life."""
    from aggregator.jobs.secure_rounds import KEPT_ROUNDS, BoundedByRound

    table = BoundedByRound()
    for round_ in range(1, 3 * KEPT_ROUNDS):
        table.setdefault(round_, {})["advertise_keys"] = 0.5
        table[round_]["share_keys"] = 1.0
    assert list(table) == list(range(2 * KEPT_ROUNDS, 3 * KEPT_ROUNDS))
    assert table[3 * KEPT_ROUNDS - 1] == {"advertise_keys": 0.5, "share_keys": 1.0}


@pytest.mark.parametrize("fleet", ["enrolled", "open"])
def test_a_revoked_members_secagg_message_is_refused_by_its_host_as_by_one_aggregator(tmp_path, fleet):
    """A review's finding: one aggregator refuses a revoked device's every message before the
    group's server machine sees it ("revoked device"); a shard hosting the group fed the revoked
    member's (unchunked) secagg messages to the machine, which took it back in ("it answered: it
    is back"), so its masked input would be in the sharded sum and not in one aggregator's. The
    same group after dev08's revocation: the host hands dev08's key advertisement to the
    coordinator's path (which refuses it) and the next phase goes to the members one aggregator asks.
    An open fleet's too: one aggregator refuses a revoked device in either mode, and its shards were
    not told of the revocation at all (a later review's finding)."""
    from aggregator.shards.shard import Forward, Publish
    from protocols.envelope import encode
    from protocols.payloads.secagg import from_envelope, to_envelope
    from protocols.secagg import ClientSecAgg
    from protocols.topics import Topics

    members, revoked = ["dev03", "dev04", "dev05", "dev06", "dev08"], "dev08"
    coordinator, pool, config, keys, host, one = _hosting_shard(tmp_path, members,
                                                                DEVICES if fleet == "enrolled" else None)

    def adverts(start):
        out = {}
        for device, env in start:
            first = from_envelope(env)
            client = ClientSecAgg(keys.devices[device], "aggregator", keys.aggregator.public_key_bytes,
                                  job_id=first.job_id, round_id=first.round_id, group_id=first.group_id)
            [out[device]] = client.handle(first)
        return out

    one_adverts, host_adverts = adverts(one.on_protocol_tick(1.0)), adverts(host.groups.tick(1.0))
    host.admission_changed(revoked, False)              # the operator revokes dev08 (the pool's commands)
    host.groups.offline(1, revoked, 1.5)
    one.member_offline(revoked, 1.5)                    # one aggregator's runner: device_lost
    refused = host.feed(Topics().outbox(revoked), encode(to_envelope(host_adverts[revoked])), 2.0)
    assert isinstance(refused, Forward) and refused.not_admitted   # the coordinator refuses it: revoked
    one_next, host_next = [], []
    for device in sorted(set(members) - {revoked}):     # one aggregator's loop never passes dev08's on
        one_next += one.on_protocol(device, to_envelope(one_adverts[device]), 2.0)
        got = host.feed(Topics().outbox(device), encode(to_envelope(host_adverts[device])), 2.0)
        assert isinstance(got, Publish)
        host_next += got.sends
    assert sorted(d for d, _ in one_next) == sorted(set(members) - {revoked})
    assert sorted(d for d, _ in host_next) == sorted(d for d, _ in one_next)


def test_a_hosted_groups_refused_secagg_messages_are_counted_by_the_coordinator_as_by_one_aggregator(tmp_path, monkeypatch):
    """A review's finding: a shard hosting a secure group logged and dropped a secagg message its
    group's machine refused (or one that raised), unheard of by the coordinator, where one
    aggregator's ``_on_protocol`` counts a "protocol" rejection (a late message: ``late``) and its
    loop's last resort a "malformed" one. The same bytes go to one aggregator's service and, through
    a shard's loop (``local._feed``), to the group's host, whose word goes to its coordinator's
    service: a malformed message of the hosted round, a silent member's key advertisement after its
    phase closed (late), one advertisement sent again, and one the machine raises on. Both count
    the same, and both groups run on alike."""
    from collections import Counter
    from types import SimpleNamespace

    from aggregator.service.active_job import ActiveJob
    from aggregator.service.loop import AggregatorService
    from aggregator.shards.local import HeldMessages, _feed
    from protocols.envelope import Envelope, encode
    from protocols.mqtt_link import BrokerConfig
    from protocols.payloads.secagg import from_envelope, to_envelope
    from protocols.secagg import ClientSecAgg
    from protocols.topics import Topics

    members, silent = ["dev03", "dev04", "dev05", "dev06", "dev08"], "dev05"
    coordinator_job, pool, config, keys, host, one = _hosting_shard(tmp_path, members)
    unconnected = BrokerConfig.from_url("mqtt://127.0.0.1:1")     # neither service runs: no broker is reached
    quiet = SimpleNamespace(publish_envelope=lambda *args, **kwargs: None)     # what the machines send is not read here
    one_aggregator = AggregatorService(None, unconnected, tmp_path / "one")
    one_aggregator.active, one_aggregator.link = ActiveJob(one, "fed3r-sync", tmp_path / "one"), quiet
    coordinator = AggregatorService(None, unconnected, tmp_path / "coordinator")    # counts a shard's word
    told = []
    shard_conn = SimpleNamespace(send=told.append)

    adverts = {}
    for device, env in one.on_protocol_tick(1.0):       # one client per member answers both machines alike
        first = from_envelope(env)
        client = ClientSecAgg(keys.devices[device], "aggregator", keys.aggregator.public_key_bytes,
                              job_id=first.job_id, round_id=first.round_id, group_id=first.group_id)
        [adverts[device]] = client.handle(first)
    host.groups.tick(1.0)
    one.member_offline(silent, 1.5)                     # the silent member: the others close the phase
    host.groups.offline(1, silent, 1.5)

    def to_both(device, env):
        topic, payload = Topics().outbox(device), encode(env)
        one_aggregator.loop.post(("mqtt", topic, payload))
        one_aggregator.loop.serve_pending()
        _feed(host, shard_conn, quiet, Topics(), HeldMessages(), (topic, payload), 2.0)
        while told:     # as the service's wiring posts a shard's word (a forward is a device's message)
            item = told.pop(0)
            coordinator.loop.post(("mqtt", *item[1:]) if item[0] == "forward" else item)
        coordinator.loop.serve_pending()

    to_both("dev03", Envelope(type=SECAGG_TYPE, sender="dev03", body={"secagg": {"round_id": 1, "phase": "nonsense"}}))
    for device in sorted(set(members) - {silent}):
        to_both(device, to_envelope(adverts[device]))
    assert one.secure.state.value == host.groups.job.secure.state.value == "wait_shares"
    to_both(silent, to_envelope(adverts[silent]))       # its phase closed: late
    to_both("dev03", to_envelope(adverts["dev03"]))     # already received: refused
    assert type(host.groups.job) is type(one)
    with monkeypatch.context() as patched:              # a machine's unexpected error: the last resort's
        patched.setattr(type(one), "on_protocol", lambda *args, **kwargs: 1 / 0)
        to_both("dev04", to_envelope(adverts["dev04"]))
    expected = Counter({"protocol": 2, "malformed": 1})
    assert (one_aggregator.active.stats.rejections, one_aggregator.active.stats.late) == (expected, 1)
    assert (coordinator.stats.rejections, coordinator.stats.late) == (expected, 1)
    assert one.secure.state.value == host.groups.job.secure.state.value == "wait_shares"
