"""A config the admin API accepts hands out tasks: every declared limit at its ends.

A review found configs accepted at create (201) and started, whose first task the wire's own
params type then refused (``client_lr`` 0 where a task's lr must be > 0; pp's ``batch_size`` up
to FedAvg's 10^6 where its recipe takes 10^4): the job stopped with "scheduling failed" and its
first round stayed open for ever. Here every kind that builds from its config alone is built at
each end of each numeric field's range and with each value of each choice, and asked for a task:
a config is refused at create, refused when the job is built (one error naming what is missing,
e.g. ``init`` 'fed3r' without its file), or it yields a task."""

from __future__ import annotations

import dataclasses

import pytest

from aggregator.jobs.config_limits import OneOf, Range, field_limit
from aggregator.jobs.registry import KINDS, build_job, full_config

NEEDS_FILES = ("tail", "ladd", "personalize", "secure", "sync")     # model files or SecAgg identities
BASE = {"num_classes": 2, "feature_dim": 4, "clients_per_round": 3}


def extremes(config_cls) -> list[tuple[str, object]]:
    out = []
    for f in dataclasses.fields(config_cls):
        limit = field_limit(config_cls, f.name)
        if isinstance(limit, Range):
            is_int = f.type in ("int", int)
            out += [(f.name, int(v) if is_int else v) for v in (limit.lo, limit.hi)]
        elif isinstance(limit, OneOf):
            out += [(f.name, v) for v in limit.values]
    return out


CASES = [(kind, name, value) for kind, spec in sorted(KINDS.items())
         if not any(part in kind for part in NEEDS_FILES)
         for name, value in extremes(spec.config_cls)
         if name not in ("num_classes", "feature_dim", "clients_per_round", "expected_devices", "total_devices")]


def test_the_cases_cover_the_kinds_that_build_from_a_config_alone():
    kinds = {kind for kind, _, _ in CASES}
    assert {"fed3r", "fedavg", "pp", "ditto", "scaffold", "fedgloss"} <= kinds and len(CASES) > 200


@pytest.mark.parametrize("kind", sorted({kind for kind, _, _ in CASES}))
def test_an_accepted_config_at_the_ends_of_its_limits_yields_a_task(kind):
    failures = []
    for _, name, value in (case for case in CASES if case[0] == kind):
        config = {**BASE, name: value}
        try:
            full_config(kind, config)
        except (ValueError, TypeError):
            continue                                   # refused at create: the API's 422
        try:
            job = build_job(kind, config)
        except ValueError:
            continue                                   # refused when built: the start's one error
        try:
            chosen = job.next_participants({"d1", "d2", "d3"})
            if chosen:
                job.task_for(sorted(chosen)[0])
        except Exception as exc:                       # noqa: BLE001 - what the service's scheduling met
            failures.append(f"{name}={value!r}: {type(exc).__name__}: {str(exc)[:120]}")
    assert not failures, f"{kind}: accepted at create, its task refused:\n" + "\n".join(failures)


@pytest.mark.parametrize("rates", [[1.5, 2.25], [True, 2], [2.0]])
def test_an_integer_list_takes_integers_only(rates, tmp_path):
    """A review's finding: LADD's ``model.aspp_rates`` took floats, stored as sent, while the
    device's network cut them to integers (1.5 ran as 1): what was stored was not what ran."""
    from starlette.testclient import TestClient

    from aggregator.api.app import create_app
    from aggregator.storage.store import Store

    config = {"model": {"num_classes": 2, "image_size": 16, "aspp_rates": rates}}
    with pytest.raises(ValueError, match=r"'aspp_rates'\]\[0\] must be an integer"):
        full_config("ladd", config)
    full_config("ladd", {"model": {"num_classes": 2, "image_size": 16, "aspp_rates": [1, 2]}})
    token = "t" * 16
    client = TestClient(create_app(Store(tmp_path / "s.db"), token))
    answer = client.post("/api/jobs", headers={"Authorization": f"Bearer {token}"},
                         json={"job_id": "seg", "kind": "ladd", "config": config})
    assert answer.status_code == 422 and "aspp_rates" in answer.text


@pytest.mark.parametrize("rates", [[2] * 300, [2.9], ["2"], [0], [65]])
def test_a_device_refuses_a_segmentation_spec_past_the_configs_bounds(rates):
    """A review's finding: a ``ladd.train`` task's ``aspp_rates`` were cut to integers and unbounded
    on the device: 300 branches built ~1 GB before the layout check refused them, and 2.9 ran as
    2. The device's spec takes what a job's config takes (1 to 8 integers in [1, 64]) before any
    network is built."""
    from edge_client.models.segmentation import SegmentationSpec

    with pytest.raises(ValueError, match="aspp_rates must be 1 to 8 integers"):
        SegmentationSpec.from_dict({"num_classes": 2, "image_size": 16, "aspp_rates": rates})
    assert SegmentationSpec.from_dict({"num_classes": 2, "image_size": 16, "aspp_rates": [1, 64]}).aspp_rates == (1, 64)


HUGE = 10 ** 400          # a JSON integer literal of 401 digits: a Python int, no float holds it


def float_fields(config_cls) -> list[str]:
    import typing

    from aggregator.jobs.config_limits import matches

    hints = typing.get_type_hints(config_cls)
    return [f.name for f in dataclasses.fields(config_cls) if matches(0.5, hints[f.name])]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_an_integer_too_large_for_a_float_is_refused_by_the_field_it_was_given_to(kind):
    """A review's finding: a float field given a 401-digit integer raised OverflowError out of the
    JSON type check (math.isfinite converts it), a traceback from ``aggregator serve --config`` and
    ``simulate --config`` instead of the one error naming the field."""
    from aggregator.jobs.registry import validate_job_config

    names = float_fields(KINDS[kind].config_cls)
    assert names
    for name in names:
        for value in (HUGE, -HUGE):
            with pytest.raises(ValueError, match=repr(name)):
                validate_job_config(kind, {name: value})


def test_a_ladd_model_takes_exactly_the_output_strides_a_device_builds():
    """A review's finding: ``model.output_stride`` was declared Range(8, 32), so a ladd job with 12 or
    32 was created (201) and started, and every device refused its tasks (its network is cut at 8
    or 16 only). The config takes what the device's SegmentationSpec takes, no more, no less."""
    from edge_client.models.segmentation import SegmentationSpec

    for stride in range(0, 65):
        spec = {"num_classes": 2, "image_size": 64, "output_stride": stride}
        try:
            SegmentationSpec.from_dict(spec)
            device_builds = True
        except ValueError:
            device_builds = False
        try:
            full_config("ladd", {"model": spec})
            accepted = True
        except ValueError:
            accepted = False
        assert accepted == device_builds, (stride, accepted, device_builds)
