"""A shard that stops taking its commands without dying: real shard processes, a real mosquitto."""

import contextlib
import os
import signal
import threading
import time

from aggregator.jobs.registry import build_job
from aggregator.shards.buckets import bucket_range

from test_shard_ingest import CONFIG


def test_a_shard_that_stops_reading_its_pipe_holds_up_no_command_and_is_restarted(broker, tmp_path):
    """A review's finding: the coordinator wrote each command to a local shard's pipe itself, under
    the pool's ``send_lock``; a shard that stopped reading (here SIGSTOPped; a process stuck holding
    the GIL alike) let the pipe fill, and the write blocked the service thread for ever, the reply
    timeout never reached, every other sender (the reader threads' hand-backs) stuck on the lock.
    Now a command is only queued, a shard that takes none for ``command_timeout_s`` is killed and
    restarted on its store (as a Ray shard that does not take one is), and the sums asked meanwhile
    come from its successor."""
    from aggregator.shards.local import LocalShards
    from protocols.mqtt_link import BrokerConfig

    pool = LocalShards(2, BrokerConfig.from_url(broker.url), tmp_path / "shards", reply_timeout_s=60.0,
                       command_timeout_s=3.0)
    pool.start(lambda item: None, timeout_s=120)
    stopped = pool._procs[1].pid
    try:
        pool.set_job(build_job("fed3r", CONFIG), "fed3r")
        os.kill(stopped, signal.SIGSTOP)
        # a close of an order-free job names every id so far: megabytes for a large fleet
        accepted = [(f"dev{i:06d}", f"{i:032x}") for i in range(40_000)]
        sent = threading.Event()

        def close_and_ask():
            pool.round_closed(CONFIG["job_id"], 1, accepted, earlier=True)
            sent.set()
        threading.Thread(target=close_and_ask, daemon=True).start()
        assert sent.wait(10), "the coordinator is blocked writing to a shard that stopped reading"
        with pool.send_lock:            # free: a reader thread's hand-back would not wait for ever
            pass
        sums = pool.ask("sums", CONFIG["job_id"], [])
        assert sorted(sums) == [bucket_range(0, 2), bucket_range(1, 2)]      # both shards answered
        assert pool.restarts == 1 and pool._procs[1].pid != stopped and pool._exited(0) is None
    finally:
        with contextlib.suppress(ProcessLookupError):       # killed by the pool, as it should be
            os.kill(stopped, signal.SIGKILL)
        pool.close()


def test_closing_the_pool_ends_a_shard_that_stopped_even_one_deaf_to_sigterm(broker, tmp_path):
    """A review's finding: ``close()`` waited 10 s for each shard, then sent SIGTERM, which a stopped
    process never acts on: the shard outlived its pool, and the coordinator hung at its own exit
    (multiprocessing joins its daemon children there, for ever). Now a shard still running after its
    wait is SIGKILLed (everything it stored is durable: a kill is what a restart resumes from)."""
    from aggregator.shards.local import LocalShards
    from protocols.mqtt_link import BrokerConfig

    pool = LocalShards(2, BrokerConfig.from_url(broker.url), tmp_path / "shards")
    pool.start(lambda item: None, timeout_s=120)
    stopped = pool._procs[1]
    try:
        pool.set_job(build_job("fed3r", CONFIG), "fed3r")
        os.kill(stopped.pid, signal.SIGSTOP)
        pool.close()
        assert stopped.exitcode is not None and pool._procs[0].exitcode == 0
    finally:
        if stopped.exitcode is None:
            os.kill(stopped.pid, signal.SIGKILL)
            stopped.join(10)
