"""What the shard tests over mosquitto share (tests/test_shards.py: Fed3R's ingest;
tests/test_shard_rounds.py: the FedAvg family's rounds): the fleet, the shard stores' rows, and the
``--shards`` options of a local or a Ray run."""

import importlib.util
import os
import signal
import sqlite3
import time
from pathlib import Path

import pytest

DEVICES = [f"dev{i:02d}" for i in range(10)]
# Ray is an optional extra (fedfleet[ray]); `make setup` installs it, so these run in CI
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs fedfleet[ray]")
ON_RAY = [pytest.mark.slow, needs_ray, pytest.mark.ray_cluster]
# How long a sharded job may take to its end: a Ray actor's start alone took over a minute on CI's
# two loaded cores, and a slow machine running the suite's four workers took 165 s for a run that
# needs 31 s alone.
SHARDED_JOB_TIMEOUT_S = 360
# `make test-ray` (FEDFLEET_RAY_ALL=1) widens the shard files' matrices to every kind on local shards
# and Ray actors: the same paths as the suite's representatives, minutes more than its budget on CI's
# two cores
RAY_ALL = os.environ.get("FEDFLEET_RAY_ALL") == "1"
RAY_ALL_ONLY = pytest.mark.skipif(not RAY_ALL, reason="make test-ray runs it")


def shard_rows(state, shards: int) -> list[list[tuple[str, str]]]:
    return [sqlite3.connect(f"{state}.shards/shard-{i}-of-{shards}.db").execute(
        "SELECT device, message_id FROM contributions").fetchall() for i in range(shards)]


def rounds_held(state, shard: int, shards: int = 2) -> set[int]:
    """The rounds shard ``shard`` of ``shards`` stores results of (none before its store exists)."""
    try:
        return {r for (r,) in sqlite3.connect(f"{state}.shards/shard-{shard}-of-{shards}.db").execute(
            "SELECT round FROM contributions")}
    except sqlite3.OperationalError:
        return set()


def sigkill_shard_holding(proc, state, victim: int, round_: int, held_back, timeout: float) -> str:
    """Once shard ``victim`` stores a result of ``round_``, SIGKILL it, open the gate the other
    devices wait at (``held_back``) and wait for the aggregator ``proc`` to end; its output."""
    try:
        deadline = time.monotonic() + 240
        while round_ not in rounds_held(state, victim) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert round_ in rounds_held(state, victim), f"shard {victim} never stored a round-{round_} result"
        os.kill(int(Path(f"{state}.shards", f"shard-{victim}.pid").read_text()), signal.SIGKILL)
        held_back.set()
        proc.wait(timeout)
    finally:
        held_back.set()                 # never leave the devices waiting at the gate
        proc.kill()
    return proc.output()


def shard_options(on: str, request) -> list[str]:
    """A shard's Ray actor goes where its custom resource is: shard 0's to the head, shard 1's to the
    second node (``aggregator/shards/ray_shards.py``; the shared cluster's ``SharedCluster.RESOURCES``)."""
    return ["--shards", "2"] + (["--ray", request.getfixturevalue("ray_test_cluster")]
                                                  if on == "ray" else [])
