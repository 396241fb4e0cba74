"""tests/rewrite_cache.py writes what pytest's assertion-rewriting hook reads back: its own
format, under its own name, holding the rewritten asserts (not a plain compile)."""

from pathlib import Path

from _pytest.assertion.rewrite import PYC_TAIL, _read_pyc, get_cache_dir

import rewrite_cache

HERE = Path(__file__).resolve()


def names_in(code) -> set[str]:
    names = set(code.co_names) | set(code.co_varnames)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= names_in(const)
    return names


def test_the_cached_rewrite_is_what_pytest_reads_back():
    files = [HERE, HERE.parent / "conftest.py"]
    assert rewrite_cache.main(files) == 0
    for path in files:
        pyc = get_cache_dir(path) / (path.stem + PYC_TAIL)
        code = _read_pyc(path, pyc)
        assert code is not None, path
    cached = _read_pyc(HERE, get_cache_dir(HERE) / (HERE.stem + PYC_TAIL))
    assert any(name.startswith("@py_assert") for name in names_in(cached))      # this module's asserts, rewritten
    # a module that changed since is not read from the cache (pytest checks the source's hash)
    assert _read_pyc(HERE.parent / "conftest.py", get_cache_dir(HERE) / (HERE.stem + PYC_TAIL)) is None
