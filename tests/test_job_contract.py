"""The job contract (``aggregator/jobs/base.py``), checked on every registered kind.

Each kind is built from a config alone, as the service builds it (real key files, a real exported
tail program, a real pretrained LADD network): the job is a ``Job`` (building it proves every
abstract method is implemented), its capabilities are what this file expects of the kind, each
interface's flag agrees with the interface, and its config is a ``JobConfig`` (the secure kinds'
a ``SecureAggregationFields``) that declares only fields or defaults differing from its bases.
Nothing in ``aggregator/`` probes a job with getattr/hasattr or isinstance on an interface: the
runners ask the job what it is. Each check is shown to fail on a deliberately wrong case.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import numpy as np
import pytest

from aggregator.jobs.base import AsynchronousJob, Job, JobConfig, SplitValidation
from aggregator.jobs.ladd import save_initial_model
from aggregator.jobs.registry import KINDS, build_job
from aggregator.jobs.secure_fields import SecureAggregationFields, SecureUpdateFields
from aggregator.compute.privacy import published_state
from aggregator.jobs.secure_rounds import CULPRITS_STATE, SecureGroupRounds
from aggregator.storage.models import npz_bytes
from protocols.files import file_sha256, read_npz

from ops_fleet import SecureKeys

ROOT = Path(__file__).resolve().parents[1]
CAPABILITIES = ("order_free", "evaluate_at_round_close", "asynchronous", "secure_rounds", "split_validation")
# what the service must know of each kind (docs/architecture.md): one row per kind, in CAPABILITIES order
EXPECTED = {
    "fed3r":              (True, False, False, False, True),
    "fed3r-sync":         (False, False, False, True, True),
    "fedncm":             (True, False, False, False, True),
    "fedncm-sync":        (False, False, False, True, True),
    "fedavg":             (False, True, False, False, False),
    "fedavg-async":       (False, True, True, False, False),
    "fedavg-secure":      (False, True, False, True, False),
    "fedavg-tail":        (False, True, False, False, False),
    "fedavg-tail-secure": (False, True, False, True, False),
    "personalize":        (True, False, False, False, False),
    "pp":                 (False, True, False, False, False),
    "pp-secure":          (False, True, False, True, False),
    "scaffold":           (False, True, False, False, False),
    "scaffold-secure":    (False, True, False, True, False),
    "scaffold-tail":      (False, True, False, False, False),
    "fedgloss":           (False, True, False, False, False),
    "ditto":              (False, True, False, False, False),
    "ditto-secure":       (False, True, False, True, False),
    "ladd":               (False, True, False, False, False),
    "ladd-secure":        (False, True, False, True, False),
}
INTERFACES = {"secure_rounds": SecureGroupRounds, "split_validation": SplitValidation, "asynchronous": AsynchronousJob}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, dict]:
    """Config fields naming the files each family of kinds needs (all but the tail program)."""
    work = tmp_path_factory.mktemp("contract")
    keys = SecureKeys.create(work, ["dev00", "dev01", "dev02"]).job_fields(work)
    np.savez(work / "head.npz", weight=np.zeros((10, 1280), np.float32), bias=np.zeros(10, np.float32))
    arrays = {"head.w": np.ones((2, 3), np.float32), "enc.w": np.zeros(4, np.float32)}
    save_initial_model(work / "pretrained.npz", arrays, ["head.w"])
    ladd = {"model": {"num_classes": 4, "image_size": 32}, "clustering": "none",
            "initial_model_file": str(work / "pretrained.npz"), "initial_model_sha256": file_sha256(work / "pretrained.npz")}
    return {"keys": keys, "personalize": {"head_file": str(work / "head.npz")}, "ladd": ladd}


def config_for(kind: str, files: dict, request) -> dict:
    config = dict(files["keys"]) if kind.endswith(("-sync", "-secure")) else {}
    if kind.startswith(("fedavg-tail", "scaffold-tail")):
        manifest = request.getfixturevalue("tail_bundle")
        config.update(image_size=32, tail_stages=1, tail_program_file=str(manifest.parent / "tail_eval.pt2"))
    config.update(files.get(kind.removesuffix("-secure"), {}))
    return config


def capabilities(job: Job) -> tuple[bool, ...]:
    return tuple(getattr(job, name) for name in CAPABILITIES)


def test_every_kind_has_a_row_here():
    assert sorted(EXPECTED) == sorted(KINDS)


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_every_kind_builds_a_job_that_keeps_the_contract(kind, files, request):
    spec = KINDS[kind]
    assert issubclass(spec.job_cls, Job) and not inspect.isabstract(spec.job_cls)
    job = build_job(kind, config_for(kind, files, request))
    assert isinstance(job, Job) and type(job) is spec.job_cls
    assert capabilities(job) == EXPECTED[kind]
    assert all(type(value) is bool for value in capabilities(job))
    for flag, interface in INTERFACES.items():       # a capability with methods comes with its interface
        assert getattr(job, flag) == isinstance(job, interface), flag
    assert isinstance(job.kind, str) and job.round == 0 and job.contributed == {}
    # the config: a JobConfig, secure exactly when the job runs secure rounds, rebuilt from its JSON
    assert issubclass(spec.config_cls, JobConfig) and type(job.config) is spec.config_cls
    assert isinstance(job.config, SecureAggregationFields) == job.secure_rounds
    assert spec.config_cls(**job.config.to_dict()) == job.config


@pytest.mark.parametrize("kind", sorted(k for k, row in EXPECTED.items() if row[3] and "tail" not in k))
def test_a_secure_jobs_culprits_survive_a_restart_in_its_checkpoint(kind, files, request):
    """Members a round named (``note_culprits``) are left out of the job's later rounds: a job
    rebuilt from its config and the checkpoint written at the close of the round that named them
    (through the store's npz bytes, as ``aggregator/service/recovery.py`` restores it) leaves them
    out too; they never reach the job's published files; a checkpoint without them restores."""
    job = build_job(kind, config_for(kind, files, request))
    job.note_culprits(1, ["dev01", "dev02"])
    state = read_npz(npz_bytes(job.state_dict()))
    restarted = build_job(kind, config_for(kind, files, request))
    restarted.load_state_dict(state)
    assert restarted.culprits == {"dev01", "dev02"}
    assert not any("culprit" in name for name in published_state(state))
    del state[CULPRITS_STATE]              # a checkpoint written before culprits were kept
    older = build_job(kind, config_for(kind, files, request))
    older.load_state_dict(state)
    assert older.culprits == set()


def test_a_dp_fed3r_job_is_neither_order_free_nor_evaluated_per_contribution():
    job = build_job("fed3r", {"dp_noise_multiplier": 1.0, "feature_clip_norm": 1.0})
    assert (job.order_free, job.evaluate_at_round_close) == (False, True)


def test_a_kind_missing_a_method_cannot_be_built():
    class NoModel(Job):            # every abstract method but model_arrays
        contributions = 0
        next_participants = task_for = parse_result = apply = close_round = finished = evaluate = \
            state_dict = load_state_dict = bookkeeping = restore_bookkeeping = lambda *a: None

    with pytest.raises(TypeError, match="model_arrays"):
        NoModel()


# ----------------------------------------------------------------------------- configs
def redeclared_defaults(config_cls: type) -> list[str]:
    """``Class.field`` for every field a config class (or a base of it below JobConfig) declares
    again with the default its own bases already give it: a kind declares only what differs."""
    out = []
    for cls in config_cls.__mro__:
        if not (dataclasses.is_dataclass(cls) and issubclass(cls, JobConfig)) or cls is JobConfig:
            continue
        inherited = {}
        for base in reversed(cls.__mro__[1:]):      # as dataclasses collects them: the nearest base wins
            inherited.update(getattr(base, "__dataclass_fields__", {}))
        own = {f.name: f for f in dataclasses.fields(cls) if f.name in cls.__dict__.get("__annotations__", {})}
        for name, f in own.items():
            if name in inherited and _default(inherited[name]) == _default(f):
                out.append(f"{cls.__name__}.{name}")
    return sorted(set(out))


def _default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def test_every_config_declares_only_what_differs_from_its_bases():
    for spec in KINDS.values():
        assert redeclared_defaults(spec.config_cls) == [], spec.name


def test_the_redeclaration_check_fails_on_a_restated_default():
    @dataclasses.dataclass
    class Restating(KINDS["fedavg"].config_cls):
        job_id: str = "restating"               # differs: fine
        round_timeout_s: float = 120.0          # JobConfig's default again

    assert redeclared_defaults(Restating) == ["Restating.round_timeout_s"]


def hidden_overrides(config_cls: type) -> list[str]:
    """``Class.field`` for every field whose default is not the one the nearest class declaring it
    in the MRO gives: a field group listed before a kind's config hides that config's defaults."""
    out = []
    for f in dataclasses.fields(config_cls):
        declaring = next(c for c in config_cls.__mro__ if f.name in c.__dict__.get("__annotations__", {}))
        if _default(declaring.__dataclass_fields__[f.name]) != _default(f):
            out.append(f"{config_cls.__name__}.{f.name}")
    return out


def test_every_config_has_the_defaults_its_classes_declare():
    for spec in KINDS.values():
        assert hidden_overrides(spec.config_cls) == [], spec.name


def test_the_default_check_fails_when_a_field_group_hides_a_kinds_defaults():
    @dataclasses.dataclass
    class Hiding(SecureUpdateFields, KINDS["ladd"].config_cls):     # the group first: LADD's job_id, κ hidden
        pass

    assert hidden_overrides(Hiding) == ["Hiding.job_id", "Hiding.clients_per_round"]


# ----------------------------------------------------------------------------- no probing
PROBES = {"getattr", "hasattr"}
JOB_NAME = re.compile(r"(^|[^\w])(\w*_)?job\b")        # job, a.job, fresh_job, job.config, ...
INTERFACE_NAMES = {"Job", "SplitValidation", "AsynchronousJob", "SecureGroupRounds"}
JOB_PACKAGES = ("jobs", "service")      # where jobs are made and driven: any getattr/hasattr there probes one


def job_probes(root: Path) -> list[str]:
    """``path:line`` of every probe of a job under ``root`` (an ``aggregator/`` tree): getattr or
    hasattr anywhere in jobs/ and service/, or elsewhere on something named like a job; isinstance
    against a job interface anywhere."""
    out = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root)
        in_job_package = where.parts[0] in JOB_PACKAGES
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args):
                continue
            name = node.func.id
            if name in PROBES and (in_job_package or JOB_NAME.search(ast.unparse(node.args[0]))):
                out.append(f"{root.name}/{where}:{node.lineno} {name}")
            elif name == "isinstance" and len(node.args) == 2 and \
                    {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} & INTERFACE_NAMES:
                out.append(f"{root.name}/{where}:{node.lineno} isinstance")
    return out


def test_nothing_in_the_aggregator_probes_a_job():
    assert job_probes(ROOT / "aggregator") == []


def test_the_probe_check_fails_on_deliberately_wrong_code(tmp_path):
    root = tmp_path / "aggregator"
    for package in ("service", "storage"):
        (root / package).mkdir(parents=True)
    (root / "service" / "runner.py").write_text(
        "def f(a):\n    return getattr(a.job, 'order_free', False)\n\n"
        "def g(self):\n    return isinstance(self.active.job, SecureGroupRounds)\n\n"
        "def h(thing):\n    return hasattr(thing, 'check_payload')\n")
    (root / "cli.py").write_text("def f(job):\n    return getattr(job.config, 'bundle_sha256', '')\n")
    (root / "storage" / "fine.py").write_text("def f(self):\n    return getattr(self._local, 'conn', None)\n")
    assert job_probes(root) == ["aggregator/cli.py:2 getattr", "aggregator/service/runner.py:2 getattr",
                                "aggregator/service/runner.py:5 isinstance", "aggregator/service/runner.py:8 hasattr"]
