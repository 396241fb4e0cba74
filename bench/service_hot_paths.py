"""The aggregator's and the device hosts' per-event costs at fleet scale, each against what it
replaced, measured in one run (stop 32's fleet-100k fixes; docs/deployment.md):

1. the round machine's bookkeeping per result at κ = 10,000 participants: kept as the rows change
   it (``RoundCoordinator``), against recomputing the pending set on every event as it did before;
2. the admin API's live snapshot with 100,000 devices online: its cost, and the service thread's
   share it takes when retaken every 0.2 s (before) and when paced to 20x its cost
   (``reporting.Pacing``);
3. a device's feature extraction for 5 images at 32 px: eager torch against the exported
   ExecuTorch program the fleet presets now run.

    .venv/bin/python bench/service_hot_paths.py [--kappa 10000] [--online 100000]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from aggregator.security.fleet import Fleet  # noqa: E402
from aggregator.service import reporting  # noqa: E402
from protocols.rounds import ResultArrived, RoundCoordinator  # noqa: E402


class RecomputedPending(RoundCoordinator):
    """The round machine as it was: ``pending`` rebuilt from the participant set on every read."""

    @property
    def pending(self) -> frozenset[str]:
        return frozenset(self.participants - set(self.accepted) - set(self.declined) - set(self.rejected) - self.lost)

    def is_pending(self, device: str) -> bool:
        return device in self.pending

    @property
    def pending_count(self) -> int:
        return len(self.pending)

    def _maybe_close(self) -> list:
        return self._close() if not self.pending else []


def round_events_per_s(cls, kappa: int, results: int) -> float:
    devices = [f"dev{i:06d}" for i in range(kappa)]
    coord = cls(1, frozenset(devices), deadline=1e18)
    t0 = time.perf_counter()
    for i, d in enumerate(devices[:results]):
        coord.handle(ResultArrived(d, f"m{i}", None))
        coord.pending_count          # the runner's per-event tick reads it
    return results / (time.perf_counter() - t0)


def snapshot_s(online: int) -> float:
    fleet = Fleet(None, None, {f"dev{i:06d}" for i in range(online)}, require_signatures=False)
    for i in range(online):
        fleet.presence(f"dev{i:06d}", True, None)
        fleet.heard_from(f"dev{i:06d}")
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        reporting.live_snapshot(None, fleet, {})
        best = min(best, time.perf_counter() - t0)
    return best


def extract_ms(runtime: str, repeats: int = 40) -> float:
    from edge_client.data import load_fashion_mnist
    from fedfleet.bundles import make_extractor

    images = load_fashion_mnist("train")[0][:5 * repeats]
    extractor = make_extractor("mobilenet_v2", 32, None, runtime=runtime, threads=1)
    extractor.extract(images[:5])
    t0 = time.perf_counter()
    for i in range(repeats):
        extractor.extract(images[5 * i:5 * (i + 1)])
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kappa", type=int, default=10_000)
    ap.add_argument("--results", type=int, default=2_000, help="results fed to each round machine")
    ap.add_argument("--online", type=int, default=100_000)
    ap.add_argument("--no-backbone", action="store_true", help="skip (3)")
    args = ap.parse_args()
    new, old = (round_events_per_s(c, args.kappa, args.results) for c in (RoundCoordinator, RecomputedPending))
    print(f"1. round bookkeeping, κ = {args.kappa:,}: {new:,.0f} results/s kept, {old:,.0f} recomputed: "
          f"{new / old:.0f}x")
    cost = snapshot_s(args.online)
    paced = reporting.Pacing()
    every = max(paced.every_s, paced.cost_factor * cost)
    print(f"2. live snapshot, {args.online:,} online: {cost * 1e3:.0f} ms; service share every 0.2 s "
          f"{min(1.0, cost / 0.2):.0%}, paced (every {every:.2f} s) {cost / every:.0%}: "
          f"{min(1.0, cost / 0.2) / (cost / every):.1f}x less")
    if not args.no_backbone:
        eager, program = extract_ms("eager"), extract_ms("executorch")
        print(f"3. 5 images at 32 px: eager {eager:.1f} ms, ExecuTorch {program:.2f} ms: {eager / program:.1f}x")


if __name__ == "__main__":
    main()
