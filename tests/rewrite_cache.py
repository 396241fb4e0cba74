"""Write pytest's assertion-rewritten bytecode of the suite's modules once, before the xdist workers
start (``make test`` runs this first).

With PYTHONDONTWRITEBYTECODE set, as on this CI's machines, pytest rewrites the asserts of every test
module in each of the 4 workers and writes none of it: ~7 CPU-s per worker, a third of a collection
(``pytest --collect-only``: 14.3 CPU-s cold, 7.3 s with the rewrites cached; the workers start at
once on 2 cores, so the suite waited ~15 s for them). pytest reads a cached rewrite even when it may
not write one (``AssertionRewritingHook.exec_module``), so writing them here, once, is what the
workers then read. Best effort, using pytest's own rewrite and cache format: if those internals
moved in another pytest, this says so and writes nothing, and the workers rewrite as before.

    .venv/bin/python tests/rewrite_cache.py
"""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# what pytest rewrites here: the test modules (python_files), conftest.py, the plugins it loads and
# the helper modules it registers for rewriting (pytest.register_assert_rewrite)
REWRITTEN = ["conftest.py", "cpu_profile.py", "secagg_rounds.py", "secure_shard_runs.py", "java_tasks.py"]


class _QuietState:
    """The hook's state as ``_write_pyc`` uses it: only its trace."""

    @staticmethod
    def trace(*_args) -> None:
        return None


def main(files: list[Path] | None = None) -> int:
    """Cache the rewrites of ``files`` (all the suite's rewritten modules by default)."""
    if files is None:
        files = sorted(TESTS.glob("test_*.py")) + [TESTS / name for name in REWRITTEN]
    try:
        from _pytest.assertion.rewrite import PYC_TAIL, _rewrite_test, _write_pyc, get_cache_dir

        written = 0
        for path in files:
            source_hash, code = _rewrite_test(path, None)
            cache_dir = get_cache_dir(path)
            cache_dir.mkdir(exist_ok=True)
            written += bool(_write_pyc(_QuietState(), code, source_hash, cache_dir / (path.stem + PYC_TAIL)))
    except Exception as exc:        # noqa: BLE001 — an optimisation only: never fail the suite for it
        print(f"rewrite_cache: not written ({type(exc).__name__}: {exc}); pytest's workers rewrite as usual")
        return 0
    print(f"rewrite_cache: {written} of {len(files)} modules' rewritten bytecode cached")
    return 0


if __name__ == "__main__":
    sys.exit(main())
