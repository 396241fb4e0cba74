"""A device agent over a real mosquitto never stops on what a task makes it do (a review's
findings): a result it cannot encode (a body over the 64 KiB header limit) is one decline with
the reason, not an error on every retry tick that ended the agent's thread; a task whose job id
would make every answer unsendable is dropped as malformed; a Fed3R task whose random features
would need gigabytes is declined before anything is allocated; a tick that raises is logged and
the agent goes on; decline reasons are cut on the wire and logged once each, boundedly; a task whose ``job_id``
param (what a stateful task keys the device's state by) is not the job it came in is declined; a task
at more pixels a side than the device runs is declined before any extractor is made, and a large
image size runs in batches of bounded pixels."""

import logging
import time

import numpy as np
import pytest

from edge_client.agent import MAX_REASON_CHARS, AgentHooks, DeviceAgent, FirstTimes, TaskDeclined
from edge_client.tasks.fed3r_stats import Fed3RStatsTask
from protocols import messages as M
from protocols.envelope import MAX_HEADER_BYTES, EnvelopeError, decode, encode
from protocols.mqtt_link import BrokerConfig
from protocols.payloads.fed3r import Fed3RStatsParams
from protocols.payloads.task_params import ModelSpec
from protocols.topics import AGGREGATOR_ID, Topics
from deployment_fleet import Sniffer
from ops_fleet import wait_for

T = Topics()


class Features:
    feature_dim = 16

    def extract(self, images):
        return np.asarray(images, dtype=np.float64)


def fed3r_params(**kw) -> dict:
    return Fed3RStatsParams(model=ModelSpec(backbone="b", image_size=8, num_classes=3), **kw).to_params()


def handlers():
    rng = np.random.default_rng(0)
    return {"echo": lambda params, tensors: ({"note": "x" * params.get("size", 0)}, {}),
            "fed3r.stats": Fed3RStatsTask(rng.normal(size=(5, 16)), np.array([0, 1, 2, 0, 1]),
                                          lambda b, s, w: Features())}


def send_task(sniffer, device, job, kind, params, round_=1):
    msg = M.task_message(AGGREGATOR_ID, job, round_, kind, params, time.time() + 60)
    sniffer.publish(T.inbox(device), encode(msg))
    return msg.id


def answers(sniffer, device) -> dict[str, object]:
    """The device's results and declines by task id."""
    out = {}
    for payload in sniffer.seen.get(T.outbox(device), []):
        env = decode(payload)
        if env.type in (M.RESULT, M.DECLINE):
            out[env.body["task"]] = env
    return out


@pytest.fixture
def agent_and_sniffer(broker):
    sniffer = Sniffer(broker, [T.outbox("dev-a"), T.presence("dev-a")])
    agent = DeviceAgent("dev-a", BrokerConfig(port=broker.port), handlers(), retry_after_s=0.2, tick_s=0.05).start()
    # its presence (retained, published after its inbox subscription on the same connection) seen:
    # a task sent now reaches it ("connected" alone was seen to let the first task in before the
    # subscription, under load, and the test waited for an answer to a task never delivered)
    wait_for(lambda: any(decode(p).body.get("state") == "online" for p in sniffer.seen.get(T.presence("dev-a"), [])),
             what="the agent online")
    yield agent, sniffer
    agent.stop()
    sniffer.close()


def test_a_result_over_the_header_limit_is_one_decline_and_the_agent_goes_on(agent_and_sniffer):
    agent, sniffer = agent_and_sniffer
    big = send_task(sniffer, "dev-a", "j1", "echo", {"size": MAX_HEADER_BYTES + 10})
    wait_for(lambda: big in answers(sniffer, "dev-a"), what="an answer to the unsendable task")
    got = answers(sniffer, "dev-a")[big]
    assert got.type == M.DECLINE and "result cannot be sent" in got.body["reason"], got.body
    time.sleep(0.5)                                # retry ticks: the agent's loop must still be serving
    assert agent.loop.alive
    ok = send_task(sniffer, "dev-a", "j1", "echo", {"size": 10}, round_=2)
    wait_for(lambda: ok in answers(sniffer, "dev-a"), what="the next task answered")
    assert answers(sniffer, "dev-a")[ok].type == M.RESULT
    assert agent.stats.tasks_declined == 1 and agent.stats.tasks_done == 1


def test_a_task_with_a_job_id_no_answer_could_carry_is_refused_and_the_agent_goes_on(agent_and_sniffer):
    agent, sniffer = agent_and_sniffer
    huge = send_task(sniffer, "dev-a", "j" * (MAX_HEADER_BYTES - 300), "echo", {})     # the task fits, answers not
    ok = send_task(sniffer, "dev-a", "j" * M.MAX_JOB_ID_CHARS, "echo", {})
    wait_for(lambda: ok in answers(sniffer, "dev-a"), what="the task with a 64-character job id answered")
    time.sleep(0.3)
    assert huge not in answers(sniffer, "dev-a") and agent.loop.alive
    with pytest.raises(EnvelopeError, match="job id"):
        M.parse_task(decode(encode(M.task_message(AGGREGATOR_ID, "j" * 65, 1, "echo", {}, 0.0))))
    with pytest.raises(EnvelopeError, match="job id"):
        M.parse_task(decode(encode(M.task_message(AGGREGATOR_ID, "", 1, "echo", {}, 0.0))))


def test_a_fed3r_task_over_the_memory_budget_is_declined_before_it_allocates(agent_and_sniffer):
    agent, sniffer = agent_and_sniffer
    rf = {"dim": 12_000, "sigma": 1.0, "seed": 0}
    t0 = time.monotonic()
    over = send_task(sniffer, "dev-a", "j2", "fed3r.stats", fed3r_params(random_features=rf))
    wait_for(lambda: over in answers(sniffer, "dev-a"), what="the over-budget task answered")
    assert time.monotonic() - t0 < 10          # a Gram matrix of 12,001² float64 (1.1 GB) was never built
    reason = answers(sniffer, "dev-a")[over].body["reason"]
    assert "MiB" in reason and "12001 features" in reason, reason
    fits = send_task(sniffer, "dev-a", "j2", "fed3r.stats", fed3r_params(random_features={**rf, "dim": 64}), round_=2)
    wait_for(lambda: fits in answers(sniffer, "dev-a"), what="a task within the budget answered")
    assert answers(sniffer, "dev-a")[fits].type == M.RESULT
    small = Fed3RStatsTask(np.ones((2, 16)), np.array([0, 1]), lambda b, s, w: Features(), memory_budget=8 * 16 * 16)
    with pytest.raises(TaskDeclined, match="MiB"):
        small(fed3r_params(), {})


def test_the_fed3r_memory_budget_counts_what_the_tasks_numbers_size_per_row():
    """A review's finding: the budget counted A, B and the random features' matrix but not the
    rows' one-hot (n x C) nor their random features (n x D), so a task at the most classes the
    check admitted allocated 20x the budget. The same task is now declined, and one whose budget
    covers its rows runs (both against the bytes counted here by hand)."""
    rows, features, classes = 300, 16, 2000
    task = Fed3RStatsParams(model=ModelSpec(backbone="b", image_size=8, num_classes=classes)).to_params()
    p = features + 1
    fixed, per_row = 8 * (p * p + classes * p), 8 * classes
    images, labels = np.ones((rows, features)), np.arange(rows) % 3
    tight = Fed3RStatsTask(images, labels, lambda b, s, w: Features(), memory_budget=fixed + rows * per_row - 1)
    with pytest.raises(TaskDeclined, match="MiB"):
        tight(task, {})
    enough = Fed3RStatsTask(images, labels, lambda b, s, w: Features(), memory_budget=fixed + rows * per_row)
    assert enough(task, {})[0]["n"] == rows


@pytest.mark.parametrize("sigma", [5e-324, 1e-310])
def test_random_features_that_overflow_are_declined_not_sent_as_nan(sigma):
    """A review's finding: a finite sigma so small that z·ω/σ overflows gave NaN statistics, sent as
    a result (2,144 NaN entries of A); the device now declines."""
    rng = np.random.default_rng(0)
    task = Fed3RStatsTask(rng.normal(size=(5, 16)), np.array([0, 1, 2, 0, 1]), lambda b, s, w: Features())
    with pytest.raises(TaskDeclined, match="not all finite"):
        task(fed3r_params(random_features={"dim": 32, "sigma": sigma, "seed": 0}), {})
    assert task(fed3r_params(random_features={"dim": 32, "sigma": 1.0, "seed": 0}), {})[0]["n"] == 5


def test_a_tick_that_raises_is_logged_once_and_the_agent_goes_on(broker, caplog):
    calls = {"n": 0}

    def flaky() -> bool:            # the availability probe (run on every tick) fails for a while
        calls["n"] += 1
        if 1 < calls["n"] < 20:          # the first, at start, succeeds
            raise RuntimeError("battery sensor unreadable")
        return True

    sniffer = Sniffer(broker, [T.outbox("dev-b")])
    agent = DeviceAgent("dev-b", BrokerConfig(port=broker.port), handlers(), tick_s=0.02,
                        hooks=AgentHooks(is_available=flaky))
    try:
        with caplog.at_level(logging.ERROR, logger="fedfleet.device"):
            agent.start()
            wait_for(lambda: calls["n"] >= 20 and agent.link.connected.is_set(), what="the probe recovered")
        assert agent.loop.alive
        assert sum("the tick raised" in r.getMessage() for r in caplog.records) == 1
        ok = send_task(sniffer, "dev-b", "j3", "echo", {})
        wait_for(lambda: ok in answers(sniffer, "dev-b"), what="a task answered after the tick's errors")
    finally:
        agent.stop()
        sniffer.close()


def test_decline_reasons_are_cut_on_the_wire_and_logged_boundedly():
    reason = "é" * (M.MAX_REASON_CHARS + 50)
    env = decode(encode(M.decline_message("d", M.TaskRef("j", 1, "t"), reason)))
    assert env.body["reason"] == reason[:M.MAX_REASON_CHARS]
    seen = FirstTimes(limit=3)
    assert [seen.first(k) for k in "aabcde"] == [True, False, True, True, False, False]
    assert MAX_REASON_CHARS <= M.MAX_REASON_CHARS


def test_a_task_whose_job_id_param_is_another_job_is_declined(agent_and_sniffer):
    """A stateful task reads and writes the device's state under its params' ``job_id``; the
    aggregator sets it to the task's job. One naming another job (a bug, a mixed-up config) would
    read that job's state: it is declined with both names, and the same task under its own job runs."""
    agent, sniffer = agent_and_sniffer
    other = send_task(sniffer, "dev-a", "j1", "echo", {"size": 1, "job_id": "j2"})
    own = send_task(sniffer, "dev-a", "j1", "echo", {"size": 1, "job_id": "j1"}, round_=2)
    odd = send_task(sniffer, "dev-a", "j1", "echo", {"size": 1, "job_id": None}, round_=3)
    wait_for(lambda: {other, own, odd} <= set(answers(sniffer, "dev-a")), what="the three answers")
    got = answers(sniffer, "dev-a")
    assert got[other].type == M.DECLINE and got[other].body["reason"] == \
        "the task's job_id param 'j2' is not its job 'j1'", got[other].body
    assert got[odd].type == M.DECLINE and got[odd].body["reason"] == "the task's job_id param is not a string"
    assert got[own].type == M.RESULT


def test_a_task_at_more_pixels_than_the_device_runs_is_declined_before_any_extractor(agent_and_sniffer):
    """The wire contract lets a task ask for 16,384 px images (one is 3.2 GB of input); this SDK's
    devices decline past MAX_DEVICE_IMAGE_SIZE before the extractor factory is called, and the
    agent goes on."""
    from edge_client.tasks.extractors import MAX_DEVICE_IMAGE_SIZE

    agent, sniffer = agent_and_sniffer
    made = []
    handler = agent.handlers["fed3r.stats"]
    factory = handler.extractor_factory
    handler.extractor_factory = lambda *a, **k: made.append(a) or factory(*a, **k)
    params = Fed3RStatsParams(model=ModelSpec(backbone="b", image_size=MAX_DEVICE_IMAGE_SIZE + 1,
                                              num_classes=3)).to_params()
    big = send_task(sniffer, "dev-a", "j1", "fed3r.stats", params)
    wait_for(lambda: big in answers(sniffer, "dev-a"), what="an answer to the task")
    got = answers(sniffer, "dev-a")[big]
    assert got.type == M.DECLINE and f"this device runs at most {MAX_DEVICE_IMAGE_SIZE}" in got.body["reason"]
    assert made == []
    ok = send_task(sniffer, "dev-a", "j1", "fed3r.stats", fed3r_params(), round_=2)
    wait_for(lambda: ok in answers(sniffer, "dev-a"), what="the next task answered")
    assert answers(sniffer, "dev-a")[ok].type == M.RESULT and len(made) == 1


def test_a_large_image_size_runs_in_batches_of_bounded_pixels():
    from edge_client.features import MAX_BATCH_PIXELS, FeatureExtractor

    seen = []

    def forward(batch):
        seen.append(batch.shape)
        return batch.reshape(len(batch), 3, -1).mean(axis=2)

    images = np.random.default_rng(0).integers(0, 256, (7, 16, 16, 3), dtype=np.uint8)
    small = FeatureExtractor(forward, image_size=32, mean=(0, 0, 0), std=(1, 1, 1), batch_size=64).extract(images)
    assert seen == [(7, 3, 32, 32)]
    seen.clear()
    large = FeatureExtractor(forward, image_size=1024, mean=(0, 0, 0), std=(1, 1, 1), batch_size=64)
    assert large.batch_size == MAX_BATCH_PIXELS // 1024 ** 2 == 3
    features = large.extract(images)
    assert [s[0] for s in seen] == [3, 3, 1] and features.shape == small.shape == (7, 3)


def test_a_device_holds_a_bounded_number_of_extractors_whatever_sizes_its_tasks_name(broker):
    """The device review's finding: every image size a task named left one more backbone (about
    29 MiB) in the device's memory for good. The device now keeps the last MAX_HELD_EXTRACTORS it
    was asked for; a size asked again after it left is made again, and every task is answered."""
    import gc
    import weakref

    from edge_client.handlers import SharedExtractors
    from edge_client.tasks.extractors import MAX_HELD_EXTRACTORS

    made, alive = [], weakref.WeakSet()

    def factory(backbone, image_size):
        made.append(image_size)
        alive.add(extractor := Features())
        return extractor

    sniffer = Sniffer(broker, [T.outbox("dev-b"), T.presence("dev-b")])
    task = Fed3RStatsTask(np.random.default_rng(0).normal(size=(5, 16)), np.array([0, 1, 2, 0, 1]),
                          SharedExtractors(factory, None))
    agent = DeviceAgent("dev-b", BrokerConfig(port=broker.port), {"fed3r.stats": task}, tick_s=0.05).start()
    try:
        wait_for(lambda: any(decode(p).body.get("state") == "online" for p in sniffer.seen.get(T.presence("dev-b"), [])),
                 what="the agent online")
        sizes = [8 + i for i in range(MAX_HELD_EXTRACTORS + 3)] + [8]       # the first size again, after it left
        sent = []
        for round_, size in enumerate(sizes, 1):
            params = Fed3RStatsParams(model=ModelSpec(backbone="b", image_size=size, num_classes=3)).to_params()
            sent.append(send_task(sniffer, "dev-b", "j1", "fed3r.stats", params, round_=round_))
            wait_for(lambda: sent[-1] in answers(sniffer, "dev-b"), what=f"the task at {size} px answered")
            gc.collect()
            assert len(alive) <= MAX_HELD_EXTRACTORS
        assert all(answers(sniffer, "dev-b")[s].type == M.RESULT for s in sent)
        assert made == sizes
    finally:
        agent.stop()
        sniffer.close()


def test_a_flood_on_the_inbox_while_the_agent_works_is_dropped_unread_beyond_its_bound(broker, monkeypatch):
    """A review's finding: paho queued every payload for the agent's thread, which decodes and
    checks them only when its task is done: 800 forged 1 MiB messages published while it trained
    grew the device by 808 MB. Beyond the inbox's bound they are dropped unread now, the task at
    work is answered, and the next task runs."""
    import threading

    import edge_client.agent as agent_module
    from protocols.message_loop import QueueBound

    monkeypatch.setattr(agent_module, "DEVICE_INBOX_BOUND", QueueBound(2 << 20, 3 << 20))
    working, release = threading.Event(), threading.Event()

    def slow(params, tensors):
        working.set()
        release.wait(20)
        return {"note": "done"}, {}

    sniffer = Sniffer(broker, [T.outbox("dev-f"), T.presence("dev-f")])
    agent = DeviceAgent("dev-f", BrokerConfig(port=broker.port), {"echo": handlers()["echo"], "slow": slow},
                        retry_after_s=5, tick_s=0.05).start()
    try:
        wait_for(lambda: any(decode(p).body.get("state") == "online" for p in sniffer.seen.get(T.presence("dev-f"), [])),
                 what="the agent online")
        busy = send_task(sniffer, "dev-f", "j", "slow", {})
        assert working.wait(10)
        junk = bytes(256 << 10)
        for _ in range(40):                                  # 10 MiB unread against a 2 MiB bound
            sniffer.publish(T.inbox("dev-f"), junk)
        wait_for(lambda: agent.loop.dropped >= 30, what="the flood dropped at the door")
        release.set()
        wait_for(lambda: busy in answers(sniffer, "dev-f"), what="the task at work answered")
        nxt = send_task(sniffer, "dev-f", "j", "echo", {"size": 3}, round_=2)
        wait_for(lambda: nxt in answers(sniffer, "dev-f"), what="the next task answered")
        assert answers(sniffer, "dev-f")[nxt].type == M.RESULT
    finally:
        release.set()
        agent.stop()
        sniffer.close()


def test_a_replayed_task_runs_once_and_is_answered_again_at_most_max_retries_times(broker):
    """A review's findings, over mosquitto: a declined task ran again on every replay (its handler's
    whole work, then another decline), and an answered task's replay re-sent its whole result each
    time, even after the ack. Now a replay gets the same answer, at most max_retries times."""
    runs = []

    def declining(params, tensors):
        runs.append("declining")
        raise TaskDeclined("the camera is busy")

    def answering(params, tensors):
        runs.append("answering")
        return {"note": "x" * 1000}, {}

    sniffer = Sniffer(broker, [T.outbox("dev-r"), T.presence("dev-r")])
    agent = DeviceAgent("dev-r", BrokerConfig(port=broker.port), {"declining": declining, "answering": answering},
                        retry_after_s=60, tick_s=0.05).start()
    again = agent.session.max_retries                    # how often a task is answered again
    try:
        wait_for(lambda: any(decode(p).body.get("state") == "online" for p in sniffer.seen.get(T.presence("dev-r"), [])),
                 what="the agent online")
        out = lambda: [decode(p) for p in sniffer.seen.get(T.outbox("dev-r"), [])
                       if decode(p).type in (M.RESULT, M.DECLINE)]
        for kind, round_ in (("declining", 1), ("answering", 2)):
            msg = M.task_message(AGGREGATOR_ID, "j", round_, kind, {}, time.time() + 60)
            for _ in range(again + 3):           # the task, then more replays of it than it answers
                sniffer.publish(T.inbox("dev-r"), encode(msg))
            wait_for(lambda: sum(e.body["task"] == msg.id for e in out()) == 1 + again, what=f"{kind}: its answers")
        time.sleep(0.5)
        assert runs == ["declining", "answering"]               # each ran once
        answers = [(e.type, e.body["task"]) for e in out()]
        assert len(answers) == 2 * (1 + again) and len({e.id for e in out() if e.type == M.RESULT}) == 1   # the same result
    finally:
        agent.stop()
        sniffer.close()


def test_replayed_first_chunks_of_earlier_messages_keep_no_chunked_task_out(agent_and_sniffer):
    """A review's finding, over mosquitto: four replayed first chunks of the aggregator's earlier
    chunked messages (chunks name no addressee) filled the inbox's partial-message slots, and every
    chunk of a real chunked task was refused until the TTL (300 s). The stalest partial gives way."""
    from protocols.chunking import split

    agent, sniffer = agent_and_sniffer

    def chunked_task(round_):
        msg = M.task_message(AGGREGATOR_ID, "j", round_, "echo", {"size": 3, "pad": "p" * 6000}, time.time() + 60)
        return msg.id, split(encode(msg), msg.id, AGGREGATOR_ID, chunk_size=2048)
    for round_ in (1, 2, 3, 4):
        sniffer.publish(T.inbox("dev-a"), chunked_task(round_)[1][0])
    task_id, parts = chunked_task(5)
    for part in parts:
        sniffer.publish(T.inbox("dev-a"), part)
    wait_for(lambda: task_id in answers(sniffer, "dev-a"), what="the chunked task answered")
    assert answers(sniffer, "dev-a")[task_id].type == M.RESULT
