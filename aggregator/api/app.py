"""The admin REST API (FastAPI) and the dashboard, served by the aggregator process.

Reads come from the store (its own SQLite connection per worker thread; WAL lets them read while
the service writes) and from the service's ``live`` snapshot; every mutation (enrol, revoke,
create/start/pause/resume/cancel a job) runs on the service thread through
``AggregatorService.call``, so the service stays the only writer of job state.

Every route needs the admin token: ``Authorization: Bearer <token>``, or the ``fedfleet_token``
cookie that ``GET /dashboard/?token=<token>`` sets (HttpOnly, SameSite=Strict) for browsers. The
OpenAPI schema is served at ``/openapi.json`` behind the same check; there is no Swagger UI
(it would load scripts from a CDN at run time).
"""

from __future__ import annotations

import dataclasses
import secrets
import types
import typing
from concurrent.futures import TimeoutError as FutureTimeout
from importlib import resources
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request, status
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, StrictBool, create_model

from protocols.topics import DEVICE_ID_RE

from ..compute import compute_summary
from ..jobs.config_limits import FIELD_LIMITS, Fields, Items, OneOf, Pattern, Range, check_limit
from ..jobs.registry import KINDS, kind_of, validate_job_config
from ..store import Store, StoreError
from .metrics import render_metrics

ID_PATTERN = DEVICE_ID_RE.pattern
MAX_ID = 2 ** 62
COOKIE = "fedfleet_token"
DASHBOARD_ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}


# ----------------------------------------------------------------------------- schemas
class Device(BaseModel):
    device_id: str
    status: Literal["enrolled", "revoked"]
    public_key: str | None
    enrolled_at: float | None
    revoked_at: float | None
    last_seen: float | None
    online: bool
    profile: dict[str, Any]
    cluster: str | None


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


class FleetMode(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["open", "enrolled"]


class EnrollRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    device_id: str = Field(pattern=ID_PATTERN)
    public_key: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$",
                                   description="raw Ed25519 public key, hex; omit to have one generated")


class Credentials(BaseModel):
    device_id: str
    mqtt_username: str
    mqtt_password: str
    public_key: str
    private_key_pem: str | None
    ca_pem: str | None


def config_model(kind: str) -> type[BaseModel]:
    """A pydantic model of a job kind's config, from its dataclass and the declared field limits
    (``aggregator/jobs/config_limits.py``), so the OpenAPI schema states what the service accepts."""
    config_cls = kind_of(kind).config_cls
    hints = typing.get_type_hints(config_cls)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(config_cls):
        if f.name == "job_id":
            continue                                    # given once, in the request
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        limit = FIELD_LIMITS.get(f.name)
        try:
            if default is not None:
                check_limit(f.name, default, limit)
        except ValueError:
            default = ...                                # no valid default (LADD's model spec): required
        fields[f.name] = (_field_type(f.name, hints[f.name], limit), Field(default=default))
    name = "".join(part.capitalize() for part in kind.split("-"))
    return create_model(f"{name}Config", __config__=ConfigDict(extra="forbid"), **fields)


def _field_type(name: str, hint, limit):
    if isinstance(limit, OneOf):
        return Literal[limit.values]
    if isinstance(limit, Fields):
        required = set(limit.spec if limit.required is None else limit.required)
        sub = {k: (_field_type(k, t, rng), ... if k in required else None) for k, (t, rng) in limit.spec.items()}
        model = create_model(f"{name.title().replace('_', '')}", __config__=ConfigDict(extra="forbid"), **sub)
        return model | None if typing.get_origin(hint) in (typing.Union, types.UnionType) else model
    if isinstance(limit, Items):
        item = Annotated[float, Field(ge=limit.item.lo, le=limit.item.hi, allow_inf_nan=False)]
        return Annotated[list[item], Field(min_length=1, max_length=limit.max_items)]
    if hint is int or (isinstance(limit, Range) and hint is list):
        return Annotated[int, Field(ge=limit.lo, le=limit.hi)] if isinstance(limit, Range) else int
    if hint is float:
        rng = {"ge": limit.lo, "le": limit.hi} if isinstance(limit, Range) else {}
        return Annotated[float, Field(allow_inf_nan=False, **rng)]
    if hint is bool:
        return StrictBool
    if hint is str:
        return Annotated[str, Field(max_length=1024, **({"pattern": limit.regex} if isinstance(limit, Pattern) else {}))]
    return hint


def job_create_model(kind: str) -> type[BaseModel]:
    config = config_model(kind)
    name = "".join(part.capitalize() for part in kind.split("-"))
    return create_model(f"{name}JobCreate", __config__=ConfigDict(extra="forbid"),
                        job_id=(str, Field(pattern=ID_PATTERN)), kind=(Literal[kind], ...),
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
    state: str
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


# ----------------------------------------------------------------------------- the app
def create_app(store: Store, token: str, service=None) -> FastAPI:
    """``service``: the running AggregatorService (None: read-only API on a store)."""
    compute = compute_summary()       # fixed for the process's life
    if not token or len(token) < 16:
        raise ValueError("the admin token must be at least 16 characters")
    bearer = HTTPBearer(auto_error=False, description="the admin token")

    def require_token(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        given = creds.credentials if creds is not None else request.cookies.get(COOKIE, "")
        if not given and request.url.path == "/dashboard/":      # the browser's way in: ?token=
            given = request.query_params.get("token", "")
        if not secrets.compare_digest(given.encode(), token.encode()):
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing or wrong admin token",
                                headers={"WWW-Authenticate": "Bearer"})

    app = FastAPI(title="fedfleet aggregator admin API", version="1", openapi_url=None, docs_url=None,
                  redoc_url=None, dependencies=[Depends(require_token)])

    def mutate(fn):
        if service is None:
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "no aggregator service in this process")
        try:
            return service.call(fn, timeout=10.0)
        except FutureTimeout:
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "the aggregator is not answering") from None
        except KeyError as exc:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"not found: {exc}") from None
        except StoreError as exc:
            raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from None
        except (ValueError, TypeError) as exc:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_ENTITY, str(exc)) from None

    def live() -> dict:
        return service.live if service is not None else {}

    def job_out(row: dict) -> dict:
        counts = store.contribution_counts(row["job_id"])
        return {**row, "rounds": len(store.rounds(row["job_id"])), "contributions": sum(counts.values())}

    def get_job(job_id: str) -> dict:
        row = store.job(job_id)
        if row is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id!r}")
        return row

    JobId = Path(pattern=ID_PATTERN)
    DeviceId = Path(pattern=ID_PATTERN)

    @app.get("/openapi.json", include_in_schema=False)
    def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/api/health", response_model=Health, tags=["service"], responses=READ)
    def health() -> dict:
        return {"status": "ok", "service_running": service is not None and bool(live()),
                "compute": compute}

    @app.get("/api/status", tags=["service"], response_model=dict[str, Any],
             description="live snapshot: online devices, active job, current round progress", responses=READ)
    def live_status() -> dict:
        return live()

    # ---------------------------------------------------------------- fleet
    @app.get("/api/fleet", response_model=FleetSummary, tags=["fleet"], responses=READ)
    def fleet() -> dict:
        devices, snap = store.devices(), live()
        return {"mode": snap.get("fleet_mode") or store.setting("fleet_mode") or "enrolled",
                "enrolled": sum(d["status"] == "enrolled" for d in devices),
                "revoked": sum(d["status"] == "revoked" for d in devices),
                "online": len(snap.get("devices_online", [])), "online_not_enrolled": len(snap.get("not_enrolled", [])),
                "clusters": len(store.clusters()), "active_job": (snap.get("job") or {}).get("job_id")}

    @app.post("/api/fleet/mode", response_model=FleetSummary, tags=["fleet"], responses=WRITE,
              description="set the fleet mode on purpose: open (any device may contribute) or enrolled")
    def set_fleet_mode(req: FleetMode) -> dict:
        mutate(lambda: service.set_fleet_mode(req.mode))
        return fleet()

    @app.get("/api/devices", response_model=list[Device], tags=["fleet"], responses=READ)
    def devices(status_: Literal["enrolled", "revoked"] | None = Query(default=None, alias="status")) -> list[dict]:
        return [d for d in _with_live(store.devices(), live()) if status_ is None or d["status"] == status_]

    @app.get("/api/devices/{device_id}", response_model=Device, tags=["fleet"], responses=ONE)
    def device(device_id: str = DeviceId) -> dict:
        d = store.device(device_id)
        if d is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no device {device_id!r}")
        return _with_live([d], live())[0]

    @app.post("/api/devices", response_model=Credentials, status_code=201, tags=["fleet"],
              responses=WRITE,
              description="enrol a device: returns its MQTT password (and private key, if generated) once")
    def enroll(req: EnrollRequest) -> dict:
        key = bytes.fromhex(req.public_key) if req.public_key else None
        return mutate(lambda: service.enroll(req.device_id, key)).to_dict()

    @app.post("/api/devices/{device_id}/revoke", response_model=Device, tags=["fleet"], responses=WRITE)
    def revoke(device_id: str = DeviceId) -> dict:
        mutate(lambda: service.revoke(device_id))
        return store.device(device_id)

    # ---------------------------------------------------------------- jobs and rounds
    @app.get("/api/jobs", response_model=list[Job], tags=["jobs"], responses=READ)
    def jobs() -> list[dict]:
        return [job_out(j) for j in store.jobs()]

    @app.post("/api/jobs", response_model=Job, status_code=201, tags=["jobs"],
              responses=WRITE,
              description="create a job from a config (``fedfleet admin job create FILE`` sends the file)")
    def create_job(req: JobCreate) -> dict:
        config = {**req.config.model_dump(exclude_none=True), "job_id": req.job_id}
        try:
            validate_job_config(req.kind, config)
        except (ValueError, TypeError) as exc:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_ENTITY, str(exc)) from None
        return job_out(mutate(lambda: service.create_job(req.kind, config)))

    @app.get("/api/jobs/{job_id}", response_model=Job, tags=["jobs"], responses=ONE)
    def job(job_id: str = JobId) -> dict:
        return job_out(get_job(job_id))

    @app.post("/api/jobs/{job_id}/{action}", response_model=Job, tags=["jobs"], responses=WRITE)
    def control(action: Literal["start", "pause", "resume", "cancel"], job_id: str = JobId) -> dict:
        get_job(job_id)
        return job_out(mutate(lambda: service.control_job(job_id, action)))

    @app.get("/api/jobs/{job_id}/quarantine", response_model=list[Quarantined], tags=["jobs"], responses=ONE,
             description="contributions that passed validation but broke the job: kept out of it, with the reason")
    def quarantine(job_id: str = JobId) -> list[dict]:
        get_job(job_id)
        return store.quarantined(job_id)

    @app.get("/api/jobs/{job_id}/rounds", response_model=list[Round], tags=["jobs"], responses=ONE)
    def rounds(job_id: str = JobId) -> list[dict]:
        get_job(job_id)
        return _rounds(store, job_id, live())

    @app.get("/api/jobs/{job_id}/rounds/{round_no}", response_model=Round, tags=["jobs"], responses=ONE)
    def round_detail(job_id: str = JobId, round_no: int = Path(ge=1, le=MAX_ID)) -> dict:
        get_job(job_id)
        found = [r for r in _rounds(store, job_id, live()) if r["round"] == round_no]
        if not found:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id!r} has no round {round_no}")
        return found[0]

    @app.get("/api/jobs/{job_id}/evaluations", response_model=list[dict[str, Any]], tags=["jobs"],
             description="provisional-model evaluations in order (accuracy curve)", responses=ONE)
    def evaluations(job_id: str = JobId) -> list[dict]:
        get_job(job_id)
        return store.evaluations(job_id)

    # ---------------------------------------------------------------- models and clusters
    @app.get("/api/models", response_model=list[Model], tags=["models"], responses=READ)
    def models(job_id: str | None = Query(default=None, pattern=ID_PATTERN)) -> list[dict]:
        return store.models(job_id)

    def get_model(model_id: int) -> dict:
        m = store.model(model_id)
        if m is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no model {model_id}")
        return m

    ModelId = Path(ge=1, le=MAX_ID)

    @app.get("/api/models/{model_id}", response_model=Model, tags=["models"], responses=ONE)
    def model(model_id: int = ModelId) -> dict:
        return get_model(model_id)

    @app.get("/api/models/{model_id}/download", tags=["models"], response_class=Response,
             responses={**ONE, 200: {"content": {"application/octet-stream": {}}, "description": "the model as .npz"}})
    def download(model_id: int = ModelId) -> Response:
        m = get_model(model_id)
        return Response(store.model_bytes(model_id), media_type="application/octet-stream",
                        headers={"Content-Disposition": f'attachment; filename="{m["job_id"]}-v{m["version"]}.npz"',
                                 "X-Model-SHA256": m["sha256"]})

    @app.get("/api/models/{model_id}/lineage", response_model=list[LineageEntry], tags=["models"],
             responses=ONE,
             description="the model and its ancestors, newest first, with the devices each round added")
    def lineage(model_id: int = ModelId) -> list[dict]:
        get_model(model_id)
        return store.lineage(model_id)

    @app.get("/api/clusters", response_model=list[Cluster], tags=["fleet"], responses=READ)
    def clusters() -> list[dict]:
        return store.clusters()

    # ---------------------------------------------------------------- metrics and dashboard
    @app.get("/metrics", response_class=Response, tags=["service"],
             responses={**READ, 200: {"content": {"text/plain": {}}, "description": "Prometheus text format 0.0.4"}})
    def metrics() -> Response:
        return Response(render_metrics(store, service), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/dashboard/", response_class=HTMLResponse, tags=["dashboard"],
             responses={**READ, 303: {"description": "token accepted: session cookie set, redirect to /dashboard/"}},
             description="the web dashboard; ``?token=`` sets the session cookie and redirects")
    def dashboard(token_: str | None = Query(default=None, alias="token", max_length=512)) -> Response:
        if token_ is not None:
            if not secrets.compare_digest(token_.encode(), token.encode()):   # even if a header authenticated
                raise HTTPException(status.HTTP_401_UNAUTHORIZED, "wrong admin token",
                                    headers={"WWW-Authenticate": "Bearer"})
            resp = RedirectResponse("/dashboard/", status_code=status.HTTP_303_SEE_OTHER)
            resp.set_cookie(COOKIE, token, httponly=True, samesite="strict")
            return resp
        return HTMLResponse(_asset("index.html"))

    @app.get("/dashboard/{asset}", response_class=Response, tags=["dashboard"], responses=READ)
    def dashboard_asset(asset: Literal["app.js", "style.css"]) -> Response:
        return Response(_asset(asset), media_type=DASHBOARD_ASSETS[asset])

    return app


def _asset(name: str) -> str:
    return resources.files("aggregator.api").joinpath("static", name).read_text()


def _with_live(devices: list[dict], live: dict) -> list[dict]:
    """Overlay the service's in-memory presence and last-seen on stored device rows."""
    if not live:
        return devices
    online, seen = set(live.get("devices_online", ())), live.get("last_seen", {})
    return [{**d, "online": d["device_id"] in online,
             "last_seen": max(filter(None, (d["last_seen"], seen.get(d["device_id"]))), default=None)}
            for d in devices]


def _rounds(store: Store, job_id: str, live: dict) -> list[dict]:
    received: dict[int, dict[str, float]] = {}
    for c in store.contributions(job_id, with_payload=False):
        received.setdefault(c.round, {})[c.device] = c.received_at
    current = (live.get("job") or {}).get("current_round") if (live.get("job") or {}).get("job_id") == job_id else None
    out = []
    for r in store.rounds(job_id):
        live_round = current if current and current["round"] == r.round else None
        if r.outcome:                    # closed: what the round machine reported (secure rounds included)
            accepted, dropped = r.outcome["accepted"], r.outcome["dropped"]
            declined, rejected, pending = r.outcome["declined"], r.outcome["rejected"], []
        elif live_round:                 # open and served now: the round machine's own view
            accepted, declined, rejected = live_round["accepted"], live_round["declined"], live_round["rejected"]
            dropped, pending = live_round["lost"], live_round["pending"]
        else:                            # open in the store only (service down): from the durable records
            events = store.round_events(job_id, r.round)
            accepted, dropped = sorted(received.get(r.round, {})), []
            declined = sorted(e["device"] for e in events if e["event"] == "declined")
            rejected = sorted(e["device"] for e in events if e["event"] == "rejected")
            pending = sorted(set(r.participants) - set(accepted) - set(declined) - set(rejected))
        out.append({"round": r.round, "state": r.state, "participants": list(r.participants), "accepted": accepted,
                    "dropped": dropped, "declined": declined, "rejected": rejected, "pending": pending,
                    "opened_at": r.opened_at, "deadline": r.deadline, "closed_at": r.closed_at,
                    "duration_s": (r.closed_at - r.opened_at) if r.closed_at else None,
                    "bytes_in": live_round["bytes_in"] if live_round else r.bytes_in,
                    "result_latency_s": {d: t - r.opened_at for d, t in received.get(r.round, {}).items()}})
    return out
