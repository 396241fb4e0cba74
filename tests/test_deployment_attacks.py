"""Rollouts against an attacker (issue 37), over a real mosquitto, with the controller and the
followers of ``deployment_fleet.py``:

* replay: a validly signed assignment and head of an older version, captured while it rolled
  out and republished after a newer one, are refused (stale sequence) and the device keeps the
  newer version; the same assignment republished on another device's topic is refused (it names
  its device); a late report on the finished deployment is refused and counted, the stored one
  unchanged; the refusals the device reports are counted per deployment by class;
* a lying canary device: one of three reports, signed and well-formed, counts far beyond any
  held-out split, inflated for a broken head and deflated for a good one; the honest devices'
  verdict stands both times (rollback, promotion), and the decision records the liar's claimed n
  next to the weight it was given.
"""

import shutil
import threading
import time

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from edge_client.deployment import DeploymentFollower, ModelSlot
from protocols.envelope import Envelope, decode, encode
from protocols.message_loop import MESSAGE_OVERHEAD_BYTES, QueueBound
from protocols.payloads import deployment as D
from test_broker_security import secured  # noqa: F401 (fixture)
from deployment_fleet import N_HOLDOUT, D_sha, correct, model_id, setup, store_state, world  # noqa: F401
from ops_fleet import wait_for


class Sniffer:
    """Anyone on the broker path: records what is published on the topics it reads, republishes at will."""

    def __init__(self, broker, topics):
        self.seen: dict[str, list[bytes]] = {}
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"sniffer-{time.monotonic_ns()}")
        self.client.on_message = lambda c, u, m: self.seen.setdefault(m.topic, []).append(bytes(m.payload))
        self.client.connect("127.0.0.1", broker.port)
        self.client.loop_start()
        for t in topics:
            self.client.subscribe(t, qos=1)

    def run(self, topics, device: str, deployment: str) -> bytes:
        """The signed ``run`` assignment of ``deployment`` it saw sent to ``device``."""
        return next(p for p in self.seen[topics.deploy(device)]
                    if decode(p).body.get("deployment") == deployment and decode(p).body.get("action") == "run")

    def head(self, topics, device: str, deployment: str) -> bytes:
        """The head file of ``deployment`` it saw sent to ``device``."""
        return next(p for p in self.seen[topics.deploy_in(device)] if decode(p).body.get("name") == f"{deployment}.npz")

    def publish(self, topic, payload, retain=False):
        self.client.publish(topic, payload, qos=1, retain=retain).wait_for_publish(5)

    def close(self):
        self.client.loop_stop()
        self.client.disconnect()


def two_versions(store, world) -> tuple[tuple[int, int], tuple[str, str]]:
    """Models v1 and v2, heads of the same argmax and other bytes: ((their ids), (their sha256s))."""
    W, b = world["good"]
    return ((model_id(store, "v1", W, b), model_id(store, "v2", W * 1.5, b * 1.5)),
            (D_sha((W, b)), D_sha((W * 1.5, b * 1.5))))


def forget_session(broker, device: str) -> None:
    """``device``'s broker session gone (past its expiry, a broker without persistence): what was
    queued for it is lost, only retained messages reach it."""
    session = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"{device}.deploy", clean_session=True)
    session.connect("127.0.0.1", broker.port)
    session.disconnect()


def lose_state(fleet, device: str) -> None:
    """``device`` stopped, its deployment state gone (it holds sequence 0 when it starts again)."""
    fleet.followers[device].stop()
    shutil.rmtree(fleet.tmp / device)


def settle(ctl, store, fleet, model: int, sha: str, deployment_id: str = "v1") -> None:
    """``model`` rolled out to cam-0 and cam-1 and complete: the settled version."""
    ctl.call(lambda: ctl.deploy(model, cohort="devices:cam-0,cam-1", stages="100%", bake_s=0, min_reports=2,
                                deployment_id=deployment_id))
    wait_for(lambda: store_state(store, deployment_id) == "complete" and fleet.sha("cam-0") == fleet.sha("cam-1") == sha,
             what=f"{deployment_id} settled on both devices")


def settled_on_v1(setup, world):
    """cam-0 and cam-1 started, a controller, v1 settled on both (``settle``): (the controller,
    (v1, v2) model ids, their sha256s)."""
    store, controller, fleet = setup
    versions, shas = two_versions(store, world)
    for d in ("cam-0", "cam-1"):
        fleet.start(d)
    ctl = controller()
    settle(ctl, store, fleet, versions[0], shas[0])
    return ctl, versions, shas


def tagged_canary(ctl, store, fleet, model: int, sha: str, deployment_id: str = "v2") -> None:
    """cam-0 tagged ``lab`` and ``model`` in a ``tags:lab`` canary baking for an hour, judged on cam-0."""
    store.set_device_tags("cam-0", ["lab"])
    ctl.call(lambda: ctl.deploy(model, cohort="tags:lab", stages="100%", bake_s=3600, deployment_id=deployment_id))
    wait_for(lambda: fleet.sha("cam-0") == sha and ctl.show(deployment_id)["devices"]["cam-0"]["report"] is not None,
             what="the candidate judged on the tagged device")


def test_a_replayed_older_assignment_and_head_are_refused_and_late_reports_counted(setup, world, broker):
    store, controller, fleet = setup
    T = fleet.topics
    sniffer = Sniffer(broker, [T.deploy("cam-0"), T.deploy_in("cam-0")])
    try:
        ctl, (v1, v2), (sha1, sha2) = settled_on_v1(setup, world)
        old_assignment = sniffer.seen[T.deploy("cam-0")][-1]
        old_head = next(p for p in sniffer.seen[T.deploy_in("cam-0")] if decode(p).body.get("sha256") == sha1)
        assert D.parse_assignment(decode(old_assignment))["sha256"] == sha1       # what was captured: v1's, signed
        v1_report = ctl.show("v1")["devices"]["cam-0"]["report"]

        ctl.call(lambda: ctl.deploy(v2, cohort="devices:cam-0,cam-1", stages="100%", bake_s=0, min_reports=2,
                                    deployment_id="v2"))
        wait_for(lambda: store_state(store, "v2") == "complete" and fleet.sha("cam-0") == sha2, what="v2 on cam-0")
        wait_for(lambda: fleet.sha("cam-1") == sha2, what="v2 on cam-1")
        follower = fleet.followers["cam-0"]
        refusals = len(follower.refusals)

        # the downgrade: v1's signed assignment and head republished (retained, as the original)
        sniffer.publish(T.deploy("cam-0"), old_assignment, retain=True)
        sniffer.publish(T.deploy_in("cam-0"), old_head)
        wait_for(lambda: len(follower.refusals) > refusals, what="the replay's refusal")
        assert "older than the one held" in follower.refusals[-1], follower.refusals[-1]
        time.sleep(0.5)                          # time enough to fetch and swap, had it been taken (it took 10 ms)
        assert fleet.sha("cam-0") == sha2 and follower.slot.seq == ctl.last["cam-0"][1]
        assert follower.reports[-1]["reason"] == "stale"

        # redirected: cam-0's assignment on cam-1's topic
        other = fleet.followers["cam-1"]
        n_other = len(other.refusals)
        sniffer.publish(T.deploy("cam-1"), old_assignment, retain=True)
        wait_for(lambda: len(other.refusals) > n_other, what="the redirected assignment's refusal")
        assert "is for 'cam-0', not this device" in other.refusals[-1] and fleet.sha("cam-1") == sha2

        # a late report on the finished v1 (what the replay used to produce), sent as the device
        late = D.report_message("cam-0", "v1", sha1, n=40, correct_candidate=40, correct_current=0,
                                seq=v1_report["seq"])
        sniffer.publish(T.deploy_out("cam-0"), encode(late))
        wait_for(lambda: ctl.show("v1")["counts"]["late_reports"] == 1, what="the late report counted")
        assert ctl.show("v1")["devices"]["cam-0"]["report"] == v1_report
        # the device's refusals, by class, on the deployment it runs
        # cam-0's and cam-1's refusal reports travel on two devices' topics: either may arrive last
        wait_for(lambda: ctl.show("v2")["counts"].get("refused:stale") == 1, what="the stale refusal counted")
        wait_for(lambda: ctl.show("v2")["counts"].get("refused:device") == 1, what="the device refusal counted")
        assert ctl.show("v2")["state"] == "complete" and ctl.show("v2")["counts"]["refused"] == 0
    finally:
        for d in ("cam-0", "cam-1"):
            sniffer.publish(T.deploy(d), b"", retain=True)
        sniffer.close()


class LyingFollower(DeploymentFollower):
    """An enrolled device that evaluates honestly, then reports what it likes: ``lie`` "inflate"
    (the candidate is perfect, its current head useless) or "deflate" (the other way round)."""
    lie = None

    def _report(self, env):
        if self.lie and "n" in env.body:
            big = 10 ** 9
            body = {**env.body, "n": big, "correct_candidate": big if self.lie == "inflate" else 0,
                    "correct_current": 0 if self.lie == "inflate" else big}
            env = Envelope(type=env.type, sender=env.sender, body=body)
        super()._report(env)


def test_a_lying_canary_device_cannot_move_the_honest_canarys_verdict(setup, world, broker):
    store, controller, fleet = setup
    W, b = world["good"]
    good, broken = model_id(store, "good", W, b), model_id(store, "broken", *world["broken"])
    good2 = model_id(store, "good2", W * 1.5, b * 1.5)                      # the same predictions, other bytes
    canary = "devices:cam-0,cam-1,cam-2"
    for d in ("cam-0", "cam-1"):
        fleet.start(d)
    liar = LyingFollower("cam-2", fleet.broker, ModelSlot(fleet.tmp / "cam-2"), lambda bundle: world["holdout"]["cam-2"],
                         topics=fleet.topics, aggregator_key=fleet.key, retry_s=0.5, fetch_timeout_s=10)
    fleet.followers["cam-2"] = liar.start()
    ctl = controller()
    ctl.call(lambda: ctl.deploy(good, cohort=canary, stages="100%", bake_s=0, deployment_id="base"))
    wait_for(lambda: store_state(store, "base") == "complete", what="the honest first rollout")

    liar.lie = "inflate"                              # a head with permuted classes, praised by the liar
    ctl.call(lambda: ctl.deploy(broken, cohort=canary, stages="100%", bake_s=0.3, deployment_id="broken-1"))
    wait_for(lambda: store_state(store, "broken-1") in ("rolled_back", "complete"), what="the broken head judged")
    view = ctl.show("broken-1")
    assert view["state"] == "rolled_back" and "median_drop" in view["reason"], view["reason"]
    evidence = view["history"][-1]["metrics"]["evidence"]
    assert evidence["cam-2"]["n"] == 10 ** 9 and evidence["cam-2"]["weight"] == N_HOLDOUT   # its earlier n
    honest = []
    for d in ("cam-0", "cam-1"):
        Z, y = world["holdout"][d]
        honest.append(100 * (correct(world["good"], Z, y) - correct(world["broken"], Z, y)) / N_HOLDOUT)
        assert evidence[d] == {"n": N_HOLDOUT, "weight": N_HOLDOUT, "drop": honest[-1]}
    assert view["history"][-1]["metrics"]["median_drop"] == sorted([*honest, -100.0])[1] > 1.0

    liar.lie = "deflate"                              # a good head, slandered by the liar
    wait_for(lambda: all(fleet.sha(d) == D_sha(world["good"]) for d in ("cam-0", "cam-1", "cam-2")),
             what="the canary back on the good head")
    ctl.call(lambda: ctl.deploy(good2, cohort=canary, stages="100%", bake_s=0.3, deployment_id="good-2"))
    wait_for(lambda: store_state(store, "good-2") in ("rolled_back", "complete"), what="the good head judged")
    view = ctl.show("good-2")
    assert view["state"] == "complete", view["reason"]
    metrics = view["history"][-1]["metrics"]
    assert metrics["evidence"]["cam-2"]["drop"] == 100.0 and metrics["median_drop"] == 0.0


def test_a_corrupted_stored_head_halts_its_deployment_and_nothing_else(setup, world):
    """Someone with disk access replaces a stored head (a valid file, other arrays) and flips a bit
    in another: the restarted controller starts (it refused to, with StoreError), halts the
    deployment of the altered model with the reason, and goes on serving the settled version to a
    new device and rolling out another model; deploying the bit-flipped model is one clear error."""
    from aggregator.deployments.controller import CorruptModel, deployment_view
    from aggregator.storage.deployments import DeploymentStore
    from aggregator.storage.store import npz_bytes

    store, controller, fleet = setup
    W, b = world["good"]
    base, other, third, flipped = (model_id(store, name, W * k, b * k) for name, k in
                                   (("base", 1.0), ("other", 1.5), ("third", 2.0), ("flipped", 2.5)))
    for d in ("cam-0", "cam-1"):
        fleet.start(d)
    ctl = controller()
    ctl.call(lambda: ctl.deploy(base, cohort="devices:cam-0,cam-1", stages="100%", bake_s=0, min_reports=2,
                                deployment_id="base"))
    wait_for(lambda: store_state(store, "base") == "complete", what="the base rollout")
    ctl.call(lambda: ctl.deploy(other, cohort="devices:cam-0", stages="100%", bake_s=3600, deployment_id="other"))
    other_sha = D_sha((W * 1.5, b * 1.5))
    wait_for(lambda: fleet.sha("cam-0") == other_sha, what="the canary on the other head")
    ctl.stop()

    with store._tx() as db:                 # the disk: one head replaced, one bit flipped in another
        db.execute("UPDATE models SET arrays=? WHERE model_id=?",
                   (npz_bytes({"coef": world["broken"][0], "intercept": world["broken"][1]}), other))
        raw = bytearray(store.model_bytes(flipped))
        raw[len(raw) // 2] ^= 1
        db.execute("UPDATE models SET arrays=? WHERE model_id=?", (bytes(raw), flipped))

    ctl2 = controller()                     # starts: the fault is one deployment's, not the service's
    view = deployment_view(DeploymentStore(store), "other")
    assert view["state"] == "halted" and "no longer hash" in view["reason"], view["reason"]
    assert ctl2.active is None and ctl2.settled.dep.deployment_id == "base"
    assert "no longer hash" in store.setting(f"model.{other}.corrupt")
    assert fleet.sha("cam-0") == other_sha   # devices keep what they run; nothing more is sent for it

    store.enroll_device("cam-9", None, None)  # the service goes on: a new device gets the settled version
    fleet.start("cam-9")
    wait_for(lambda: fleet.sha("cam-9") == D_sha((W, b)), what="the new device on the settled version")
    with pytest.raises(CorruptModel, match="unreadable"):
        ctl2.call(lambda: ctl2.deploy(flipped, cohort="devices:cam-1", deployment_id="flipped"))
    assert DeploymentStore(store).get("flipped") is None
    ctl2.call(lambda: ctl2.deploy(third, cohort="devices:cam-1", stages="100%", bake_s=0, min_reports=1,
                                  deployment_id="third"))
    wait_for(lambda: store_state(store, "third") == "complete", what="another model's rollout")


def test_on_the_generated_acl_broker_no_two_connections_share_an_identity(secured, tmp_path, world):
    """The aggregator's service and deployment controller, a device's agent connection, its
    deployment follower and its on-demand bundle fetch, all on the TLS + ACL broker fedfleet generates (the user name is the
    client id), through a whole rollout and 5 s more with a 1 s keepalive: the broker closes none
    of the connections (with one account for service and controller, and one for agent and
    follower, each pair closed the other in turn about once a second, and this rollout did not
    complete in 15 s). 5 s: several keepalive periods and reconnect delays, enough to show that
    churn. FEDFLEET_ACL_SOAK_S=180 holds the connections for minutes (a soak run outside make test)."""
    import os
    import threading

    from aggregator.deployments.controller import DeploymentController
    from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
    from aggregator.service.loop import AggregatorService
    from aggregator.service.settings import ServiceSettings
    from aggregator.storage.store import Store
    from ops_fleet import job_config
    from protocols.mqtt_link import BrokerConfig, MqttLink
    from protocols.topics import AGGREGATOR_ID, FETCH_ROLE, Topics

    sec, port = secured
    store = Store(tmp_path / "state.db")
    broker = BrokerConfig("127.0.0.1", port, AGGREGATOR_ID, sec.aggregator_password, tls_ca=str(sec.ca_cert),
                          keepalive=1)
    svc = AggregatorService(Fed3RJob(Fed3RConfig(**job_config(["dev01"], start_timeout_s=60))), broker,
                            tmp_path / "out", ServiceSettings(tick_s=0.05), store=store, security=sec)
    creds = svc.enroll("dev01", None)
    device = BrokerConfig("127.0.0.1", port, "dev01", creds.mqtt_password, tls_ca=str(sec.ca_cert), keepalive=1)
    W, b = world["good"]
    store.create_job("heads", "fed3r", {})
    model = store.finish_job("heads", "done", {}, {}, {"coef": W, "intercept": b}, {}, 1)
    hold_s = float(os.environ.get("FEDFLEET_ACL_SOAK_S", "5"))
    thread = threading.Thread(target=svc.run, kwargs={"timeout_s": 60 + hold_s}, daemon=True)
    thread.start()
    ctl = DeploymentController(store, broker, Topics(), tick_s=0.05).start()
    agent = MqttLink("dev01", device, on_message=lambda t, p: None, subscriptions=[(Topics().inbox("dev01"), 1)])
    agent.start()                                # the agent's connection, as edge_client/agent.py opens it
    follower = DeploymentFollower("dev01", device, ModelSlot(tmp_path / "slot"), lambda bundle: world["holdout"]["cam-0"],
                                  retry_s=0.5).start()
    fetch_broker = device.for_role(FETCH_ROLE)     # a bundle fetched on demand, as fedfleet/device.py does
    fetch = MqttLink(fetch_broker.username, fetch_broker, on_message=lambda t, p: None,
                     subscriptions=[(Topics().inbox("dev01"), 1)], clean_start=True)
    fetch.start()
    links = {"service": svc.link, "controller": ctl.link, "agent": agent, "follower": follower.link, "fetch": fetch}
    closed = {name: 0 for name in links}
    for name, link in links.items():            # count every connection the broker closes
        handler = link.client.on_disconnect
        link.client.on_disconnect = (lambda h, n: lambda *a: (closed.__setitem__(n, closed[n] + 1), h(*a)))(handler, name)
    try:
        assert all(link.connected.wait(10) for link in links.values())
        ctl.call(lambda: ctl.deploy(model, cohort="devices:dev01", stages="100%", bake_s=0, min_reports=1,
                                    deployment_id="acl-1"))
        wait_for(lambda: store_state(store, "acl-1") == "complete", 15, "the rollout on the ACL broker")
        assert follower.slot.current.sha256 == D_sha((W, b))
        time.sleep(hold_s)
        assert closed == {name: 0 for name in links}, closed
        assert all(link.connected.is_set() for link in links.values())
        assert {link.client._client_id.decode() for link in links.values()} == \
            {"aggregator", "aggregator/deployments", "dev01", "dev01/deploy", "dev01/fetch"}
    finally:
        fetch.stop()
        follower.stop()
        agent.stop()
        ctl.stop()
        svc.stop()
        thread.join(10)


def test_a_refusal_names_its_class_and_forgeries_cannot_make_a_device_flood_reports(broker, tmp_path, world):
    """A device holding the aggregator's key, driven by a test-held aggregator identity over the
    broker: a head altered after signing is refused as ``signature``, one whose bytes do not hash
    to the assignment (signed as such) as ``hash``, an assignment whose head never comes as
    ``timeout``, each reported against its own assignment (once per class, however many forged
    heads come); 30 forged assignments make one report."""
    from protocols.identity import DeviceIdentity
    from protocols.mqtt_link import BrokerConfig
    from protocols.payloads.artifacts import artifact_message
    from protocols.topics import AGGREGATOR_ID, Topics

    agg = DeviceIdentity.generate(AGGREGATOR_ID)
    T = Topics(f"r{time.monotonic_ns()}")
    sniffer = Sniffer(broker, [T.deploy_out("cam-0")])
    follower = DeploymentFollower("cam-0", BrokerConfig.from_url(broker.url), ModelSlot(tmp_path / "slot"),
                                  lambda bundle: world["holdout"]["cam-0"], topics=T, aggregator_key=agg.public_key_bytes,
                                  retry_s=0.2, fetch_timeout_s=1.0, refusal_interval_s=60).start()
    head = D.head_npz(*world["good"])
    sha = D_sha(world["good"])

    def assign(dep, seq, sha=sha):
        sniffer.publish(T.deploy("cam-0"), encode(D.run_message(AGGREGATOR_ID, dep, sha, len(head), 1, device="cam-0",
                                                                seq=seq), signer=agg.sign), retain=True)

    def reports():
        return [decode(p).body for p in sniffer.seen.get(T.deploy_out("cam-0"), []) if decode(p).type == D.REPORT]
    try:
        assign("d1", 1)                          # the head, altered after the aggregator signed it
        wait_for(lambda: T.deploy_out("cam-0") in sniffer.seen, what="the head asked for")
        signed = bytearray(encode(artifact_message(AGGREGATOR_ID, sha, "d1.npz", head), signer=agg.sign))
        signed[len(signed) // 2] ^= 1
        for _ in range(5):                       # refused each time, reported once for the assignment
            sniffer.publish(T.deploy_in("cam-0"), bytes(signed))
        wait_for(lambda: len(follower.refusals) == 5, what="the five signature refusals")
        time.sleep(0.2)
        assert len(reports()) == 1
        assign("d2", 2)                          # a signed head whose bytes are not the assigned ones
        wait_for(lambda: follower._pending is not None, what="d2 pending")
        other = D.head_npz(*world["broken"])
        sniffer.publish(T.deploy_in("cam-0"), encode(artifact_message(AGGREGATOR_ID, sha, "d2.npz", other),
                                                     signer=agg.sign))
        wait_for(lambda: len(reports()) == 2, what="the hash refusal")
        assign("d3", 3)                          # nobody answers
        wait_for(lambda: len(reports()) == 3, what="the timeout refusal")
        got = [(r["deployment"], r["seq"], r["reason"]) for r in reports()]
        assert got == [("d1", 1, "signature"), ("d2", 2, "hash"), ("d3", 3, "timeout")], got
        assert follower.slot.current is None

        assign("d4", 4)                          # now a head is taken, then forgeries rain
        sniffer.publish(T.deploy_in("cam-0"), encode(artifact_message(AGGREGATOR_ID, sha, "d4.npz", head),
                                                     signer=agg.sign))
        wait_for(lambda: follower.slot.current is not None, what="the d4 swap")
        # the swap's own report (no "refused") may still be on its way: count from after it
        wait_for(lambda: any(r["deployment"] == "d4" and "refused" not in r for r in reports()), what="the d4 report")
        before, refusals = len(reports()), len(follower.refusals)
        for i in range(30):
            sniffer.publish(T.deploy("cam-0"), encode(D.run_message(AGGREGATOR_ID, f"x{i}", sha, len(head), 1,
                                                                    device="cam-0", seq=100 + i)), retain=True)
        wait_for(lambda: len(follower.refusals) == refusals + 30, what="thirty refusals")
        time.sleep(0.3)
        flood = reports()[before:]
        assert [(r["deployment"], r["seq"], r["reason"]) for r in flood] == [("d4", 4, "signature")], flood
        # a review's finding: every refusal was kept whole for the process's life (a schema error
        # quotes the field: 60 KB a forged message here); the latest few are kept, each cut
        from edge_client.deployment import KEPT_REFUSALS, MAX_WHY_CHARS
        junk = encode(Envelope(type="x" * 60_000, sender=AGGREGATOR_ID, body={}))
        for _ in range(KEPT_REFUSALS + 20):
            sniffer.client.publish(T.deploy("cam-0"), junk, qos=1)
        wait_for(lambda: sum("x" * 100 in r for r in follower.refusals) == KEPT_REFUSALS, timeout=30,
                 what="the junk refused")
        assert len(follower.refusals) == KEPT_REFUSALS and max(map(len, follower.refusals)) <= MAX_WHY_CHARS
    finally:
        sniffer.publish(T.deploy("cam-0"), b"", retain=True)
        follower.stop()
        sniffer.close()


def test_a_device_that_lost_its_state_is_given_its_assignment_again_after_a_replay(setup, world, broker):
    """A device whose deployment state is gone holds sequence 0 and takes any signed assignment
    addressed to it: one captured while a rolled-back deployment ran, republished (retained) on the
    broker path while the device was offline, with its head. Its report on that assignment is not
    about its last one, so the controller sends its current assignment again, under a new sequence,
    and the device goes back to the version the fleet holds."""
    store, controller, fleet = setup
    topics = fleet.topics
    good, broken = model_id(store, "good", *world["good"]), model_id(store, "broken", *world["broken"])
    sniffer = Sniffer(broker, [topics.deploy("cam-0"), topics.deploy_in("cam-0")])
    for d in ("cam-0", "cam-1", "cam-2"):
        fleet.start(d)
    ctl = controller()
    ctl.call(lambda: ctl.deploy(good, cohort="devices:cam-0,cam-1,cam-2", stages="100%", bake_s=0, deployment_id="g"))
    wait_for(lambda: store_state(store, "g") == "complete", what="g")
    ctl.call(lambda: ctl.deploy(broken, cohort="devices:cam-0,cam-1,cam-2", stages="100%", bake_s=0.2,
                                deployment_id="bad"))
    wait_for(lambda: store_state(store, "bad") == "rolled_back", what="the guard rolls back bad")
    wait_for(lambda: fleet.sha("cam-0") == D_sha(world["good"]), what="cam-0 back on good")
    run_bad, head_bad = sniffer.run(topics, "cam-0", "bad"), sniffer.head(topics, "cam-0", "bad")
    lose_state(fleet, "cam-0")
    sniffer.publish(topics.deploy("cam-0"), run_bad, retain=True)
    fleet.start("cam-0")
    time.sleep(0.5)
    sniffer.publish(topics.deploy_in("cam-0"), head_bad)
    try:
        wait_for(lambda: fleet.sha("cam-0") == D_sha(world["good"]), timeout=30,
                 what=f"cam-0 on the fleet's version again (the controller's last: {ctl.last['cam-0']})")
    finally:
        sniffer.close()


def test_a_sequence_forged_before_the_device_had_the_key_does_not_bind_it_after(broker, tmp_path):
    """A review's finding: a device following rollouts without the aggregator's key (an open
    broker) took an unsigned assignment of seq 2^62 - 1 and kept that sequence; once given the key
    it refused every signed assignment as older, for good. A sequence binds only under the key it
    was held under (``ModelSlot.bind_key``); one written before keys were recorded keeps binding."""
    from protocols.identity import DeviceIdentity
    from protocols.mqtt_link import BrokerConfig
    from protocols.topics import Topics

    topics, cfg = Topics(), BrokerConfig.from_url(broker.url)
    aggregator = DeviceIdentity.generate("aggregator")
    holdout = lambda sha: (np.zeros((4, 3)), np.zeros(4, int))     # noqa: E731
    raw = Sniffer(broker, [])
    try:
        open_follower = DeploymentFollower("dev1", cfg, ModelSlot(tmp_path / "slot"), holdout, topics,
                                           client_id="dev1.a").start()
        forged = D.rollback_message("aggregator", "x", "forged", device="dev1", seq=2**62 - 1)
        raw.publish(topics.deploy("dev1"), encode(forged), retain=True)          # unsigned, retained
        wait_for(lambda: ModelSlot(tmp_path / "slot").seq == 2**62 - 1, what="the forged sequence held")
        open_follower.stop()
        raw.publish(topics.deploy("dev1"), b"", retain=True)
        keyed = DeploymentFollower("dev1", cfg, ModelSlot(tmp_path / "slot"), holdout, topics,
                                   aggregator_key=aggregator.public_key_bytes, client_id="dev1.b").start()
        assert keyed.slot.seq == 0
        real = D.run_message("aggregator", "dep-1", "ab" * 32, 100, 1, device="dev1", seq=1)
        raw.publish(topics.deploy("dev1"), encode(real, signer=aggregator.sign), retain=True)
        wait_for(lambda: keyed.slot.seq == 1, what="the signed assignment taken")
        assert not any("older than the one held" in r for r in keyed.refusals), keyed.refusals
        keyed.stop()
        # under the same key the held sequence still binds: an older signed one is refused
        again = DeploymentFollower("dev1", cfg, ModelSlot(tmp_path / "slot"), holdout, topics,
                                   aggregator_key=aggregator.public_key_bytes, client_id="dev1.c")
        assert again.slot.seq == 1
    finally:
        raw.publish(topics.deploy("dev1"), b"", retain=True)
        raw.close()


def test_a_devices_junk_costs_the_controller_one_row_not_the_fleet_and_a_flood_waits_within_a_bound(
        setup, broker, monkeypatch):
    """A review's finding: every message on a deploy outbox read every device's row (95 ms a
    message at 10,000 devices), and the controller's queue had no bound, so one enrolled device
    sending a few junk messages a second stalled the operator's rollback behind them (503). A
    message costs one row now, and what waits unread is bounded per device."""
    store, controller, fleet = setup
    T = fleet.topics
    ctl = controller()
    scans = []
    rows = []
    real_devices, real_device = store.devices, store.device
    monkeypatch.setattr(store, "devices", lambda *a, **k: scans.append(1) or real_devices(*a, **k))
    monkeypatch.setattr(store, "device", lambda *a, **k: rows.append(1) or real_device(*a, **k))
    sniffer = Sniffer(broker, [])
    try:
        junk = encode(Envelope(type="nonsense", sender="cam-0", body={}))
        seen = ctl.call(lambda: len(scans))
        for _ in range(100):
            sniffer.publish(T.deploy_out("cam-0"), junk)
        # all 100 read (one row each) before the bound shrinks: one still on its way would be dropped below
        wait_for(lambda: ctl.call(lambda: len(rows)) >= 100, what="the 100 junk messages read")
        assert ctl.call(lambda: (len(scans), len(rows), ctl.loop.dropped)) == (seen, 100, 0)   # not one read of the fleet
        ctl.loop.bound = QueueBound(4 * (len(junk) + MESSAGE_OVERHEAD_BYTES), 1 << 20)   # a small bound per device, to see it hold
        busy = threading.Thread(target=lambda: ctl.call(lambda: time.sleep(2.0)))   # the loop busy while the 20 arrive
        busy.start()
        time.sleep(0.2)
        for _ in range(20):
            sniffer.publish(T.deploy_out("cam-0"), junk)
        busy.join()
        assert 10 <= ctl.loop.dropped <= 16                    # 4 wait for the loop at a time, the rest never queue
        assert ctl.call(lambda: "answers") == "answers"
    finally:
        sniffer.close()


def test_a_re_delivered_assignment_does_not_restart_its_heads_fetch(broker, tmp_path, world):
    """A review's finding: each re-delivery of the retained assignment whose head was being fetched
    started the fetch's clock again, so a replay every few seconds kept the timeout refusal from
    ever being said (and the device asked the aggregator again each time)."""
    from protocols.identity import DeviceIdentity
    from protocols.mqtt_link import BrokerConfig
    from protocols.topics import AGGREGATOR_ID, Topics

    agg = DeviceIdentity.generate(AGGREGATOR_ID)
    T = Topics(f"r{time.monotonic_ns()}")
    sniffer = Sniffer(broker, [T.deploy_out("cam-0")])
    follower = DeploymentFollower("cam-0", BrokerConfig.from_url(broker.url), ModelSlot(tmp_path / "slot"),
                                  lambda bundle: world["holdout"]["cam-0"], topics=T, aggregator_key=agg.public_key_bytes,
                                  retry_s=0.2, fetch_timeout_s=1.5).start()
    head = D.head_npz(*world["good"])
    signed = encode(D.run_message(AGGREGATOR_ID, "d1", D_sha(world["good"]), len(head), 1, device="cam-0", seq=1),
                    signer=agg.sign)
    try:
        start = time.monotonic()
        while time.monotonic() - start < 4.0 and not any(r.get("reason") == "timeout" for r in follower.reports):
            sniffer.publish(T.deploy("cam-0"), signed)          # nobody sends the head; the assignment comes again
            time.sleep(0.3)
        assert [r["reason"] for r in follower.reports] == ["timeout"], follower.reports
        assert time.monotonic() - start < 3.0                     # within its 1.5 s, not restarted by each copy
    finally:
        follower.stop()
        sniffer.close()


def test_a_tags_canary_holds_the_devices_the_operator_tagged_never_those_announcing_the_tag(setup, world):
    """A review's finding: a tags: cohort read the tags each device announces in its own profile, so
    any enrolled device could put itself in a canary (and enough of them outvote its honest devices).
    It reads the tags the operator gave (POST /api/devices/{id}/tags) now; a profile's are shown only."""
    store, controller, fleet = setup
    store.device_seen("cam-1", profile={"tags": "lab"})         # what a presence announcing the tag stores
    store.set_device_tags("cam-0", ["lab", "north"])
    store.set_device_tags("cam-2", ["north"])
    with pytest.raises(KeyError):
        store.set_device_tags("cam-404", ["lab"])
    good = model_id(store, "good", *world["good"])
    ctl = controller()
    with pytest.raises(ValueError, match="no device carries these tags"):      # a typo, or tags never given
        ctl.call(lambda: ctl.deploy(good, cohort="tags:lbs", stages="100%", bake_s=3600, deployment_id="typo"))
    # a devices: list naming one not in the fleet (a review's finding: the typo was dropped, and a list of
    # none rolled back at once, its id used up) is refused, nothing made
    for cohort, named in (("devices:cam-0,cam-typo", "cam-typo"), ("devices:ghost1,ghost2", "ghost1, ghost2")):
        with pytest.raises(ValueError, match=f"not in the fleet \\(unknown or revoked\\): {named}$"):
            ctl.call(lambda: ctl.deploy(good, cohort=cohort, stages="100%", bake_s=3600, deployment_id="lab"))
    ctl.call(lambda: ctl.deploy(good, cohort="tags:lab", stages="100%", bake_s=3600, deployment_id="lab"))
    wait_for(lambda: ctl.call(lambda: sorted(ctl.active.sent)) == ["cam-0"], what="the canary assigned")
    assert store.device("cam-1")["tags"] == [] and store.device("cam-0")["tags"] == ["lab", "north"]
    store.set_device_tags("cam-0", [])                           # cleared
    assert store.device("cam-0")["tags"] == [] and store.device("cam-2")["tags"] == ["north"]


def test_a_device_untagged_mid_canary_goes_back_to_the_settled_version_and_returns_with_its_tag(setup, world):
    """A device the operator takes out of a ``tags:`` canary (its tag removed) ran the candidate on
    until promotion or rollback, its reports no longer counted. The candidate is rolled back on it now
    (it goes back to what it kept: nothing here, the settled version below), the settled version's run
    follows, and it gets the candidate again when it is tagged again. A later rollback of the settled
    version takes it where it takes the others, never back to the candidate (a review's finding)."""
    store, controller, fleet = setup
    (v1, v2), (sha1, sha2) = two_versions(store, world)
    for d in ("cam-0", "cam-1"):
        fleet.start(d)
    ctl = controller()
    tagged_canary(ctl, store, fleet, v2, sha2, "first")
    store.set_device_tags("cam-0", [])                                  # no settled version: rolled back
    wait_for(lambda: fleet.sha("cam-0") is None, what="the first candidate rolled back on the untagged device")
    assert ctl.call(lambda: ctl.active.sent["cam-0"])["sent"] == "rollback" and ctl.show("first")["state"] == "canary"
    ctl.call(lambda: ctl.rollback("first"))

    settle(ctl, store, fleet, v1, sha1)
    tagged_canary(ctl, store, fleet, v2, sha2)
    store.set_device_tags("cam-0", [])
    wait_for(lambda: fleet.sha("cam-0") == sha1 and ctl.last["cam-0"][0] == "v1",
             what="the settled version back on the untagged device, and its run sent")
    assert ctl.show("v2")["devices"]["cam-0"]["sent"] == "rollback" and ctl.show("v2")["state"] == "canary"
    assert fleet.sha("cam-1") == sha1
    old_report = ctl.show("v2")["devices"]["cam-0"]["report"]
    store.set_device_tags("cam-0", ["lab"])                             # back in the canary: the candidate again
    wait_for(lambda: ctl.last["cam-0"][0] == "v2", what="the candidate sent again to the device tagged again")
    wait_for(lambda: fleet.sha("cam-0") == sha2 and ctl.show("v2")["devices"]["cam-0"]["report"] not in (None, old_report),
             what="the candidate judged anew on the device tagged again (its old report gone)")
    store.set_device_tags("cam-0", [])
    wait_for(lambda: fleet.sha("cam-0") == sha1 and ctl.last["cam-0"][0] == "v1", what="let go again")
    ctl.call(lambda: ctl.rollback("v1"))                                # the settled version rolled back
    wait_for(lambda: fleet.sha("cam-1") is None, what="v1 rolled back on the device that never left it")
    time.sleep(1.0)                                                     # ticks enough to send anything else
    assert fleet.sha("cam-0") is None, "the device let go runs the candidate again, unjudged"


def test_a_run_sent_again_after_a_rollback_drops_the_devices_old_report(tmp_path):
    """A review's finding: a device let go by a canary (rolled back on it) and later back in its stage
    kept its old report, which counted in the guard before the device judged the head again. A run
    after a rollback clears it, durably and in the controller's memory; a rollback keeps it (the
    rolled-back deployment's record), and a run re-sent to a device that runs it keeps it too."""
    from aggregator.storage.deployments import DeploymentStore
    from aggregator.storage.store import Store

    store = Store(tmp_path / "state.db")
    table = DeploymentStore(store)
    table.create("dep", 1, "canary", {})
    report = {"deployment": "dep", "n": 40}
    table.mark_sent("dep", ["cam-0"], D.RUN)
    table.record_report("dep", "cam-0", report)
    table.mark_sent("dep", ["cam-0"], D.RUN)                     # re-sent while it runs: kept
    assert table.devices("dep")["cam-0"]["report"] == report
    table.mark_sent("dep", ["cam-0"], D.ROLLBACK)                # let go: the record keeps it
    assert table.devices("dep")["cam-0"]["report"] == report
    table.mark_sent("dep", ["cam-0"], D.RUN)                     # back in the stage: judged anew
    assert table.devices("dep")["cam-0"] == {**table.devices("dep")["cam-0"], "sent": D.RUN, "report": None}


def test_a_device_that_missed_its_rollback_judges_the_candidate_again_when_it_is_sent_anew(setup, world, broker):
    """A review's finding: a device let go by a ``tags:`` canary while offline, and tagged again,
    whose broker session was lost meanwhile (past its expiry, a broker without persistence) gets only
    the retained run of the candidate it still runs. It took that as a re-delivery and said nothing,
    while the controller had dropped its old report (a run after a rollback is judged anew): it ran
    the candidate outside the guard for good. A run of the head it runs under a new sequence is
    judged again and reported, on both devices (the Java follower's rule is the same)."""
    store, controller, fleet = setup
    ctl, (v1, v2), (sha1, sha2) = settled_on_v1(setup, world)
    tagged_canary(ctl, store, fleet, v2, sha2)
    fleet.followers["cam-0"].stop()                             # offline
    store.set_device_tags("cam-0", [])
    wait_for(lambda: ctl.show("v2")["devices"]["cam-0"]["sent"] == "rollback", what="let go while offline")
    store.set_device_tags("cam-0", ["lab"])
    wait_for(lambda: ctl.show("v2")["devices"]["cam-0"]["sent"] == "run" and
             ctl.show("v2")["devices"]["cam-0"]["report"] is None, what="the candidate sent anew, to be judged anew")
    forget_session(broker, "cam-0")     # only the retained run reaches it, not the rollback queued for it
    fleet.start("cam-0")
    wait_for(lambda: ctl.show("v2")["devices"]["cam-0"]["report"] is not None, timeout=30,
             what="the device running the candidate reports on it again")
    assert fleet.sha("cam-0") == sha2


def test_a_device_let_go_by_a_canary_that_takes_a_replayed_candidate_is_sent_the_settled_version(setup, world,
                                                                                              broker):
    """A review's finding: a device let go by a ``tags:`` canary (untagged) that lost its state and
    its broker session, then took the candidate's run replayed to it, reported on an assignment not
    its last, and the controller sent it nothing (it was in the canary's record): it stayed on the
    candidate, unjudged. It is sent the settled version's run again, as a device outside the canary is."""
    store, controller, fleet = setup
    topics = fleet.topics
    sniffer = Sniffer(broker, [topics.deploy("cam-0"), topics.deploy_in("cam-0")])
    try:
        ctl, (v1, v2), (sha1, sha2) = settled_on_v1(setup, world)
        tagged_canary(ctl, store, fleet, v2, sha2)
        run_v2, head_v2 = sniffer.run(topics, "cam-0", "v2"), sniffer.head(topics, "cam-0", "v2")
        store.set_device_tags("cam-0", [])
        wait_for(lambda: fleet.sha("cam-0") == sha1 and ctl.last["cam-0"][0] == "v1", what="let go: v1 again")
        lose_state(fleet, "cam-0")
        forget_session(broker, "cam-0")
        sniffer.publish(topics.deploy("cam-0"), run_v2, retain=True)
        fleet.start("cam-0")
        wait_for(lambda: fleet.followers["cam-0"]._pending is not None, what="the replayed run taken")
        sniffer.publish(topics.deploy_in("cam-0"), head_v2)
        wait_for(lambda: ctl.show("v2")["counts"].get("late_reports"), what="its report on the replay refused")
        wait_for(lambda: fleet.sha("cam-0") == sha1, timeout=30,
                 what=f"cam-0 on the settled version again (the controller's last: {ctl.last['cam-0']})")
    finally:
        sniffer.close()
