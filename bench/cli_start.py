"""How long a ``fedfleet`` call takes before it does anything: ``--version`` and ``admin --help``
(only the named command's parser is built: no torch) against the parser the command built before
stop 50 (every command's, the server's job registry included: torch), each in a fresh interpreter.
And how long a mistake in a config takes to be reported (``simulate --config`` naming a key twice;
``aggregator serve --config`` the same): since stop 68 the job registry the check builds on imports
torch only where the jobs compute, against the same call with torch imported first (as before).
And (stop 82) the aggregator's command line and a config's check without scipy, which they imported
through the CPU's LAPACK calls and the synthetic scenes' filters, against the same calls with
scipy.linalg and scipy.ndimage imported first (as before).

    .venv/bin/python bench/cli_start.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
CALLS = {
    "fedfleet --version": "from fedfleet.cli import main\ntry: main(['--version'])\nexcept SystemExit: pass",
    "fedfleet admin --help": "from fedfleet.cli import main\ntry: main(['admin', '--help'])\nexcept SystemExit: pass",
    "every command's parser (before)": "from fedfleet.cli import build_parser\nbuild_parser()",
}
BAD_CONFIG = '{"devices": 4, "devices": 5}'
CONFIG_CHECKS = {       # {bad}: a file holding BAD_CONFIG
    "simulate --config mistake": "from fedfleet.cli import main\nmain(['simulate', '--config', {bad!r}])",
    "the same, torch first (before)": "import torch\nfrom fedfleet.cli import main\nmain(['simulate', '--config', {bad!r}])",
    "aggregator serve --config mistake": "from fedfleet.cli import main\nmain(['aggregator', 'serve', '--out', 'o', "
                                         "'--config', {bad!r}])",
}

SCIPY_FIRST = "import scipy.linalg, scipy.ndimage\n"
SCIPY_CALLS = {         # each against itself with SCIPY_FIRST (before stop 82)
    "fedfleet aggregator --help": "from fedfleet.cli import main\ntry: main(['aggregator', '--help'])\n"
                                  "except SystemExit: pass",
    "simulate --config mistake": CONFIG_CHECKS["simulate --config mistake"],
}


def seconds(code: str, repeats: int) -> float:
    """Median wall seconds of a fresh interpreter running ``code``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    measured = {name: seconds(code, args.repeats) for name, code in CALLS.items()}
    full = measured["every command's parser (before)"]
    for name, value in measured.items():
        print(f"{name:>34}: {value:.3f} s   ({value / full:.3f} of the full parser's)")
    with tempfile.TemporaryDirectory() as folder:
        bad = str(pathlib.Path(folder) / "bad.json")
        pathlib.Path(bad).write_text(BAD_CONFIG)
        checks = {name: seconds(code.format(bad=bad), args.repeats) for name, code in CONFIG_CHECKS.items()}
        without_scipy = {name: (seconds(code.format(bad=bad), args.repeats),
                                seconds(SCIPY_FIRST + code.format(bad=bad), args.repeats))
                         for name, code in SCIPY_CALLS.items()}
    before = checks["the same, torch first (before)"]
    for name, value in checks.items():
        print(f"{name:>34}: {value:.3f} s   ({value / before:.3f} of the check with torch imported first)")
    for name, (now, scipy_first) in without_scipy.items():
        print(f"{name:>34}: {now:.3f} s   ({now / scipy_first:.3f} of the same with scipy imported first)")


if __name__ == "__main__":
    main()
