"""Admin routes about devices: the fleet summary and its mode, enrolment, revocation, clusters."""

from __future__ import annotations

from functools import partial

from typing import Literal

from fastapi import FastAPI, HTTPException, Path, Query, Response, status

from aggregator.api.context import ApiContext
from aggregator.api.schemas import (ID_PATTERN, JOB_ID_PATTERN, ONE, READ, WRITE, Cluster, Credentials, Device,
                                    DeviceTags, EnrollRequest, FleetMode, FleetSummary, Forgotten, RevokedDevice)

DeviceId = Path(pattern=ID_PATTERN)
DEVICE_PAGE, MAX_DEVICE_PAGE = 1000, 10_000        # devices per page of /api/devices: default, most


def add_fleet_routes(app: FastAPI, ctx: ApiContext) -> None:
    get, post = (partial(method, tags=["fleet"]) for method in (app.get, app.post))
    store = ctx.store

    @get("/api/fleet", response_model=FleetSummary, responses=READ)
    def fleet() -> dict:
        counts, snap = store.device_counts(), ctx.live()
        return {"mode": snap.get("fleet_mode") or store.setting("fleet_mode") or "enrolled",
                "enrolled": counts.get("enrolled", 0), "revoked": counts.get("revoked", 0),
                "online": len(snap.get("devices_online", [])), "online_not_enrolled": len(snap.get("not_enrolled", [])),
                "clusters": len(store.clusters()), "active_job": (snap.get("job") or {}).get("job_id")}

    @post("/api/fleet/mode", response_model=FleetSummary, responses=WRITE,
            description="set the fleet mode on purpose: open (any device may contribute) or enrolled")
    def set_fleet_mode(req: FleetMode) -> dict:
        ctx.mutate(lambda: ctx.service.set_fleet_mode(req.mode))
        return fleet()

    @get("/api/devices", response_model=list[Device], responses=READ,
         description="the devices the aggregator knows, in id order, a page at a time: enrolled and revoked ones "
                     "from the store, and those it heard from without being enrolled (status 'not enrolled'), "
                     "each with its presence. A full page carries the header X-Next-After: pass it as `after` "
                     "for the next page")
    def devices(response: Response,
                status_: Literal["enrolled", "revoked", "not enrolled"] | None = Query(default=None, alias="status"),
                after: str = Query(default="", pattern=f"^$|{ID_PATTERN}"),
                limit: int = Query(default=DEVICE_PAGE, ge=1, le=MAX_DEVICE_PAGE)) -> list[dict]:
        stored = [] if status_ == "not enrolled" else store.devices(after, limit, status_)
        page = device_page(stored, ctx.live(), store, after, limit, strangers=status_ in (None, "not enrolled"))
        if len(page) == limit:
            response.headers["X-Next-After"] = page[-1]["device_id"]
        return page

    @get("/api/devices/{device_id}", response_model=Device, responses=ONE)
    def device(device_id: str = DeviceId) -> dict:
        d = store.device(device_id)
        if d is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no device {device_id!r}")
        live = ctx.live()
        return with_presence(d, set(live.get("devices_online", ())), live.get("last_seen", {})) if live else d

    @post("/api/devices", response_model=Credentials, status_code=201, responses=WRITE,
            description="enrol a device: returns its MQTT password (and private key, if generated) once")
    def enroll(req: EnrollRequest) -> dict:
        key = bytes.fromhex(req.public_key) if req.public_key else None
        return ctx.mutate(lambda: ctx.service.enroll(req.device_id, key)).to_dict()

    @post("/api/devices/{device_id}/tags", response_model=Device, responses=WRITE,
          description="set the tags of a known device (enrolled or revoked), replacing any it had: a deployment's "
                      "tags: cohort selects the devices the operator tagged, never those that announce a tag")
    def set_tags(req: DeviceTags, device_id: str = DeviceId) -> dict:
        ctx.mutate(lambda: store.set_device_tags(device_id, req.tags))
        return device(device_id)

    @post("/api/devices/{device_id}/revoke", response_model=RevokedDevice, responses=WRITE)
    def revoke(device_id: str = DeviceId) -> dict:
        warning = ctx.mutate(lambda: ctx.service.revoke(device_id))
        return {**store.device(device_id), "warning": warning}

    @post("/api/devices/{device_id}/forget", response_model=list[Forgotten], responses=WRITE,
          description="exact unlearning: remove the device's statistics from every Fed3R or FedNCM job without "
                      "DP that holds them (or job_id only) and re-solve; other jobs (secure, DP, sharded, "
                      "gradient-trained) say why they cannot")
    def forget(device_id: str = DeviceId, job_id: str | None = Query(default=None, pattern=JOB_ID_PATTERN)) -> list[dict]:
        return ctx.mutate(lambda: ctx.service.forget_device(device_id, job_id))

    @get("/api/clusters", response_model=list[Cluster], responses=READ)
    def clusters() -> list[dict]:
        return store.clusters()



def device_page(stored: list[dict], live: dict, store, after: str, limit: int, strangers: bool = True) -> list[dict]:
    """The first ``limit`` devices after ``after`` of the stored rows (``stored``: their page) and,
    with ``strangers``, the devices the service heard from that the store does not know ('not
    enrolled'), each with its presence."""
    online, seen = set(live.get("devices_online", ())), live.get("last_seen", {})
    # a stranger beyond a full stored page cannot be on this page: only ids up to its last are looked up
    bound = stored[-1]["device_id"] if len(stored) == limit else None
    heard = sorted(d for d in online | set(seen) if d > after and (bound is None or d <= bound)) if strangers else []
    unknown = [{"device_id": dev, "status": "not enrolled", "public_key": None, "enrolled_at": None,
                  "revoked_at": None, "last_seen": None, "online": False, "profile": {}, "cluster": None}
                 for dev in store.unknown_devices(heard)]
    rows = stored + unknown
    if live:
        rows = [with_presence(d, online, seen) for d in rows]
    return sorted(rows, key=lambda d: d["device_id"])[:limit]


def with_presence(device: dict, online: set[str], seen: dict[str, float]) -> dict:
    """A device's row with the service's in-memory presence and last-seen laid over the stored ones."""
    return {**device, "online": device["device_id"] in online,
            "last_seen": max(filter(None, (device["last_seen"], seen.get(device["device_id"]))), default=None)}
