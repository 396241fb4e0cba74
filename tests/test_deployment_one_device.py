"""What one enrolled device can no longer do to a rollout (a review's attacks), over a real
mosquitto with the controller and followers of ``tests/deployment_fleet.py``:

* freeze every rollout with a malformed profile (tags that are a number): presence refuses it,
  and the controller reads no profile (a tags: cohort reads the tags the operator gave);
* outweigh the honest canary under a pooled guard (``wma_drop``) by claiming a huge held-out
  split: its weight is at most twice the stage's median claimed size;
* make the controller publish its head again and again with a flood of small asks: one answer per
  device and head per window;
* pin the controller's memory with first chunks under invented senders on its own outbox: the
  controller takes single messages only.
"""

import time

import numpy as np
import pytest

from aggregator.security.repeat_limit import RepeatLimiter
from edge_client.deployment import ModelSlot
from protocols import messages as M
from protocols.chunking import CHUNK_TYPE
from protocols.envelope import Envelope, EnvelopeError, decode, encode
from protocols.payloads.artifacts import get_message
from deployment_fleet import D_sha, LyingFollower, Sniffer, model_id, setup, store_state, world  # noqa: F401
from ops_fleet import wait_for

CANARY3 = "devices:cam-0,cam-1,cam-2"


@pytest.mark.parametrize("tags", [5, None, True, [1, 2], ["x" * 65], ["t"] * 33])
def test_presence_refuses_a_profile_whose_tags_are_not_short_strings(tags):
    with pytest.raises(EnvelopeError, match="tags"):
        M.parse_presence(decode(encode(M.presence_message("cam-5", "online", {"tags": tags}))))
    online, info = M.parse_presence(decode(encode(M.presence_message("cam-5", "online", {"tags": "a,b"}))))
    assert online and M.profile_tags(info) == ("a", "b")


def test_a_malformed_stored_profile_does_not_freeze_the_rollouts(setup, world):
    """A profile stored before presence checked its tags made every tick raise: the broken canary
    was never judged, never rolled back."""
    store, controller, fleet = setup
    good, broken = model_id(store, "good", *world["good"]), model_id(store, "broken", *world["broken"])
    for d in ("cam-0", "cam-1", "cam-2"):
        fleet.start(d)
    ctl = controller()
    ctl.call(lambda: ctl.deploy(good, cohort=CANARY3, stages="100%", bake_s=0, deployment_id="g"))
    wait_for(lambda: store_state(store, "g") == "complete", what="baseline")
    store.device_seen("cam-5", True, {"tags": 5})
    ctl.call(lambda: ctl.deploy(broken, cohort=CANARY3, stages="100%", bake_s=0.5, deployment_id="b"))
    wait_for(lambda: store_state(store, "b") == "rolled_back", timeout=30, what="the broken canary rolled back")
    wait_for(lambda: all(fleet.sha(d) == D_sha(world["good"]) for d in ("cam-0", "cam-1", "cam-2")),
             what="the canary back on the good head")
    assert ctl.show("b")["state"] == "rolled_back"


def test_one_device_claiming_a_huge_split_cannot_promote_a_broken_head_under_a_pooled_guard(setup, world):
    store, controller, fleet = setup
    canary = "devices:cam-0,cam-1,cam-2,cam-3"
    good, broken = model_id(store, "good", *world["good"]), model_id(store, "broken", *world["broken"])
    for d in ("cam-0", "cam-1", "cam-2"):
        fleet.start(d)
    liar = LyingFollower("cam-3", fleet.broker, ModelSlot(fleet.tmp / "cam-3"), lambda b: world["holdout"]["cam-3"],
                         topics=fleet.topics, aggregator_key=fleet.key, retry_s=0.5, fetch_timeout_s=10)
    liar.lie = "inflate"
    fleet.followers["cam-3"] = liar.start()
    ctl = controller()
    ctl.call(lambda: ctl.deploy(good, cohort=canary, stages="100%", guard="wma_drop<=1.0", bake_s=0, deployment_id="g"))
    wait_for(lambda: store_state(store, "g") == "complete", what="baseline")
    ctl.call(lambda: ctl.deploy(broken, cohort=canary, stages="100%", guard="wma_drop<=1.0", bake_s=0.3,
                                deployment_id="broken"))
    wait_for(lambda: store_state(store, "broken") in ("rolled_back", "complete"), timeout=30, what="a verdict")
    view = ctl.show("broken")
    metrics = view["history"][1]["metrics"]
    assert view["state"] == "rolled_back", metrics
    weights = {d: e["weight"] for d, e in metrics["evidence"].items()}
    assert weights["cam-3"] <= 2 * max(w for d, w in weights.items() if d != "cam-3"), weights


def test_a_flood_of_asks_for_a_head_is_answered_once_per_window(setup, world, broker):
    store, controller, fleet = setup
    rng = np.random.default_rng(0)
    W, b = rng.normal(size=(100, 1280)), rng.normal(size=100)         # a realistic head: ~1 MB
    store.create_job("big", "fed3r", {})
    mid = store.finish_job("big", "done", {}, {}, {"coef": W, "intercept": b}, {}, 1)
    ctl = controller()
    ctl.call(lambda: ctl.deploy(mid, cohort="devices:cam-0", stages="100%", bake_s=3600, deployment_id="big"))
    wait_for(lambda: ctl.last.get("cam-0", ("",))[0] == "big", what="assignment sent")
    sniffer = Sniffer(broker, [fleet.topics.deploy_in("cam-0")])
    ask = encode(get_message("cam-0", D_sha((W, b))))
    for _ in range(200):
        sniffer.client.publish(fleet.topics.deploy_out("cam-0"), ask, qos=1)
    wait_for(lambda: ctl._head_answers.dropped >= 150, timeout=30, what="the asks handled")
    time.sleep(1.0)
    answers = sniffer.seen.get(fleet.topics.deploy_in("cam-0"), [])
    sniffer.close()
    sent = sum(map(len, answers))
    assert 0 < sent < 3 * (W.nbytes + b.nbytes), f"200 asks made the controller publish {sent / 1e6:.1f} MB"


def test_chunks_on_a_devices_deploy_outbox_hold_no_memory(setup, broker, caplog):
    """Its outbox takes single small messages: first chunks of messages that never complete, each
    under another invented sender, were held (up to 1 GiB) and never expired. Now each is one
    refused message (or one dropped unread, past what its outbox may hold waiting), and the device's next
    message is handled as ever."""
    store, controller, fleet = setup
    ctl = controller()
    attacker = Sniffer(broker, [])
    data = np.zeros(200_000, dtype=np.uint8)
    for i in range(20):
        chunk = Envelope(type=CHUNK_TYPE, sender=f"ghost-{i}", tensors={"data": data},
                         body={"parent": f"p{i}", "index": 0, "count": 2, "total": 400_010, "sha256": "0" * 64})
        attacker.client.publish(fleet.topics.deploy_out("cam-0"), encode(chunk), qos=1)
    unassigned = "ab" * 32
    attacker.client.publish(fleet.topics.deploy_out("cam-0"), encode(get_message("cam-0", unassigned)), qos=1)
    wait_for(lambda: any("not the head assigned" in r.getMessage() for r in caplog.records), timeout=20,
             what="the device's next message handled")
    attacker.close()
    refused = [r for r in caplog.records if "deploy/cam-0/out refused: message too large" in r.getMessage()]
    assert len(refused) >= 5 and len(refused) + ctl.loop.dropped == 20   # or dropped unread: past its bound


def test_a_request_is_answered_a_few_times_per_window_and_forgotten_after_it():
    limiter = RepeatLimiter(10.0, answers=2)
    assert [limiter.allow("cam-0", "h", now=t) for t in (0.0, 1.0, 2.0, 9.9)] == [True, True, False, False]
    assert limiter.allow("cam-1", "h", now=5.0) and limiter.allow("cam-0", "other", now=5.0)    # per device, per request
    assert limiter.allow("cam-0", "h", now=10.0)               # the window passed: answered again
    assert limiter.dropped == 2 and len(limiter._first) == 3   # cam-0's first window forgotten
    with pytest.raises(ValueError):
        RepeatLimiter(0.0)
