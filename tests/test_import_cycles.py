"""No import cycle anywhere in the five packages: every module's imports, those inside functions
included (a lazy import that closes a cycle only hides it until someone moves it to the top),
form a graph with no strongly connected component of more than one module."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocols", "edge_client", "aggregator", "export", "fedfleet")


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages under ``root``."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports: ``from a.b import c`` counts as a.b.c when c is a module,
    as a.b otherwise. The parent packages Python initialises first are not edges: a module cannot
    run before its package anyway, and the package's own imports are counted where they stand."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            submodules = {f"{source}.{alias.name}" for alias in node.names} & modules.keys()
            found |= submodules if len(submodules) == len(node.names) else submodules | {source}
    return {m for m in found if m in modules and m != name}


def cycles(root: Path) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    modules = module_names(root)
    graph = {name: sorted(imports_of(name, path, modules)) for name, path in modules.items()}
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_module_takes_part_in_an_import_cycle():
    assert cycles(ROOT) == []


def test_the_check_finds_a_cycle_through_a_lazy_import(tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "aggregator" / "a.py").write_text("from aggregator.b import f\n")
    (tmp_path / "aggregator" / "b.py").write_text("def f():\n    from . import c\n")
    (tmp_path / "aggregator" / "c.py").write_text("import aggregator.a\n")
    (tmp_path / "protocols" / "d.py").write_text("from protocols import e\n")
    (tmp_path / "protocols" / "e.py").write_text("X = 1\n")
    assert cycles(tmp_path) == [["aggregator.a", "aggregator.b", "aggregator.c"]]
