"""The seeds' claims side by side: the paper's figure, ours on Fashion-MNIST, holds or not, and why.

Discovers every module of ``bench/claims/`` (each exposes ``rows(seeds, quick)``, see
``bench/claims/__init__.py``), runs it on the seeds and prints one row per claim; the table also
goes to runs/bench/seed_claims.md (markdown, what docs/algorithms.md quotes) and .json.
A module that fails is reported as a failed row (its traceback in the JSON), never hides the others.

Usage: .venv/bin/python bench/seed_claims.py [--seeds 0 1 2] [--quick] [--only fed3r_pipeline ...]
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import pkgutil
import sys
import time
import traceback

BENCH = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

import claims  # noqa: E402

OUT_DIR = BENCH.parent / "runs" / "bench"


def discover() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(claims.__path__) if not m.name.startswith("_"))


def verdict(holds) -> str:
    if holds is True:
        return "holds"
    if holds is False:
        return "does not hold"
    return str(holds)


def run_module(name: str, seeds: list[int], quick: bool) -> tuple[list[dict], dict]:
    t0 = time.perf_counter()
    try:
        module = importlib.import_module(f"claims.{name}")
        rows = module.rows(seeds, quick)
        for row in rows:
            missing = set(claims.ROW_KEYS) - set(row)
            if missing:
                raise ValueError(f"claims.{name}: a row lacks {sorted(missing)}")
        return rows, {"module": name, "s": time.perf_counter() - t0}
    except Exception as exc:          # one family failing must not hide the others' rows
        return ([{"claim": f"(claims.{name} failed)", "source": name, "paper": "", "ours": "",
                  "holds": "not run", "why": f"{type(exc).__name__}: {exc}"}],
                {"module": name, "s": time.perf_counter() - t0, "traceback": traceback.format_exc()})


def markdown(rows: list[dict]) -> str:
    lines = ["| claim | source | paper | ours (Fashion-MNIST) | verdict | why |", "|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["claim"], r["source"], r["paper"], r["ours"], verdict(r["holds"]), r["why"]]
        lines.append("| " + " | ".join(str(c).replace("|", "/").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--quick", action="store_true", help="each module's fast path (smoke run)")
    ap.add_argument("--only", nargs="+", help="run these claims modules only (default: all of bench/claims/)")
    args = ap.parse_args(argv)
    names = discover()
    unknown = set(args.only or ()) - set(names)
    if unknown:
        ap.error(f"unknown claims modules {sorted(unknown)} (known: {', '.join(names)})")
    wall0 = time.perf_counter()
    rows, runs = [], []
    for name in names:
        if args.only and name not in args.only:
            continue
        print(f"[claims.{name}] seeds {args.seeds}{' (quick)' if args.quick else ''} ...", flush=True)
        got, info = run_module(name, args.seeds, args.quick)
        rows += got
        runs.append(info)
        print(f"[claims.{name}] {len(got)} row(s) in {info['s']:.0f}s", flush=True)
    table = markdown(rows)
    print("\n" + table)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "seed_claims.md").write_text(table + "\n")
    (OUT_DIR / "seed_claims.json").write_text(json.dumps(
        {"args": vars(args), "rows": rows, "modules": runs, "wall_s": time.perf_counter() - wall0}, indent=1,
        default=str))
    print(f"\nwrote {OUT_DIR / 'seed_claims.md'} and seed_claims.json; wall {time.perf_counter() - wall0:.0f}s")
    return 0 if all(r["holds"] != "not run" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
