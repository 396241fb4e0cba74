"""Job config limits are declared at the fields: one limit per name across every config class, a
bad value refused with one error naming the field (``validate_config`` and the admin API), the
OpenAPI schema's bounds equal to the declarations, and the CLI's choices read from them."""

import dataclasses

import pytest
from starlette.testclient import TestClient

from aggregator.api.app import create_app
from aggregator.jobs.config_limits import (LIMIT, Fields, Items, OneOf, Pattern, Range, field_limit, limited,
                                           validate_config)
from aggregator.jobs.fedavg_tail import TailFedAvgConfig
from aggregator.jobs.registry import KINDS, validate_job_config
from aggregator.jobs.robustness_fields import FedAvgRobustnessFields
from aggregator.storage.store import Store

from test_admin_api import AUTH, TOKEN
from test_job_registry import minimal_config


def declarations(classes) -> dict[str, dict]:
    """name -> {limit: [classes that declare the name with it]}, over the classes and their bases:
    only declarations a class makes itself (its own annotations) with a limit in their metadata."""
    found: dict[str, dict] = {}
    for cls in {klass for c in classes for klass in c.__mro__ if dataclasses.is_dataclass(klass)}:
        for name in vars(cls).get("__annotations__", {}):
            metadata = vars(cls)["__dataclass_fields__"][name].metadata
            if LIMIT in metadata:
                found.setdefault(name, {}).setdefault(repr(metadata[LIMIT]), []).append(cls.__qualname__)
    return found


def conflicts(classes) -> dict[str, dict]:
    return {name: limits for name, limits in declarations(classes).items() if len(limits) > 1}


def test_a_field_name_has_one_limit_in_every_config_class():
    configs = [kind.config_cls for kind in KINDS.values()]
    assert len(declarations(configs)) > 100
    assert conflicts(configs) == {}


def test_the_consistency_check_finds_two_limits_for_one_name():
    @dataclasses.dataclass
    class A:
        batch_size: int = limited(8, Range(1, 100))

    @dataclasses.dataclass
    class B:
        batch_size: int = limited(8, Range(1, 1000))

    @dataclasses.dataclass
    class C(A):
        batch_size: int = 16              # a new default keeps A's limit: not a second declaration

    assert conflicts([A, C]) == {}
    assert set(conflicts([A, B, C])) == {"batch_size"}
    assert field_limit(C, "batch_size") == Range(1, 100)


def test_a_changed_default_keeps_the_declared_limit():
    declared = FedAvgRobustnessFields.__dataclass_fields__["norm_bound_multiplier"].metadata[LIMIT]
    assert TailFedAvgConfig.__dataclass_fields__["norm_bound_multiplier"].default == 3.0
    assert field_limit(TailFedAvgConfig, "norm_bound_multiplier") == declared
    with pytest.raises(ValueError, match="norm_bound_multiplier"):
        validate_config("fedavg-tail", TailFedAvgConfig, {"norm_bound_multiplier": declared.hi * 2})


BAD_VALUES = [("fedavg", "server_optimizer", "adamw"), ("fedavg", "aggregator", "mode"), ("fed3r", "lam", -1.0),
              ("fed3r", "stats_dtype", "float16"), ("fed3r-sync", "graph", "star"), ("personalize", "fp_lrs", []),
              ("personalize", "fallback", "oll"), ("fedavg-tail", "train", "head"), ("ladd", "model", {"num_classes": 4}),
              ("ladd", "cluster_scope", "bn"), ("pp", "pp_algorithm", "fedavg"), ("scaffold", "total_devices", -1),
              ("fedavg-secure", "ring_bits", 48)]


@pytest.mark.parametrize("kind, name, value", BAD_VALUES)
def test_a_bad_value_is_refused_with_one_error_naming_the_field(kind, name, value):
    config = {**minimal_config(kind), name: value}
    with pytest.raises(ValueError, match=f"'{name}'") as refused:
        validate_job_config(kind, config)
    assert str(refused.value).count("config field") == 1


# Whole-number fields a config built in Python checks itself (no JSON type check ran): the least value
# each takes, spelt here apart from the code (aggregator/jobs/config_limits.check_whole_number).
WHOLE_NUMBERS = [("scaffold", "total_devices", 0), ("fedgloss", "total_devices", 0), ("pp", "personal_epochs", 0),
                 ("ditto", "state_max_staleness", 0), ("personalize", "tail_stages", 0),
                 ("fedavg-tail", "tail_stages", 1)]


@pytest.mark.parametrize("kind, name, least", WHOLE_NUMBERS)
def test_a_config_built_in_python_refuses_a_count_that_is_no_whole_number(kind, name, least):
    config_cls = KINDS[kind].config_cls
    base = {**minimal_config(kind), "num_classes": 2, "feature_dim": 4, "clients_per_round": 3}
    assert getattr(config_cls(**base, **{name: least}), name) == least
    for bad in (True, least + 0.5, least - 1):
        with pytest.raises(ValueError) as refused:
            config_cls(**base, **{name: bad})
        assert str(refused.value) == f"{name} must be an integer >= {least}, got {bad!r}"



@pytest.mark.parametrize("kind, extra, reason", [
    ("fed3r-sync", {}, "fed3r-sync sums in the 64-bit ring"),
    ("fedncm-sync", {}, "fed3r-sync sums in the 64-bit ring"),
    ("fedavg-secure", {"dp_noise_multiplier": 1.0, "dp_clip_norm": 1.0}, "distributed DP needs the 64-bit ring")])
def test_a_32_bit_ring_is_refused_where_the_job_needs_64_bits(kind, extra, reason):
    """ring_bits = 32 is a field every secure job has; the jobs whose sums need the 64-bit ring's
    precision (Fed3R's statistics, distributed DP's noise) refuse it when built, with the reason."""
    config, config_cls = {**minimal_config(kind), **extra}, KINDS[kind].config_cls
    for ring_bits in (64, 32):
        validate_job_config(kind, {**config, "ring_bits": ring_bits})      # the field's own limit allows both
    assert config_cls(**config, ring_bits=64).ring_bits == 64
    with pytest.raises(ValueError, match=reason):
        config_cls(**config, ring_bits=32)
    assert KINDS["fedavg-secure"].config_cls(**minimal_config("fedavg-secure"), ring_bits=32).ring_bits == 32


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    return TestClient(create_app(Store(tmp_path_factory.mktemp("limits") / "state.db"), TOKEN))


def test_the_admin_api_refuses_a_bad_value_naming_the_field(api):
    for kind, name, value in BAD_VALUES:
        resp = api.post("/api/jobs", headers=AUTH,
                        json={"job_id": "bad", "kind": kind, "config": {**minimal_config(kind), name: value}})
        assert resp.status_code == 422, (kind, name, resp.text)
        # the discriminated union reports the kind's model only: every error is about this field
        locations = [err["loc"] for err in resp.json()["detail"]]
        assert locations and all(loc[:4] == ["body", kind, "config", name] for loc in locations), (kind, locations)


# JSON a client may send where a field declares another type: pydantic's lax mode stored each
# converted (true as 1, "5" as 5, 7.0 as 7), while validate_config, ``aggregator serve --config``'s
# check, refuses every one. (kind, config, where the error is, below the config)
MISTYPED = [("fed3r", {"clients_per_round": True}, ("clients_per_round",)),
            ("fed3r", {"expected_devices": "5"}, ("expected_devices",)),
            ("fed3r", {"seed": 7.0}, ("seed",)),
            ("fed3r", {"lam": True}, ("lam",)),
            ("fed3r", {"round_timeout_s": "1e1"}, ("round_timeout_s",)),
            ("fed3r", {"random_features": {"seed": 1, "dim": True, "sigma": 2.0}}, ("random_features", "dim")),
            ("fed3r", {"random_features": {"seed": 1, "dim": 4, "sigma": "2"}}, ("random_features", "sigma")),
            ("personalize", {"fp_lrs": [0.5, True]}, ("fp_lrs", 1)),
            ("personalize", {"fp_lrs": ["0.5"]}, ("fp_lrs", 0)),
            ("ladd", {"model": {"num_classes": 2, "image_size": 16, "aspp_rates": [6, True]}}, ("model", "aspp_rates", 1)),
            ("fed3r", {"streaming": 1}, ("streaming",)),                       # a choice: pydantic's Literal has no strict mode
            ("fedavg-secure", {"ring_bits": 64.0}, ("ring_bits",))]


@pytest.mark.parametrize("kind, config, where", MISTYPED, ids=[f"{c}" for _, c, _ in MISTYPED])
def test_the_admin_api_converts_no_json_type_that_validate_config_refuses(api, kind, config, where):
    config = {**minimal_config(kind), **config}
    with pytest.raises(ValueError):
        validate_job_config(kind, config)
    resp = api.post("/api/jobs", headers=AUTH, json={"job_id": "mistyped", "kind": kind, "config": config})
    assert resp.status_code == 422, resp.text
    assert ["body", kind, "config", *where] in [err["loc"] for err in resp.json()["detail"]], resp.text


def test_the_admin_api_takes_a_json_integer_where_a_float_is_declared(api):
    """JSON has one number type: 1 is a float's value for validate_config, and for the API too."""
    for kind, config in [("fed3r", {"lam": 1, "random_features": {"seed": 1, "dim": 4, "sigma": 2}}),
                         ("personalize", {"fp_lrs": [1, 0.5]})]:
        validate_job_config(kind, config)
        resp = api.post("/api/jobs", headers=AUTH, json={"job_id": "integral", "kind": kind, "config": config})
        assert resp.status_code == 503, resp.text          # past every check (this API has no service to create it)


def _resolve(schema: dict, components: dict) -> dict:
    """The property's own schema: through a $ref, and the non-null branch of an optional field."""
    if "anyOf" in schema:
        (schema,) = [s for s in schema["anyOf"] if s.get("type") != "null"]
    if "$ref" in schema:
        schema = components[schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _declared(cls: type, name: str):
    """The limit read straight from the dataclass: the first class along the MRO whose own field
    carries one (a subclass may redeclare a field with a new default only)."""
    for klass in cls.__mro__:
        field = vars(klass).get("__dataclass_fields__", {}).get(name)
        if field is not None and LIMIT in field.metadata:
            return field.metadata[LIMIT]
    raise AssertionError(f"{cls.__name__}.{name} has no limit")


def _assert_bounds(prop: dict, limit, components: dict, where: str) -> None:
    prop = _resolve(prop, components)
    if isinstance(limit, Range):
        assert (prop["minimum"], prop["maximum"]) == (limit.lo, limit.hi), where
    elif isinstance(limit, OneOf):
        assert sorted(map(repr, prop["enum"])) == sorted(map(repr, limit.values)), where
    elif isinstance(limit, Pattern):
        assert prop["pattern"] == limit.regex, where
    elif isinstance(limit, Items):
        assert (prop["minItems"], prop["maxItems"]) == (1, limit.max_items), where
        _assert_bounds(prop["items"], limit.item, components, where + "[]")
    else:
        assert isinstance(limit, Fields), where
        required = set(limit.spec if limit.required is None else limit.required)
        assert set(prop["properties"]) == set(limit.spec) and set(prop.get("required", ())) == required, where
        for key, (_, sub) in limit.spec.items():
            _assert_bounds(prop["properties"][key], sub, components, f"{where}.{key}")


def test_the_openapi_bounds_are_the_field_declarations(api):
    components = api.app.openapi()["components"]["schemas"]
    for name, kind in KINDS.items():
        model = components["".join(part.capitalize() for part in name.split("-")) + "Config"]
        fields = [f.name for f in dataclasses.fields(kind.config_cls) if f.name != "job_id"]
        assert sorted(model["properties"]) == sorted(fields), name
        for field in fields:
            _assert_bounds(model["properties"][field], _declared(kind.config_cls, field), components, f"{name}.{field}")


def test_the_cli_offers_the_declared_choices():
    from fedfleet.cli import build_parser

    simulate = build_parser()._subparsers._group_actions[0].choices["simulate"]
    options = {action.dest: action.choices for action in simulate._actions}
    expected = {"secure_graph": _declared(KINDS["fed3r-sync"].config_cls, "graph"),
                "fp_part": _declared(KINDS["personalize"].config_cls, "fp_part"),
                "server_optimizer": _declared(KINDS["fedavg"].config_cls, "server_optimizer"),
                "local_rule": _declared(KINDS["fedavg"].config_cls, "local_rule"),
                "served_model": _declared(KINDS["fedavg"].config_cls, "served_model"),
                "cluster_scope": _declared(KINDS["ladd"].config_cls, "cluster_scope")}
    for dest, limit in expected.items():
        assert tuple(options[dest]) == limit.values, dest


def test_a_field_without_a_limit_is_found_and_never_passed_unchecked():
    from aggregator.jobs.base import JobConfig
    from aggregator.jobs.config_limits import undeclared_fields

    @dataclasses.dataclass
    class Unlimited(JobConfig):
        new_field: int = 3

    assert undeclared_fields(Unlimited) == ["new_field"]
    with pytest.raises(TypeError, match="new_field"):
        validate_config("x", Unlimited, {"new_field": 4})
