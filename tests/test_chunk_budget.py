"""Reassembly buffers are bounded per device (one device never blocks another's chunked results)
and expire on the receiver's clock — the running service expires them by itself (once it never
called the expiry, so one device's partials starved everyone until a restart). (A resend of a reassembled message: tests/test_protocol_envelope.py.)"""

import threading
import time

import numpy as np
import paho.mqtt.client as mqtt
import pytest

from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.service.loop import AggregatorService
from aggregator.service.settings import ServiceSettings
from edge_client.agent import DeviceAgent
from protocols.chunking import MessageAssembler, split
from protocols.envelope import Envelope, EnvelopeError, encode
from protocols.mqtt_link import BrokerConfig
from protocols.topics import Topics

from ops_fleet import C, D, SyntheticStats, reference_sums


def mid(name: str) -> str:
    return name.encode().hex().ljust(32, "0")          # message ids are 32 hex digits


def chunked(sender: str, name: str, nbytes: int, chunk: int = 1000) -> list[bytes]:
    env = Envelope(type="result", sender=sender, id=mid(name), body={},
                   tensors={"x": np.frombuffer(np.random.default_rng(nbytes).bytes(nbytes), np.uint8)})
    return split(encode(env), env.id, sender, chunk_size=chunk)


def test_one_device_filling_its_budget_never_blocks_another_device():
    asm = MessageAssembler(max_message_bytes=20_000, max_pending_bytes=30_000)
    assert asm.reassembler.max_pending_bytes_per_sender == 15_000
    hog = [chunked("hog", f"m{i}", 9_000) for i in range(3)]
    with pytest.raises(EnvelopeError, match="budget"):
        for message in hog:
            for part in message[:-1]:                # never completes: pins what it can
                asm.feed(part, now=0.0)
    assert asm.reassembler.pending_bytes() <= 15_000
    honest = chunked("honest", "h1", 12_000)
    got = [asm.feed(part, now=1.0) for part in honest]
    assert got[-1] is not None and got[-1].id == mid("h1") and all(g is None for g in got[:-1])


def _memory_held(reassembler) -> int:
    """Bytes the partials keep alive: a part that is a view counts the whole buffer under it."""
    held = 0
    for partial in reassembler._partials.values():
        for part in partial.parts.values():
            base = part
            while isinstance(base, np.ndarray) and base.base is not None:
                base = base.base
            held += len(base.obj) if isinstance(base, memoryview) else memoryview(base).nbytes
    return held


def test_a_chunk_holds_what_the_budget_counts_not_its_whole_message():
    """Budgets count a part's data; a part kept as a view kept its whole message alive. A chunk
    padded with another tensor is refused; one with a large header and a tiny part is copied."""
    from protocols.chunking import CHUNK_TYPE

    asm = MessageAssembler(max_message_bytes=10_000_000)
    body = {"parent": "a" * 32, "count": 4096, "total": 4096, "sha256": "0" * 64}
    padded = Envelope(type=CHUNK_TYPE, sender="hog", body={**body, "index": 0},
                      tensors={"data": np.zeros(1, np.uint8), "pad": np.zeros(1 << 20, np.uint8)})
    with pytest.raises(EnvelopeError, match="exactly one tensor"):
        asm.feed(encode(padded), now=0.0)
    for i in range(20):                 # ~60 KB of header each (a long body string), one byte of data
        asm.feed(encode(Envelope(type=CHUNK_TYPE, sender="hog", body={**body, "index": i, "note": "x" * 60_000},
                                 tensors={"data": np.zeros(1, np.uint8)})), now=0.0)
    assert asm.reassembler.pending_bytes() == 20 and _memory_held(asm.reassembler) == 20
    big = chunked("big", "b1", 300_000, chunk=100_000)         # large parts stay views on their chunks
    for part in big[:-1]:
        asm.feed(part, now=0.0)
    held = asm.reassembler._partials[("big", mid("b1"))]
    assert 0 < _memory_held(asm.reassembler) - 20 <= 2 * held.held


def test_a_message_the_full_buffer_cannot_take_is_dropped_whole_and_pins_nothing():
    """Two senders' messages interleave in a buffer that holds about one: the chunk that does not
    fit drops its whole message at once (and its later chunks are refused unheld), so the other
    message completes; the dropped one's resend from chunk 0 then goes through."""
    asm = MessageAssembler(max_message_bytes=20_000, max_pending_bytes=16_000, max_pending_bytes_per_sender=12_000)
    first, second = chunked("a", "m1", 9_000), chunked("b", "m2", 9_000)
    assert len(first) == len(second) >= 9
    errors, done = [], []
    for pa, pb in zip(first, second):
        for part in (pa, pb):
            try:
                got = asm.feed(part, now=0.0)
            except EnvelopeError as exc:
                errors.append(str(exc))
                continue
            if got is not None:
                done.append(got.id)
        assert asm.reassembler.pending_bytes() <= 16_000
    assert done == [mid("m2")]                  # a's 9th chunk was the first that did not fit: a's message went
    assert errors[0] == f"reassembly buffer full: message {mid('m1')} dropped" and len(errors) == len(first) - 8
    assert all("was dropped" in e for e in errors[1:])
    assert asm.reassembler.pending_bytes() == 0               # nothing of the dropped message held
    resent = [asm.feed(part, now=1.0) for part in first]
    assert resent[-1] is not None and resent[-1].id == mid("m1")


def test_partials_expire_after_the_ttl_and_free_their_budget():
    asm = MessageAssembler(max_message_bytes=20_000, ttl_s=300.0)
    parts = chunked("dev", "m1", 9_000)
    for part in parts[:-1]:
        asm.feed(part, now=0.0)
    assert asm.reassembler.pending_bytes() > 0
    assert asm.reassembler.expire(now=299.0) == []
    assert asm.reassembler.expire(now=301.0) == [("dev", mid("m1"))]
    assert asm.reassembler.pending_bytes() == 0
    assert asm.feed(parts[-1], now=302.0) is None        # the late last chunk starts a new partial, never a message


def test_the_service_expires_a_devices_unfinished_chunks_on_its_own_clock(broker, tmp_path):
    """Over a real mosquitto: a client that sends all but the last chunk of a message pins
    reassembly memory only until the TTL (3 s here, 300 s by default): the running service frees
    it by itself, and the honest devices' chunked results still go through."""
    devices = ["dev00", "dev01", "dev02"]
    gate = threading.Event()
    config = Fed3RConfig(num_classes=C, feature_dim=D, clients_per_round=3, round_timeout_s=30, expected_devices=3)
    svc = AggregatorService(Fed3RJob(config), BrokerConfig.from_url(broker.url), tmp_path,
                            ServiceSettings(tick_s=0.05), enrolled={*devices, "hog"})      # chunks held: enrolled
    svc.assembler.reassembler.ttl_s = 3.0
    result = {}
    thread = threading.Thread(target=lambda: result.update(svc.run(timeout_s=60)), daemon=True)
    thread.start()
    agents = [DeviceAgent(d, BrokerConfig.from_url(broker.url), {"fed3r.stats": SyntheticStats(d, gate)},
                          chunk_size=200, retry_after_s=1).start() for d in devices]      # chunked results
    def pending():
        return svc.call(lambda: svc.assembler.reassembler.pending_bytes())

    peak, watching = [0], threading.Event()     # watched while they arrive: a loaded machine may take
    watching.set()                              # longer than the TTL to publish them all

    def watch():
        while watching.is_set():
            peak[0] = max(peak[0], pending())
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    deadline = time.time() + 20         # the service hears the devices: its subscriptions are live, so
    while len(svc.online) < len(devices) and time.time() < deadline:    # no hog chunk goes unheard
        time.sleep(0.05)
    hog = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="hog")
    hog.connect("127.0.0.1", broker.port)
    hog.loop_start()
    for name in ("a", "b"):
        for part in chunked("hog", name, 9_000)[:-1]:
            hog.publish(Topics().outbox("hog"), part, qos=1).wait_for_publish(5)
    deadline = time.time() + 10
    while peak[0] < 16_000 and time.time() < deadline:
        time.sleep(0.05)
    watching.clear()
    watcher.join(5)
    assert peak[0] >= 16_000                        # the hog's partials are held ...
    deadline = time.time() + 10
    while pending() and time.time() < deadline:
        time.sleep(0.1)
    assert pending() == 0 and not svc.call(lambda: dict(svc._device_bytes))     # ... and freed by the service
    gate.set()
    thread.join(60)
    for a in agents:
        a.stop()
    hog.loop_stop()
    assert result["state"] == "done" and sorted(result["contributed"]) == devices
    A_ref, B_ref = reference_sums(devices)
    stats = np.load(tmp_path / "statistics.npz")
    np.testing.assert_allclose(stats["A"], A_ref, rtol=1e-12)     # no store: summed in arrival order
    np.testing.assert_allclose(stats["B"], B_ref, rtol=1e-12)


def test_chunks_sent_on_many_other_devices_topics_leave_no_state_behind(tmp_path):
    """One sender's unfinished chunk published on 2,000 other topics (an open broker without ACLs)
    is refused on each before anything is held: no partial (held under the sender it claims, they
    took that device's slots and budget), no per-topic byte count. Its own topic's is held."""
    svc = AggregatorService(None, BrokerConfig(port=1), tmp_path)          # the link is never started
    part = chunked("hog", "a", 9_000)[0]
    for i in range(2_000):
        svc._on_payload(Topics().outbox(f"victim{i}"), part)
    assert svc._device_bytes == {} and svc.assembler.reassembler.senders() == set()
    assert svc.stats.rejections["malformed"] == 2_000
    svc._on_payload(Topics().outbox("hog"), part)                        # open fleet: any device's own
    assert svc.assembler.reassembler.senders() == {"hog"}


def test_chunks_claiming_another_sender_or_from_one_not_enrolled_hold_nothing(tmp_path):
    """A review's findings: chunks were held under the sender they claimed before the topic's
    device or its enrolment was checked, so one client filled other devices' partial-message slots
    ("dev00 has too many partial messages in flight" for 300 s, four 400-byte messages) and, by
    claiming many names, many budgets at once. A chunk is now held only when its sender is the
    topic's device and may contribute."""
    svc = AggregatorService(None, BrokerConfig(port=1), tmp_path, enrolled={"dev00", "mallory"})
    for i in range(4):                                   # mallory's chunks in dev00's name, on its own topic
        svc._on_payload(Topics().outbox("mallory"), chunked("dev00", f"m{i}", 3_000)[0])
    svc._on_payload(Topics().outbox("stranger"), chunked("stranger", "s", 3_000)[0])      # not enrolled
    assert svc.assembler.reassembler.senders() == set() and svc.stats.rejections["malformed"] == 5
    for part in chunked("dev00", "real", 3_000):         # dev00's own message goes through whole
        svc._on_payload(Topics().outbox("dev00"), part)
    assert svc.assembler.reassembler.senders() == set() and svc.stats.rejections["malformed"] == 5


def test_a_chunks_parent_is_a_message_id_and_each_sender_is_remembered_for_a_bounded_number():
    """A review's finding: completed (and refused) parents were remembered for the TTL whatever
    their number and length: 2,000 one-chunk messages with 60 KB parent strings held 114 MiB outside
    every budget. A parent is a message id (32 hex digits), and a sender's latest 16 are kept."""
    from protocols.chunking import RECENT_PER_SENDER, split

    asm = MessageAssembler()
    env = Envelope(type="result", sender="d", body={}, tensors={"x": np.zeros(3000, np.uint8)})
    with pytest.raises(EnvelopeError, match="message's id"):
        asm.feed(split(encode(env), "p" * 60_000, "d", chunk_size=1000)[0])
    for i in range(200):
        for part in chunked("d", f"n{i}", 3_000):
            asm.feed(part)
    assert len(asm.reassembler._done["d"]) == RECENT_PER_SENDER
    assert list(asm.reassembler._done["d"]) == [mid(f"n{i}") for i in range(200 - RECENT_PER_SENDER, 200)]


def test_a_device_agent_expires_its_unfinished_chunked_messages_on_its_tick(broker, monkeypatch):
    """Four first chunks of messages that never complete (an aggregator that stopped mid-send, or
    forged ones) held the aggregator's slots on the device for ever: every later chunked task was
    refused. The agent's tick now drops them once their TTL has passed."""
    import hashlib
    import types

    import protocols.chunking as chunking
    from protocols.chunking import CHUNK_TYPE

    agent = DeviceAgent("cam1", BrokerConfig.from_url(broker.url), {})
    for i in range(4):
        agent.assembler.feed(encode(Envelope(type=CHUNK_TYPE, sender="aggregator", tensors={"data": np.zeros(1, np.uint8)},
                                             body={"parent": f"{i:032x}", "index": 0, "count": 2, "total": 2,
                                                   "sha256": hashlib.sha256(b"xx").hexdigest()})))
    assert agent.assembler.reassembler.pending_bytes() == 4
    real = time.monotonic
    agent._tick(real())
    assert agent.assembler.reassembler.pending_bytes() == 4           # within the TTL: kept
    monkeypatch.setattr(chunking, "time", types.SimpleNamespace(monotonic=lambda: real() + 3600))
    agent._tick(real() + 3600)
    assert agent.assembler.reassembler.pending_bytes() == 0
