"""The job lifecycle an operator drives (admin API, ``fedfleet admin job ...``): create, start,
pause, resume, cancel. A table of which action is allowed in which stored state; the service
runs these on its own thread (the store's single writer) and applies the effect on the job it
is serving.

    action   allowed from                                   effect
    start    created, stopped                                queued (the service picks it up)
    pause    running                                         paused (no new round opens)
    resume   paused, stopped                                 running if served now, else queued
    cancel   created, queued, running, paused, stopped       cancelled (a served job: after its round)
"""

from __future__ import annotations

from aggregator.service.active_job import ActiveJob
from aggregator.jobs.registry import full_config
from aggregator.storage.store import Store, StoreError

ALLOWED = {"start": ("created", "stopped"), "pause": ("running",), "resume": ("paused", "stopped"),
           "cancel": ("created", "queued", "running", "paused", "stopped")}


def create_job(store: Store | None, kind: str, config: dict) -> dict:
    config = full_config(kind, config)              # validated, defaults made explicit
    if store is None:
        raise StoreError("creating jobs needs a store")
    store.create_job(config["job_id"], kind, config)
    return store.job(config["job_id"])


def control_job(store: Store | None, served: ActiveJob | None, job_id: str, action: str) -> dict:
    row = store.job(job_id) if store else None
    if row is None:
        raise KeyError(job_id)
    if action not in ALLOWED:
        raise ValueError(f"unknown action {action!r}")
    if row["state"] not in ALLOWED[action]:
        raise StoreError(f"cannot {action} job {job_id} in state {row['state']!r}")
    a = served if served is not None and served.job_id == job_id else None
    if action == "pause":
        if a is not None:
            a.state = "paused"
        store.set_job_state(job_id, "paused")
    elif action == "resume" and a is not None:
        a.state = "running"
        store.set_job_state(job_id, "running")
    elif action in ("start", "resume"):
        store.set_job_state(job_id, "queued")
    elif a is not None:                              # cancel the job being served: after its round
        a.cancelling = True
    else:
        store.set_job_state(job_id, "cancelled")
    return store.job(job_id)
