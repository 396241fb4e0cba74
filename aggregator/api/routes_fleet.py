"""Admin routes about devices: the fleet summary and its mode, enrolment, revocation, clusters."""

from __future__ import annotations

from functools import partial

from typing import Literal

from fastapi import FastAPI, HTTPException, Path, Query, status

from aggregator.api.context import ApiContext
from aggregator.api.schemas import (ID_PATTERN, JOB_ID_PATTERN, ONE, READ, WRITE, Cluster, Credentials, Device, EnrollRequest, FleetMode,
                      FleetSummary, Forgotten)

DeviceId = Path(pattern=ID_PATTERN)


def add_fleet_routes(app: FastAPI, ctx: ApiContext) -> None:
    get, post = (partial(method, tags=["fleet"]) for method in (app.get, app.post))
    store = ctx.store

    @get("/api/fleet", response_model=FleetSummary, responses=READ)
    def fleet() -> dict:
        devices, snap = store.devices(), ctx.live()
        return {"mode": snap.get("fleet_mode") or store.setting("fleet_mode") or "enrolled",
                "enrolled": sum(d["status"] == "enrolled" for d in devices),
                "revoked": sum(d["status"] == "revoked" for d in devices),
                "online": len(snap.get("devices_online", [])), "online_not_enrolled": len(snap.get("not_enrolled", [])),
                "clusters": len(store.clusters()), "active_job": (snap.get("job") or {}).get("job_id")}

    @post("/api/fleet/mode", response_model=FleetSummary, responses=WRITE,
            description="set the fleet mode on purpose: open (any device may contribute) or enrolled")
    def set_fleet_mode(req: FleetMode) -> dict:
        ctx.mutate(lambda: ctx.service.set_fleet_mode(req.mode))
        return fleet()

    @get("/api/devices", response_model=list[Device], responses=READ,
         description="every device the aggregator knows: enrolled and revoked ones from the store, and those it "
                     "heard from without being enrolled (status 'not enrolled'), each with its presence")
    def devices(status_: Literal["enrolled", "revoked", "not enrolled"] | None = Query(default=None, alias="status")
                ) -> list[dict]:
        return [d for d in with_live(store.devices(), ctx.live()) if status_ is None or d["status"] == status_]

    @get("/api/devices/{device_id}", response_model=Device, responses=ONE)
    def device(device_id: str = DeviceId) -> dict:
        d = store.device(device_id)
        if d is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no device {device_id!r}")
        return with_live([d], ctx.live())[0]

    @post("/api/devices", response_model=Credentials, status_code=201, responses=WRITE,
            description="enrol a device: returns its MQTT password (and private key, if generated) once")
    def enroll(req: EnrollRequest) -> dict:
        key = bytes.fromhex(req.public_key) if req.public_key else None
        return ctx.mutate(lambda: ctx.service.enroll(req.device_id, key)).to_dict()

    @post("/api/devices/{device_id}/revoke", response_model=Device, responses=WRITE)
    def revoke(device_id: str = DeviceId) -> dict:
        ctx.mutate(lambda: ctx.service.revoke(device_id))
        return store.device(device_id)

    @post("/api/devices/{device_id}/forget", response_model=list[Forgotten], responses=WRITE,
          description="exact unlearning: remove the device's statistics from every plaintext Fed3R job that "
                      "holds them (or job_id only) and re-solve; other jobs say why they cannot")
    def forget(device_id: str = DeviceId, job_id: str | None = Query(default=None, pattern=JOB_ID_PATTERN)) -> list[dict]:
        return ctx.mutate(lambda: ctx.service.forget_device(device_id, job_id))

    @get("/api/clusters", response_model=list[Cluster], responses=READ)
    def clusters() -> list[dict]:
        return store.clusters()



def with_live(devices: list[dict], live: dict) -> list[dict]:
    """Overlay the service's in-memory presence and last-seen on stored device rows; a device the
    service heard from that the store does not know is listed too, as 'not enrolled'."""
    if not live:
        return devices
    online, seen = set(live.get("devices_online", ())), live.get("last_seen", {})
    known = {d["device_id"] for d in devices}
    strangers = [{"device_id": dev, "status": "not enrolled", "public_key": None, "enrolled_at": None,
                  "revoked_at": None, "last_seen": None, "online": False, "profile": {}, "cluster": None}
                 for dev in sorted((online | set(seen)) - known)]
    return sorted(({**d, "online": d["device_id"] in online,
                    "last_seen": max(filter(None, (d["last_seen"], seen.get(d["device_id"]))), default=None)}
                   for d in devices + strangers), key=lambda d: d["device_id"])
