"""What the lowering benches share: their options, and two ways of lowering one model alternated in
one run (the machine is shared and noisy), CPU seconds of each and whether their .pte bytes agree."""

from __future__ import annotations

import argparse
import statistics
from typing import Callable

Lowering = Callable[[], tuple[float, bytes]]        # -> (CPU seconds, the .pte bytes)


def lowering_arguments(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--backbone", default="mobilenet_v2")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    return ap


def compare_lowerings(title: str, before: tuple[str, Lowering], after: tuple[str, Lowering], repeats: int) -> None:
    """Run ``before`` and ``after`` alternately ``repeats`` times; print each one's median CPU-s and
    runs, the ratio after / before, and whether the two programs are the same bytes."""
    times: dict[str, list[float]] = {before[0]: [], after[0]: []}
    buffers: dict[str, bytes] = {}
    for _ in range(repeats):
        for name, lower in (before, after):
            seconds, buffers[name] = lower()
            times[name].append(seconds)
    medians = {name: statistics.median(runs) for name, runs in times.items()}
    width = max(len(name) for name in times) + 1
    print(f"{title}; CPU-s of export + lowering:")
    for name, runs in times.items():
        print(f"  {name + ':':<{width}} {medians[name]:.2f}  (runs {', '.join(f'{t:.2f}' for t in runs)})")
    print(f"  ratio {after[0]} / {before[0]}: {medians[after[0]] / medians[before[0]]:.2f}; "
          f".pte bytes identical: {buffers[before[0]] == buffers[after[0]]}")
