"""Admin routes about jobs: create (every registered kind), control, rounds, evaluations,
quarantined contributions, and the model versions jobs produce."""

from __future__ import annotations

from functools import partial

from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Path, Query, status
from fastapi.responses import Response

from aggregator.jobs.registry import full_config
from aggregator.storage.round_log import SETTING_PREFIX, read_from
from aggregator.storage.rounds import StoredRound
from aggregator.storage.store import Store
from aggregator.api.context import ApiContext
from aggregator.api.paging import PAGE_READ, PAGED, Order, cursor, limit_query, order_query, paged
from aggregator.api.schemas import (ID_PATTERN, JOB_ID_PATTERN, MAX_ID, ONE, WRITE, Job, JobCreate, LineageEntry, Model, Quarantined,
                      Round, RoundLogPage)

JobId = Path(pattern=JOB_ID_PATTERN)
ModelId = Path(ge=1, le=MAX_ID)


def add_job_routes(app: FastAPI, ctx: ApiContext) -> None:
    get, post = (partial(method, tags=["jobs"]) for method in (app.get, app.post))
    store = ctx.store

    @get("/api/jobs", response_model=list[Job], responses=PAGE_READ,
         description="the jobs in creation order" + PAGED + " (a job id)")
    def jobs(response: Response, after: str = Query(default="", pattern=f"^$|{JOB_ID_PATTERN}"),
             limit: int = limit_query(), order: Order = order_query()) -> list[dict]:
        row = cursor(store.job(after), after) if after else None
        start = (row["created_at"], row["job_id"]) if row else None
        rows = store.jobs(start, limit + 1, newest=order == "newest")
        return [ctx.job_out(j) for j in paged(response, rows, limit, store.job_count(), "job_id")]

    @post("/api/jobs", response_model=Job, status_code=201, responses=WRITE,
            description="create a job of any registered kind (``fedfleet admin job create FILE`` sends the file)")
    def create_job(req: JobCreate) -> dict:
        config = {**req.config.model_dump(exclude_none=True), "job_id": req.job_id}
        try:
            full_config(req.kind, config)           # its fields, their cross-field rules, what a stored job needs
        except (ValueError, TypeError) as exc:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_ENTITY, str(exc)) from None
        return ctx.job_out(ctx.mutate(lambda: ctx.service.create_job(req.kind, config)))

    @get("/api/jobs/{job_id}", response_model=Job, responses=ONE)
    def job(job_id: str = JobId) -> dict:
        return ctx.job_out(ctx.job(job_id))

    @post("/api/jobs/{job_id}/{action}", response_model=Job, responses=WRITE)
    def control(action: Literal["start", "pause", "resume", "cancel"], job_id: str = JobId) -> dict:
        ctx.job(job_id)
        return ctx.job_out(ctx.mutate(lambda: ctx.service.control_job(job_id, action)))

    @get("/api/jobs/{job_id}/quarantine", response_model=list[Quarantined], responses=ONE,
           description="contributions that passed validation but broke the job, or that its fleet screen named: "
                       "kept out of it, with the reason")
    def quarantine(job_id: str = JobId) -> list[dict]:
        ctx.job(job_id)
        return store.quarantined(job_id)

    @post("/api/jobs/{job_id}/quarantine/{device_id}/release", response_model=list[Quarantined], responses=WRITE,
          description="reverse a quarantine: the device may be asked again and the job's fleet screen spares it; "
                      "answers the job's remaining quarantine")
    def release_quarantine(job_id: str = JobId, device_id: str = Path(pattern=ID_PATTERN)) -> list[dict]:
        ctx.job(job_id)
        return ctx.mutate(lambda: ctx.service.release_quarantine(job_id, device_id))

    @get("/api/jobs/{job_id}/rounds", response_model=list[Round], responses=ONE,
         description="the job's rounds in order; ``last``: only the last that many (the dashboard's page)")
    def rounds(job_id: str = JobId, last: int | None = Query(default=None, ge=1, le=MAX_ID)) -> list[dict]:
        ctx.job(job_id)
        return round_views(store, job_id, ctx.live(), store.rounds(job_id, last))

    @get("/api/jobs/{job_id}/rounds/{round_no}", response_model=Round, responses=ONE)
    def round_detail(job_id: str = JobId, round_no: int = Path(ge=1, le=MAX_ID)) -> dict:
        ctx.job(job_id)
        stored = store.round_of(job_id, round_no)         # that round alone, not the job's every round
        if stored is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id!r} has no round {round_no}")
        return round_views(store, job_id, ctx.live(), stored=[stored])[0]

    @get("/api/jobs/{job_id}/evaluations", response_model=list[dict[str, Any]],
           description="provisional-model evaluations in order (accuracy curve)", responses=ONE)
    def evaluations(job_id: str = JobId) -> list[dict]:
        ctx.job(job_id)
        return store.evaluations(job_id)

    @get("/api/jobs/{job_id}/log", response_model=RoundLogPage, responses=ONE,
         description="the job's round log from byte ``offset`` on (a bounded page of whole lines); "
                     "``fedfleet admin logs JOB --follow`` polls it with each answer's ``next_offset``")
    def round_log(job_id: str = JobId, offset: int = Query(default=0, ge=0, le=MAX_ID)) -> dict:
        row = ctx.job(job_id)
        path = store.setting(SETTING_PREFIX + job_id)         # set when the job first ran
        lines, next_offset = read_from(path, offset) if path else ([], offset)
        return {"lines": lines, "next_offset": next_offset, "job_state": row["state"]}



def add_model_routes(app: FastAPI, ctx: ApiContext) -> None:
    get, post = (partial(method, tags=["models"]) for method in (app.get, app.post))
    store = ctx.store

    def get_model(model_id: int) -> dict:
        m = store.model(model_id)
        if m is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no model {model_id}")
        return m

    @get("/api/models", response_model=list[Model], responses=PAGE_READ,
         description="model versions in id (creation) order, of one job (``job_id``) or all" + PAGED + " (a model id)")
    def models(response: Response, job_id: str | None = Query(default=None, pattern=JOB_ID_PATTERN),
               after: int | None = Query(default=None, ge=1, le=MAX_ID), limit: int = limit_query(),
               order: Order = order_query()) -> list[dict]:
        rows = store.models(job_id, after, limit + 1, newest=order == "newest")
        return paged(response, rows, limit, store.model_count(job_id), "model_id")

    @get("/api/models/{model_id}", response_model=Model, responses=ONE)
    def model(model_id: int = ModelId) -> dict:
        return get_model(model_id)

    @get("/api/models/{model_id}/download", response_class=Response,
           responses={**ONE, 200: {"content": {"application/octet-stream": {}}, "description": "the model as .npz"}})
    def download(model_id: int = ModelId) -> Response:
        m = get_model(model_id)
        return Response(store.model_bytes(model_id), media_type="application/octet-stream",
                        headers={"Content-Disposition": f'attachment; filename="{m["job_id"]}-v{m["version"]}.npz"',
                                 "X-Model-SHA256": m["sha256"]})

    @get("/api/models/{model_id}/lineage", response_model=list[LineageEntry], responses=ONE,
           description="the model and its ancestors, newest first, with the devices each round added")
    def lineage(model_id: int = ModelId) -> list[dict]:
        get_model(model_id)
        return store.lineage(model_id)



def round_views(store: Store, job_id: str, live: dict, stored: list[StoredRound]) -> list[dict]:
    """The job's ``stored`` rounds (consecutive, in order) as the API shows them: closed rounds as the
    round machine reported them, the open round from the live round machine (or, service down, from
    the durable records)."""
    received: dict[int, dict[str, float]] = {}
    if not stored:
        return []
    # only the contributions of the rounds shown (a page's first round to its last)
    for c in store.contributions(job_id, with_payload=False, after_round=stored[0].round - 1,
                                 through_round=stored[-1].round):
        received.setdefault(c.round, {})[c.device] = c.received_at
    current = (live.get("job") or {}).get("current_round") if (live.get("job") or {}).get("job_id") == job_id else None
    out = []
    for r in stored:
        live_round = current if current and current["round"] == r.round else None
        if r.outcome:
            accepted, dropped = r.outcome["accepted"], r.outcome["dropped"]
            declined, rejected, pending = r.outcome["declined"], r.outcome["rejected"], []
        elif live_round:
            accepted, declined, rejected = live_round["accepted"], live_round["declined"], live_round["rejected"]
            dropped, pending = live_round["lost"], live_round["pending"]
        else:
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
