"""K shards as Ray actors (``aggregator serve --shards K --ray ADDRESS``): the same shard loop as a
local shard process (``local.py``'s :func:`shard_main`: its own MQTT client, its own store), run
by an actor on one of the cluster's nodes; the coordinator reaches it through Ray in place of a
pipe (:class:`RayShards`, a ``pool.py`` :class:`ShardPool` like ``LocalShards``).

Where a shard runs is where its store is: ``store_path(i)`` is opened on the node that runs actor
i. A shard restarted while the coordinator runs goes back to that node (node affinity), so it
resumes from its store. To resume after the coordinator itself restarts, shard i must land on
that node again: a node started with the custom resource ``fedfleet_shard_<i>`` (``ray start
--resources '{"fedfleet_shard_0": 1}'``) gets shard i every time; without one, the shards are
spread over the nodes by Ray, and their store directory must be one every node sees (a shared
file system). ``placement.json`` in the coordinator's store directory says which node runs which
shard. Every node must reach the broker at the address the coordinator was given.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
from pathlib import Path
from typing import Callable

from protocols.mqtt_link import BrokerConfig
from protocols.ray_cluster import join_ray
from protocols.topics import Topics

from aggregator.shards.local import shard_main
from aggregator.shards.pool import ShardPool

PIN_RESOURCE = "fedfleet_shard_"    # + i: the custom resource of the node that runs shard i
COMMAND_TIMEOUT_S = 60.0            # for an actor to take the previous command
# for a new actor to take its first: it starts meanwhile, and with every shard starting at once a
# loaded machine took over two minutes (a hung start is the pool's start timeout's, or a restart's)
START_TIMEOUT_S = 600.0


class QueueChannel:
    """What :func:`shard_main` speaks through inside an actor: commands in, messages out."""

    def __init__(self):
        self.commands: queue.Queue = queue.Queue()
        self.messages: queue.Queue = queue.Queue()

    def send(self, message: tuple) -> None:
        self.messages.put(message)

    def recv(self) -> tuple:
        return self.commands.get()


class ShardActor:
    """The actor body (wrapped by ``ray.remote`` in :class:`RayShards`): the shard loop on a thread;
    the coordinator puts commands with :meth:`command` and long-polls messages with :meth:`take`."""

    def __init__(self, index: int, shards: int, broker: BrokerConfig, store_path: str, topics: Topics,
                 max_message_bytes: int):
        self.index, self.store_path = index, store_path
        self.channel = QueueChannel()
        self.thread = threading.Thread(target=self._run, daemon=True, args=(
            index, shards, broker, store_path, topics, max_message_bytes))
        self.thread.start()

    def _run(self, *shard_args) -> None:
        try:
            shard_main(*shard_args, self.channel)
        except BaseException:
            # the actor ends with its shard, as a process would: the coordinator restarts it
            logging.getLogger("fedfleet.aggregator.shards").exception("shard %d failed", self.index)
            os._exit(1)

    def where(self) -> dict:
        import ray

        context = ray.get_runtime_context()
        return {"shard": self.index, "node_id": context.get_node_id(), "host": socket.gethostname(),
                "pid": os.getpid(), "store": self.store_path, "resources": context.get_assigned_resources()}

    def command(self, command: tuple) -> None:
        self.channel.commands.put(command)

    def take(self, timeout_s: float) -> list[tuple]:
        """The messages the shard sent: at least one, or none after ``timeout_s``."""
        try:
            out = [self.channel.messages.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while len(out) < 256:
            try:
                out.append(self.channel.messages.get_nowait())
            except queue.Empty:
                break
        return out

    def join(self, timeout_s: float) -> bool:
        self.thread.join(timeout_s)
        return not self.thread.is_alive()


class ActorCommands:
    """One actor's commands, delivered in the order they were queued by a thread of their own.

    A threaded actor may run two calls at once, out of order, so each command is submitted only
    once the actor has taken the one before. That wait (START_TIMEOUT_S for the first, while the
    actor starts, then COMMAND_TIMEOUT_S) happens here, never under the pool's ``send_lock``:
    queueing a command is all a sender does, so one slow actor holds up neither the other shards'
    commands nor the reader threads handing messages back. ``failed(exc)`` is called once if the
    actor cannot take one (dead, not taking it in time, or a command Ray cannot send); the commands
    after it are dropped (its successor is told the job again at its start)."""

    def __init__(self, ray, actor, failed: Callable[[Exception], None]):
        self.ray, self.actor, self.failed = ray, actor, failed
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._deliver, daemon=True)
        self._thread.start()

    def put(self, command: tuple) -> None:
        self._queue.put(command)

    def close(self, timeout_s: float = 0.0) -> None:
        """Deliver what was queued (waiting up to ``timeout_s`` for it to be taken), then stop."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _deliver(self) -> None:
        pending, timeout = None, START_TIMEOUT_S
        try:
            while (command := self._queue.get()) is not None:
                if pending is not None:
                    self.ray.get(pending, timeout=timeout)
                    timeout = COMMAND_TIMEOUT_S
                pending = self.actor.command.remote(command)
            if pending is not None:
                self.ray.get(pending, timeout=timeout)
        except Exception as exc:            # not only Ray's: a thread that died silently left a deaf shard
            self.failed(exc)


class RayShards(ShardPool):
    """The shards as Ray actors, one CPU each, on the cluster at ``address`` ("auto": the local
    cluster started with ``ray start``; else its head's host:port)."""

    def __init__(self, address: str, shards: int, broker: BrokerConfig, store_dir: Path, topics: Topics = Topics(),
                 max_message_bytes: int = 256 * 1024 * 1024, reply_timeout_s: float = 600.0):
        super().__init__(shards, broker, store_dir, topics, max_message_bytes, reply_timeout_s)
        self.ray, self._joined = join_ray(address)
        # threaded: take() waits for messages while commands come in
        self._remote = self.ray.remote(num_cpus=1, max_concurrency=4)(ShardActor)
        self._actors: list = [None] * shards
        self._commands: list[ActorCommands | None] = [None] * shards
        self._ended: list[str | None] = [None] * shards
        self._liveness = threading.Lock()           # an actor's end is recorded only while it is current
        self.placement: list[dict | None] = [None] * shards
        self._placement_lock = threading.Lock()

    def _options(self, index: int) -> dict:
        pinned = f"{PIN_RESOURCE}{index}"
        if pinned in self.ray.cluster_resources():
            return {"resources": {pinned: 1}}
        if self.placement[index] is not None:      # restarted where its store is
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            return {"scheduling_strategy": NodeAffinitySchedulingStrategy(self.placement[index]["node_id"], soft=False)}
        return {"scheduling_strategy": "SPREAD"}

    def _launch(self, index: int) -> None:
        old, self._actors[index] = self._actors[index], None
        if old is not None:         # dead, or never placed: either way never two shards on one store
            self._commands[index].close()
            self.ray.kill(old)
        self._attach(index, self._remote.options(**self._options(index)).remote(*self.shard_args(index)))

    def _attach(self, index: int, actor) -> None:
        """Reach shard ``index`` through ``actor`` from now on: its commands and its messages."""
        commands = ActorCommands(self.ray, actor, lambda exc: self._failed(index, actor, exc))
        with self._liveness:
            self._ended[index], self._commands[index], self._actors[index] = None, commands, actor
        threading.Thread(target=self._read, args=(index, actor), daemon=True).start()

    def _failed(self, index: int, actor, exc: Exception) -> None:
        reason = _reason(exc)
        with self._liveness:
            if self._actors[index] is actor:    # not a predecessor's late failure
                self._ended[index] = reason

    def _read(self, index: int, actor) -> None:
        try:
            where = self.ray.get(actor.where.remote())
            if self._actors[index] is actor:
                self._placed(index, where)
            while self._actors[index] is actor:
                for message in self.ray.get(actor.take.remote(1.0)):
                    self._received(index, message)
        except self.ray.exceptions.RayError as exc:
            self._failed(index, actor, exc)

    def _placed(self, index: int, where: dict) -> None:
        with self._placement_lock:
            self.placement[index] = where
            path = self.store_dir / "placement.json"
            path.with_suffix(".tmp").write_text(json.dumps([p for p in self.placement if p], indent=1))
            path.with_suffix(".tmp").replace(path)

    def _send(self, index: int, command: tuple) -> None:
        with self.send_lock:                        # the pool's order, across threads
            if self._actors[index] is None or self._ended[index] is not None:
                return                              # dead: watch() restarts it
            self._commands[index].put(command)

    def _exited(self, index: int) -> str | None:
        return self._ended[index]

    def _stop(self) -> None:
        live = [a for a in self._actors if a is not None]
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        for commands in self._commands:             # ("stop",) taken by each before it is joined
            if commands is not None:
                commands.close(max(0.0, deadline - time.monotonic()))
        # each leaves the broker cleanly, then goes; wait() is not cut short by a dead one's error
        if live:
            self.ray.wait([a.join.remote(10.0) for a in live], num_returns=len(live), timeout=15.0)
        self._actors = [None] * self.shards
        for actor in live:
            self.ray.kill(actor)
        if self._joined:
            self.ray.shutdown()


def _reason(exc: Exception) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first[:200]}"
