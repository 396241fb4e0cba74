"""bench/secagg.py --flower: one SecAgg+ round of fedfleet against one of Flower 1.42, same run.

Same n, m, neighbourhood (fedfleet's degree k and share threshold t' as RoundConfig picks them;
Flower's num_shares = k + 1, reconstruction_threshold = t'), the same vectors, and the same 10 % of
the clients dropping out after sharing keys (they never send their masked input, so both servers
rebuild their pair masks). Flower runs in its own venv (bench/secagg_flower_round.py, started here
as a subprocess; its Ray start-up is outside its timed round).

fedfleet runs each pairing twice: in its default 64-bit ring, and in the 32-bit ring a round may
declare (``RoundConfig.ring_bits``), the width of Flower's modulus; the goal (<= 0.1x Flower's time)
is read on the 32-bit round, the same ring width on both sides.

Two pairings, like with like:
- clients one after another: fedfleet's in-process driver (protocols.secagg.driver.run_round) with
  the server's mask expansion on 1 thread; Flower's simulation with 1 Ray actor (Flower's server
  unmasks on 1 thread);
- clients in parallel on C cores: fedfleet's clients in C forked processes
  (bench/_secagg_parallel_clients.py) and its server's expansion on C threads; Flower's simulation
  with C actors. Both runs are pinned to the same C cores (sched_setaffinity, inherited by Ray).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from protocols.identity import DeviceIdentity
from protocols.secagg import AggregateReady, Phase, RoundConfig
from protocols.secagg.driver import make_identities, run_round

from _secagg_parallel_clients import run_round_parallel

FLOWER_SCRIPT = Path(__file__).with_name("secagg_flower_round.py")
DEFAULT_FLOWER_PYTHON = Path(__file__).resolve().parents[1] / ".venv-flower" / "bin" / "python"


def fedfleet_round(n: int, m: int, bound: float, dropout: float, processes: int, ring_bits: int = 64) -> dict:
    """One SecAgg+ round, fedfleet's; processes = 1: the driver, clients in turn, server on 1 thread."""
    identities = {i.device_id: i for i in make_identities(n)}
    aggregator = DeviceIdentity.generate("aggregator")
    config = RoundConfig.create(job_id="bench", round_id=1, group_id="g", aggregator_id="aggregator",
                                members=list(identities), vector_length=m, bound=bound, graph="regular",
                                ring_bits=ring_bits)
    base = np.random.default_rng(0).uniform(-bound, bound, m)
    scale = {device: (index % 97 + 1) / 97 for index, device in enumerate(config.members)}
    dropped = config.members[:: max(1, round(1 / dropout))][: round(dropout * n)]
    dropouts = {device: Phase.MASKED_INPUT for device in dropped}

    def inputs(device):
        return base * scale[device]

    if processes == 1:
        started_cpu, started = time.process_time(), time.perf_counter()
        run = run_round(config, aggregator, identities, inputs, dropouts=dropouts, server_workers=1)
        wall, cpu = time.perf_counter() - started, time.process_time() - started_cpu
        outcome, client_cpu, server_cpu = run.outcome, run.client_seconds, run.server_seconds
    else:
        run = run_round_parallel(config, aggregator, identities, inputs, dropouts=dropouts, processes=processes,
                                 server_workers=processes)
        wall, outcome, client_cpu, server_cpu = run.wall_seconds, run.outcome, run.client_cpu_seconds, \
            run.server_cpu_seconds
        cpu = client_cpu + server_cpu
    if not isinstance(outcome, AggregateReady):
        raise RuntimeError(f"fedfleet's secure round failed: {outcome}")
    expected = np.zeros(m, dtype=config.codec.word)
    for device in outcome.survivors:
        expected += config.codec.encode(inputs(device))
    float_sum = np.sum([inputs(device) for device in outcome.survivors], axis=0)
    return {"round_s": wall, "cpu_s": cpu, "client_cpu_ms_per_device": 1e3 * client_cpu / n,
            "server_cpu_s": server_cpu, "degree": config.degree, "share_threshold": config.share_threshold,
            "threshold": config.threshold, "scale_bits": config.scale_bits, "ring_bits": ring_bits,
            "dropped": len(dropped), "survivors": len(outcome.survivors),
            "exact": bool(np.array_equal(outcome.sum_words, expected)),
            "max_abs_error": float(np.abs(outcome.decode() - float_sum).max())}


def flower_round(python: Path, n: int, m: int, num_shares: int, threshold: int, dropout: float, cpus: int,
                 parallel: int, log_dir: Path) -> dict:
    log = log_dir / f"flower-secagg-n{n}-m{m}-parallel{parallel}.log"
    command = [str(python), str(FLOWER_SCRIPT), "--n", str(n), "--m", str(m), "--num-shares", str(num_shares),
               "--threshold", str(threshold), "--dropout", str(dropout), "--cpus", str(cpus),
               "--parallel", str(parallel)]
    with log.open("w") as stderr:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"Flower's round failed (exit {done.returncode}); its log: {log}")
    return json.loads(lines[-1])


def compare(python: Path | None, n: int, m: int, bound: float, dropout: float, cores: int,
            log_dir: Path) -> dict | None:
    """Run both pairings; print them; return the figures (None when Flower was not measured)."""
    if python is None or not Path(python).exists():
        print(f"\nFlower was not measured: no Flower python at {python or DEFAULT_FLOWER_PYTHON} "
              "(`make bench-flower` makes .venv-flower and runs this comparison; or pass --flower PYTHON)")
        return None
    log_dir.mkdir(parents=True, exist_ok=True)
    previous = os.sched_getaffinity(0)
    pinned = set(sorted(previous)[:cores])
    os.sched_setaffinity(0, pinned)
    try:
        serial = fedfleet_round(n, m, bound, dropout, processes=1)
        serial32 = fedfleet_round(n, m, bound, dropout, processes=1, ring_bits=32)
        num_shares, t_prime = serial["degree"] + 1, serial["share_threshold"]
        print(f"\nSecAgg+ against Flower, n = {n}, m = {m}, {serial['dropped']} clients "
              f"({dropout:.0%}) drop out after sharing keys (no masked input), on {len(pinned)} core(s) "
              f"{sorted(pinned)}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        flower_serial = flower_round(python, n, m, num_shares, t_prime, dropout, len(pinned), 1, log_dir)
        parallel = parallel32 = flower_parallel = None
        if len(pinned) > 1:
            parallel = fedfleet_round(n, m, bound, dropout, processes=len(pinned))
            parallel32 = fedfleet_round(n, m, bound, dropout, processes=len(pinned), ring_bits=32)
            flower_parallel = flower_round(python, n, m, num_shares, t_prime, dropout, len(pinned), len(pinned),
                                           log_dir)
    finally:
        os.sched_setaffinity(0, previous)
    print(f"  fedfleet: degree k = {serial['degree']} (neighbourhood of {serial['degree'] + 1} share holders), "
          f"share threshold t' = {serial['share_threshold']}, round threshold {serial['threshold']} of {n}; "
          f"64-bit ring (uint64 words, {serial['scale_bits']} fractional bits; max error of the decoded sum "
          f"{serial['max_abs_error']:.1e}) and 32-bit ring (uint32 words, {serial32['scale_bits']} fractional bits; "
          f"max error {serial32['max_abs_error']:.1e}), masks from AES-128-CTR")
    print(f"  Flower {flower_serial['flwr']}: num_shares = {flower_serial['num_shares']}, reconstruction_threshold"
          f" = {flower_serial['reconstruction_threshold']}; {flower_serial['modulus_bits']}-bit modulus (values "
          f"quantised to {flower_serial['quantization_bits']} bits), masks from {flower_serial['mask_prg']}")
    print("  Flower's masks are 32-bit values from numpy's Mersenne Twister, fedfleet's are words of AES-CTR "
          "keystream (64- or 32-bit): mask expansion, most of the work, is not the same work on the two sides")
    rows = [("clients one after another (fedfleet: in-process driver, server on 1 thread; Flower: 1 Ray actor)",
             {64: serial, 32: serial32}, flower_serial)]
    if parallel:
        rows.append((f"clients in parallel on {len(pinned)} cores (fedfleet: {len(pinned)} client processes, server "
                     f"expansion on {len(pinned)} threads; Flower: {len(pinned)} Ray actors)",
                     {64: parallel, 32: parallel32}, flower_parallel))
    for label, rings, theirs in rows:
        print(f"  {label}:")
        for ring_bits, ours in rings.items():
            _print_pairing(ring_bits, ours, theirs, n)
    figures = {"serial": {"fedfleet": serial, "fedfleet_ring32": serial32, "flower": flower_serial},
               "parallel": {"fedfleet": parallel, "fedfleet_ring32": parallel32, "flower": flower_parallel}
               if parallel else None}
    if not all(pair["fedfleet"]["exact"] and pair["fedfleet_ring32"]["exact"] and pair["flower"]["correct"]
               for pair in filter(None, figures.values())):
        print("ERROR: a sum was wrong (see above)")
        figures["error"] = True
    return figures


def _print_pairing(ring_bits: int, ours: dict, theirs: dict, n: int) -> None:
    """One fedfleet round against Flower's: wall ratio (the goal is read on the 32-bit ring), CPU ratio."""
    ratio = ours["round_s"] / theirs["round_s"]
    goal = "goal <= 0.1" if ring_bits == 32 else "the goal is read on the 32-bit ring"
    print(f"    {ring_bits}-bit ring, SecAgg+ round: fedfleet {ours['round_s']:.2f} s, Flower {theirs['round_s']:.2f} s, "
          f"ratio {ratio:.3f} ({goal}){' -- NOT MET' if ring_bits == 32 and ratio > 0.1 else ''}")
    print(f"    fedfleet: client CPU {ours['client_cpu_ms_per_device']:.1f} ms/device, server CPU "
          f"{ours['server_cpu_s']:.2f} s, sum exact: {ours['exact']}; Flower stages (s): "
          + ", ".join(f"{name.removesuffix('_stage')} {seconds:.2f}" for name, seconds in theirs["stage_s"].items())
          + f", aggregate within {theirs['tolerance']:.1e} of the plain sum: {theirs['correct']} "
          f"(max error {theirs['max_abs_error']:.1e})")
    flower_cpu = theirs["client_cpu_s"] + theirs["server_process_cpu_s"]
    print(f"    CPU seconds of the round (less swayed by other load than wall time): fedfleet {ours['cpu_s']:.2f} "
          f"(clients {ours['client_cpu_ms_per_device'] * n / 1e3:.2f}), Flower {flower_cpu:.2f} (ClientApps "
          f"{theirs['client_cpu_s']:.2f}, server process {theirs['server_process_cpu_s']:.2f}), ratio "
          f"{ours['cpu_s'] / flower_cpu:.3f}")


if __name__ == "__main__":
    sys.exit("run bench/secagg.py --flower PYTHON")
