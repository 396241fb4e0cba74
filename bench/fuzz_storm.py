"""Fuzz storm: a million hostile messages against a live, signed Fed3R job (not part of ``make test``).

The aggregator runs as its own process (``python -m aggregator serve --state ... --require-signatures
--identity ...``) on a real mosquitto; honest enrolled devices (real DeviceAgents, signing their
messages and verifying the aggregator's) contribute while publisher processes send ``--messages``
hostile messages on every topic the aggregator listens to (each device's outbox and presence):
hypothesis-drawn mutations of the golden vectors (tests/fuzz_strategies.py), well-formed envelopes
with wrong fields and tensors re-signed by an enrolled attacker, random envelopes, byte-flipped and
truncated signed messages, oversized results (a 2 MB extra tensor), poison statistics, headers
nested 20,000 deep, bad chunks (out of range, inconsistent, never completed), replays of honest
devices' signed messages, forged senders and unknown devices. A pool of variations is drawn once
and cycled. The publishers stay at most a window of bytes ahead of what the aggregator has
received (its ``/metrics``), so what is measured is the aggregator's own rate, not a broker queue.

Printed: messages/s, rejections by class, crashes (the process must finish "done" with no
unexpected exception logged), the aggregator's RSS before and after the storm, and whether the
final statistics are bit-exact with the honest devices' plain numpy sum and the model bit-exact
with a storm-free run of the same job.

    nice -n 10 .venv/bin/python bench/fuzz_storm.py --messages 1000000
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import numpy as np  # noqa: E402
import paho.mqtt.client as mqtt  # noqa: E402

from aggregator.service.active_job import REJECTION_CLASSES  # noqa: E402
from aggregator.storage.store import Store  # noqa: E402
from edge_client.fed3r import Fed3RAccumulator  # noqa: E402
from fedfleet.emulation.broker import FLEET_BROKER_CONFIG, MosquittoBroker, free_port  # noqa: E402
from fuzz_strategies import draw_examples, mutated_bytes, mutated_results, mutated_secagg  # noqa: E402
from ops_fleet import C, D, Fleet, aggregator_cmd, aggregator_env, prepare, reference_sums  # noqa: E402
from protocols import messages as M  # noqa: E402
from protocols.chunking import split  # noqa: E402
from protocols.envelope import Envelope, decode, encode  # noqa: E402
from protocols.identity import DeviceIdentity  # noqa: E402
from protocols.payloads.fed3r import encode_stats  # noqa: E402
from protocols.topics import Topics  # noqa: E402
from test_aggregator_over_mqtt import hostile_storm  # noqa: E402
from test_containment import deep_envelope  # noqa: E402

T = Topics()
JOB = "ops"
ATTACKER = "dev90"              # enrolled with its own key: its messages pass the signature check
TOKEN = "fuzz-storm-token-0123456789"
WINDOW_BYTES = 8 * 1024 * 1024  # how far the publishers may run ahead of what the aggregator received


class HostilePool:
    """(class, topic, payload) variations of every kind of hostile message, drawn once."""

    def __init__(self, honest: list[str], keys: dict, size: int, seed: int):
        self.rng = np.random.default_rng(seed)
        self.honest, self.keys, self.size, self.seed = honest, keys, size, seed
        self.items: list[tuple[str, str, bytes]] = []

    def build(self) -> list[tuple[str, str, bytes]]:
        n = self.size
        self._fuzzed_bytes(n // 6)
        self._wrong_envelopes(n // 6)
        self._random_envelopes(n // 8)
        self._aimed_results(n // 8)
        self._flipped_and_truncated(n // 8)
        self._bad_chunks(n // 10)
        self._replays_and_forgeries(n // 10)
        self._deep_and_oversized()
        self.rng.shuffle(self.items)
        return self.items

    def signed(self, env: Envelope, sender: str = ATTACKER) -> bytes:
        return encode(env, signer=self.keys[sender].sign)

    def any_topic(self) -> str:
        device = str(self.rng.choice([ATTACKER, *self.honest, "dev77", "stranger", "x" * 64]))
        return T.outbox(device) if self.rng.random() < 0.7 else T.presence(device)

    def _fuzzed_bytes(self, n: int) -> None:
        for data in draw_examples(mutated_bytes(), n, self.seed):
            self.items.append(("fuzzed bytes", self.any_topic(), data))

    def _wrong_envelopes(self, n: int) -> None:
        """Hypothesis' well-formed-but-wrong results and secagg messages, re-signed by the attacker."""
        drawn = [m for _, m in draw_examples(mutated_results(), n // 2, self.seed)]
        drawn += draw_examples(mutated_secagg(), n - len(drawn), self.seed)
        for m in drawn:
            env = Envelope(m.type, ATTACKER, body=m.body, tensors=m.tensors)
            self.items.append(("wrong envelope", T.outbox(ATTACKER), self.signed(env)))

    def _random_envelopes(self, n: int) -> None:
        for raw in hostile_storm(JOB, ATTACKER, n, seed=self.seed):
            env, topic = decode(raw), T.outbox(ATTACKER) if self.rng.random() < 0.8 else T.presence(ATTACKER)
            self.items.append(("random envelope", topic, self.signed(env)))

    def _stats(self, poison: str | None = None) -> tuple[dict, dict]:
        acc = Fed3RAccumulator(C, D)
        acc.update(self.rng.normal(size=(20, D)), self.rng.integers(0, C, 20))
        body, tensors = encode_stats(*acc.sparse(), acc.n, C)
        if poison == "indefinite":
            tensors["A_upper"] = tensors["A_upper"].copy()
            tensors["A_upper"][1] = 1e9
        elif poison == "nan":
            tensors["b"] = np.full_like(tensors["b"], np.nan)
        elif poison == "extra tensor":
            tensors["extra"] = np.zeros(2 * 1024 * 1024, np.uint8)
        return body, tensors

    def _aimed_result(self, poison: str | None = None, round_: int | None = None) -> bytes:
        ref = M.TaskRef(JOB, round_ or int(self.rng.integers(0, 5)), os.urandom(16).hex())
        return self.signed(M.result_message(ATTACKER, ref, "fed3r.stats", *self._stats(poison)))

    def _aimed_results(self, n: int) -> None:
        """Results for the live job's rounds from a device that was never asked: valid, poison, NaN."""
        for i in range(n):
            poison = [None, "indefinite", "nan"][i % 3]
            self.items.append(("aimed result", T.outbox(ATTACKER), self._aimed_result(poison)))

    def _flipped_and_truncated(self, n: int) -> None:
        for i in range(n):
            data = bytearray(self._aimed_result())
            if i % 2:
                data[self.rng.integers(0, len(data))] ^= 1 << int(self.rng.integers(0, 8))
                self.items.append(("byte-flipped", T.outbox(ATTACKER), bytes(data)))
            else:
                self.items.append(("truncated", T.outbox(ATTACKER), bytes(data[:self.rng.integers(0, len(data))])))

    def _bad_chunks(self, n: int) -> None:
        """Chunks of the attacker's results: out of range, disagreeing, never completed, forged."""
        for i in range(n):
            whole = self._aimed_result()
            parts = split(whole, decode(whole).id, ATTACKER, chunk_size=128, signer=self.keys[ATTACKER].sign)
            chunk = decode(parts[int(self.rng.integers(0, len(parts)))])
            body = dict(chunk.body)
            field = ["index", "count", "total", "sha256", "parent", None][i % 6]
            if field is not None:
                body[field] = {"index": 10**6, "count": 10**9, "total": 2**40, "sha256": "0" * 64,
                               "parent": os.urandom(16).hex()}[field]
            env = Envelope(chunk.type, ATTACKER, body=body, tensors=chunk.tensors, id=chunk.id)
            self.items.append(("bad chunk", T.outbox(ATTACKER), self.signed(env)))

    def _replays_and_forgeries(self, n: int) -> None:
        for i in range(n):
            victim = str(self.rng.choice(self.honest))
            kind = i % 4
            if kind == 0:       # a replay of the victim's own signed presence
                self.items.append(("replay", T.presence(victim), self.signed(M.presence_message(victim, "online"), victim)))
            elif kind == 1:     # claims to be the victim, signed with the attacker's key
                env = M.result_message(victim, M.TaskRef(JOB, 1, os.urandom(16).hex()), "fed3r.stats", *self._stats())
                self.items.append(("forged sender", T.outbox(victim), self.signed(env)))
            elif kind == 2:     # the attacker's own signed message on the victim's topic
                self.items.append(("forged sender", T.outbox(victim), self._aimed_result()))
            else:               # an unknown device signing with a key of its own
                stranger = DeviceIdentity.generate("stranger")
                env = M.presence_message("stranger", "online")
                self.items.append(("forged sender", T.presence("stranger"), encode(env, signer=stranger.sign)))

    def _deep_and_oversized(self) -> None:
        for levels, kind in ((20000, "["), (20000, "{"), (5000, "[")):
            for topic in (T.outbox(ATTACKER), T.presence(self.honest[0])):
                self.items.append(("deep nesting", topic, deep_envelope(levels, kind)))
        for _ in range(2):
            self.items.append(("oversized", T.outbox(ATTACKER), self._aimed_result("extra tensor", round_=1)))
        self.items.append(("oversized", T.outbox(ATTACKER), b"\0" * (3 * 1024 * 1024)))


def publisher(index: int, workers: int, total: int, pool, port: int, sent_bytes, sent_msgs, received_bytes,
              out: mp.Queue) -> None:
    """Sends messages index, index + workers, ... of the storm, never more than WINDOW_BYTES ahead."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"storm{index}")
    client.connect("127.0.0.1", port)
    client.loop_start()
    counts, mine = Counter(), 0
    for k in range(index, total, workers):
        category, topic, payload = pool[k % len(pool)]
        stalled = time.monotonic()
        while sum(v.value for v in sent_bytes) - received_bytes.value > WINDOW_BYTES \
                and time.monotonic() - stalled < 5:
            time.sleep(0.002)
        client.publish(topic, payload, qos=0)
        mine += len(payload)
        counts[category] += 1
        if counts.total() % 64 == 0:
            sent_bytes[index].value, sent_msgs[index].value = mine, counts.total()
    sent_bytes[index].value, sent_msgs[index].value = mine, counts.total()
    client.loop_stop()
    client.disconnect()
    out.put(dict(counts))


class Metrics:
    """Polls the aggregator's /metrics: bytes received, rejections by reason, the open round."""

    def __init__(self, url: str):
        self.url, self.text = url, ""

    def poll(self) -> "Metrics":
        req = urllib.request.Request(f"{self.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                self.text = resp.read().decode()
        except OSError:
            pass
        return self

    def value(self, name: str) -> float:
        m = re.search(rf"^{name}{{[^}}]*}} (\S+)$", self.text, re.M)
        return float(m.group(1)) if m else 0.0

    def rejections(self) -> dict[str, float]:
        return {r: float(v) for r, v in re.findall(r'^fedfleet_rejections_total{reason="([^"]*)"} (\S+)$', self.text, re.M)}


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def setup_job(work: Path, honest: list[str], keys: dict) -> None:
    prepare(work, honest, round_timeout_s=3600, max_attempts=5)
    (work / "aggregator.pem").write_bytes(keys["aggregator"].to_pem())
    (work / "token").write_text(TOKEN)
    store = Store(work / "state.db")
    for d in [*honest, ATTACKER]:
        store.enroll_device(d, keys[d].public_key_bytes, None)
    store.close()


def start_aggregator(work: Path, broker_url: str, api_port: int) -> subprocess.Popen:
    extra = ["--timeout", "7200", "--require-signatures", "--identity", str(work / "aggregator.pem"),
             "--api", f"127.0.0.1:{api_port}", "--api-token-file", str(work / "token")]
    log = open(work / "aggregator.log", "wb")
    return subprocess.Popen(aggregator_cmd(work, broker_url, work / "state.db", extra), env=aggregator_env(),
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


class Hold(threading.Event):
    """A device's gate that holds its answer for as long as the storm lasts (the test fleet's
    handler gives up waiting after 60 s, which would let the job finish mid-storm)."""

    def wait(self, timeout: float | None = None) -> bool:
        return super().wait()


def run_job(work: Path, honest: list[str], keys: dict, storm=None) -> dict:
    """One live job; ``storm(proc, metrics, gates)`` runs while the first round is open."""
    setup_job(work, honest, keys)
    api_port = free_port()
    gates = {d: Hold() for d in honest}
    with MosquittoBroker(extra_config=FLEET_BROKER_CONFIG) as broker, \
            Fleet(broker.url, honest, gates=gates, identities=keys, aggregator_key=keys["aggregator"].public_key_bytes):
        proc = start_aggregator(work, broker.url, api_port)
        metrics = Metrics(f"http://127.0.0.1:{api_port}")
        wait_for(lambda: proc.poll() is not None or metrics.poll().value("fedfleet_job_round") >= 1, 300,
                 "the aggregator never opened round 1")
        figures = storm(proc, metrics, gates, broker) if storm else {}
        for g in gates.values():
            g.set()
        rc = proc.wait(600)
    figures.update(rc=rc, results=json.loads((work / "out" / "results.json").read_text()),
                   model=dict(np.load(work / "out" / "model.npz")), stats=dict(np.load(work / "out" / "statistics.npz")))
    return figures


class Storm:
    """The storm phase of a job: publishers, pacing, a replay thread, gates released as it goes."""

    def __init__(self, total: int, workers: int, pool):
        self.total, self.workers, self.pool = total, workers, pool
        ctx = mp.get_context("fork")            # forked before any thread of this process exists
        self.sent = [ctx.Value("d", 0.0, lock=False) for _ in range(workers)]
        self.sent_msgs = [ctx.Value("d", 0.0, lock=False) for _ in range(workers)]
        self.received = ctx.Value("d", 0.0, lock=False)
        self.out, self.go = ctx.Queue(), ctx.Event()
        self.port = ctx.Value("i", 0)
        self.procs = [ctx.Process(target=self._child, args=(i,), daemon=True) for i in range(workers)]
        for p in self.procs:
            p.start()

    def _child(self, i: int) -> None:
        self.go.wait()
        publisher(i, self.workers, self.total, self.pool, self.port.value, self.sent, self.sent_msgs, self.received,
                  self.out)

    def __call__(self, proc, metrics: Metrics, gates: dict, broker) -> dict:
        rss_before = rss_kib(proc.pid)
        bytes_before = metrics.poll().value("fedfleet_job_bytes_in_total")
        self.received.value = bytes_before
        self.port.value = broker.port
        order = sorted(gates)
        samples = {}                            # storm progress (tenths) -> aggregator RSS
        t0 = time.monotonic()
        self.go.set()
        while any(p.is_alive() for p in self.procs):
            self.received.value = metrics.poll().value("fedfleet_job_bytes_in_total")
            done = sum(v.value for v in self.sent_msgs) / self.total
            # honest devices answer during the storm; the last one only after it, so the job outlives it
            for d in order[:min(len(order) - 1, int(done * len(order)))]:
                gates[d].set()
            samples.setdefault(int(done * 10), rss_kib(proc.pid))
            if proc.poll() is not None:         # the aggregator died: stop, and say so below
                for p in self.procs:
                    p.terminate()
                break
            time.sleep(0.1)
        counts = Counter()
        for _ in self.procs:
            counts.update(self.out.get(timeout=60) if proc.poll() is None else {})
        sent = sum(v.value for v in self.sent)
        if proc.poll() is not None:
            raise RuntimeError(f"the aggregator exited with {proc.returncode} during the storm")
        # drained: the aggregator received every byte sent (honest traffic only adds to it)
        wait_for(lambda: proc.poll() is not None or
                 metrics.poll().value("fedfleet_job_bytes_in_total") - bytes_before >= sent, 600, "never drained")
        elapsed = time.monotonic() - t0
        return {"elapsed": elapsed, "sent": counts, "sent_bytes": sent, "rss_before": rss_before,
                "rss_after": rss_kib(proc.pid), "rss_samples": samples, "rss_peak": rss_kib(proc.pid, "VmHWM"),
                "received_bytes": metrics.value("fedfleet_job_bytes_in_total") - bytes_before,
                "live_rejections": metrics.rejections()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=1_000_000, help="hostile messages to send")
    ap.add_argument("--publishers", type=int, default=3, help="publisher processes")
    ap.add_argument("--pool", type=int, default=20_000, help="distinct hostile variations drawn")
    ap.add_argument("--devices", type=int, default=8, help="honest devices")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    honest = [f"dev{i:02d}" for i in range(args.devices)]
    keys = {d: DeviceIdentity.generate(d) for d in [*honest, ATTACKER]}
    keys["aggregator"] = DeviceIdentity.generate("aggregator")
    t = time.monotonic()
    pool = HostilePool(honest, keys, args.pool, args.seed).build()
    print(f"pool: {len(pool)} variations in {time.monotonic() - t:.0f} s "
          f"({dict(sorted(Counter(c for c, _, _ in pool).items()))})", flush=True)
    storm = Storm(args.messages, args.publishers, pool)
    tmp = Path(tempfile.mkdtemp(prefix="fuzz-storm-"))
    try:
        clean = run_job(tmp / "clean", honest, keys)
        got = run_job(tmp / "storm", honest, keys, storm)
        report(args, got, clean, honest, tmp / "storm" / "aggregator.log")
    except Exception:
        log = tmp / "storm" / "aggregator.log"
        if log.exists():
            print("aggregator log (tail):\n" + log.read_text(errors="replace")[-4000:], file=sys.stderr)
        print(f"kept {tmp} for inspection", file=sys.stderr)
        raise
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def report(args, got: dict, clean: dict, honest: list[str], log: Path) -> None:
    sent = sum(got["sent"].values())
    text = log.read_text(errors="replace")
    unexpected = text.count("raised an unexpected error") + text.count("Traceback")
    results = got["results"]
    rejections = results.get("rejections", {})
    A_ref, B_ref = reference_sums(sorted(honest))
    stats_exact = np.array_equal(got["stats"]["A"], A_ref) and np.array_equal(got["stats"]["B"], B_ref)
    model_exact = sorted(got["model"]) == sorted(clean["model"]) and all(
        np.array_equal(got["model"][k], clean["model"][k]) for k in clean["model"])
    print(f"hostile messages sent: {sent:,} ({got['sent_bytes'] / 2**20:.0f} MiB) by {args.publishers} publishers; "
          f"aggregator received {got['received_bytes'] / 2**20:.0f} MiB")
    print(f"  by class sent: {dict(sorted(got['sent'].items()))}")
    print(f"rate: {sent / got['elapsed']:,.0f} messages/s ({got['elapsed']:.0f} s, aggregator-paced)")
    print(f"rejections by class: {dict(sorted(rejections.items()))} (total {sum(rejections.values()):,})")
    labels = set(got["live_rejections"])
    print(f"metrics labels: {len(labels)}, all from the fixed set of {len(REJECTION_CLASSES)}: "
          f"{labels <= set(REJECTION_CLASSES)}")
    print(f"crashes: exit code {got['rc']} (0 = done), job state {results.get('state')!r}, "
          f"unexpected exceptions logged: {unexpected}")
    print(f"aggregator RSS: before {got['rss_before'] / 1024:.1f} MiB, after {got['rss_after'] / 1024:.1f} MiB "
          f"(peak {got['rss_peak'] / 1024:.1f} MiB)")
    print("  during the storm (% sent: MiB): " + ", ".join(f"{10 * k}%: {v / 1024:.0f}" for k, v in
                                                           sorted(got["rss_samples"].items())))
    print(f"contributed: {sorted(results.get('contributed', {}))}")
    print(f"statistics bit-exact with the honest devices' numpy sum: {stats_exact}; "
          f"model bit-exact with the storm-free run: {model_exact}")


if __name__ == "__main__":
    sys.exit(main())
