"""The admin API's request and response models (its OpenAPI schema), one place for every route.

A job's config model is built per registered kind from its config dataclass and the limit each
field declares (``aggregator/jobs/config_limits.py``), so the schema states what the service accepts.
Its numbers and choices take only their own JSON types, as ``validate_config`` does: pydantic's lax
mode would store ``true`` as 1, ``"5"`` as 5 or ``7.0`` as 7, which ``aggregator serve --config``
refuses for the same file.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt, create_model

from protocols.messages import MAX_TAGS, TAG_PATTERN
from protocols.topics import DEVICE_ID_RE

from aggregator.jobs.config_limits import (JOB_ID_RE, Fields, Items, OneOf, Pattern, Range, check_limit, field_limit,
                                           matches)
from aggregator.jobs.registry import KINDS, kind_of
from aggregator.storage.schema import JobState

ID_PATTERN = DEVICE_ID_RE.pattern
JOB_ID_PATTERN = JOB_ID_RE.pattern        # a device id's characters, never "." or ".." (a directory)
MAX_ID = 2 ** 62


class Device(BaseModel):
    device_id: str
    status: Literal["enrolled", "revoked", "not enrolled"] = Field(
        description="not enrolled: heard from (presence or messages) but not in the store's fleet")
    public_key: str | None
    enrolled_at: float | None
    revoked_at: float | None
    last_seen: float | None
    online: bool
    profile: dict[str, Any]
    cluster: str | None
    tags: list[str] = Field(default_factory=list, description="the tags the operator gave the device "
                            "(POST /api/devices/{device_id}/tags): what a deployment's tags: cohort selects by; "
                            "tags in the device's own profile are never used for that")


class DeviceTags(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tags: list[Annotated[str, Field(pattern=TAG_PATTERN)]] = Field(
        max_length=MAX_TAGS, description="the device's tags, replacing any it had ([] clears them)")


WARNING = Field(default=None, description="the change is committed and the aggregator acts on it, but the broker "
                                         "has not taken it yet: why, and what makes it take it")


class RevokedDevice(Device):
    warning: str | None = WARNING


class FleetSummary(BaseModel):
    mode: Literal["open", "enrolled"] = Field(description="open: any device may contribute (development); "
                                                          "enrolled: only enrolled devices are given tasks")
    enrolled: int
    revoked: int
    online: int
    online_not_enrolled: int
    clusters: int
    active_job: str | None


class Quarantined(BaseModel):
    round: int
    device: str
    message_id: str
    reason: str
    at: float


class Forgotten(BaseModel):
    """What forgetting a device did in one job that held its data."""
    job_id: str
    kind: str
    forgotten: bool = Field(description="its statistics were removed and the job re-solved or rebuilt")
    contributions_deleted: int = 0
    model_id: int | None = Field(default=None, description="a finished job's new final model (re-solved)")
    metrics: dict[str, Any] | None = None
    reason: str = Field(default="", description="why this job cannot forget exactly")


class FleetMode(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["open", "enrolled"]


class EnrollRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # a device id never "." or "..": enrolled, no client could reach it in a path (a review's finding)
    device_id: str = Field(pattern=JOB_ID_PATTERN)
    public_key: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$",
                                   description="raw Ed25519 public key, hex (a point of the curve: else 422); omit to have one "
                                               "generated")


class Credentials(BaseModel):
    device_id: str
    mqtt_username: str
    mqtt_password: str
    public_key: str
    private_key_pem: str | None
    ca_pem: str | None
    aggregator_public_key: str | None = Field(default=None, description="hex: verify every aggregator message")
    warning: str | None = WARNING


def config_model(kind: str) -> type[BaseModel]:
    """A pydantic model of a job kind's config, from its dataclass and the limit each field declares
    (``aggregator/jobs/config_limits.py``), so the OpenAPI schema states what the service accepts."""
    config_cls = kind_of(kind).config_cls
    hints = typing.get_type_hints(config_cls)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(config_cls):
        if f.name == "job_id":
            continue                                    # given once, in the request
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        limit = field_limit(config_cls, f.name)
        try:
            if default is not None:
                check_limit(f.name, default, limit)
        except ValueError:
            default = ...                                # no valid default (LADD's model spec): required
        fields[f.name] = (_field_type(f.name, hints[f.name], limit), Field(default=default))
    name = "".join(part.capitalize() for part in kind.split("-"))
    return create_model(f"{name}Config", __config__=ConfigDict(extra="forbid"), **fields)


def _field_type(name: str, hint, limit):
    # strict=True on every number: an int still passes where a float is declared (JSON has one
    # number type, and validate_config takes it), a bool or a string never does
    if isinstance(limit, OneOf):
        return Annotated[Literal[limit.values], _json_type_of(hint)]
    if isinstance(limit, Fields):
        required = set(limit.spec if limit.required is None else limit.required)
        sub = {k: (_field_type(k, t, rng), ... if k in required else None) for k, (t, rng) in limit.spec.items()}
        model = create_model(f"{name.title().replace('_', '')}", __config__=ConfigDict(extra="forbid"), **sub)
        return model | None if typing.get_origin(hint) in (typing.Union, types.UnionType) else model
    if isinstance(limit, Items):
        number = {"allow_inf_nan": False} if limit.item_type is float else {}
        item = Annotated[limit.item_type, Field(strict=True, ge=limit.item.lo, le=limit.item.hi, **number)]
        return Annotated[list[item], Field(min_length=1, max_length=limit.max_items)]
    if hint is int or (isinstance(limit, Range) and hint is list):
        return Annotated[int, Field(strict=True, ge=limit.lo, le=limit.hi)] if isinstance(limit, Range) else StrictInt
    if hint is float:
        rng = {"ge": limit.lo, "le": limit.hi} if isinstance(limit, Range) else {}
        return Annotated[float, Field(strict=True, allow_inf_nan=False, **rng)]
    if hint is bool:
        return StrictBool
    if hint is str:
        return Annotated[str, Field(max_length=1024, **({"pattern": limit.regex} if isinstance(limit, Pattern) else {}))]
    return hint


def _json_type_of(hint) -> BeforeValidator:
    """A choice's value of its declared JSON type first (``matches``: bools are not ints): pydantic's
    Literal has no strict mode and takes ``true`` for 1 and ``1`` for ``true``, equal in Python."""
    def check(value):
        if not matches(value, hint):
            raise ValueError(f"{value!r} is not of type {getattr(hint, '__name__', hint)}")
        return value
    return BeforeValidator(check)


def job_create_model(kind: str) -> type[BaseModel]:
    config = config_model(kind)
    name = "".join(part.capitalize() for part in kind.split("-"))
    return create_model(f"{name}JobCreate", __config__=ConfigDict(extra="forbid"),
                        job_id=(str, Field(pattern=JOB_ID_PATTERN)), kind=(Literal[kind], ...),
                        config=(config, Field(description=kind_of(kind).summary)) if _required_fields(config)
                        else (config, Field(default_factory=config, description=kind_of(kind).summary)))


def _required_fields(model: type[BaseModel]) -> bool:
    return any(f.is_required() for f in model.model_fields.values())


# One request model per registered kind, told apart by ``kind``: the schema of each kind's config.
JobCreate = Annotated[typing.Union[tuple(job_create_model(k) for k in KINDS)], Field(discriminator="kind")]


class Job(BaseModel):
    job_id: str
    kind: str
    config: dict[str, Any]
    state: JobState = Field(description="cancelling: the served job was cancelled; cancelled once its open round "
                                        "closes (also after a restart of the service)")
    created_at: float
    updated_at: float
    started_at: float | None
    finished_at: float | None
    summary: dict[str, Any] | None
    counters: dict[str, Any]
    rounds: int
    contributions: int


class Round(BaseModel):
    round: int
    state: Literal["open", "closed"]
    participants: list[str]
    accepted: list[str]
    dropped: list[str]
    declined: list[str]
    rejected: list[str]
    pending: list[str]
    opened_at: float
    deadline: float
    closed_at: float | None
    duration_s: float | None
    bytes_in: int
    result_latency_s: dict[str, float] = Field(description="device -> seconds from round open to its accepted result")


class RoundLogPage(BaseModel):
    lines: list[dict[str, Any]] = Field(description="events of the job's round log (rounds.jsonl), oldest first")
    next_offset: int = Field(description="pass as ?offset= to get the lines written after these")
    job_state: JobState


class Model(BaseModel):
    model_id: int
    job_id: str
    version: int
    round: int
    parent_id: int | None
    contributions: int
    sha256: str
    metrics: dict[str, Any]
    final: bool
    created_at: float
    nbytes: int


class LineageEntry(Model):
    accepted: list[str]


class Cluster(BaseModel):
    cluster_id: str
    label: str
    job_id: str | None
    model_id: int | None
    created_at: float
    devices: int


class ErrorBody(BaseModel):
    detail: Any


def _errors(*codes: int) -> dict:
    text = {401: "missing or wrong admin token", 404: "no such object", 409: "conflicts with the current state",
            422: "invalid request", 503: "the aggregator service is not available"}
    return {c: {"model": ErrorBody, "description": text[c], "content": {"application/json": {}}}
            for c in (401, *codes)}


READ, ONE, WRITE = _errors(), _errors(404), _errors(404, 409, 422, 503)


class Compute(BaseModel):
    device: str                  # torch device of the aggregation math
    gpu: str | None
    torch: str
    secagg_unmask: str           # where secure aggregation's final mask expansion runs


class Health(BaseModel):
    status: str
    service_running: bool
    compute: Compute

