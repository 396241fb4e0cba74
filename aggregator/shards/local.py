"""A shard's loop (:func:`shard_main`), and K shards as local processes (``aggregator serve
--shards K``, :class:`LocalShards`): each its own MQTT client, subscribed to the outboxes of the
devices in its bucket range, and its own store; a pipe each way to the coordinator (the service,
through ``pool.py``'s :class:`ShardPool`), which restarts a shard that died (same store: it
resumes). On a Ray cluster the same loop runs in an actor (``ray_shards.py``).

Routing: a shard learns its devices from their retained presence (``T/presence/+``, small) and
subscribes to exactly their outbox topics, so each result crosses the broker once, to its owner,
on any MQTT 3.1.1 or 5 broker. MQTT 5 shared subscriptions are not used: the broker would pick
the receiving shard per message, so a device's buckets would have no fixed owner and the shards'
stores no fixed content to resume from.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from pathlib import Path

from protocols.log_text import log_to_stderr
from protocols.mqtt_link import BrokerConfig, MqttLink
from protocols.topics import AGGREGATOR_ID, Topics

from aggregator.compute.fork_server import fork_server_context
from aggregator.shards.buckets import shard_role
from aggregator.shards.pool import ShardPool
from aggregator.shards.shard import Forward, Publish, Receipt, Refused, ShardIngest
from aggregator.storage.store import Store

log = logging.getLogger("fedfleet.aggregator.shard")

HELD_BYTES = 64 << 20       # outbox messages a shard keeps while it has no job (devices re-send the rest)
# for a shard's pipe to take a command (its reader thread takes each at once; a full pipe waits only
# on a shard that stopped reading): one that takes none this long is hung, killed and restarted
COMMAND_TIMEOUT_S = 60.0


def _held_bytes(item: tuple[str, bytes]) -> int:
    """What one held message costs: its topic and payload and the tuple around them (an empty
    payload is legal MQTT, and 200,000 of them held 28 MB while counting 0 bytes)."""
    return len(item[0]) + len(item[1]) + 128


class HeldMessages:
    """Outbox messages that reached a shard before its job did (a persistent session's queue),
    kept in arrival order up to ``budget`` bytes of payload: the oldest are dropped beyond it, since
    a device re-sends a result until it is answered, and a flood before the first job command
    would otherwise grow the shard's memory without bound."""

    def __init__(self, budget: int = HELD_BYTES):
        self.budget, self.size, self.dropped = budget, 0, 0
        self.items: collections.deque = collections.deque()

    def add(self, item: tuple[str, bytes]) -> None:
        self.items.append(item)
        self.size += _held_bytes(item)
        while self.size > self.budget:
            self.size -= _held_bytes(self.items.popleft())
            self.dropped += 1
            if self.dropped == 1:
                log.warning("messages before the job exceed %d bytes; the oldest are dropped (devices re-send)",
                            self.budget)

    def drain(self) -> list[tuple[str, bytes]]:
        out, self.items, self.size = list(self.items), collections.deque(), 0
        return out


def shard_main(index: int, shards: int, broker: BrokerConfig, store_path: str, topics: Topics,
               max_message_bytes: int, conn) -> None:
    """A shard: MQTT in, receipts and forwards out, sums on request. ``conn`` is its channel to
    the coordinator (``send(message)``, ``recv()`` the next command, EOFError once it is gone)."""
    log_to_stderr(f"%(asctime)s shard{index} %(levelname)s %(message)s", force=True)   # a fork inherits its handler
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(1)            # the shards are the parallelism: one core's worth each, like the
    threadpool_limits(1)                # ingest workers' (a BLAS pool per shard only waits for the others)
    ingest = ShardIngest(index, shards, Store(store_path), topics, max_message_bytes)
    # beside its store, on the machine that runs it: which process to signal to stop this shard by hand
    Path(store_path).with_name(f"shard-{index}.pid").write_text(str(os.getpid()))
    inbox: queue.Queue = queue.Queue()
    link = MqttLink(f"{AGGREGATOR_ID}-shard{index}of{shards}", broker.for_role(shard_role(index)),
                    on_message=lambda t, p: inbox.put((t, p)),
                    subscriptions=[(topics.all_presence, 1)])
    threading.Thread(target=_read_commands, args=(conn, inbox), daemon=True).start()
    link.start(timeout=60.0)
    conn.send(("ready",))
    subscribed: set[str] = set()
    held = HeldMessages()
    expired_at = 0.0
    while True:
        try:
            item = inbox.get(timeout=0.2)       # a hosted secure group's phase timers tick at least this often
        except queue.Empty:
            item = None
        now = time.monotonic()
        if now - expired_at > 1.0:
            expired_at = now
            ingest.expire(expired_at)
        if item is None:
            pass
        elif item[0] == "cmd" and item[1][0].startswith("group_"):
            _publish(ingest, link, topics, _group_command(ingest, item[1], now))
        elif item[0] == "cmd" and item[1][0] == "refeed":
            _feed(ingest, conn, link, topics, held, (item[1][1], item[1][2], True), now)
        elif item[0] == "cmd":
            if not _command(ingest, conn, item[1]):
                break
            if ingest.job_id is not None:
                for queued in held.drain():
                    inbox.put(queued)
        elif "/presence/" in item[0]:
            device = topics.device_of(item[0])
            if device is not None and ingest.owns(device):
                _subscribe(link, topics, subscribed, [device])
        else:
            _feed(ingest, conn, link, topics, held, item, now)
        if ingest.groups is not None:
            _subscribe(link, topics, subscribed, ingest.groups.members)   # before the group's first message
            _publish(ingest, link, topics, ingest.groups.tick(now))
            for outcome in ingest.groups.outcomes():
                conn.send(outcome)
                _unsubscribe_former(ingest, link, topics, subscribed)
    link.stop()


def _feed(ingest: ShardIngest, conn, link: MqttLink, topics: Topics, held: HeldMessages, item: tuple,
          now: float) -> None:
    """One outbox message (``item``: topic, payload, and True when the coordinator handed it back):
    what the shard's ingest makes of it goes to the coordinator or, a hosted group's, to the broker."""
    if ingest.job_id is None:
        return held.add(item)
    topic, payload, refed = item[0], item[1], len(item) > 2
    try:
        out = ingest.feed(topic, payload, now)
    except Exception as exc:    # one device's message never stops the shard (and its whole bucket range)
        # refused, and said to the coordinator, which counts it as one aggregator counts a message
        # that raised on its path (``AggregatorService._refused``): it was dropped unheard of
        log.exception("shard %d: a message on %s raised; refused", ingest.index, topic)
        out = Refused(topic, "malformed", repr(exc))
    if isinstance(out, Refused):        # counted by the coordinator, as one aggregator counts it
        conn.send(("refused", out.topic, f"shard {ingest.index}: {out.detail}"[:300], out.reason_class))
    elif isinstance(out, Receipt):
        conn.send(("receipt", out.topic, out.raw))
    elif isinstance(out, Forward):
        # a chunk of a device not admitted here: the coordinator's to judge, handed back once at most
        conn.send(("unadmitted" if out.not_admitted and not refed else "forward", out.topic, out.payload))
    elif isinstance(out, Publish):
        _publish(ingest, link, topics, out.sends)


def _subscribe(link: MqttLink, topics: Topics, subscribed: set[str], devices) -> None:
    for device in devices:
        if device not in subscribed:
            subscribed.add(device)
            link.subscribe(topics.outbox(device))


def _unsubscribe_former(ingest: ShardIngest, link: MqttLink, topics: Topics, subscribed: set[str]) -> None:
    """A hosted group ended: stop reading its members of other buckets (each would otherwise reach
    one more shard with every later message, up to every shard reading every device)."""
    for device in sorted(d for d in subscribed if not ingest.reads(d)):
        subscribed.discard(device)
        link.unsubscribe(topics.outbox(device))


def _publish(ingest: ShardIngest, link: MqttLink, topics: Topics, sends: list) -> None:
    """A hosted group's messages, signed as the aggregator's (its members accept no others)."""
    for device, env in sends:
        link.publish_envelope(topics.inbox(device), env, signer=ingest.groups.signer)


def _group_command(ingest: ShardIngest, cmd: tuple, now: float) -> list:
    """The coordinator's word on a secure group (``secure_groups.py``): host it, a member is gone,
    give it up. The messages to publish."""
    if ingest.groups is None:
        log.warning("shard %d: %s for a job with no secure groups: ignored", ingest.index, cmd[0])
        return []
    if cmd[0] == "group_open":
        return ingest.groups.open(cmd[1], cmd[2])
    if cmd[0] == "group_offline":
        return ingest.groups.offline(cmd[1], cmd[2], now)
    return ingest.groups.abort(cmd[1], cmd[2])


def _shard_process(*args) -> None:
    """A local shard's process: its loop, then out at once. Everything it stored is durable by
    then; the interpreter's own shutdown (torch's, the link's threads') took seconds of every
    job's end."""
    shard_main(*args)
    logging.shutdown()
    os._exit(0)


def _read_commands(conn, inbox: queue.Queue) -> None:
    try:
        while True:
            inbox.put(("cmd", conn.recv()))
    except (EOFError, OSError):             # the coordinator is gone: so is this shard
        os._exit(0)


def _command(ingest: ShardIngest, conn, cmd: tuple) -> bool:
    if cmd[0] == "job":
        ingest.set_job(*cmd[1:])
    elif cmd[0] == "keys":
        ingest.require_signatures(cmd[1])
    elif cmd[0] == "key":
        ingest.key_changed(cmd[1], cmd[2])
    elif cmd[0] == "admit":
        ingest.admit(cmd[1], cmd[2])
    elif cmd[0] == "admitted":
        ingest.admission_changed(cmd[1], cmd[2])
    elif cmd[0] == "closed":
        ingest.drop_orphans(*cmd[1:])
    elif cmd[0] in ("sums", "statistics"):
        request, job_id, accepted, context = cmd[1:]
        answer = ingest.sums if cmd[0] == "sums" else ingest.statistics
        try:
            conn.send(("sums", request, answer(job_id, accepted, context)))
        except Exception as exc:            # said to the coordinator, which cannot reduce without it
            conn.send(("sums", request, f"{type(exc).__name__}: {exc}"))
    return cmd[0] != "stop"


class PipeCommands:
    """One local shard's commands, written to its pipe in order by a thread of their own (as a Ray
    shard's ``ActorCommands``): a sender only queues one. A shard that stopped reading (stopped, or
    stuck holding the GIL) lets its pipe fill, and the write that then waits holds up no caller: the
    service thread waited on it for ever, under the pool's ``send_lock`` (a review's finding)."""

    def __init__(self, conn):
        self.conn = conn
        self.failed: str | None = None          # why a command could not be written (a broken pipe)
        self._writing_since: float | None = None
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._deliver, daemon=True).start()

    def put(self, command: tuple) -> None:
        self._queue.put(command)

    def close(self) -> None:
        """Write nothing more (a successor has its own)."""
        self._queue.put(None)

    def blocked_for(self, now: float) -> float:
        """How long the write in progress has waited for the shard to read (0: none waits)."""
        since = self._writing_since
        return 0.0 if since is None else now - since

    def _deliver(self) -> None:
        while (command := self._queue.get()) is not None:
            self._writing_since = time.monotonic()
            try:
                self.conn.send(command)
            except Exception as exc:    # its pipe broke (it died): the commands after it go with it
                self.failed = f"{type(exc).__name__}: {exc}"
                return
            self._writing_since = None


class LocalShards(ShardPool):
    """The shards as processes on this machine (forked from the service's fork server:
    ``aggregator/compute/fork_server.py``), a pipe each. ``command_timeout_s``: how long a shard's
    pipe may take a command before the shard counts as hung (killed, then restarted on its store)."""

    def __init__(self, shards: int, broker: BrokerConfig, store_dir: Path, topics: Topics = Topics(),
                 max_message_bytes: int = 256 * 1024 * 1024, reply_timeout_s: float = 600.0,
                 command_timeout_s: float = COMMAND_TIMEOUT_S):
        super().__init__(shards, broker, store_dir, topics, max_message_bytes, reply_timeout_s)
        self.command_timeout_s = command_timeout_s
        self._ctx = fork_server_context(__name__)
        self._procs: list = [None] * shards
        self._commands: list[PipeCommands | None] = [None] * shards

    def _launch(self, index: int) -> None:
        ours, theirs = self._ctx.Pipe()
        proc = self._ctx.Process(target=_shard_process, name=f"fedfleet-shard{index}", daemon=True,
                                 args=(*self.shard_args(index), theirs))
        proc.start()
        theirs.close()
        if self._commands[index] is not None:   # its predecessor's: never written to the new pipe
            self._commands[index].close()
        self._procs[index], self._commands[index] = proc, PipeCommands(ours)
        threading.Thread(target=self._read, args=(index, ours), daemon=True).start()

    def _read(self, index: int, conn) -> None:
        try:
            while True:
                self._received(index, conn.recv())
        except (EOFError, OSError):
            return

    def _send(self, index: int, command: tuple) -> None:
        with self.send_lock:                # the pool's order, across threads
            self._commands[index].put(command)

    def _exited(self, index: int) -> str | None:
        """How shard ``index`` ended; one whose pipe took no command for ``command_timeout_s`` is
        hung (it reads no result either): killed here, so it is restarted as a dead one is."""
        proc, commands = self._procs[index], self._commands[index]
        if proc is None:
            return None
        hung = (f"took no command for {self.command_timeout_s:.0f} s"
                if commands.blocked_for(time.monotonic()) > self.command_timeout_s else None)
        if proc.exitcode is None and (why := commands.failed or hung):
            # a shard that cannot be told its commands would serve the job deaf: its successor is told them all
            log.error("shard %d %s: killed, to be restarted on its store", index, why)
            proc.kill()
            proc.join(10)
        return None if proc.exitcode is None else f"code {proc.exitcode}"

    def _stop(self) -> None:
        for commands in self._commands:     # each writes its ("stop",), then ends
            if commands is not None:
                commands.close()
        for proc in self._procs:
            if proc is not None:
                proc.join(timeout=10)
                if proc.exitcode is None:   # SIGKILL: a stopped one never acts on SIGTERM; its store is durable
                    proc.kill()
                    proc.join(timeout=10)
