"""Admin routes about deployments (issue 29): roll a model version out through a canary cohort,
promote it, roll it back, and see every stage, device and report (``fedfleet admin model deploy``,
``fedfleet admin deployment ...``). Reads come from the store; changes run on the deployment
controller's thread."""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Path, Query, Response, status
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from aggregator.api.context import ApiContext
from aggregator.api.paging import PAGE_READ, PAGED, Order, cursor, limit_query, order_query, paged
from aggregator.api.schemas import JOB_ID_PATTERN, MAX_ID, ONE, WRITE
from aggregator.deployments.cohort import parse_stages
from aggregator.deployments.controller import deployment_view
from aggregator.deployments.guard import DEFAULT_GUARD, DEFAULT_MIN_REPORTS
from aggregator.deployments.machine import DeploymentState
from aggregator.storage.deployments import DeploymentStore

def _integral(value):
    # JSON Schema's integer is a number with no fraction (2.0 is one; the OpenAPI schema says
    # integer): taken as the int it is, while strict mode still refuses true, "3" and 2.5
    return int(value) if type(value) is float and value.is_integer() else value


JsonInt = Annotated[int, BeforeValidator(_integral)]
DEPLOYMENT_ID = JOB_ID_PATTERN        # a job id's rule: never "." or ".." (no client could reach it in a path)
DeploymentId = Path(pattern=DEPLOYMENT_ID)


class DeploymentCreate(BaseModel):
    # strict, as a job's config: true is no min_reports of 1, "3" no 3, and a misspelt field no default
    model_config = ConfigDict(strict=True, extra="forbid")
    deployment_id: str = Field(default="", pattern=f"^$|{DEPLOYMENT_ID}",
                               description="default: m<model id>-<unix time>, with -2, -3, ... added when "
                                           "a deployment has that id")
    cohort: str = Field(default="5%", max_length=4096,
                        description="the canary: a seeded fraction (5%), tags:a,b (the tags the operator gave devices) "
                                    "or devices:id1,id2")
    stages: str = Field(default="100%", max_length=200, description="widening fractions after the canary, "
                                                                     "each wider than the one before, ending at 100% "
                                                                     "(e.g. 25%,100%)")
    guard: str = Field(default=DEFAULT_GUARD, max_length=500,
                       description="METRIC OP NUMBER[,...] over reports, METRIC one of reports, refused, "
                                   "median_drop (the median device's accuracy drop, robust to liars), "
                                   "wma_candidate, wma_current, wma_drop (percentage points)")
    bake_s: float = Field(default=600.0, ge=0, le=30 * 86400, description="seconds each stage runs before it is judged")
    min_reports: JsonInt = Field(default=DEFAULT_MIN_REPORTS, ge=0, le=10 ** 6, description="fewer reports (distinct devices) than this "
                                                                                        "fail the stage")
    patience_s: float = Field(default=600.0, ge=0, le=30 * 86400,
                              description="after the bake time, how long to wait for min_reports")
    seed: JsonInt = Field(default=0, ge=0, le=2 ** 31, description="the seed of the fraction cohorts")


class Rollback(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    reason: str = Field(default="rolled back by the operator", max_length=500)


class DeploymentOut(BaseModel):
    deployment_id: str
    model_id: int
    state: DeploymentState
    created_at: float
    updated_at: float
    model_sha256: str
    replaces: int | None
    cohort: str
    stages: list[float]
    guard: str
    bake_s: float
    min_reports: int
    patience_s: float
    stage: int
    reason: str
    history: list[dict[str, Any]] = Field(description="every state change: time, from, to, stage, why, metrics")
    counts: dict[str, int] = Field(description="devices sent the candidate, sent a rollback, that reported, "
                                               "that refused it; fleet: known devices; late_reports: reports refused as "
                                               "not about the device's last assignment; refused:<class>: refusals "
                                               "devices reported, by class (signature, hash, stale, device, timeout, "
                                               "load)")
    devices: dict[str, dict[str, Any]] | None = Field(description="per device: what it was sent, when, and its "
                                                                  "report (held-out counts only, or why it refused); "
                                                                  "null in the listing (/api/deployments/{id} has them)")


class DeploymentLogPage(BaseModel):
    lines: list[dict[str, Any]] = Field(description="the deployment's state changes from ``offset`` on, oldest first: "
                                                    "time, from, to, stage, why (a promotion's or rollback's reason) "
                                                    "and the stage's metrics")
    next_offset: int = Field(description="pass as ?offset= to get the changes after these")
    state: str


def log_lines(view: dict, offset: int) -> list[dict]:
    """The deployment's history from entry ``offset`` on as log events (the shape of the job's round
    log, ``fedfleet admin logs``; the event is the state entered): the metrics the stage was judged on
    become fields of their own."""
    return [{"t": h["t"], "deployment_id": view["deployment_id"], "event": h["to"], "stage": h["stage"],
             "from": h["from"], "why": h["why"],
             # per-device evidence stays in the deployment's history (one field per device is no log line)
             **{k: v for k, v in (h.get("metrics") or {}).items() if k != "evidence"}}
            for h in view["history"][offset:]]


def add_deployment_routes(app: FastAPI, ctx: ApiContext) -> None:
    get, post = (partial(method, tags=["deployments"]) for method in (app.get, app.post))
    table = DeploymentStore(ctx.store)

    def view(deployment_id: str) -> dict:
        try:
            return deployment_view(table, deployment_id)
        except KeyError:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no deployment {deployment_id!r}") from None

    @get("/api/deployments", response_model=list[DeploymentOut], responses=PAGE_READ,
         description="the deployments in creation order, each without its devices (their counts only)" + PAGED
                     + " (a deployment id)")
    def deployments(response: Response, after: str = Query(default="", pattern=f"^$|{DEPLOYMENT_ID}"),
                    limit: int = limit_query(), order: Order = order_query()) -> list[dict]:
        row = cursor(table.get(after), after) if after else None
        rows = table.list((row["created_at"], row["deployment_id"]) if row else None, limit + 1, order == "newest")
        # a deployment's every device is its own route's: one per device of the fleet, in each deployment
        return [{**view(r["deployment_id"]), "devices": None}
                for r in paged(response, rows, limit, table.count(), "deployment_id")]

    @get("/api/deployments/{deployment_id}", response_model=DeploymentOut, responses=ONE)
    def deployment(deployment_id: str = DeploymentId) -> dict:
        return view(deployment_id)

    @get("/api/deployments/{deployment_id}/log", response_model=DeploymentLogPage, responses=ONE,
         description="the deployment's state changes with their reasons from entry ``offset`` on "
                     "(``fedfleet admin logs --deployment ID --follow`` polls it with ``next_offset``)")
    def deployment_log(deployment_id: str = DeploymentId, offset: int = Query(default=0, ge=0, le=MAX_ID)) -> dict:
        v = view(deployment_id)
        return {"lines": log_lines(v, offset), "next_offset": max(offset, len(v["history"])), "state": v["state"]}

    @post("/api/models/{model_id}/deploy", response_model=DeploymentOut, status_code=201, responses=WRITE,
          description="roll the model version out: canary cohort, guard on the devices' held-out counts, "
                      "bake time, widening stages (``fedfleet admin model deploy ID``)")
    def deploy(req: DeploymentCreate, model_id: int = Path(ge=1, le=MAX_ID)) -> dict:
        if ctx.store.model(model_id) is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no model {model_id}")
        try:
            parse_stages(req.stages)        # refused here too: a read-only API's 409 would hide why
        except ValueError as exc:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_ENTITY, str(exc)) from None
        c = ctx.deployments
        return ctx.deploy_action(lambda: c.deploy(model_id, **req.model_dump()))

    @post("/api/deployments/{deployment_id}/promote", response_model=DeploymentOut, responses=WRITE,
          description="widen to the next stage now (the last: complete), without waiting for the bake time")
    def promote(deployment_id: str = DeploymentId) -> dict:
        view(deployment_id)
        c = ctx.deployments
        return ctx.deploy_action(lambda: c.promote(deployment_id))

    @post("/api/deployments/{deployment_id}/rollback", response_model=DeploymentOut, responses=WRITE,
          description="every device the deployment reached goes back to the version it kept")
    def rollback(req: Rollback | None = None, deployment_id: str = DeploymentId) -> dict:
        view(deployment_id)
        c, reason = ctx.deployments, (req or Rollback()).reason
        return ctx.deploy_action(lambda: c.rollback(deployment_id, reason))
