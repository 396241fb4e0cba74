"""Shape rules of docs/architecture.md that a reader relies on: no function in the product
packages (``protocols``, ``edge_client``, ``aggregator``, ``export``, ``fedfleet``) over 80 lines, ``aggregator/service/loop.py`` (the I/O loop) at most 450 lines, no module of
``aggregator/storage/`` (one repository per aggregate) over 250 lines, and one connection and
transaction discipline: only ``aggregator/storage/connection.py`` opens an SQLite connection or
begins, commits or rolls back a transaction. The checks are shown to fail on deliberately wrong code."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80
MAX_SERVICE_LINES = 450
MAX_STORAGE_MODULE_LINES = 250
CONNECTION_MODULE = Path("aggregator", "storage", "connection.py")
# a statement: at the start of an SQL string or after a ";" (not the word in a docstring)
TRANSACTION_STATEMENT = re.compile(r"(^|;)\s*(BEGIN|COMMIT|ROLLBACK|SAVEPOINT)\b")


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


def own_transactions(root: Path) -> list[str]:
    """``path:line`` for each ``sqlite3.connect`` call and each string holding BEGIN, COMMIT or
    ROLLBACK outside the connection module: a repository that opened its own connection or ran its
    own transaction would escape ``_tx`` (its lock, its rollback, its commit counters)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root.parent)
        if where == CONNECTION_MODULE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            connects = (isinstance(node, ast.Attribute) and node.attr == "connect"
                        and isinstance(node.value, ast.Name) and node.value.id == "sqlite3")
            statement = (isinstance(node, ast.Constant) and isinstance(node.value, str)
                         and TRANSACTION_STATEMENT.search(node.value))
            if connects or statement:
                out.append(f"{where}:{node.lineno}")
    return out


PRODUCT_PACKAGES = ("protocols", "edge_client", "aggregator", "export", "fedfleet")


@pytest.mark.parametrize("package", PRODUCT_PACKAGES)
def test_no_function_in_the_product_is_over_80_lines(package):
    assert long_functions(ROOT / package) == []


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


def test_only_the_connection_module_opens_connections_and_transactions():
    assert own_transactions(ROOT / "aggregator") == []


def test_the_check_finds_a_connection_or_transaction_of_its_own(tmp_path):
    storage = tmp_path / "aggregator" / "storage"
    storage.mkdir(parents=True)
    (storage / "connection.py").write_text("import sqlite3\nc = sqlite3.connect('x')\nc.execute('BEGIN IMMEDIATE')\n")
    (storage / "jobs.py").write_text("import sqlite3\n\ndef f(db):\n    db.execute('COMMIT')\n\n"
                                     "def g():\n    return sqlite3.connect('x')\n")
    (storage / "fine.py").write_text('"""Each write: BEGIN IMMEDIATE, then COMMIT."""\nROLLOUT = "rollback"\n\n'
                                     'def f(db):\n    db.execute("SELECT 1 -- no COMMIT here")\n')
    assert own_transactions(tmp_path / "aggregator") == ["aggregator/storage/jobs.py:4", "aggregator/storage/jobs.py:7"]


def test_the_check_finds_a_long_method(tmp_path):
    package = tmp_path / "aggregator"
    package.mkdir()
    body = "".join(f"        x = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (package / "m.py").write_text(f"class A:\n    def short(self):\n        pass\n\n    def long(self):\n{body}")
    assert long_functions(package) == [f"aggregator/m.py:5 long ({MAX_FUNCTION_LINES + 1} lines)"]
