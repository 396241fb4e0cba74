"""docs/architecture.md is the newcomer's map: every file, folder and module it names exists, and
every folder of the aggregator is on it."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("protocols", "edge_client", "aggregator", "export", "fedfleet", "tests", "bench", "clients", "docs")
PATH = re.compile(r"`((?:%s)/[\w./-]*)`" % "|".join(PACKAGES))
MODULE = re.compile(r"`((?:protocols|edge_client|aggregator|export|fedfleet)(?:\.\w+)+)")


def missing_references(doc: str, root: Path) -> list[str]:
    """Paths (`a/b.py`, `a/b/`) and dotted modules (`a.b.c`, `a.b.Class`) the text names that do not exist."""
    missing = [p for p in PATH.findall(doc) if not (root / p.rstrip("/")).exists()]
    for dotted in MODULE.findall(doc):
        parts = dotted.split(".")
        # the longest prefix that is a module or package; what follows may be a class or function
        found = any((root / Path(*parts[:n])).with_suffix(".py").is_file() or (root / Path(*parts[:n])).is_dir()
                    for n in range(len(parts), 1, -1))
        if not found:
            missing.append(dotted)
    return missing


def test_every_path_and_module_the_architecture_doc_names_exists():
    assert missing_references(DOC.read_text(), ROOT) == []


def test_every_aggregator_folder_is_on_the_map():
    doc = DOC.read_text()
    folders = sorted(p.name for p in (ROOT / "aggregator").iterdir()
                     if p.is_dir() and (p / "__init__.py").exists())
    assert [f for f in folders if f"aggregator/{f}/" not in doc] == []


def test_the_check_catches_a_stale_name(tmp_path):
    (tmp_path / "aggregator" / "service").mkdir(parents=True)
    (tmp_path / "aggregator" / "service" / "loop.py").write_text("")
    doc = ("`aggregator/service/loop.py`, `aggregator/service/`, `aggregator.service.loop.AggregatorService` "
           "and the old `aggregator/service.py`, `aggregator.job_runner.JobRunner`")
    assert missing_references(doc, tmp_path) == ["aggregator/service.py", "aggregator.job_runner.JobRunner"]


def modules_off_the_map(doc: str, root: Path) -> list[str]:
    """Modules of the product packages the doc never names: by its path from any folder above it
    (`aggregator/service/loop.py`, `service/loop.py`, `loop.py` in its folder's row), by its dotted
    name, or, in the opening diagram, by its bare name (`chunking`)."""
    diagram = doc.split("```")[1]
    named = set(re.findall(r"[\w./]+\.py", doc))
    missing = []
    for package in ("protocols", "edge_client", "aggregator", "export", "fedfleet"):
        for path in sorted((root / package).rglob("*.py")):
            if path.name in ("__init__.py", "__main__.py"):
                continue
            parts = path.relative_to(root).parts
            suffixes = {"/".join(parts[i:]) for i in range(len(parts))}
            if suffixes & named or ".".join(parts)[:-3] in doc or re.search(rf"\b{path.stem}\b", diagram):
                continue
            missing.append("/".join(parts))
    return missing


def test_every_module_of_the_product_packages_is_on_the_map():
    assert modules_off_the_map(DOC.read_text(), ROOT) == []


def test_the_map_check_catches_a_module_nobody_named(tmp_path):
    for name in ("loop.py", "ingest.py", "settings.py", "new_thing.py"):
        (tmp_path / "aggregator" / "service").mkdir(parents=True, exist_ok=True)
        (tmp_path / "aggregator" / "service" / name).write_text("")
    (tmp_path / "protocols").mkdir()
    (tmp_path / "protocols" / "chunking.py").write_text("")
    doc = ("```\n protocols/: chunking · topics\n```\n`aggregator/service/loop.py`, `service/ingest.py`, "
           "`aggregator.service.settings.ServiceSettings`")
    assert modules_off_the_map(doc, tmp_path) == ["aggregator/service/new_thing.py"]
