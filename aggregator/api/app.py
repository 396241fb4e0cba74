"""The admin REST API (FastAPI) and the dashboard, served by the aggregator process.

Reads come from the store (its own SQLite connection per worker thread; WAL lets them read while
the service writes) and from the service's ``live`` snapshot; every mutation (enrol, revoke,
create/start/pause/resume/cancel a job) runs on the service thread through
``AggregatorService.call``, so the service stays the only writer of job state.

Every route needs the admin token: ``Authorization: Bearer <token>``, or, for browsers, the
session cookie that the sign-in form's ``POST /dashboard/login`` sets (``guard.py``). The
OpenAPI schema is served at ``/openapi.json`` behind the same check; there is no Swagger UI
(it would load scripts from a CDN at run time).

Every route's JSON body is parsed by ``StrictJsonRequest``: a key named twice in one object is a 400
naming it, never its last value taken.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import partial
from importlib import resources
from typing import Any, Literal

from fastapi import Depends, FastAPI, HTTPException, Request, status
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from protocols.envelope import DuplicateKeyError, object_without_duplicates

from aggregator.compute.summary import compute_summary
from aggregator.service.reporting import status_summary
from aggregator.storage.store import Store
from aggregator.api.context import ApiContext
from aggregator.api.guard import DASHBOARD_HEADERS, RequestGuard, authenticated
from aggregator.api.metrics import render_metrics
from aggregator.api.origins import DashboardOrigins
from aggregator.api.routes_deployments import add_deployment_routes
from aggregator.api.routes_fleet import add_fleet_routes
from aggregator.api.routes_jobs import add_job_routes, add_model_routes
from aggregator.api.schemas import READ, Health

DASHBOARD_ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}


def create_app(store: Store, token: str, service=None, deployments=None, public_origins: Iterable[str] = ()) -> FastAPI:
    """``service``: the running AggregatorService (None: read-only API on a store).
    ``public_origins``: where browsers reach the dashboard through a reverse proxy (``origins.py``;
    ValueError naming a value that is not scheme://host[:port])."""
    if not token or len(token) < 16:
        raise ValueError("the admin token must be at least 16 characters")
    origins = DashboardOrigins(public_origins)
    app = FastAPI(title="fedfleet aggregator admin API", version="1", openapi_url=None, docs_url=None,
                  redoc_url=None, dependencies=[Depends(token_check(token))])
    app.router.route_class = StrictJsonRoute          # every route added below
    ctx = ApiContext(store, service, deployments)
    add_service_routes(app, ctx, compute_summary())
    add_fleet_routes(app, ctx)
    add_job_routes(app, ctx)
    add_model_routes(app, ctx)
    add_deployment_routes(app, ctx)
    add_dashboard_routes(app)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_middleware(RequestGuard, token=token, origins=origins)
    return app


class StrictJsonRequest(Request):
    """A request whose JSON body refuses a key named twice in one object: Python's json keeps the
    last value silently, so ``{"job_id": "a", ..., "job_id": "b"}`` created job b while the
    operator (or a proxy, a log, another parser) read a."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = json.loads(await self.body(), object_pairs_hook=object_without_duplicates)
            except DuplicateKeyError as exc:
                raise HTTPException(status.HTTP_400_BAD_REQUEST, f"the JSON body has a {exc}") from None
            except json.JSONDecodeError:
                raise                   # FastAPI's answer names the position
            except RecursionError:      # FastAPI said only "There was an error parsing the body"
                raise HTTPException(status.HTTP_400_BAD_REQUEST, "the JSON body is nested too deeply") from None
            except ValueError as exc:   # an integer of more digits than Python converts
                raise HTTPException(status.HTTP_400_BAD_REQUEST, f"the JSON body cannot be read: {exc}") from None
        return self._json


class StrictJsonRoute(APIRoute):
    """A route whose endpoint reads its body through ``StrictJsonRequest`` (FastAPI's hook for a
    request class of one's own)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def strict_json_handler(request: Request) -> Response:
            return await handler(StrictJsonRequest(request.scope, request.receive))
        return strict_json_handler


async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 with where and why each field failed, without echoing the input back: FastAPI's own
    answer does, and a NaN or Infinity in it (which JSON bodies may carry) cannot be written as
    JSON, so the refusal itself became a 500."""
    errors = [{k: v for k, v in error.items() if k not in ("input", "ctx")} for error in exc.errors()]
    return JSONResponse(status_code=status.HTTP_422_UNPROCESSABLE_ENTITY, content={"detail": jsonable_encoder(errors)})


def token_check(token: str):
    """The dependency every route has: the admin token as a Bearer header, or the dashboard's cookie."""
    bearer = HTTPBearer(auto_error=False, description="the admin token")

    def require_token(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        # RequestGuard already refused what fails this before the body was read; this states the
        # security scheme in the OpenAPI schema and guards an app mounted without the guard
        if not authenticated(request.scope, token):
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing or wrong admin token",
                                headers={"WWW-Authenticate": "Bearer"})
    return require_token


def add_service_routes(app: FastAPI, ctx: ApiContext, compute: dict) -> None:
    get, post = (partial(method, tags=["service"]) for method in (app.get, app.post))

    @get("/openapi.json", include_in_schema=False)
    def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @get("/api/health", response_model=Health, responses=READ)
    def health() -> dict:
        return {"status": "ok", "service_running": ctx.service is not None and bool(ctx.live()), "compute": compute}

    @get("/api/status", response_model=dict[str, Any],
           description="live snapshot, of a size independent of the fleet's: devices online (a count), active "
                       "job, current round progress (counts); the devices themselves are /api/devices'",
           responses=READ)
    def live_status() -> dict:
        return status_summary(ctx.live())

    @get("/metrics", response_class=Response,
           responses={**READ, 200: {"content": {"text/plain": {}}, "description": "Prometheus text format 0.0.4"}})
    def metrics() -> Response:
        return Response(render_metrics(ctx.store, ctx.service), media_type="text/plain; version=0.0.4; charset=utf-8")



def add_dashboard_routes(app: FastAPI) -> None:
    get = partial(app.get, tags=["dashboard"])

    @get("/", include_in_schema=False)
    def root() -> Response:
        return RedirectResponse("/dashboard/", status_code=status.HTTP_303_SEE_OTHER)

    @get("/dashboard/", response_class=HTMLResponse, responses=READ,
           description="the web dashboard (a browser without a session gets the sign-in page: guard.py)")
    def dashboard() -> Response:
        return HTMLResponse(_asset("index.html"), headers=DASHBOARD_HEADERS)

    @get("/dashboard/{asset}", response_class=Response, responses=READ)
    def dashboard_asset(asset: Literal["app.js", "style.css"]) -> Response:
        return Response(_asset(asset), media_type=DASHBOARD_ASSETS[asset], headers=DASHBOARD_HEADERS)



def _asset(name: str) -> str:
    return resources.files("aggregator.api").joinpath("static", name).read_text()
