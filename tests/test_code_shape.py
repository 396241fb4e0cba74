"""Shape rules of docs/architecture.md that a reader relies on: no function in ``aggregator/``
over 80 lines, ``aggregator/service/loop.py`` (the I/O loop) at most 450 lines, no module of
``aggregator/storage/`` (one repository per aggregate) over 250 lines. The checks are shown to fail
on a deliberately long function and a deliberately long module."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80
MAX_SERVICE_LINES = 450
MAX_STORAGE_MODULE_LINES = 250


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line name (n lines)`` for every function or method (nested ones too) over ``limit``
    lines, decorators excluded, docstring and comments included."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return out


def long_modules(package: Path, limit: int) -> list[str]:
    """``path (n lines)`` for every module of ``package`` (subpackages too) over ``limit`` lines."""
    out = []
    for path in sorted(package.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > limit:
            out.append(f"{path.relative_to(package.parent)} ({lines} lines)")
    return out


def test_no_function_in_the_aggregator_is_over_80_lines():
    assert long_functions(ROOT / "aggregator") == []


def test_the_service_is_a_thin_io_loop():
    assert len((ROOT / "aggregator" / "service" / "loop.py").read_text().splitlines()) <= MAX_SERVICE_LINES


def test_every_storage_module_is_readable_at_once():
    assert long_modules(ROOT / "aggregator" / "storage", MAX_STORAGE_MODULE_LINES) == []


def test_the_check_finds_a_long_module(tmp_path):
    package = tmp_path / "storage"
    package.mkdir()
    (package / "short.py").write_text("x = 1\n" * MAX_STORAGE_MODULE_LINES)
    (package / "long.py").write_text("x = 1\n" * (MAX_STORAGE_MODULE_LINES + 1))
    assert long_modules(package, MAX_STORAGE_MODULE_LINES) == [f"storage/long.py ({MAX_STORAGE_MODULE_LINES + 1} lines)"]


def test_the_check_finds_a_long_method(tmp_path):
    package = tmp_path / "aggregator"
    package.mkdir()
    body = "".join(f"        x = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (package / "m.py").write_text(f"class A:\n    def short(self):\n        pass\n\n    def long(self):\n{body}")
    assert long_functions(package) == [f"aggregator/m.py:5 long ({MAX_FUNCTION_LINES + 1} lines)"]
