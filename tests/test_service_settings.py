"""The aggregator service's settings (``aggregator/service/settings.py``): every field declares its
limit with the job configs' mechanism, a bad value is refused at construction with one error naming
the field, the serve command builds them from its options, and the service runs by them."""

import dataclasses
import typing

import pytest

from protocols.mqtt_link import BrokerConfig

from aggregator.jobs.config_limits import FLAG, Range, declared_limits, undeclared_fields
from aggregator.service.settings import ServiceSettings

BAD_SETTINGS = [("tick_s", 0), ("tick_s", float("nan")), ("tick_s", "0.2"), ("chunk_size", -1),
                ("chunk_size", 2 ** 40), ("max_message_bytes", 0), ("offline_grace_s", float("inf")),
                ("offline_grace_s", -1.0), ("ingest_workers", 2.5), ("ingest_workers", -1), ("keep_serving", 1),
                ("require_signatures", "yes"), ("checkpoints", None), ("topic_root", ""), ("topic_root", "a/#"),
                ("topic_root", "/fedfleet"), ("shard_start_timeout_s", 0.0), ("shard_start_timeout_s", float("nan"))]


@pytest.mark.parametrize("name, value", BAD_SETTINGS)
def test_a_bad_setting_is_refused_with_one_error_naming_the_field(name, value):
    with pytest.raises(ValueError, match=f"'{name}'") as refused:
        ServiceSettings(**{name: value})
    assert str(refused.value).count("field") == 1


def test_every_setting_declares_a_limit_and_the_limits_are_what_is_checked():
    assert undeclared_fields(ServiceSettings) == []
    hints, limits = typing.get_type_hints(ServiceSettings), declared_limits(ServiceSettings)
    for field in dataclasses.fields(ServiceSettings):
        name, limit = field.name, limits[field.name]
        ServiceSettings(**{name: field.default})                  # the default is within its own limit
        if isinstance(limit, Range):
            cast = hints[name]
            for edge in (limit.lo, limit.hi):                     # both ends of the declared range are accepted
                assert getattr(ServiceSettings(**{name: cast(edge)}), name) == edge
            for outside in (limit.lo - 1, limit.hi * 2 + 1):
                with pytest.raises(ValueError, match=f"'{name}'"):
                    ServiceSettings(**{name: cast(outside)})
        else:
            assert limit == FLAG or name == "topic_root", name


def test_the_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ServiceSettings().tick_s = 0        # a service's settings cannot change under it


def test_the_serve_command_builds_its_settings_from_its_options(tmp_path):
    from aggregator.cli import build_parser, service_settings

    def options(*extra):
        return build_parser().parse_args(["serve", "--out", str(tmp_path), *extra])

    built = service_settings(options("--topic-root", "site7", "--evaluate", "round", "--require-signatures",
                                     "--keep-serving", "--ingest-workers", "3", "--shard-start-timeout", "45"))
    assert built == ServiceSettings(topic_root="site7", evaluate_every_contribution=False, require_signatures=True,
                                    keep_serving=True, ingest_workers=3, shard_start_timeout_s=45.0)
    assert service_settings(options()) == ServiceSettings()
    with pytest.raises(ValueError, match="'ingest_workers'"):
        service_settings(options("--ingest-workers", "-2"))


def test_the_service_runs_by_its_settings(tmp_path):
    from aggregator.service.loop import AggregatorService

    settings = ServiceSettings(topic_root="site7", tick_s=0.5, max_message_bytes=4096, chunk_size=2048,
                               require_signatures=True)
    svc = AggregatorService(None, BrokerConfig(port=1), tmp_path, settings)      # the link is never started
    try:
        assert svc.settings is settings and svc.topics.root == "site7"
        assert svc.loop.tick_s == 0.5 and svc.assembler.max_message_bytes == 4096
        assert svc.assembler.verifier is not None                                 # signatures required
        assert {topic for topic, _ in svc.link.subscriptions} == {"site7/v1/dev/+/out", "site7/v1/presence/+"}
    finally:
        svc.stop()
