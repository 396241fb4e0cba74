"""What a deployment controller's start costs at fleet scale: at start it publishes each device's
last assignment again (retained, signed, the same sequence: ``DeploymentController._plan_redelivery``
and ``_redeliver_some``), one signed envelope and one publish per device that was ever assigned,
in slices of ``REDELIVERY_BATCH`` devices between which its thread serves commands and reports;
against the same re-delivery in one go (one slice of every device: what the controller did before).

The fleet: N enrolled devices in a real SQLite store (rows written in bulk), a settled (complete)
deployment whose ``run`` every device was sent, and an active 5 % canary of a second model whose
``run`` its devices were sent: a controller restarted mid-rollout. The broker: a real mosquitto
(``MosquittoBroker``). In a fresh process per way (its memory its own), measured:

* the unit, in that process against that broker: one assignment built, signed (Ed25519) and
  published until the broker acknowledged it, per message over a batch of the same shape;
* the start: from constructing the controller until every assignment of its re-delivery is
  acknowledged by the broker; within it, the longest the controller's thread was busy in one go,
  the longest an operator's command waited (commands posted one after another from the moment
  the re-delivery began until it ended: what a deploy/promote/rollback or a report waits for at
  worst), the publishes in the MQTT client at once, and the peak resident memory above what the
  process held before; and a rollout tick after it (the settled version's check of the fleet);
* the ratios: the re-delivery per device against the unit, and in slices against in one go.

``--steady``: the rollout after the start (its re-delivery skipped): the same fleet, nothing
changing, a rollout tick every ``tick_s`` (the settled version's check of the fleet and the
canary's); measured over ``--ticks`` ticks after the first: each tick's cost, and the longest an
operator's command waited (commands posted one after another, as above); then one device enrolled
between two ticks (on another thread's store connection, as the admin API enrols): the cost of
the tick that assigns it. Two ways, each in a fresh process: the controller's, which looks at the
devices that changed since the last tick (``FleetView``), and the way before (the reference):
every tick read every device's row from the store (``Store.devices``) and looked at every device.

    nice -n 10 .venv/bin/python bench/deployment_restart.py [--devices 10000] [--steady [--ticks 10]]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from aggregator.deployments.cohort import CohortRule  # noqa: E402
import aggregator.deployments.controller as controller_module  # noqa: E402
from aggregator.deployments.controller import DeploymentController  # noqa: E402
from aggregator.deployments.guard import DEFAULT_GUARD, Guard  # noqa: E402
from aggregator.deployments.machine import Deployment, DeploymentState  # noqa: E402
from aggregator.storage.deployments import DeploymentStore  # noqa: E402
from aggregator.storage.store import Store  # noqa: E402
from fedfleet.emulation.broker import MosquittoBroker  # noqa: E402
from protocols.chunking import encode_parts  # noqa: E402
from protocols.files import read_npz  # noqa: E402
from protocols.identity import DeviceIdentity  # noqa: E402
from protocols.mqtt_link import BrokerConfig, MqttLink  # noqa: E402
from protocols.payloads import deployment as D  # noqa: E402
from protocols.topics import AGGREGATOR_ID, Topics  # noqa: E402

CANARY = "5%"
UNIT_MESSAGES = 5_000
TOPICS = Topics("bench")


def device_ids(n: int) -> list[str]:
    return [f"dev{i:06d}" for i in range(n)]


def populate(path: pathlib.Path, n: int) -> None:
    """The store of a controller restarted mid-rollout: N devices enrolled, v1 complete and sent to
    all, v2 in a canary and sent to its devices (the controller's own tables, written in bulk)."""
    store, table = Store(path), DeploymentStore(Store(path))
    now, devices = time.time(), device_ids(n)
    with store._tx() as db:              # enroll_device is one transaction per device
        db.executemany("INSERT INTO devices (device_id, status, public_key, mqtt_password_hash, enrolled_at) "
                       "VALUES (?, 'enrolled', NULL, NULL, ?)", [(d, now) for d in devices])
    rng = np.random.default_rng(0)
    for version, cohort, state in (("v1", "100%", DeploymentState.COMPLETE), ("v2", CANARY, DeploymentState.CANARY)):
        store.create_job(version, "fed3r", {})
        model = store.finish_job(version, "done", {}, {}, {"coef": rng.normal(size=(3, 8)),
                                                           "intercept": rng.normal(size=3)}, {}, 1)
        head = D.head_npz(*D.head_arrays(read_npz(store.model_bytes(model))))
        dep = Deployment(version, model, hashlib.sha256(head).hexdigest(), CohortRule.parse(cohort), (1.0,),
                         Guard.parse(DEFAULT_GUARD), bake_s=3600.0, state=state, stage_started_at=now)
        table.create(version, model, dep.state, dep.to_dict())
        table.mark_sent(version, sorted(dep.cohort.canary({d: () for d in devices})), D.RUN)


def acknowledged(link: MqttLink, timeout: float = 3600.0) -> None:
    """Until the broker acknowledged every QoS 1 publish the link was handed."""
    deadline = time.monotonic() + timeout
    while link.held or link._unacked:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{link.held} held, {link._unacked} unacknowledged")
        time.sleep(0.005)


def unit_s(broker: BrokerConfig, signer, n: int) -> tuple[float, float]:
    """Per message: (built and signed, built, signed, published and acknowledged), over ``n``."""
    def message(i):
        return D.run_message(AGGREGATOR_ID, "v1", "ab" * 32, 1000, 1, device=f"unit{i:06d}", seq=10 ** 12 + i)

    t0 = time.perf_counter()
    for i in range(n):
        encode_parts(message(i), signer)
    signed = (time.perf_counter() - t0) / n
    link = MqttLink("bench-unit", broker, on_message=lambda *_: None)
    link.start()
    try:
        t0 = time.perf_counter()
        for i in range(n):
            link.publish_envelope(TOPICS.deploy(f"unit{i:06d}"), message(i), signer=signer, retain=True)
        acknowledged(link)
        return signed, (time.perf_counter() - t0) / n
    finally:
        link.stop()


def rss_mb(field: str) -> float:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(db: str, url: str, batch: int) -> dict:
    """In this fresh process: the unit, then a controller's start with its re-delivery in slices of
    ``batch`` devices (see the module's docstring)."""
    broker, signer = BrokerConfig.from_url(url), DeviceIdentity.generate(AGGREGATOR_ID).sign
    signed, published = unit_s(broker, signer, UNIT_MESSAGES)
    controller_module.REDELIVERY_BATCH = batch
    store, began, out = Store(db), threading.Event(), {"in_memory": 0}
    starting, later = [], []            # the durations of the ticks during the re-delivery, and of the rollout's after
    plan, tick = DeploymentController._plan_redelivery, DeploymentController._tick

    def timed_plan(self):
        began.set()
        out["began_at"] = time.perf_counter()
        return plan(self)

    def timed_tick(self, now):
        redelivering, due, t0 = self._redelivery is None or bool(self._redelivery), now >= self._next_tick, \
            time.perf_counter()
        tick(self, now)
        if redelivering or due:         # the calls between rollout ticks do nothing
            (starting if redelivering else later).append(time.perf_counter() - t0)
        out["in_memory"] = max(out["in_memory"], self.link.held + self.link._unacked)

    DeploymentController._plan_redelivery, DeploymentController._tick = timed_plan, timed_tick
    rss_before = rss_mb("VmRSS")
    t0 = time.perf_counter()
    ctl = DeploymentController(store, broker, TOPICS, signer=signer)
    out["construct_s"] = time.perf_counter() - t0
    ctl.start()
    began.wait(3600)
    waits = []                          # operator commands posted one after another while it re-delivers
    while ctl._redelivery is None or ctl._redelivery:
        t_call = time.perf_counter()
        ctl.call(lambda: None, timeout=3600)
        waits.append(time.perf_counter() - t_call)
    acknowledged(ctl.link)
    out["start_s"], out["redelivered_s"] = time.perf_counter() - t0, time.perf_counter() - out.pop("began_at")
    time.sleep(3 * ctl.tick_s)          # ticks after the start: the rollout's own cost
    ctl.stop()
    out.update(unit_signed_s=signed, unit_published_s=published, longest_busy_s=max(starting),
               later_tick_s=max(later or [0.0]), commands=len(waits), command_wait_s=max(waits),
               peak_rss_growth_mb=rss_mb("VmHWM") - rss_before, devices=len(ctl.last))
    return out


WAYS = ("changed devices", "whole fleet every tick")


def whole_fleet_read(ctl: DeploymentController) -> dict[str, tuple[str, ...]]:
    """The way before, as the reference: every device's row read, and every device looked at."""
    ctl._planned = None
    return {row["device_id"]: tuple(row["tags"]) for row in ctl.store.devices() if row["status"] != "revoked"}


def measure_steady(db: str, url: str, ticks: int, way: str) -> dict:
    """In this fresh process: a started controller's rollout ticks with nothing changing, then the
    tick after one enrolment (see the module's docstring)."""
    broker, signer = BrokerConfig.from_url(url), DeviceIdentity.generate(AGGREGATOR_ID).sign
    store = Store(db)
    t0 = time.perf_counter()
    ctl = DeploymentController(store, broker, TOPICS, signer=signer)
    construct_s = time.perf_counter() - t0
    ctl._redelivery = deque()           # the start's re-delivery: the default mode measures it
    if way == WAYS[1]:
        ctl._fleet = lambda: whole_fleet_read(ctl)
    durations, assigned, roll_out, newcomer = [], [], ctl._roll_out, f"benchnew{WAYS.index(way)}"

    def timed_roll_out(now):
        t0 = time.perf_counter()
        roll_out(now)
        durations.append(time.perf_counter() - t0)
        assigned.append(newcomer in ctl.last)

    ctl._roll_out = timed_roll_out
    rss_before = rss_mb("VmRSS")
    ctl.start()
    try:
        while not durations:            # the first tick: whatever the controller does once
            time.sleep(0.001)
        waits = []                      # operator commands posted one after another from then on
        while len(durations) < ticks + 1:
            t_call = time.perf_counter()
            ctl.call(lambda: None, timeout=3600)
            waits.append(time.perf_counter() - t_call)
        ticked, devices = len(durations), ctl.call(lambda: len(ctl._fleet()), timeout=3600)
        store.enroll_device(newcomer, None, None)       # this thread's connection: another writer
        while not any(assigned[ticked:]):
            time.sleep(0.001)
        store.revoke_device(newcomer)                   # the next way's fleet: the same N
    finally:
        ctl.stop()
    steady = sorted(durations[1:ticks + 1])
    return {"devices": devices, "construct_s": construct_s, "first_tick_s": durations[0],
            "tick_median_s": steady[len(steady) // 2], "tick_max_s": steady[-1], "ticks": len(steady),
            "commands": len(waits), "command_wait_s": max(waits), "enrolled_tick_s": durations[assigned.index(True)],
            "rss_growth_mb": rss_mb("VmHWM") - rss_before}


def run(db: pathlib.Path, url: str, batch: int) -> dict:
    child = subprocess.run([sys.executable, __file__, "--measure", str(db), url, str(batch)],
                           stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(child.stdout)


def steady(db: pathlib.Path, url: str, ticks: int) -> None:
    runs = {}
    for way in WAYS:
        child = subprocess.run([sys.executable, __file__, "--measure-steady", str(db), url, str(ticks), way],
                               stdout=subprocess.PIPE, text=True, check=True)
        runs[way] = r = json.loads(child.stdout)
        print(f"steady rollout, {r['devices']:,} devices (a settled version, a {CANARY} canary, nothing changing), "
              f"{way}: a tick {r['tick_median_s'] * 1e3:.1f} ms (median of {r['ticks']}), "
              f"{r['tick_max_s'] * 1e3:.1f} ms at most; the first {r['first_tick_s'] * 1e3:.0f} ms "
              f"(construction {r['construct_s']:.2f} s)")
        print(f"  {r['commands']:,} commands served meanwhile, the longest waited {r['command_wait_s'] * 1e3:.1f} ms; "
              f"the tick that assigned a device enrolled meanwhile {r['enrolled_tick_s'] * 1e3:.1f} ms; "
              f"peak RSS +{r['rss_growth_mb']:.0f} MB")
    new, old = (runs[way] for way in WAYS)
    print(f"{WAYS[0]} / {WAYS[1]}: a tick {new['tick_median_s'] / old['tick_median_s']:.4f}x, the longest wait for "
          f"a command {new['command_wait_s'] / old['command_wait_s']:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", type=int, default=10_000)
    ap.add_argument("--steady", action="store_true", help="the rollout's ticks after the start, nothing changing")
    ap.add_argument("--ticks", type=int, default=10, help="--steady: how many ticks to measure")
    ap.add_argument("--measure", nargs=3, metavar=("DB", "URL", "BATCH"), help=argparse.SUPPRESS)   # a child's part
    ap.add_argument("--measure-steady", nargs=4, metavar=("DB", "URL", "TICKS", "WAY"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure[0], args.measure[1], int(args.measure[2]))))
        return
    if args.measure_steady:
        db, url, ticks, way = args.measure_steady
        print(json.dumps(measure_steady(db, url, int(ticks), way)))
        return
    with tempfile.TemporaryDirectory() as tmp, MosquittoBroker(workdir=pathlib.Path(tmp)) as broker:
        db = pathlib.Path(tmp) / "state.db"
        t0 = time.perf_counter()
        populate(db, args.devices)
        print(f"{args.devices:,} devices populated in {time.perf_counter() - t0:.1f} s")
        if args.steady:
            return steady(db, broker.url, args.ticks)
        runs = {how: run(db, broker.url, batch) for how, batch in
                (("in slices", controller_module.REDELIVERY_BATCH), ("in one go", 2 ** 62))}
    for how, r in runs.items():
        n, unit = r["devices"], r["unit_published_s"]
        per_device = r["redelivered_s"] / n
        print(f"{how}: unit: one assignment signed {r['unit_signed_s'] * 1e6:.0f} us; signed, published and "
              f"acknowledged {unit * 1e6:.0f} us (over {UNIT_MESSAGES:,})")
        print(f"  start, {n:,} devices: {r['start_s']:.2f} s from constructing the controller until the broker "
              f"acknowledged its re-delivery (construction {r['construct_s']:.2f} s, the re-delivery "
              f"{r['redelivered_s']:.2f} s); per device {per_device * 1e6:.0f} us = {per_device / unit:.2f}x the unit")
        print(f"  the controller's thread: busy {r['longest_busy_s']:.2f} s at most in one go; "
              f"{r['commands']:,} commands served meanwhile, the longest waited {r['command_wait_s']:.2f} s; "
              f"a rollout tick after: {r['later_tick_s'] * 1e3:.0f} ms")
        print(f"  memory: {r['in_memory']:,} publishes in the MQTT client at once at most; peak RSS "
              f"+{r['peak_rss_growth_mb']:.0f} MB ({r['peak_rss_growth_mb'] * 2 ** 20 / n:.0f} B per device)")
    sliced, one_go = runs["in slices"], runs["in one go"]
    print(f"in slices / in one go: the longest wait for a command "
          f"{sliced['command_wait_s'] / one_go['command_wait_s']:.3f}x, the re-delivery's length {sliced['redelivered_s'] / one_go['redelivered_s']:.2f}x")


if __name__ == "__main__":
    main()
