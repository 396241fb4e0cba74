"""What an enrolled device sends the deployment controller, against it, over a real mosquitto:

* a lying canary device: one of three reports, signed and well-formed, counts far beyond any
  held-out split, inflated for a broken head and deflated for a good one; the honest devices'
  verdict stands both times (rollback, promotion), and the decision records the liar's claimed n
  next to the weight it was given;
* junk on its outbox costs the controller one row, not a read of the fleet, and a flood waits
  within a bound."""

import threading
import time

from edge_client.deployment import ModelSlot
from protocols.envelope import Envelope, encode
from protocols.message_loop import MESSAGE_OVERHEAD_BYTES, QueueBound
from ops_fleet import wait_for
from deployment_fleet import N_HOLDOUT, LyingFollower, Sniffer, D_sha, correct, model_id, store_state
from deployment_fleet import setup, world  # noqa: F401 (fixtures)


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
