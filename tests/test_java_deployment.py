"""The Java library's deployed model (issue 29 item 4, ``clients/java/.../ModelSlot.java``) against
the Python device's (``edge_client/deployment.py``) on the same head files, features and slot
directory, and against a numpy reference:

* a signed ``run`` assignment and its head file make the head current; the Java predictions and
  held-out counts are numpy's; a second swap keeps the first as previous, a ``rollback`` brings it
  back; the Python slot opens the directory the Java one wrote (and the other way round);
* an unsigned assignment, one signed by another key, a tampered head and a file that is not a head
  are refused, and the slot keeps its version;
* a device that personalises (OLL) predicts with the head pruned to its training labels, as the
  Python device does, and refuses a head without a row for one of them;
* the Java ``DeploymentFollower`` follows a rollout of the real controller over mosquitto (catch-up
  on the retained assignment, counts equal to numpy's, rollback, an unsigned assignment refused).

Driven through ``tests/java_device/SlotRunner.java`` and ``FollowerRunner.java`` (plain javac, Java 11 level)."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import subprocess
import time

import numpy as np
import pytest

import java_build
from edge_client.deployment import ModelSlot
from protocols.envelope import decode, encode
from protocols.identity import DeviceIdentity
from protocols.payloads import deployment as D
from protocols.topics import AGGREGATOR_ID
from test_java_device import write_features
from ops_fleet import wait_for

pytestmark = pytest.mark.skipif(java_build.missing() is not None, reason=str(java_build.missing()))

C, DIM, N = 5, 8, 60


@pytest.fixture(scope="module")
def java_cp() -> str:
    return java_build.built()


@pytest.fixture(scope="module")
def world():
    rng = np.random.default_rng(3)
    heads = [(rng.normal(size=(C, DIM)), rng.normal(size=C)) for _ in range(2)]
    Z = rng.normal(size=(N, DIM)).astype(np.float32)
    y = rng.integers(0, C, N)
    return {"heads": heads, "Z": Z, "y": y, "aggregator": DeviceIdentity.generate(AGGREGATOR_ID)}


def reference(head, Z, local=None):
    """numpy: the float32 head file's logits in float64; with ``local`` only those rows compete."""
    W, b = (np.asarray(a, np.float32).astype(np.float64) for a in head)
    rows = np.arange(C) if local is None else np.unique(local)
    return rows[(Z.astype(np.float64) @ W[rows].T + b[rows]).argmax(1)]


def slot_runner(java_cp, slot_dir, features, key="-", local="-", *message) -> dict[str, str]:
    proc = subprocess.run(java_build.java_command("-cp", java_cp, "SlotRunner", str(slot_dir), key, str(features),
                                                  local, *map(str, message)),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in proc.stdout.splitlines()}


def write_message(path, env, signer=None):
    path.write_bytes(encode(env, signer=signer))
    return path


SEQ = itertools.count(1)          # every assignment a later one, as the controller numbers them


def run_assignment(tmp_path, name, head_bytes, deployment, signer, device="jdev", seq=None):
    sha = hashlib.sha256(head_bytes).hexdigest()
    (tmp_path / f"{name}.npz").write_bytes(head_bytes)
    msg = write_message(tmp_path / f"{name}.bin", D.run_message(AGGREGATOR_ID, deployment, sha, len(head_bytes), 1,
                                                                device=device, seq=seq or next(SEQ)), signer)
    return msg, tmp_path / f"{name}.npz", sha


def swap_in_first_head(java_cp, world, tmp_path):
    """The held-out split's features file, and a Java slot into which dep-1's signed assignment swapped
    head 1: (features file, slot folder, aggregator key as hex, head 1's sha256, what the slot runner printed)."""
    agg = world["aggregator"]
    feats = write_features(tmp_path / "held.bin", world["Z"], world["y"])
    slot, key = tmp_path / "slot", agg.public_key_bytes.hex()
    msg, head, sha = run_assignment(tmp_path, "h1", D.head_npz(*world["heads"][0]), "dep-1", agg.sign)
    return feats, slot, key, sha, slot_runner(java_cp, slot, feats, key, "-", msg, head)


def test_the_java_slot_swaps_predicts_and_rolls_back_like_the_python_device(java_cp, world, tmp_path):
    agg, (h1, h2), Z, y = world["aggregator"], world["heads"], world["Z"], world["y"]
    feats, slot, key, sha1, out = swap_in_first_head(java_cp, world, tmp_path)
    assert out["SWAPPED"] == sha1 and out["CURRENT"] == sha1 and out["PREVIOUS"] == "none"
    np.testing.assert_array_equal(np.array(out["PREDICT"].split(), int), reference(h1, Z))
    assert int(out["CORRECT"]) == int((reference(h1, Z) == y).sum())
    python = ModelSlot(slot)                                 # the Python device opens what Java wrote
    assert python.current.sha256 == sha1 and python.current.deployment == "dep-1"
    np.testing.assert_array_equal(python.predict(Z), reference(h1, Z))

    msg2, file2, sha2 = run_assignment(tmp_path, "h2", D.head_npz(*h2), "dep-2", agg.sign)
    out = slot_runner(java_cp, slot, feats, key, "-", msg2, file2)
    assert (out["SWAPPED"], out["CURRENT"], out["PREVIOUS"]) == (sha2, sha2, sha1)
    np.testing.assert_array_equal(np.array(out["PREDICT"].split(), int), reference(h2, Z))
    assert sorted(p.name for p in slot.glob("*.npz")) == sorted([f"{sha1}.npz", f"{sha2}.npz"])

    back = write_message(tmp_path / "rb.bin", D.rollback_message(AGGREGATOR_ID, "dep-2", "guard failed",
                                                                          device="jdev", seq=next(SEQ)), agg.sign)
    out = slot_runner(java_cp, slot, feats, key, "-", back)
    assert (out["REVERTED"], out["CURRENT"], out["PREVIOUS"]) == ("true", sha1, "none")
    assert slot_runner(java_cp, slot, feats, key, "-", back)["REVERTED"] == "false"   # not from dep-2 any more
    python = ModelSlot(slot)
    assert python.current.sha256 == sha1 and python.previous is None
    assert [p.name for p in slot.glob("*.npz")] == [f"{sha1}.npz"]

    # the other way round: the Python device swaps a Fed3R-named float64 head, Java predicts with it
    buf = io.BytesIO()
    np.savez(buf, coef=h2[0], intercept=h2[1])
    data = buf.getvalue()
    python.swap(data, hashlib.sha256(data).hexdigest(), "dep-3")
    out = slot_runner(java_cp, slot, feats)
    assert out["CURRENT"] == hashlib.sha256(data).hexdigest() and out["PREVIOUS"] == sha1
    W, b = h2
    np.testing.assert_array_equal(np.array(out["PREDICT"].split(), int), (Z.astype(float) @ W.T + b).argmax(1))


def test_the_java_slot_refuses_unsigned_tampered_and_malformed_versions(java_cp, world, tmp_path):
    agg, (h1, h2), Z = world["aggregator"], world["heads"], world["Z"]
    feats, slot, key, sha1, out = swap_in_first_head(java_cp, world, tmp_path)
    assert out["SWAPPED"] == sha1
    state = version_on_disk(slot)

    unsigned, file2, _ = run_assignment(tmp_path, "h2", D.head_npz(*h2), "dep-2", None)
    stranger = DeviceIdentity.generate(AGGREGATOR_ID)
    forged, _, _ = run_assignment(tmp_path, "forged", D.head_npz(*h2), "dep-2", stranger.sign)
    good2, _, sha2 = run_assignment(tmp_path, "good2", D.head_npz(*h2), "dep-2", agg.sign)
    data2 = file2.read_bytes()
    tampered = tmp_path / "tampered.npz"
    tampered.write_bytes(data2[:-1] + bytes([data2[-1] ^ 1]))
    buf = io.BytesIO()
    np.savez(buf, other=np.zeros(3))
    not_head = buf.getvalue()
    odd, odd_file, _ = run_assignment(tmp_path, "odd", not_head, "dep-4", agg.sign)
    for message, head, why in ((unsigned, file2, "sig"), (forged, file2, "signature"),
                               (good2, tampered, "differs from the assigned"),
                               (odd, odd_file, "expected coef/intercept or weight/bias")):
        out = slot_runner(java_cp, slot, feats, key, "-", message, head)
        assert why in out["REFUSED"], out
        assert (out["CURRENT"], out["PREVIOUS"]) == (sha1, "none")
        assert version_on_disk(slot) == state               # nothing changed on disk (but the sequence taken)
    np.testing.assert_array_equal(np.array(out["PREDICT"].split(), int), reference(h1, Z))
    assert slot_runner(java_cp, slot, feats, key, "-", good2, file2)["REASON"] == "stale"    # older than odd's
    again, _, _ = run_assignment(tmp_path, "again", D.head_npz(*h2), "dep-2", agg.sign)    # re-sent: a new seq
    assert slot_runner(java_cp, slot, feats, key, "-", again, file2)["SWAPPED"] == sha2


def version_on_disk(slot):
    return {k: v for k, v in json.loads((slot / "slot.json").read_bytes()).items() if k != "seq"}


def test_the_java_slot_refuses_replayed_and_misaddressed_assignments_like_the_python_device(java_cp, world, tmp_path):
    """Golden vectors: one sequence of signed messages through the Java slot (one process per
    message: the sequence held must survive a restart) and through the Python device's rule
    (``refusal_of`` and its ``ModelSlot``), step by step the same decision and version."""
    from edge_client.deployment import refusal_of

    agg, (h1, h2), Z = world["aggregator"], world["heads"], world["Z"]
    feats, key = write_features(tmp_path / "held.bin", Z, world["y"]), agg.public_key_bytes.hex()
    first, head1, sha1 = run_assignment(tmp_path, "h1", D.head_npz(*h1), "dep-1", agg.sign, seq=10)
    second, head2, sha2 = run_assignment(tmp_path, "h2", D.head_npz(*h2), "dep-2", agg.sign, seq=20)
    other, _, _ = run_assignment(tmp_path, "other", D.head_npz(*h1), "dep-3", agg.sign, device="jother", seq=30)
    rollback = (lambda seq: write_message(tmp_path / f"rb{seq}.bin", D.rollback_message(
        AGGREGATOR_ID, "dep-2", "guard failed", device="jdev", seq=seq), agg.sign))
    steps = [(first, head1), (second, head2), (first, head1), (other, head1), (rollback(15), None),
             (rollback(25), None)]
    python = ModelSlot(tmp_path / "py")
    for message, head in steps:
        a = D.parse_assignment(decode(message.read_bytes()))
        refusal = refusal_of(a, "jdev", python.seq)
        if refusal is None:
            python.hold_seq(a["seq"])
            if a["action"] == D.ROLLBACK:
                python.revert(a["deployment"])
            elif python.current is None or python.current.sha256 != a["sha256"]:
                python.swap(head.read_bytes(), a["sha256"], a["deployment"])
        out = slot_runner(java_cp, tmp_path / "java", feats, key, "-", message, *([head] if head else []))
        assert out.get("REASON") == (refusal[0] if refusal else None), (a, out)
        assert out["CURRENT"] == (python.current.sha256 if python.current else "none"), (a, out)
        assert int(out["SEQ"]) == python.seq
    # what the rule gives here, independently: the replay (10 < 20) and the old rollback (15 < 20)
    # refused as stale, the other device's refused, the newer rollback taken
    assert python.seq == 25 and python.current.sha256 == sha1 and ModelSlot(tmp_path / "java").seq == 25


def test_a_java_slot_holds_a_sequence_only_under_the_key_it_took_it_with_like_the_python_device(java_cp, world,
                                                                                                 tmp_path):
    """A review's finding (ModelSlot.bindKey / bind_key): an unsigned assignment of seq 2^62 - 1 taken
    while the device had no key kept it refusing every signed assignment once it had one."""
    agg, (h1, _), Z = world["aggregator"], world["heads"], world["Z"]
    feats, key = write_features(tmp_path / "held.bin", Z, world["y"]), agg.public_key_bytes.hex()
    forged = write_message(tmp_path / "forged.bin", D.rollback_message(
        AGGREGATOR_ID, "x", "forged", device="jdev", seq=2**62 - 1))                 # unsigned
    assert int(slot_runner(java_cp, tmp_path / "java", feats, "-", "-", forged)["SEQ"]) == 2**62 - 1
    real, head, sha = run_assignment(tmp_path, "real", D.head_npz(*h1), "dep-1", agg.sign, seq=1)
    out = slot_runner(java_cp, tmp_path / "java", feats, key, "-", real, head)
    assert "REASON" not in out and out["CURRENT"] == sha and int(out["SEQ"]) == 1, out
    python = ModelSlot(tmp_path / "java")          # the Python device reads the key it was held under
    assert python.seq == 1 and python.seq_key == hashlib.sha256(agg.public_key_bytes).hexdigest()
    python.bind_key(agg.public_key_bytes)
    assert python.seq == 1                         # the same key: still held


def test_a_personalising_java_device_predicts_with_the_oll_pruned_head_like_the_python_device(java_cp, world,
                                                                                            tmp_path):
    agg, (h1, _), Z, y = world["aggregator"], world["heads"], world["Z"], world["y"]
    feats = write_features(tmp_path / "held.bin", Z, y)
    data = D.head_npz(*h1)
    sha = hashlib.sha256(data).hexdigest()
    local = np.array([3, 1, 1, 4])
    python = ModelSlot(tmp_path / "py", local)
    python.swap(data, sha, "dep-1")
    expected = reference(h1, Z, local)
    assert set(expected) <= {1, 3, 4} and (expected != reference(h1, Z)).any()
    np.testing.assert_array_equal(python.predict(Z), expected)
    out = slot_runner(java_cp, tmp_path / "py", feats)                 # the labels kept in the slot
    np.testing.assert_array_equal(np.array(out["PREDICT"].split(), int), expected)
    assert int(out["CORRECT"]) == python.correct(python.current, Z, y) == int((expected == y).sum())

    msg, head, _ = run_assignment(tmp_path, "h1", data, "dep-1", agg.sign)
    out = slot_runner(java_cp, tmp_path / "java", feats, agg.public_key_bytes.hex(), "4,1,3", msg, head)
    np.testing.assert_array_equal(np.array(out["PREDICT"].split(), int), expected)
    assert ModelSlot(tmp_path / "java").local_labels.tolist() == [1, 3, 4]
    out = slot_runner(java_cp, tmp_path / "java7", feats, agg.public_key_bytes.hex(), "0,7", msg, head)
    assert "[0, 5)" in out["REFUSED"] and out["CURRENT"] == "none"


def store_state(store, deployment_id):
    from aggregator.storage.deployments import DeploymentStore

    return DeploymentStore(store).get(deployment_id)["state"]


def running(slot_dir):
    try:
        current = ModelSlot(slot_dir).current
    except (OSError, ValueError):       # not written yet
        return None
    return current.sha256 if current else None


def test_a_java_device_follows_a_rollout_over_mosquitto(java_cp, world, broker, tmp_path):
    """The Java DeploymentFollower against the real controller: an offline device catches up on its
    retained assignment, reports OLL-pruned held-out counts equal to numpy's, swaps (its first two
    reads of the held-out features fail: tried again, not refused, so a guard of ``refused<=0``
    completes); a failing guard rolls it back; an unsigned assignment is refused and it keeps its version."""
    import paho.mqtt.client as mqtt

    from aggregator.deployments.controller import DeploymentController
    from aggregator.storage.store import Store
    from protocols.mqtt_link import BrokerConfig
    from protocols.topics import Topics

    agg, (good, _), Z, y = world["aggregator"], world["heads"], world["Z"], world["y"]
    broken = (good[0][[1, 2, 3, 4, 0]], good[1][[1, 2, 3, 4, 0]])
    local = [0, 2, 3]
    store = Store(tmp_path / "state.db")
    store.enroll_device("jcam", None, None)
    ids = {}
    for name, (W, b) in (("good", good), ("broken", broken)):
        store.create_job(name, "fedavg", {})
        ids[name] = store.finish_job(name, "done", {}, {}, {"weight": W, "bias": b}, {}, 1)
    topics = Topics(f"j{time.monotonic_ns()}")
    ctl = DeploymentController(store, BrokerConfig.from_url(broker.url), topics, signer=agg.sign, tick_s=0.05).start()
    feats, slot = write_features(tmp_path / "held.bin", Z, y), tmp_path / "jslot"
    proc = None
    try:
        ctl.call(lambda: ctl.deploy(ids["good"], cohort="devices:jcam", stages="100%", bake_s=0.2, min_reports=1,
                                    guard="refused<=0", deployment_id="good-1"))
        time.sleep(0.5)                               # published while the device is offline: retained
        proc = subprocess.Popen(java_build.java_command("-cp", java_cp, "FollowerRunner", broker.url, "jcam",
                                                        topics.root, agg.public_key_bytes.hex(), str(slot),
                                                        str(feats), ",".join(map(str, local))),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "FOLLOWER_FAILED_READS": "2"})
        assert proc.stdout.readline().strip() == "READY"
        good_sha = hashlib.sha256(D.head_npz(*good)).hexdigest()
        wait_for(lambda: store_state(store, "good-1") == "complete", 60.0, "the rollout to complete")
        wait_for(lambda: running(slot) == good_sha, 60.0, "the Java device to swap")
        report = ctl.show("good-1")["devices"]["jcam"]["report"]
        right = int((reference(good, Z, local) == y).sum())
        assert report == {"deployment": "good-1", "seq": ctl.last["jcam"][1], "sha256": good_sha, "n": N,
                          "correct_candidate": right,
                          "correct_current": 0}

        ctl.call(lambda: ctl.deploy(ids["broken"], cohort="devices:jcam", stages="100%", bake_s=0.2, min_reports=1,
                                    deployment_id="broken-1"))
        wait_for(lambda: store_state(store, "broken-1") == "rolled_back", 60.0, "the broken head's rollback")
        report = ctl.show("broken-1")["devices"]["jcam"]["report"]
        assert (report["correct_candidate"], report["correct_current"]) == \
            (int((reference(broken, Z, local) == y).sum()), right)
        wait_for(lambda: running(slot) == good_sha and ModelSlot(slot).previous is None, 60.0, "the Java device back")
        ctl.call(lambda: ctl.deploy(ids["good"], cohort="devices:jcam", stages="100%", bake_s=0.2, min_reports=1,
                                    deployment_id="good-2"))      # the running head, deployed anew
        wait_for(lambda: store_state(store, "good-2") == "complete", 60.0, "the same head's new rollout")
        assert ModelSlot(slot).current.deployment == "good-2" and running(slot) == good_sha

        raw = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="intruder")
        raw.connect("127.0.0.1", broker.port)
        raw.loop_start()
        evil = D.head_npz(*broken)
        raw.publish(topics.deploy("jcam"), encode(D.run_message(AGGREGATOR_ID, "evil", hashlib.sha256(evil).hexdigest(),
                                                                len(evil), 1, device="jcam", seq=2 ** 61)), qos=1, retain=True).wait_for_publish(5)
        time.sleep(2)
        raw.publish(topics.deploy("jcam"), b"", retain=True).wait_for_publish(5)
        raw.loop_stop()
        raw.disconnect()
        out, err = proc.communicate("", timeout=30)
        assert "CURRENT " + good_sha in out and "REFUSALS 1" in out, (out, err[-2000:])
        assert "unsigned" in err or "signature" in err or "sig" in err, err[-2000:]
        assert err.count("not adopted yet (held-out features: IOException: held-out store unavailable)") == 2, err[-2000:]
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        ctl.stop()
        store.close()


def test_a_newer_assignment_ends_the_java_devices_fetch_of_an_older_ones_head(java_cp, world, broker, tmp_path):
    """deployment_fleet.newer_assignment_ends_an_older_fetch on the Java follower, as on the Python
    one (tests/test_deployment_replays.py): a late head of the older assignment is not swapped in."""
    from deployment_fleet import newer_assignment_ends_an_older_fetch
    from protocols.topics import Topics

    agg, (good, other), Z, y = world["aggregator"], world["heads"], world["Z"], world["y"]
    topics, slot = Topics(f"j{time.monotonic_ns()}"), tmp_path / "jslot"
    proc = subprocess.Popen(java_build.java_command("-cp", java_cp, "FollowerRunner", broker.url, "jcam", topics.root,
                                                    agg.public_key_bytes.hex(), str(slot),
                                                    str(write_features(tmp_path / "held.bin", Z, y))),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        newer_assignment_ends_an_older_fetch(broker, agg, topics, "jcam", slot, good, other, retry_s=0.5)
        out, err = proc.communicate("", timeout=30)
        assert "CURRENT " + hashlib.sha256(D.head_npz(*good)).hexdigest() in out, (out, err[-2000:])
    finally:
        if proc.poll() is None:
            proc.kill()
