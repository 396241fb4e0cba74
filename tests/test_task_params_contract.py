"""Task parameters are a declared contract (protocols/payloads/task_kinds.py), checked three ways.

* No device module reads a raw params dict: every handler parses its kind's declared type
  (an AST scan of edge_client/tasks and edge_client/runtime, and a line scan of the Java device
  outside its typed params classes, each shown to fail on the idioms it replaced).
* Each kind's type round-trips (to_params -> JSON -> from_params is the identity) and refuses
  every field of a wrong JSON type, a missing required field, a version the device does not speak
  and each kind's out-of-range values, with ValueError.
* What the aggregator's jobs send parses as the type the table names for the job's wire kind
  (the job kind <-> wire kind declaration of aggregator/jobs/registry.py), and a device declines
  a task whose params its type refuses, through the agent's task entry point.
* The JSON Schema and docs/protocol.md's tables are the ones rendered from the types, and the
  golden params vectors (protocols/golden/task_params/) are read the same, and refused for the
  same fields, by the Python types and the Java device's typed classes.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

from protocols.payloads.fed3r import Fed3RStatsParams, RandomFeaturesSpec
from protocols.payloads.fedavg import HeadTrainingParams, LocalRuleRecipe, LocalTraining, TailTrainingParams
from protocols.payloads.ditto import DittoParams
from protocols.payloads.fedgloss import AdmmRecipe, FedGlossParams
from protocols.payloads.ladd import LaddTrainParams, SelfTrainingRecipe, StyleParams, layout_digest
from protocols.payloads.partial import PartialParams
from protocols.payloads.personalize import PersonalizeParams
from protocols.payloads.scaffold import ScaffoldParams, ScaffoldTailParams
from protocols.payloads.secagg import ClusterSlotLayout
from protocols.payloads.secure_tasks import (SecureDittoParams, SecureFed3RParams, SecureFedAvgParams,
                                             SecureLaddParams, SecurePartialParams, SecureScaffoldParams,
                                             SecureTailParams)
from protocols.payloads.stateful import StateBinding
from protocols.payloads.task_kinds import TASK_PARAMS
from protocols.payloads.task_params import VERSION_KEY, DpRound, ModelSpec

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("edge_client/tasks", "edge_client/runtime")


# ----------------------------------------------------------------------------- no raw reads
def _is_params(node: ast.AST) -> bool:
    """``params`` or ``<anything>.params``: the names a task's raw params dict goes by."""
    return (isinstance(node, ast.Name) and node.id == "params") or \
        (isinstance(node, ast.Attribute) and node.attr == "params")


def raw_params_reads(source: str) -> list[int]:
    """Lines reading a raw params dict: params[...], params.get/pop/setdefault/items/keys/values(...),
    ``... in params``, dict(params, ...) and {**params}."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and _is_params(node.value):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_params(node.func.value) \
                and node.func.attr in ("get", "pop", "setdefault", "items", "keys", "values"):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" \
                and node.args and _is_params(node.args[0]):
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any(_is_params(c) for c in node.comparators):
            lines.append(node.lineno)
        elif isinstance(node, ast.Dict) and any(k is None and _is_params(v) for k, v in zip(node.keys, node.values)):
            lines.append(node.lineno)
    return sorted(lines)


def test_no_device_task_or_runtime_module_reads_a_raw_params_dict():
    offenders = {str(path.relative_to(ROOT)): raw_params_reads(path.read_text())
                 for folder in SCANNED for path in sorted((ROOT / folder).glob("*.py"))}
    assert {p: lines for p, lines in offenders.items() if lines} == {}


def test_the_raw_read_scan_catches_the_idioms_it_replaced():
    replaced = ("num_classes = int(params['num_classes'])\n"
                "dense = params.get('format', 'sparse') == 'dense'\n"
                "if 'model_version' in params:\n    pass\n"
                "stats = self.stats(dict(params, format='dense'))\n"
                "merged = {**params, 'epochs': 1}\n"
                "x = act.params['b']\n"
                "ok = task.training.lr\n")
    assert raw_params_reads(replaced) == [1, 2, 3, 5, 6, 7]


# the Java device: only its typed params classes (and the parts they compose) read a raw params map
JAVA_DEVICE = ROOT / "clients" / "java" / "src"
JAVA_PARAMS_PARTS = ("LocalTraining.java", "ModelSpec.java", "DpRound.java", "SecureUpdateRound.java",
                     "SyncBlockScales.java")
JAVA_RAW_READ = re.compile(r"\bparams\s*\.\s*(get|getOrDefault|containsKey|keySet|entrySet|values|put|remove)\s*\("
                           r"|\b(Task)?Params\s*\.\s*(integer|number|string|present|bool|choice|require)\s*\(")


def java_raw_params_reads(source: str) -> list[int]:
    """Lines reading a raw params map: params.get/getOrDefault/containsKey(...) (also of
    ``task.params``) or the field readers of Params/TaskParams."""
    return [i for i, line in enumerate(source.splitlines(), 1) if JAVA_RAW_READ.search(line)]


def test_no_java_device_class_but_the_typed_params_reads_a_raw_params_map():
    offenders = {str(path.relative_to(ROOT)): java_raw_params_reads(path.read_text())
                 for path in sorted(JAVA_DEVICE.rglob("*.java"))
                 if not path.name.endswith("Params.java") and path.name not in JAVA_PARAMS_PARTS}
    assert {p: lines for p, lines in offenders.items() if lines} == {}
    assert all((JAVA_DEVICE / "org" / "fedfleet" / "device" / name).exists() for name in JAVA_PARAMS_PARTS)


def test_the_java_raw_read_scan_catches_the_idioms_it_replaced():
    replaced = ('Object group = w.task.params.get("group");\n'
                'long maxSamples = Params.integer(params, "max_samples", 1, Long.MAX_VALUE);\n'
                'if (params.containsKey("dp")) return noise.add(v, params.get("dp"), v.length - 1);\n'
                'Object order = params.getOrDefault("vector_order", new ArrayList<Object>(HEAD_ORDER));\n'
                'double stddev = Params.number(p, "stddev", Double.NaN, false);\n'
                'SecureFedAvgParams task = SecureFedAvgParams.fromParams(params);\n'
                'extractor.checkModel(task.model);\n')
    assert java_raw_params_reads(replaced) == [1, 2, 3, 4, 5]


# ----------------------------------------------------------------------------- examples per kind
SHA = "ab" * 32
MODEL = ModelSpec(10, "mobilenet_v2", 64, SHA, "")
TRAINING = LocalTraining(2, 16, 0.05, 1e-4, 0.1, 7, LocalRuleRecipe("asam", 0.5, 0.2, 0.01))
STATE = StateBinding("0123abcd" * 2, 3, 5, 3600.0)
DP = DpRound(0.25, 20, 2, clip_norm=1.5)
LAYOUT = (("enc.w", (4,)), ("head.w", (2, 3)))
SLOTS = ClusterSlotLayout([("enc.w", (4,))], [("head.w", (2, 3))], (True, False))
LADD = LaddTrainParams({"num_classes": 4, "image_size": 32}, 1, LAYOUT, layout_digest(list(LAYOUT)), ("head.w",),
                       teacher="tensor", kd_sha256=SHA, recipe=SelfTrainingRecipe(epochs=2, kd_lambda=0.0))
SECURE = dict(group="g1", max_samples=100, max_abs_param=50.0)

EXAMPLES = {
    "fed3r.stats": Fed3RStatsParams(MODEL, True, RandomFeaturesSpec(64, 2.0, 3), "sparse", "float32", True,
                                    feature_clip_norm=1.0, max_samples=20, cap_samples=True, from_sample=4),
    "fedavg.head": HeadTrainingParams(MODEL, 1280, TRAINING, model_version=2),
    "fedavg.tail": TailTrainingParams(MODEL, 1280, TRAINING, tail_stages=2, train="tail+head"),
    "oll.personalize": PersonalizeParams(MODEL, 1280, "global", 3, 32, (1e-4, 1e-3), 4, 1e-5, 0.1, 2, 0,
                                         personal_job="pp-1", fp_part="phi"),
    "ladd.style": StyleParams(3, 64),
    "ladd.train": LADD,
    "pp.head": PartialParams(MODEL, 1280, TRAINING, job_id="pp-1", state=STATE, algorithm="fedsim",
                             personal_epochs=0),
    "scaffold.head": ScaffoldParams(MODEL, 1280, TRAINING, job_id="sc-1", state=STATE),
    "scaffold.tail": ScaffoldTailParams(MODEL, 1280, TRAINING, tail_stages=2, train="tail+head", job_id="sct-1",
                                        state=STATE),
    "fedgloss.head": FedGlossParams(MODEL, 1280, TRAINING, job_id="fg-1", state=STATE, admm=AdmmRecipe(2.0)),
    "ditto.head": DittoParams(MODEL, 1280, TRAINING, job_id="dt-1", state=STATE, ditto_lambda=0.5, personal_epochs=2,
                              personal_lr=0.05),
    "fed3r.secure": SecureFed3RParams(MODEL, format="dense", max_samples=100, feature_clip_norm=1.0, group="g0",
                                      dp=DpRound(0.5, 16, 3)),
    "fedavg.secure": SecureFedAvgParams(MODEL, 1280, TRAINING, update_clip_norm=2.0, **SECURE),
    "fedavg.tail.secure": SecureTailParams(MODEL, 1280, TRAINING, tail_stages=1, vector_order=("tail.x",), dp=DP,
                                           **SECURE),
    "pp.head.secure": SecurePartialParams(MODEL, 1280, TRAINING, job_id="pp-2", state=STATE, vector_order=("weight",),
                                          **SECURE),
    "scaffold.head.secure": SecureScaffoldParams(MODEL, 1280, TRAINING, job_id="sc-2", state=STATE, control_clip_norm=3.0,
                                                 update_clip_norm=1.5, **SECURE),
    "ditto.head.secure": SecureDittoParams(MODEL, 1280, TRAINING, job_id="dt-2", state=STATE, ditto_lambda=0.5,
                                           personal_epochs=2, personal_lr=0.05, dp=DP, **SECURE),
    "ladd.train.secure": SecureLaddParams.extending(LADD, group=SLOTS.group_id(), slots=SLOTS.to_json(),
                                                    max_samples=10, max_abs_param=100.0, dp=DP),
}
# per kind, values of the right JSON type that its type must still refuse
OUT_OF_RANGE = {
    "fed3r.stats": {"format": "csv", "dtype": "float16", "num_classes": 0, "random_features": {"dim": 0, "sigma": 1.0,
                    "seed": 0}, "feature_clip_norm": -1.0, "max_samples": 0, "from_sample": -1, "weights_sha256": "x"},
    "fedavg.head": {"lr": 0.0, "epochs": 0, "batch_size": -1, "temperature": float("inf"), "local_rule": "adam",
                    "feature_dim": 0, "model_version": -1, "image_size": 0},
    "fedavg.tail": {"train": "head", "tail_stages": 0},
    "oll.personalize": {"fallback": "drop", "fp_epochs": -1, "fp_lrs": [0.0], "fp_folds": 1, "tail_stages": -1,
                        "fp_part": "tail"},
    "ladd.style": {"b": 9, "image_size": 8},
    "ladd.train": {"layout_sha256": "0" * 64, "teacher": "both", "trainable": [], "cluster": -1, "momentum": 1.0},
    "pp.head": {"algorithm": "ditto", "personal_epochs": -1, "job_id": "",
                "state": {"run": "XYZ", "round": 1}},
    "scaffold.head": {"state": {"run": "0123abcd", "round": 1, "extra": 1}},
    "scaffold.tail": {"train": "head", "tail_stages": 0, "job_id": ""},
    "fedgloss.head": {"admm_beta": 0.0},
    "ditto.head": {"ditto_lambda": 0.0, "personal_epochs": 0, "personal_lr": -0.1},
    "fed3r.secure": {"group": "", "dp": {"stddev": -1.0, "scale_bits": 2, "threshold": 2}},
    "fedavg.secure": {"max_samples": 0, "max_abs_param": 0.0, "vector_order": ["weight", "weight"],
                      "update_clip_norm": -1.0},
    "fedavg.tail.secure": {"dp": {"stddev": 1.0, "scale_bits": 2, "threshold": 2}},    # no clip_norm
    "pp.head.secure": {"vector_order": []},
    "scaffold.head.secure": {"control_clip_norm": 0.0, "update_clip_norm": -1.0},
    "ditto.head.secure": {"ditto_lambda": 0.0, "vector_order": []},
    "ladd.train.secure": {"group": "g1", "slots": {"global": [], "slot": [], "enabled": []}},
}


def test_every_task_kind_has_an_example_here():
    assert sorted(EXAMPLES) == sorted(TASK_PARAMS) == sorted(OUT_OF_RANGE)
    assert all(type(EXAMPLES[kind]) is TASK_PARAMS[kind] and TASK_PARAMS[kind].KIND == kind for kind in TASK_PARAMS)


@pytest.mark.parametrize("kind", sorted(TASK_PARAMS))
def test_params_round_trip_through_json(kind):
    example = EXAMPLES[kind]
    wire = json.loads(json.dumps(example.to_params()))
    assert wire[VERSION_KEY] == 1
    parsed = TASK_PARAMS[kind].from_params(wire)
    assert parsed == example and parsed.to_params() == wire
    wire.pop(VERSION_KEY)                 # params without a version: version 1 (older aggregators)
    assert TASK_PARAMS[kind].from_params(wire) == example
    assert TASK_PARAMS[kind].from_params({**wire, "a_field_from_the_future": 1}) == example   # ignored


def _wrong_type(value):
    return 5 if isinstance(value, str) else [] if isinstance(value, dict) else "x"


@pytest.mark.parametrize("kind", sorted(TASK_PARAMS))
def test_each_field_of_a_wrong_type_or_out_of_range_is_refused(kind):
    cls, wire = TASK_PARAMS[kind], EXAMPLES[kind].to_params()
    bad = {key: _wrong_type(value) for key, value in wire.items()}
    bad.update(OUT_OF_RANGE[kind])
    assert set(OUT_OF_RANGE[kind]) <= set(wire) | {"admm_beta"}, "an out-of-range example names no field"
    accepted = [key for key, value in bad.items() if not _refused(cls, {**wire, key: value})]
    assert accepted == []
    with pytest.raises(ValueError, match="version"):
        cls.from_params({**wire, VERSION_KEY: 2})
    with pytest.raises(ValueError):
        cls.from_params([wire])


@pytest.mark.parametrize("kind", sorted(TASK_PARAMS))
def test_each_required_field_missing_is_refused(kind):
    cls, wire = TASK_PARAMS[kind], EXAMPLES[kind].to_params()
    probe = {k: v for k, v in wire.items() if k != VERSION_KEY}
    required = [k for k in probe if _refused_without(cls, probe, k)]
    # what a kind cannot run without: the model (classification kinds), the state (stateful), the round's fields
    expected = {"num_classes", "backbone", "image_size"} if "num_classes" in probe else set()
    assert expected <= set(required)
    if kind.endswith(".secure") or kind == "fed3r.secure":
        assert {"group", "max_samples"} <= set(required)
    if "state" in probe:
        assert {"state", "job_id"} <= set(required)
    if kind == "fedgloss.head":
        assert "admm_beta" in required       # a device never guesses the server's β
    if kind.startswith("fedavg.tail") or kind == "scaffold.tail":
        assert {"tail_stages", "train"} <= set(required)      # nor FT(φ) from FT(M)


def _refused_without(cls, wire: dict, key: str) -> bool:
    return _refused(cls, {k: v for k, v in wire.items() if k != key})


def _refused(cls, wire: dict) -> bool:
    try:
        cls.from_params(wire)
    except ValueError:
        return True
    return False


def test_a_secure_type_is_its_plain_type_plus_the_rounds_fields():
    pairs = {"fedavg.secure": "fedavg.head", "fedavg.tail.secure": "fedavg.tail", "pp.head.secure": "pp.head",
             "scaffold.head.secure": "scaffold.head", "ditto.head.secure": "ditto.head",
             "ladd.train.secure": "ladd.train", "fed3r.secure": "fed3r.stats"}
    for secure, plain in pairs.items():
        assert issubclass(TASK_PARAMS[secure], TASK_PARAMS[plain])
        # the plain handler reads a secure task's params as its own kind's
        plain_view = TASK_PARAMS[plain].from_params(EXAMPLES[secure].to_params())
        assert all(getattr(plain_view, f.name) == getattr(EXAMPLES[secure], f.name)
                   for f in dataclasses.fields(plain_view))


# ----------------------------------------------------------------------------- jobs and devices
def test_every_job_kind_names_wire_kinds_with_a_declared_type():
    from aggregator.jobs.registry import KINDS, job_kinds_sending

    assert all(set(spec.task_kinds) <= set(TASK_PARAMS) for spec in KINDS.values())
    assert all(job_kinds_sending(kind) for kind in TASK_PARAMS), "a task kind no job sends"


def test_a_job_sends_params_its_wire_kind_declares(tmp_path):
    """A plain and a secure job of the FedAvg family and a Fed3R job: the params they send are the
    declared type's wire form, byte for byte."""
    from aggregator.jobs.registry import KINDS, build_job
    from ops_fleet import SecureKeys

    devices = ["dev00", "dev01", "dev02"]
    keys = SecureKeys.create(tmp_path, devices).job_fields(tmp_path)
    configs = {"fed3r": {"feature_clip_norm": 1.0}, "fedavg": {"prox_mu": 0.1},
               "fedavg-secure": {"max_samples": 100, **keys}, "fed3r-sync": {"max_samples": 100, **keys},
               "scaffold": {}, "fedgloss": {}, "pp": {}, "pp-secure": {"max_samples": 100, **keys}}
    for name, config in configs.items():
        job = build_job(name, {"clients_per_round": 3, **config})
        assert job.next_participants(set(devices)), name
        params, _ = job.task_for(devices[0])
        assert job.kind in KINDS[name].task_kinds, name
        parsed = TASK_PARAMS[job.kind].from_params(params)
        assert parsed.to_params() == params, name


class _NoFeatures:
    feature_dim = 4

    def extract(self, images):
        raise AssertionError("a declined task must not reach the extractor")


def test_a_device_declines_a_task_whose_params_its_type_refuses():
    """Over the agent's task entry point: the decline goes out with the type's reason; the agent
    runs on (it handles the next, well-formed task)."""
    from edge_client.agent import TaskDeclined
    from edge_client.tasks.head_training import HeadTrainingTask

    handler = HeadTrainingTask(np.zeros((3, 8, 8, 3), np.uint8), np.array([0, 1, 1]),
                               lambda *a, **k: _NoFeatures())
    params = EXAMPLES["fedavg.head"].to_params()
    for bad, reason in (({"lr": -1.0}, "lr"), ({"num_classes": "ten"}, "num_classes"),
                        ({VERSION_KEY: 9}, "version"), ({"local_rule": "adam"}, "local_rule")):
        with pytest.raises(TaskDeclined, match=f"bad fedavg.head params: .*{reason}"):
            handler({**params, **bad}, {})
    declines = _agent_declines(handler, [{**params, "batch_size": 0}, {**params, VERSION_KEY: "2"}])
    assert len(declines) == 2 and "batch_size" in declines[0] and "version" in declines[1]


def _agent_declines(handler, tasks: list[dict]) -> list[str]:
    """Each task's params through the agent's entry point for an arriving message (no broker: a
    link that records what the agent publishes); the decline reasons it sent."""
    from edge_client.agent import DeviceAgent
    from protocols import messages as M
    from protocols.envelope import decode, encode
    from protocols.mqtt_link import BrokerConfig

    sent: list[str] = []

    class RecordingLink:
        def __init__(self, **kwargs):
            pass

        def publish_envelope(self, topic, env, **kwargs):
            if env.type == M.DECLINE:
                sent.append(env.body["reason"])
            return 0

    agent = DeviceAgent("dev0", BrokerConfig(), {"fedavg.head": handler}, link_factory=RecordingLink)
    for round_, params in enumerate(tasks, 1):
        task = M.task_message("aggregator", "job-1", round_, "fedavg.head", params, deadline=4e9)
        agent._handle(("inbox", encode(decode(encode(task)))))      # what the agent's loop serves
    return sent


# ----------------------------------------------------------------------------- rendered docs and schema
def test_the_checked_in_schemas_are_the_rendered_ones():
    from protocols.task_params_schema import SCHEMA_DIR, render_schema

    assert sorted(p.name for p in SCHEMA_DIR.glob("*.schema.json")) == sorted(f"{k}.schema.json" for k in TASK_PARAMS)
    stale = [kind for kind in TASK_PARAMS if (SCHEMA_DIR / f"{kind}.schema.json").read_text() != render_schema(kind)]
    assert stale == [], "stale: run `python -m protocols.task_params_schema`"


def test_docs_show_the_params_tables_rendered_from_the_types():
    import re

    from protocols.task_params_schema import render_tables

    text = (ROOT / "docs" / "protocol.md").read_text()
    block = re.search(r"<!-- BEGIN task params tables \(generated\) -->\n(.*?)\n<!-- END task params tables -->",
                      text, re.S)
    assert block is not None, "docs/protocol.md lost its generated task params tables"
    assert block.group(1) == render_tables(), "stale: paste `python -m protocols.task_params_schema` into docs/protocol.md"


@pytest.mark.parametrize("kind", sorted(TASK_PARAMS))
def test_each_schema_accepts_the_example_and_says_what_the_type_requires(kind):
    """The schema (checked with jsonschema, an independent validator) accepts what the type sends
    and refuses params missing a key the type requires."""
    import jsonschema
    from protocols.task_params_schema import kind_schema

    schema, wire = kind_schema(kind), EXAMPLES[kind].to_params()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid(wire)
    missing = [key for key in TASK_PARAMS[kind].required_keys()
               if validator.is_valid({k: v for k, v in wire.items() if k != key})]
    assert missing == [], "the schema does not require what the type requires"
    wrong = [key for key, value in wire.items()       # a wrong JSON type: the schema refuses what the type refuses
             if key != VERSION_KEY and not isinstance(value, dict) and validator.is_valid({**wire, key: _wrong_type(value)})]
    assert wrong == []


# ----------------------------------------------------------------------------- golden vectors: Python and Java
GOLDEN_KINDS = ("fed3r.stats", "fedavg.head", "oll.personalize",      # the kinds the Java device serves
                "fed3r.secure", "fedavg.secure", "scaffold.head", "ditto.head", "pp.head",
                "fedavg.tail", "scaffold.tail", "fedgloss.head", "ladd.style", "ladd.train",  # and those it only reads
                "fedavg.tail.secure", "pp.head.secure", "ladd.train.secure",
                "scaffold.head.secure", "ditto.head.secure")


def test_every_task_kind_has_golden_params():
    assert sorted(GOLDEN_KINDS) == sorted(TASK_PARAMS)


def test_the_checked_in_golden_params_are_the_rendered_ones_and_python_reads_them():
    from protocols.task_params_golden import CASES, GOLDEN_DIR, render

    assert sorted(CASES) == sorted(GOLDEN_KINDS)
    for kind in GOLDEN_KINDS:
        text = (GOLDEN_DIR / f"{kind}.json").read_text()
        assert text == render(kind), "stale: run `python -m protocols.task_params_golden`"
        golden = json.loads(text)
        for case in golden["valid"]:
            assert TASK_PARAMS[kind].from_params(case["params"]).to_params() == case["canonical"]
        for case in golden["invalid"]:
            with pytest.raises(ValueError, match=case["field"]):
                TASK_PARAMS[kind].from_params(case["params"])


def test_the_java_device_reads_and_refuses_the_golden_params_as_python_does():
    """The Java device's typed params classes against the same vectors: each valid case read to the
    same canonical params (every default the same), each invalid one declined naming its field."""
    import subprocess

    import java_build
    from protocols.task_params_golden import GOLDEN_DIR

    if java_build.missing():
        pytest.skip(java_build.missing())
    paths = [GOLDEN_DIR / f"{kind}.json" for kind in GOLDEN_KINDS]
    proc = subprocess.run(java_build.java_command("-cp", java_build.built(), "ParamsRunner", *map(str, paths)),
                          capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    blocks = proc.stdout.split("KIND ")[1:]
    assert [block.split("\n", 1)[0] for block in blocks] == list(GOLDEN_KINDS)
    for kind, path, block in zip(GOLDEN_KINDS, paths, blocks):
        golden = json.loads(path.read_text())
        lines = block.splitlines()[1:]
        valid = [json.loads(line.split(" ", 2)[2]) for line in lines if line.startswith("VALID ")]
        assert valid == [case["canonical"] for case in golden["valid"]], kind
        outcomes = [line.split(" ", 2)[2] for line in lines if line.startswith("INVALID ")]
        assert len(outcomes) == len(golden["invalid"])
        for case, outcome in zip(golden["invalid"], outcomes):
            assert outcome.startswith("DECLINED ") and case["field"] in outcome, (kind, case, outcome)
