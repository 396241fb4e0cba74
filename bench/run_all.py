"""Run every benchmark once (quick settings) and keep their outputs in runs/bench/.

Each script prints ratios measured within its own run (never absolute claims across runs):
    .venv/bin/python bench/run_all.py [--full]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
QUICK = {
    "fed3r_ingest.py": ["--devices", "10", "--ingest-workers", "0", "2"],
    "ingest_steps.py": [],
    "fed3r_precision.py": ["--train", "1000", "--test", "500", "--devices", "40"],
    "fed3r_solve.py": ["--dims", "1281", "2049", "4097"],
    "fed3r_paper_scale.py": ["--quick"],
    "fleet_scale.py": ["--devices", "200"],
    "backbone_speed.py": ["--quick"],
    "export.py": ["--quick"],
    "secagg.py": ["--quick"],
    "fed3r_sync_member.py": ["--repeats", "3"],
    "ops.py": [],
    "fed3r_vs_fedavg.py": [],
    "personalization.py": [],
    "fp_cross_validation.py": ["--repeats", "1"],
    "ladd.py": [],
    "ft_modes.py": ["--quick"],
    "quantization.py": ["--quick"],
    "java_device.py": [],
    "shard_start.py": ["--starts", "3"],
    "cli_start.py": [],
    "import_compile.py": ["--repeats", "4"],
    "sim_process_start.py": ["--starts", "3"],
    "export_folding.py": [],
    "device_session_memory.py": ["--sessions", "2000"],
    "deployment_restart.py": ["--devices", "2000"],
    "secagg_degree.py": ["--repeats", "1"],
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", action="store_true", help="each script's default (larger) settings")
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    out = Path("runs/bench")
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for script, quick in QUICK.items():
        if args.only and script not in args.only or not (HERE / script).exists():
            continue
        cmd = [sys.executable, str(HERE / script)] + ([] if args.full else quick)
        print(f"=== {' '.join(cmd[1:])}", flush=True)
        t0 = time.monotonic()
        res = subprocess.run(cmd, capture_output=True, text=True)
        (out / f"{script[:-3]}.txt").write_text(res.stdout + res.stderr)
        print(res.stdout[-3000:], flush=True)
        print(f"--- {script}: exit {res.returncode} in {time.monotonic() - t0:.0f}s", flush=True)
        if res.returncode:
            failed.append(script)
            print(res.stderr[-2000:], flush=True)
    if failed:
        print("failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
