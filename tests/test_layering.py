"""The layering rules of docs/architecture.md, enforced on every import in the tree:
``protocols`` imports no other fedfleet package; ``edge_client`` never imports ``aggregator``,
``export`` or ``fedfleet``; ``aggregator`` never imports ``edge_client``, ``export`` or ``fedfleet``;
``export`` never imports ``aggregator`` or ``fedfleet``. Only ``fedfleet`` starts both sides."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocols", "edge_client", "aggregator", "export", "fedfleet")
FORBIDDEN = {"protocols": {"edge_client", "aggregator", "export", "fedfleet"},
             "edge_client": {"aggregator", "export", "fedfleet"},
             "aggregator": {"edge_client", "export", "fedfleet"},
             "export": {"aggregator", "fedfleet"}}


def imported_packages(source: str) -> set[str]:
    """Top-level packages a module imports, anywhere in it (inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def violations(root: Path) -> list[str]:
    out = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((root / package).rglob("*.py")):
            bad = imported_packages(path.read_text()) & forbidden
            out += [f"{path.relative_to(root)} imports {name}" for name in sorted(bad)]
    return out


def test_the_tree_keeps_the_layering_rules():
    assert all((ROOT / p).is_dir() for p in PACKAGES)
    assert violations(ROOT) == []


@pytest.mark.parametrize("package,line,culprit", [
    ("protocols", "import aggregator.service.loop\n", "aggregator"),
    ("edge_client", "def f():\n    from export import pipeline\n", "export"),          # a lazy import counts too
    ("aggregator", "from edge_client.agent import DeviceAgent\n", "edge_client")])
def test_the_check_fails_on_a_deliberately_wrong_import(tmp_path, package, line, culprit):
    for p in PACKAGES:
        (tmp_path / p).mkdir()
    (tmp_path / package / "fine.py").write_text("import numpy\nfrom protocols import envelope\n")
    (tmp_path / package / "wrong.py").write_text(line)
    assert violations(tmp_path) == [f"{package}/wrong.py imports {culprit}"]


def emulation_imports(source: str) -> list[str]:
    """Imports of the emulated fleet (``fedfleet.emulation``, or ``.emulation`` from inside fedfleet)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [("fedfleet." if node.level == 1 else "") + (node.module or "")]
        out += [n for n in names if n == "fedfleet.emulation" or n.startswith("fedfleet.emulation.")]
    return out


def test_the_real_device_imports_nothing_of_the_emulated_fleet():
    # a Jetson runs fedfleet/device.py (and its device_*.py modules): its handlers come from the device
    # SDK (edge_client.handlers)
    device_modules = sorted((ROOT / "fedfleet").glob("device*.py"))
    assert ROOT / "fedfleet" / "device.py" in device_modules
    for module in device_modules:
        assert emulation_imports(module.read_text()) == [], module.name
    assert emulation_imports("def f():\n    from .emulation.worker import device_handlers\n") == \
        ["fedfleet.emulation.worker"]
