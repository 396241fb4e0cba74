"""Every state machine in the product packages is a TransitionTable (issue 36): its rules are data
that the code fires, and the table is rendered into the docs.

What counts as a state machine, found by reading the source (AST), not by asking the code: a class
that holds a state-like attribute (``state``, ``phase``, ``stage``, ``status``) and either has a
``handle`` method (events in, actions out), or writes two or more constant values to it (string
literals or enum members: transitions spelt out in code), or a string literal to ``state``. Such a
class conforms when its methods call ``TABLE.fire(self, ...)`` for a module-level
``TABLE = TransitionTable(...)``, every constant it writes to its state is a member of that table's
states, and it is in MACHINES below, which names the doc its table is rendered into."""

from __future__ import annotations

import ast
import functools
import importlib
from pathlib import Path

import pytest

from protocols.transition_table import TransitionTable

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("aggregator", "protocols", "edge_client")
STATE_NAMES = {"state", "phase", "stage", "status"}

# module:class -> (the module-level table it fires, the doc that shows the table rendered)
MACHINES = {
    "protocols.rounds:RoundCoordinator": ("COORDINATOR_TABLE", "docs/protocol.md"),
    "protocols.device_session:DeviceSession": ("DEVICE_TABLE", "docs/protocol.md"),
    "protocols.secagg.client:ClientSecAgg": ("CLIENT_TABLE", "docs/secure-aggregation.md"),
    "protocols.secagg.server:ServerSecAgg": ("SERVER_TABLE", "docs/secure-aggregation.md"),
    "aggregator.service.job_lifecycle:JobLifecycle": ("LIFECYCLE_TABLE", "docs/operations.md"),
    "aggregator.deployments.machine:Deployment": ("DEPLOYMENT_TABLE", "docs/operations.md"),
    "aggregator.jobs.ladd:LaddJob": ("LADD_TABLE", "docs/ladd.md"),
}
# Machines known not to be on a table yet, each with why; an entry that no longer holds fails too.
KNOWN_DEBT: dict[str, str] = {}


def _state_writes(cls: ast.ClassDef) -> list[tuple[str, ast.expr]]:
    """(attribute, value) for every write of a state-like attribute in the class: ``self.x = v``
    (also inside tuple assignments) and class-level fields ``x: T = v``."""
    writes = []
    for node in ast.walk(cls):
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
            pairs = [(target, node.value)]
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs = list(zip(target.elts, node.value.elts))
            for t, value in pairs:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" \
                        and t.attr in STATE_NAMES:
                    writes.append((t.attr, value))
                elif isinstance(t, ast.Name) and t.id in STATE_NAMES and node in cls.body:
                    writes.append((t.id, value))
    return writes


def _constant(value: ast.expr) -> bool:
    return isinstance(value, ast.Attribute) or (isinstance(value, ast.Constant) and isinstance(value.value, str))


def _tables(tree: ast.Module) -> set[str]:
    """Module-level names bound to ``TransitionTable(...)``."""
    return {t.id for node in tree.body if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name) and node.value.func.id == "TransitionTable"
            for t in node.targets if isinstance(t, ast.Name)}


def _fired_tables(cls: ast.ClassDef, tables: set[str]) -> set[str]:
    """The module's tables the class fires on itself: ``TABLE.fire(self, ...)``."""
    return {node.func.value.id for node in ast.walk(cls)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "fire"
            and isinstance(node.func.value, ast.Name) and node.func.value.id in tables
            and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id == "self"}


def find_machines(root: Path) -> dict[str, dict]:
    """module:class -> what the scan saw, for every state machine under `root`'s product packages."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            tables = _tables(tree)
            for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
                writes = _state_writes(cls)
                constants = {ast.unparse(v) for _, v in writes if _constant(v)}
                string_state = any(a == "state" and isinstance(v, ast.Constant) for a, v in writes)
                handles = any(isinstance(f, ast.FunctionDef) and f.name == "handle" for f in cls.body)
                if writes and (handles or len(constants) >= 2 or string_state):
                    found[f"{module}:{cls.name}"] = {"fires": _fired_tables(cls, tables), "constants": constants,
                                                     "string_state": string_state}
    return found


def off_the_table(found: dict[str, dict]) -> dict[str, str]:
    """module:class -> why it is not a TransitionTable machine (empty when every machine is), over
    what find_machines found (``off_the_table(find_machines(<an older checkout>))`` lists its debt)."""
    problems = {}
    for name, seen in found.items():
        if name in KNOWN_DEBT:
            continue
        if name not in MACHINES:
            problems[name] = f"a state machine not in MACHINES (fires {sorted(seen['fires'])})"
        elif seen["fires"] != {MACHINES[name][0]}:
            problems[name] = f"does not fire {MACHINES[name][0]} on itself (fires {sorted(seen['fires'])})"
        elif seen["string_state"]:
            problems[name] = "writes a string literal as its state"
    return problems


@functools.cache
def _found_here() -> dict[str, dict]:
    return find_machines(ROOT)


def test_every_state_machine_is_a_transition_table():
    assert off_the_table(_found_here()) == {}


def test_the_scan_finds_every_registered_machine_and_the_known_debt_is_still_owed():
    found = _found_here()
    assert set(MACHINES) <= set(found), "a registered machine the scan no longer recognises: fix the scan"
    assert set(KNOWN_DEBT) <= set(found), "converted: remove it from KNOWN_DEBT and add it to MACHINES"


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_each_table_is_rendered_in_its_doc_and_holds_the_states_the_class_writes(name):
    module_name, cls_name = name.split(":")
    table_name, doc = MACHINES[name]
    table = getattr(importlib.import_module(module_name), table_name)
    assert isinstance(table, TransitionTable)
    assert table.render() in (ROOT / doc).read_text(), f"stale: render {table_name} into {doc}"
    written = _found_here()[name]["constants"]
    known = {c for c in written if c.split(".")[-1] in table.states.__members__}    # Enum.MEMBER or _alias.MEMBER
    assert known == written, f"{cls_name} writes states its table does not know: {written - known}"
