"""The suite's per-file worker seconds, which ``conftest._slow_files_first`` hands out longest first.

    .venv/bin/python -m pytest -q --durations=0 -n 4 --dist loadfile --no-loadscope-reorder > LOG
    .venv/bin/python tests/file_seconds.py LOG        # rewrites tests/file_seconds.json

Only the order of the files changes with these figures (never what runs), so stale ones cost wall
time at worst: a file missing from the table is handed out after every file in it.
"""

from __future__ import annotations

import collections
import json
import pathlib
import re
import sys

TABLE = pathlib.Path(__file__).with_name("file_seconds.json")
LINE = re.compile(r"\s*([\d.]+)s (?:setup|call|teardown)\s+(tests/[^:\s]+)::")


def per_file(log_lines) -> dict[str, float]:
    """{test file: seconds of its setup, call and teardown phases} from pytest's --durations lines."""
    seconds: collections.Counter = collections.Counter()
    for line in log_lines:
        if match := LINE.match(line):
            seconds[match[2]] += float(match[1])
    return {path: round(total, 1) for path, total in sorted(seconds.items())}


def load() -> dict[str, float]:
    try:
        return json.loads(TABLE.read_text())
    except (OSError, ValueError):
        return {}


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as log:
        TABLE.write_text(json.dumps(per_file(log), indent=0, sort_keys=True) + "\n")
