"""K shards as local processes (``aggregator serve --shards K``): each its own MQTT client,
subscribed to the outboxes of the devices in its bucket range, and its own store; a pipe each
way to the coordinator (the service), which restarts a shard that died (same store: it resumes).

Routing: a shard learns its devices from their retained presence (``T/presence/+``, small) and
subscribes to exactly their outbox topics, so each result crosses the broker once, to its owner,
on any MQTT 3.1.1 or 5 broker. MQTT 5 shared subscriptions are not used: the broker would pick
the receiving shard per message, so a device's buckets would have no fixed owner and the shards'
stores no fixed content to resume from.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from pathlib import Path
from typing import Callable

from protocols.mqtt_link import BrokerConfig, MqttLink
from protocols.topics import AGGREGATOR_ID, Topics

from aggregator.jobs.base import Job
from aggregator.shards.buckets import bucket_range
from aggregator.shards.partial_sums import additive, reduce_nodes
from aggregator.shards.shard import Forward, Receipt, ShardIngest
from aggregator.storage.store import Store

log = logging.getLogger("fedfleet.aggregator.shards")


def shard_main(index: int, shards: int, broker: BrokerConfig, store_path: str, topics: Topics, conn,
               max_message_bytes: int) -> None:
    """A shard process: MQTT in, receipts and forwards out, sums on request."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s shard{index} %(levelname)s %(message)s")
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(1)            # the shards are the parallelism: one core's worth each, like the
    threadpool_limits(1)                # ingest workers' (a BLAS pool per shard only waits for the others)
    ingest = ShardIngest(index, shards, Store(store_path), topics, max_message_bytes)
    inbox: queue.Queue = queue.Queue()
    link = MqttLink(f"{AGGREGATOR_ID}-shard{index}of{shards}", broker, on_message=lambda t, p: inbox.put((t, p)),
                    subscriptions=[(topics.all_presence, 1)])
    threading.Thread(target=_read_commands, args=(conn, inbox), daemon=True).start()
    link.start(timeout=60.0)
    conn.send(("ready",))
    subscribed: set[str] = set()
    held: list = []         # outbox messages that came before the job did (a persistent session's queue)
    expired_at = 0.0
    while True:
        try:
            item = inbox.get(timeout=1.0)
        except queue.Empty:
            item = None
        if time.monotonic() - expired_at > 1.0:
            expired_at = time.monotonic()
            ingest.expire(expired_at)
        if item is None:
            continue
        if item[0] == "cmd":
            if not _command(ingest, conn, item[1]):
                break
            if ingest.job_id is not None:
                for queued in held:
                    inbox.put(queued)
                held = []
        elif "/presence/" in item[0]:
            device = topics.device_of(item[0])
            if device is not None and device not in subscribed and ingest.owns(device):
                subscribed.add(device)
                link.subscribe(topics.outbox(device))
        elif ingest.job_id is None:
            held.append(item)
        else:
            out = ingest.feed(*item)
            if isinstance(out, Receipt):
                conn.send(("receipt", out.topic, out.raw))
            elif isinstance(out, Forward):
                conn.send(("forward", out.topic, out.payload))
    link.stop()


def _read_commands(conn, inbox: queue.Queue) -> None:
    try:
        while True:
            inbox.put(("cmd", conn.recv()))
    except (EOFError, OSError):             # the coordinator is gone: so is this shard
        os._exit(0)


def _command(ingest: ShardIngest, conn, cmd: tuple) -> bool:
    if cmd[0] == "job":
        ingest.set_job(*cmd[1:])
    elif cmd[0] == "sums":
        request, job_id, accepted = cmd[1:]
        try:
            conn.send(("sums", request, ingest.sums(job_id, accepted)))
        except Exception as exc:            # said to the coordinator, which cannot reduce without it
            conn.send(("sums", request, f"{type(exc).__name__}: {exc}"))
    return cmd[0] != "stop"


def check_shardable(job: Job, kind: str) -> None:
    """Refuse, with the reason, a job whose sums shards cannot take."""
    additive(kind)
    if not job.order_free:
        raise ValueError(f"a {kind} job with this config is not order-free (e.g. DP noise at round close): "
                         f"it cannot be summed by shards")
    if job.config.to_dict().get("streaming"):
        # an increment is checked against the samples the job holds, which only the coordinator knows
        raise ValueError("streaming Fed3R cannot run on shards yet: run it without --shards")


class LocalShards:
    """The coordinator's side: start, feed with the job, ask for sums, restart the dead."""

    def __init__(self, shards: int, broker: BrokerConfig, store_dir: Path, topics: Topics = Topics(),
                 max_message_bytes: int = 256 * 1024 * 1024, reply_timeout_s: float = 600.0):
        bucket_range(0, shards)             # a count no bucket range fits is refused here
        self.shards, self.broker, self.topics = shards, broker, topics
        self.store_dir, self.max_message_bytes = Path(store_dir), max_message_bytes
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.reply_timeout_s = reply_timeout_s
        self._ctx = mp.get_context("spawn")
        self._ready = [threading.Event() for _ in range(shards)]
        self._started_at = [0.0] * shards
        self._procs: list = [None] * shards
        self._conns: list = [None] * shards
        self._replies: queue.Queue = queue.Queue()
        self._deliver: Callable[[tuple], None] = lambda item: None
        self._job: tuple | None = None
        self._request = 0
        self.restarts = 0

    def store_path(self, index: int) -> Path:
        return self.store_dir / f"shard-{index}-of-{self.shards}.db"

    def start(self, deliver: Callable[[tuple], None], timeout_s: float = 120.0) -> None:
        """Start the shards and wait until each is connected (so no result reaches the broker before
        its shard can subscribe). ``deliver(("forward", topic, payload) | ("receipt", topic, raw))``
        runs on reader threads."""
        self._deliver = deliver
        for i in range(self.shards):
            self._start(i)
        deadline = time.monotonic() + timeout_s
        while not all(r.is_set() for r in self._ready):
            if time.monotonic() > deadline:
                self.close()
                waiting = [i for i, r in enumerate(self._ready) if not r.is_set()]
                raise ConnectionError(f"shards {waiting} did not connect to the broker within {timeout_s:.0f}s")
            self.watch()                # one that failed to start (e.g. its connection) gets another try
            time.sleep(0.1)

    def _start(self, index: int) -> None:
        ours, theirs = self._ctx.Pipe()
        proc = self._ctx.Process(target=shard_main, name=f"fedfleet-shard{index}", daemon=True, args=(
            index, self.shards, self.broker, str(self.store_path(index)), self.topics, theirs, self.max_message_bytes))
        proc.start()
        self._started_at[index] = time.monotonic()
        theirs.close()
        (self.store_dir / f"shard-{index}.pid").write_text(str(proc.pid))
        self._procs[index], self._conns[index] = proc, ours
        if self._job is not None:
            ours.send(("job", *self._job))
        threading.Thread(target=self._read, args=(index, ours), daemon=True).start()

    def _read(self, index: int, conn) -> None:
        try:
            while True:
                msg = conn.recv()
                if msg[0] == "ready":
                    self._ready[index].set()
                else:
                    (self._replies.put((index, *msg[1:])) if msg[0] == "sums" else self._deliver(msg))
        except (EOFError, OSError):
            return

    def set_job(self, job: Job, kind: str) -> None:
        """Serve ``job`` (refused, changing nothing, unless it is shardable)."""
        check_shardable(job, kind)
        self._job = (job.config.job_id, kind, job.config.to_dict())
        for conn in self._conns:
            conn.send(("job", *self._job))

    def watch(self) -> None:
        """Restart every shard process that died: it reopens its store and resumes."""
        for i, proc in enumerate(self._procs):
            # at most one start a second: a shard that cannot start does not spin the service
            if proc is not None and proc.exitcode is not None and time.monotonic() - self._started_at[i] > 1.0:
                log.error("shard %d exited (code %s): restarting it on its store", i, proc.exitcode)
                self.restarts += 1
                self._start(i)

    def reduce(self, kind: str, config: dict, job_id: str, accepted: list[tuple[str, str]]) -> Job:
        """The canonical model of ``accepted`` (device, message id)s: the shards' node sums reduced."""
        self._request += 1
        request, nodes, waiting = self._request, {}, set(range(self.shards))
        for i in waiting:
            self._conns[i].send(("sums", request, job_id, accepted))
        deadline = time.monotonic() + self.reply_timeout_s
        while waiting:
            try:
                index, got_request, sums = self._replies.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"shards {sorted(waiting)} did not send their sums")
                for i in list(waiting):             # a shard that died meanwhile: restarted and asked again
                    if self._procs[i].exitcode is not None:
                        self.watch()
                        self._conns[i].send(("sums", request, job_id, accepted))
                continue
            if got_request != request or index not in waiting:
                continue
            if isinstance(sums, str):
                raise RuntimeError(f"shard {index} cannot sum: {sums}")
            nodes.update(sums)
            waiting.discard(index)
        return reduce_nodes(kind, config, nodes)

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(("stop",))
            except (OSError, ValueError):
                pass
        for proc in self._procs:
            if proc is not None:
                proc.join(timeout=10)
                if proc.exitcode is None:
                    proc.terminate()
