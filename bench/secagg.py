"""Cost of secure aggregation against a plaintext round of the same size, measured in one run.

For each group size n and vector length m, and for the complete graph (SecAgg) and the SecAgg+
k-regular graph, one round runs through protocols.secagg.driver (every message serialised to
its wire form) with 10 % of the devices dropping out after ShareKeys (by default) -- the
costliest place, since the server must then rebuild their pair masks with all their surviving
neighbours. The
plaintext round sends the same fixed-point vectors in the same signed envelope (SHA-256 over the
array + Ed25519), and the server verifies and adds them; "unsigned" drops the signature too.

Two clocks. CPU time of the process (time.process_time, all threads: the work itself, which
other users' load on a shared machine does not inflate; `openssl speed` also reports CPU-time
throughput) and wall clock (time.perf_counter: what the server's `workers` threads for the
final mask expansion shorten, but which swings with the machine's load -- the load average is
printed before and after). The plaintext server verifies and adds on one thread, as the secure
server does with its masked inputs; only the secure round's final unmasking is parallel.

Reported: client time per device (summed over devices, run one after another here, divided by
n), server CPU and wall time (and the part spent unmasking), bytes sent + received per surviving
device, ratios secure / plaintext, and that the secure sum equals the plaintext sum exactly.
For each round, the unmasking's mask expansion is run again on the same seeds with 1 thread and
with `workers` threads (same run, same load), checking both give the same bits. Then the mask
expansion (AES-128-CTR keystream + uint64 add, all seeds block by block) against the raw
AES-128-CTR throughput of `cryptography` on this machine, the same keystream through AES-GCM's
loop (how the PRG computes it where GCM's counters are its own), and `openssl speed` when the
binary is there; and a device's own masks with the GCM path against plain CTR (before).

    .venv/bin/python bench/secagg.py --quick     # < 3 min on 2 cores
    .venv/bin/python bench/secagg.py             # all combinations that fit in a few minutes
    .venv/bin/python bench/secagg.py --n 1000 --m 1000000 --graphs regular   # the issue's case, ~90 s

With a Flower 1.42 venv (`make bench-flower` makes .venv-flower, used by default when it exists, or
--flower PYTHON), the run ends with one SecAgg+ round of fedfleet's against one of Flower's at
--flower-n / --flower-m (100, 10^6), clients serial and in parallel (bench/_secagg_flower.py):

    make bench-flower    # = bench/secagg.py --n 100 --m 1000000 --graphs regular --flower .venv-flower/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aggregator.compute.mask_expansion import CudaMaskApplier, ProcessMaskApplier, pick_mask_applier  # noqa: E402
from protocols.identity import DeviceIdentity  # noqa: E402
from protocols.secagg import AggregateReady, MaskedInput, Phase, RoundConfig  # noqa: E402
from protocols.secagg import crypto  # noqa: E402
from protocols.secagg.crypto import apply_masks, default_mask_workers, usable_cores  # noqa: E402
from protocols.secagg.driver import WireFrame, make_identities, run_round  # noqa: E402
from protocols.secagg.server import ServerSecAgg  # noqa: E402

from _secagg_flower import DEFAULT_FLOWER_PYTHON, compare as compare_with_flower  # noqa: E402

BOUND = 1.0
DROPOUT = 0.10
# (graph, n, m) pairs not run, with the reason printed next to the table
SKIPPED = {
    ("complete", 1000, 10**4): "complete graph at n=1000: ~2.10^6 X25519 + AEAD ops and n Shamir shares of "
                               "degree 667 per device; about 10 min here (run with --include-slow)",
    ("complete", 1000, 10**6): "complete graph at n=1000, m=10^6: 1000 mask expansions of 8 MB per device, "
                               "~8 TB of keystream in total; past MAX_MASK_WORDS (2^29 words a member), "
                               "so no round config holds it",
}


def device_inputs(base: np.ndarray, members: tuple[str, ...]):
    """Cheap distinct vectors within the bound: base scaled by a per-device factor in (0, 1]."""
    scale = {device: (index % 97 + 1) / 97 for index, device in enumerate(members)}
    return lambda device: base * scale[device]


def plaintext_round(config: RoundConfig, identities, inputs, survivors, signed: bool) -> dict:
    """Each survivor encodes its vector and sends it in a MaskedInput envelope (signed or not);
    the server decodes, verifies and adds."""
    total = np.zeros(config.vector_length, dtype=np.uint64)
    client_seconds = server_seconds = server_wall = 0.0
    upload = 0
    for device in survivors:
        started = time.process_time()
        message = MaskedInput(job_id=config.job_id, round_id=config.round_id, group_id=config.group_id,
                              sender=device, recipient=config.aggregator_id,
                              masked_input=config.codec.encode(inputs(device)))
        if signed:
            message = message.signed(identities[device])
        frame = WireFrame.from_message(message)
        client_seconds += time.process_time() - started
        upload += frame.size
        started, started_wall = time.process_time(), time.perf_counter()
        received = frame.to_message()
        if signed:
            received.verify(identities[device].public_key_bytes)
        np.add(total, received.masked_input, out=total)
        server_seconds += time.process_time() - started
        server_wall += time.perf_counter() - started_wall
    return {"sum": total, "client_seconds": client_seconds, "server_seconds": server_seconds,
            "server_wall_s": server_wall, "upload": upload}


DROPOUT_PHASES = {"advertise": Phase.ADVERTISE_KEYS, "share_keys": Phase.SHARE_KEYS,
                  "masked_input": Phase.MASKED_INPUT, "unmask": Phase.UNMASK}


def timed(function, *args, **kwargs) -> tuple[float, float]:
    """(CPU seconds of the process, wall seconds) of one call."""
    started, started_wall = time.process_time(), time.perf_counter()
    function(*args, **kwargs)
    return time.process_time() - started, time.perf_counter() - started_wall


def secure_round(graph: str, n: int, m: int, consistency_check: bool, base: np.ndarray,
                 dropout_phase: Phase, workers: int, fast_applier, gpu_applier: CudaMaskApplier | None,
                 process_applier: ProcessMaskApplier) -> dict:
    """`fast_applier`: what the round's server unmasks with (pick_mask_applier: the GPU, worker
    processes, or None for `workers` threads); the removed masks are then expanded again on 1
    thread, `workers` threads, the worker processes and the GPU (if any), checking the bits."""
    identities = {i.device_id: i for i in make_identities(n)}
    aggregator = DeviceIdentity.generate("aggregator")
    config = RoundConfig.create(job_id="bench", round_id=1, group_id="g", aggregator_id="aggregator",
                                members=list(identities), vector_length=m, bound=BOUND, graph=graph,
                                consistency_check=consistency_check)
    inputs = device_inputs(base, config.members)
    dropped = config.members[:: max(1, round(1 / DROPOUT))][: round(DROPOUT * n)]
    dropouts = {device: dropout_phase for device in dropped}

    # bench-only instrumentation: the share of server time spent unmasking, and the seeds whose
    # masks the server removed (to time their expansion again with 1 and `workers` threads, and
    # on the GPU)
    unmask_seconds, unmask_wall, removed_seeds = [], [], []
    original_finish = ServerSecAgg._finish
    applier = fast_applier or partial(apply_masks, workers=workers)

    def timed_finish(server):
        started, started_wall = time.process_time(), time.perf_counter()
        try:
            return original_finish(server)
        finally:
            unmask_seconds.append(time.process_time() - started)
            unmask_wall.append(time.perf_counter() - started_wall)

    def recording_apply(accumulator, signed_seeds):
        removed_seeds.extend(signed_seeds)
        applier(accumulator, signed_seeds)

    ServerSecAgg._finish = timed_finish
    try:
        started = time.perf_counter()
        run = run_round(config, aggregator, identities, inputs, dropouts=dropouts, server_workers=workers,
                        server_mask_applier=recording_apply)
        wall = time.perf_counter() - started
    finally:
        ServerSecAgg._finish = original_finish
    if not isinstance(run.outcome, AggregateReady):
        raise RuntimeError(f"secure round failed: {run.outcome}")
    survivors = run.outcome.survivors
    signed = plaintext_round(config, identities, inputs, survivors, signed=True)
    unsigned = plaintext_round(config, identities, inputs, survivors, signed=False)
    serial_total, parallel_total = np.zeros(m, np.uint64), np.zeros(m, np.uint64)
    serial_cpu, serial_wall = timed(apply_masks, serial_total, removed_seeds, workers=1)
    parallel_cpu, parallel_wall = timed(apply_masks, parallel_total, removed_seeds, workers=workers)
    gpu_total, process_total = np.zeros(m, np.uint64), np.zeros(m, np.uint64)
    gpu_cpu, gpu_wall = timed(gpu_applier, gpu_total, removed_seeds) if gpu_applier else (float("nan"),) * 2
    process_cpu, process_wall = timed(process_applier, process_total, removed_seeds)
    return {
        "graph": "SecAgg+" if graph == "regular" else "complete", "n": n, "m": m, "degree": config.degree,
        "dropped": len(dropped), "exact": bool(np.array_equal(run.outcome.sum_words, signed["sum"])),
        "secure_client_ms": 1e3 * run.client_seconds / n, "plain_client_ms": 1e3 * signed["client_seconds"] / n,
        "secure_server_s": run.server_seconds, "unmask_s": sum(unmask_seconds),
        "plain_server_s": signed["server_seconds"], "unsigned_server_s": unsigned["server_seconds"],
        "secure_server_wall_s": run.server_wall_seconds, "unmask_wall_s": sum(unmask_wall),
        "plain_server_wall_s": signed["server_wall_s"], "workers": workers,
        "masks_removed": len(removed_seeds), "expansion_1_thread_cpu_s": serial_cpu,
        "expansion_1_thread_wall_s": serial_wall, "expansion_parallel_cpu_s": parallel_cpu,
        "expansion_parallel_wall_s": parallel_wall,
        "expansion_gpu_wall_s": gpu_wall, "expansion_gpu_cpu_s": gpu_cpu, "expansion_processes_wall_s": process_wall,
        "unmask_on": {CudaMaskApplier: "cuda", ProcessMaskApplier: "processes"}.get(type(fast_applier), "threads"),
        "expansion_identical": bool(np.array_equal(serial_total, parallel_total)
                                    and np.array_equal(serial_total, process_total)
                                    and (gpu_applier is None or np.array_equal(serial_total, gpu_total))),
        # per surviving device: what one contributor sends and receives
        "secure_bytes_per_device": (run.upload_bytes + run.download_bytes) / len(survivors),
        "plain_bytes_per_device": signed["upload"] / len(survivors), "wall_s": wall,
    }


def raw_aes_ctr_gbps(total_bytes: int = 1 << 28, chunk: int = 1 << 18, gcm: bool = False) -> tuple[float, float]:
    """One thread's raw AES-128-CTR keystream, or (``gcm``) the same keystream through AES-GCM's
    loop as the PRG takes it: (GB/s of CPU time, GB/s of wall clock)."""
    mode = modes.GCM(bytes(12)) if gcm else modes.CTR(bytes(16))
    encryptor = Cipher(algorithms.AES(os.urandom(16)), mode).encryptor()
    zeros, out = bytes(chunk), bytearray(chunk + 16)

    def run():
        for _ in range(total_bytes // chunk):
            encryptor.update_into(zeros, out)

    cpu, wall = timed(run)
    return total_bytes / cpu / 1e9, total_bytes / wall / 1e9


def mask_expansion_gbps(workers: int, m: int = 10**6, seeds: int = 32) -> tuple[float, float]:
    """apply_masks with `workers` threads: (GB/s of CPU time, all threads; GB/s of wall clock)."""
    accumulator = np.zeros(m, dtype=np.uint64)
    signed_seeds = [(os.urandom(32), 1 if i % 2 else -1) for i in range(seeds)]
    cpu, wall = timed(apply_masks, accumulator, signed_seeds, workers=workers)
    return seeds * m * 8 / cpu / 1e9, seeds * m * 8 / wall / 1e9


def device_mask_cpu_s(m: int, seeds: int, repeats: int = 5) -> tuple[float, float, bool]:
    """A device's own masks (one pass from word 0, as ``MaskedInput`` is built): CPU seconds of
    apply_masks with the keystream through AES-GCM's loop where its counters are the PRG's (now)
    and with plain AES-128-CTR throughout (before: the GCM path switched off), best of
    ``repeats``; and whether the two give the same bits."""
    signed_seeds = [(os.urandom(32), 1 if i % 2 else -1) for i in range(seeds)]
    results, best = {}, {}
    for path, first_gcm_block in (("ctr", -1), ("gcm", crypto._GCM_FIRST_BLOCK)):
        saved, crypto._GCM_FIRST_BLOCK = crypto._GCM_FIRST_BLOCK, first_gcm_block
        try:
            for _ in range(repeats):
                accumulator = np.zeros(m, dtype=np.uint64)
                cpu, _ = timed(apply_masks, accumulator, signed_seeds)
                best[path] = min(best.get(path, cpu), cpu)
            results[path] = accumulator
        finally:
            crypto._GCM_FIRST_BLOCK = saved
    return best["ctr"], best["gcm"], bool(np.array_equal(results["ctr"], results["gcm"]))


def gpu_expansion_gbps(applier: CudaMaskApplier, m: int = 10**6, seeds: int = 512) -> float:
    """The GPU applier's wall-clock GB/s of mask keystream (copies to and from the GPU included)."""
    accumulator = np.zeros(m, dtype=np.uint64)
    signed_seeds = [(os.urandom(32), 1 if i % 2 else -1) for i in range(seeds)]
    _, wall = timed(applier, accumulator, signed_seeds)
    return seeds * m * 8 / wall / 1e9


def describe(applier, workers: int) -> str:
    if isinstance(applier, CudaMaskApplier):
        import torch

        return f"the GPU ({torch.cuda.get_device_name()})"
    if isinstance(applier, ProcessMaskApplier):
        return f"{applier.processes} worker processes"
    return f"{workers} thread(s)"


def expansion_scaling(seeds: int, m: int) -> list[dict]:
    """apply_masks of `seeds` masks of m words with 1, 2, 4, ... threads up to the CPU count
    (the unmasking at n = 1000, k = 20, 10 % dropped after ShareKeys is ~2 700 masks); every
    result is compared with the 1-thread one."""
    signed_seeds = [(os.urandom(32), 1 if i % 2 else -1) for i in range(seeds)]
    counts = sorted({1, *(2**i for i in range(1, 8) if 2**i <= (os.cpu_count() or 1))})
    reference, rows = None, []
    for workers in counts:
        accumulator = np.zeros(m, dtype=np.uint64)
        cpu, wall = timed(apply_masks, accumulator, signed_seeds, workers=workers)
        if reference is None:
            reference = accumulator
        rows.append({"workers": workers, "cpu_s": cpu, "wall_s": wall,
                     "identical": bool(np.array_equal(accumulator, reference))})
    return rows


def openssl_aes_ctr_gbps() -> float | None:
    if not shutil.which("openssl"):
        return None
    try:
        out = subprocess.run(["openssl", "speed", "-evp", "aes-128-ctr", "-seconds", "1"], capture_output=True,
                             text=True, timeout=60).stdout
    except (subprocess.SubprocessError, OSError):
        return None
    for line in out.splitlines():
        if line.lower().startswith("aes-128-ctr"):
            return float(line.split()[-1].rstrip("k")) * 1e3 / 1e9
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller grid (< 3 min on 2 cores)")
    parser.add_argument("--include-slow", action="store_true", help="also run the complete graph at n=1000, m=10^4")
    parser.add_argument("--consistency-check", action="store_true",
                        help="enable the signed consistency round (t Ed25519 verifications per device)")
    parser.add_argument("--dropout-after", choices=sorted(DROPOUT_PHASES), default="masked_input",
                        help="phase whose message the dropped 10%% never send (default masked_input: they "
                             "vanish after ShareKeys, so the server must rebuild their pair masks)")
    parser.add_argument("--n", type=int, nargs="+", help="only these group sizes")
    parser.add_argument("--m", type=int, nargs="+", help="only these vector lengths")
    parser.add_argument("--graphs", nargs="+", choices=("complete", "regular"), help="only these graphs")
    parser.add_argument("--workers", type=int, default=default_mask_workers(),
                        help="server threads for the final mask expansion (default: usable cores, "
                             f"capped; here {default_mask_workers()})")
    parser.add_argument("--mask-device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the secure server expands masks (aggregator.compute.mask_expansion; auto: the "
                             "GPU when torch sees one and Triton imports)")
    parser.add_argument("--scaling", type=int, metavar="SEEDS", default=0,
                        help="also time the expansion of SEEDS masks of the largest m with 1, 2, 4, ... threads "
                             "(2700 = the unmasking at n=1000, k=20, 10%% dropped after ShareKeys)")
    parser.add_argument("--flower", type=Path, metavar="PYTHON",
                        default=DEFAULT_FLOWER_PYTHON if DEFAULT_FLOWER_PYTHON.exists() else None,
                        help="a Flower 1.42 venv's python (`make bench-flower` makes .venv-flower; the default "
                             "when it exists): also run one SecAgg+ round of Flower's against fedfleet's at "
                             "--flower-n, --flower-m (bench/_secagg_flower.py)")
    parser.add_argument("--no-flower", action="store_true", help="skip the Flower comparison")
    parser.add_argument("--flower-n", type=int, default=100, help="group size of the Flower comparison")
    parser.add_argument("--flower-m", type=int, default=10**6, help="vector length of the Flower comparison")
    parser.add_argument("--flower-cores", type=int, default=usable_cores(),
                        help="cores both sides of the Flower comparison are pinned to (parallel pairing: "
                             "that many client processes / Ray actors)")
    parser.add_argument("--json", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)

    if args.quick:
        grid = [(g, n, 10**4) for g in ("complete", "regular") for n in (10, 100)]
        grid += [("regular", 1000, 10**4), ("regular", 100, 10**6)]
        skipped = {"m=10^6 except SecAgg+ n=100, complete n=1000, SecAgg+ n=1000 m=10^6":
                   "--quick (run without it for the full grid)"}
    else:
        grid = [(g, n, m) for m in (10**4, 10**6) for n in (10, 100, 1000) for g in ("complete", "regular")]
        skipped = {key: why for key, why in SKIPPED.items() if not (args.include_slow and key[2] == 10**4)}
        grid = [combo for combo in grid if combo not in skipped]
    if args.n or args.m or args.graphs:
        grid = [(g, n, m) for g in (args.graphs or ("complete", "regular")) for n in (args.n or (10, 100, 1000))
                for m in (args.m or (10**4, 10**6))]
        skipped = {}

    fast_applier = pick_mask_applier(args.mask_device)
    gpu_applier = fast_applier if isinstance(fast_applier, CudaMaskApplier) else None
    process_applier = ProcessMaskApplier(usable_cores()).warm_up()
    base = np.random.default_rng(0).uniform(-BOUND, BOUND, max(m for _, _, m in grid))
    dropout_phase = DROPOUT_PHASES[args.dropout_after]
    load_before = os.getloadavg()
    print(f"secure aggregation vs plaintext; {int(DROPOUT * 100)}% of devices never send "
          f"their {dropout_phase.value} message; consistency check {'on' if args.consistency_check else 'off'}; "
          f"{os.cpu_count()} CPUs, server mask expansion on "
          f"{describe(fast_applier, args.workers)}; "
          f"load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}\n")
    header = (f"{'graph':9} {'n':>5} {'m':>8} {'k':>4} | {'client ms/dev':>13} {'plain':>7} {'ratio':>6} | "
              f"{'CPU s':>7} {'unmask':>7} {'plain':>7} {'ratio':>6} {'unsigned':>8} | "
              f"{'wall s':>7} {'unmask':>7} {'plain':>7} {'ratio':>6} | "
              f"{'MB/surv':>7} {'plain':>7} {'ratio':>6} | exact")
    print(header)
    print("-" * len(header))
    rows = []
    for graph, n, m in grid:
        row = secure_round(graph, n, m, args.consistency_check, base[:m], dropout_phase, args.workers, fast_applier,
                           gpu_applier, process_applier)
        rows.append(row)
        print(f"{row['graph']:9} {n:>5} {m:>8} {row['degree']:>4} | {row['secure_client_ms']:>13.2f} "
              f"{row['plain_client_ms']:>7.2f} {row['secure_client_ms'] / row['plain_client_ms']:>6.2f} | "
              f"{row['secure_server_s']:>7.3f} {row['unmask_s']:>7.3f} {row['plain_server_s']:>7.3f} "
              f"{row['secure_server_s'] / row['plain_server_s']:>6.2f} {row['unsigned_server_s']:>8.3f} | "
              f"{row['secure_server_wall_s']:>7.3f} {row['unmask_wall_s']:>7.3f} {row['plain_server_wall_s']:>7.3f} "
              f"{row['secure_server_wall_s'] / row['plain_server_wall_s']:>6.2f} | "
              f"{row['secure_bytes_per_device'] / 1e6:>7.3f} {row['plain_bytes_per_device'] / 1e6:>7.3f} "
              f"{row['secure_bytes_per_device'] / row['plain_bytes_per_device']:>6.2f} | {row['exact']}",
              flush=True)
    used = {CudaMaskApplier: "expansion_gpu_wall_s", ProcessMaskApplier: "expansion_processes_wall_s"}.get(
        type(fast_applier), "expansion_parallel_wall_s")
    print(f"\nunmasking's mask expansion, run again on the same seeds (CPU s / wall s; 1 thread -> "
          f"{args.workers} threads; wall s on {process_applier.processes} worker processes and on the GPU; same "
          "bits?); then the wall ratio secure/plain the round would have had with each (its wall time with "
          "that expansion's wall time swapped in)")
    for row in rows:
        def swapped(key):
            return (row["secure_server_wall_s"] - row[used] + row[key]) / row["plain_server_wall_s"]
        print(f"{row['graph']:9} {row['n']:>5} {row['m']:>8}: {row['masks_removed']:>5} masks  "
              f"{row['expansion_1_thread_cpu_s']:.3f} / {row['expansion_1_thread_wall_s']:.3f} -> "
              f"{row['expansion_parallel_cpu_s']:.3f} / {row['expansion_parallel_wall_s']:.3f}  "
              f"(wall x{row['expansion_1_thread_wall_s'] / max(row['expansion_parallel_wall_s'], 1e-9):.2f}) "
              f"processes {row['expansion_processes_wall_s']:.3f} GPU {row['expansion_gpu_wall_s']:.3f} "
              f"{row['expansion_identical']}  | ratio: 1 thread {swapped('expansion_1_thread_wall_s'):.2f}, "
              f"{args.workers} threads {swapped('expansion_parallel_wall_s'):.2f}, processes "
              f"{swapped('expansion_processes_wall_s'):.2f}"
              + (f", GPU {swapped('expansion_gpu_wall_s'):.2f}" if gpu_applier else ""))
    for key, why in skipped.items():
        print(f"skipped {key}: {why}")

    raw_cpu, raw_wall = raw_aes_ctr_gbps()
    raw_gcm_cpu, _ = raw_aes_ctr_gbps(gcm=True)
    expansion_cpu, expansion_wall = mask_expansion_gbps(workers=1)
    parallel_cpu, parallel_wall = mask_expansion_gbps(workers=args.workers)
    openssl = openssl_aes_ctr_gbps()
    print(f"\nmask expansion (AES-128-CTR + uint64 add, blocked), 1 thread:  {expansion_cpu:.2f} GB/s of CPU time")
    print(f"raw AES-128-CTR keystream via cryptography, 1 thread:        {raw_cpu:.2f} GB/s of CPU time  "
          f"(expansion / raw = {expansion_cpu / raw_cpu:.2f})")
    print(f"raw keystream through AES-GCM's counters (the PRG's path):  {raw_gcm_cpu:.2f} GB/s of CPU time  "
          f"(expansion / raw = {expansion_cpu / raw_gcm_cpu:.2f})")
    print(f"mask expansion on {args.workers} thread(s), wall clock:               {parallel_wall:.2f} GB/s "
          f"(/ raw 1-thread wall {raw_wall:.2f} GB/s = {parallel_wall / raw_wall:.2f}; "
          f"CPU time {parallel_cpu:.2f} GB/s)")
    if openssl:
        print(f"openssl speed -evp aes-128-ctr (16 KiB blocks), 1 thread:    {openssl:.2f} GB/s")
    device_m = max(m for _, _, m in grid)
    device_seeds = 34           # a SecAgg+ member's pair masks at n = 1,000, and its self-mask
    ctr_s, gcm_s, same_bits = device_mask_cpu_s(device_m, device_seeds)
    print(f"mask keystream, a device's {device_seeds} masks of {device_m} words: plain AES-CTR (before) "
          f"{1e3 * ctr_s:.1f} ms, through AES-GCM's counters (now) {1e3 * gcm_s:.1f} ms of CPU: "
          f"{ctr_s / gcm_s:.2f}x faster, same bits {same_bits}")
    gpu_wall = gpu_expansion_gbps(gpu_applier) if gpu_applier else None
    if gpu_wall:
        print(f"mask expansion on the GPU, wall clock (host transfers in):   {gpu_wall:.2f} GB/s "
              f"(/ raw 1-thread wall {raw_wall:.2f} GB/s = {gpu_wall / raw_wall:.1f})")
        sweep = {blocks: gpu_expansion_gbps(CudaMaskApplier(blocks_per_program=blocks))
                 for blocks in (32, 64, 128, 256, 512)}
        print("GPU kernel, counter blocks per program -> GB/s (/ the default 256's): " + ", ".join(
            f"{blocks}: {gbps:.0f} ({gbps / sweep[256]:.2f})" for blocks, gbps in sweep.items()))
    scaling = expansion_scaling(args.scaling, max(m for _, _, m in grid)) if args.scaling else []
    if scaling:
        print(f"\nexpansion of {args.scaling} masks of {max(m for _, _, m in grid)} words by thread count "
              "(CPU s all threads / wall s / wall speed-up / same bits as 1 thread):")
        for entry in scaling:
            print(f"  {entry['workers']:>3} threads: {entry['cpu_s']:7.3f} {entry['wall_s']:7.3f} "
                  f"x{scaling[0]['wall_s'] / entry['wall_s']:.2f} {entry['identical']}")
    flower = None if args.no_flower else compare_with_flower(
        args.flower, args.flower_n, args.flower_m, BOUND, DROPOUT, args.flower_cores,
        Path(__file__).resolve().parents[1] / "runs" / "bench-flower")
    if args.no_flower:
        print("\nFlower was not measured (--no-flower)")
    load_after = os.getloadavg()
    print(f"load average at the end: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} "
          f"on {os.cpu_count()} CPUs (wall-clock figures are only as good as the machine is idle)")
    if (flower or {}).get("error"):
        print("ERROR: a sum in the Flower comparison was wrong (see above)")
        return 1
    if not all(row["exact"] and row["expansion_identical"] for row in rows) \
            or not all(entry["identical"] for entry in scaling) or not same_bits:
        print("ERROR: a secure sum differed from the plaintext sum, or parallel from serial expansion")
        return 1
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "workers": args.workers,
                                         "mask_expansion_gbps": expansion_cpu, "raw_aes_ctr_gbps": raw_cpu,
                                         "raw_aes_gcm_keystream_gbps": raw_gcm_cpu,
                                         "parallel_expansion_wall_gbps": parallel_wall,
                                         "raw_aes_ctr_wall_gbps": raw_wall, "openssl_aes_ctr_gbps": openssl,
                                         "gpu_expansion_wall_gbps": gpu_wall,
                                         "scaling": scaling, "flower": flower,
                                         "load_average": [load_before, load_after]},
                                        indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
