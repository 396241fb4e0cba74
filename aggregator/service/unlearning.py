"""Exact unlearning: remove one device's data from the jobs that hold it (``fedfleet admin device
forget ID``).

Fed3R's model is a function of Σ_k A_k and Σ_k B_k only, so deleting a device's stored
statistics and re-solving gives *the* ridge solution without that device: equal, bit for bit, to a
run the device never took part in, because both sum the remaining contributions in device-id
order (``canonical.canonical_job``). What is deleted is gone from the store for good (its rows and
the job's checkpoint, a sum that held it); a restart replays only what is left.

Other kinds cannot forget exactly, and say why (``NOT_FORGETTABLE``): a gradient-trained model
(FedAvg family, LADD, personalization) carries each update's influence into every later round,
and Fed3R-Sync never held the device's statistics on their own — only its group's masked sum
(``docs/algorithms.md``, "Forgetting").
"""

from __future__ import annotations

from protocols.envelope import decode_header

from aggregator.service.canonical import canonical_job
from aggregator.shards.shard import RECEIPT
from aggregator.storage.store import FINAL_JOB_STATES, Store

FORGETTABLE = ("fed3r", "fedncm")      # sums of per-device statistics: re-summed without the device
# a DP job's model is a function of its noisy releases only: re-summing without the device would be a
# second release of every other device (fresh noise, counted nowhere), and the sums it would need are
# never released (docs/algorithms.md, DP Fed3R)
DP_RELEASE = ("a DP job's model comes from its noisy releases; re-solving without the device would release "
              "every other device's statistics again")
NOT_FORGETTABLE = {
    "fed3r-sync": "the device's statistics exist only inside its group's masked sum: removing them needs the "
                  "group re-summed without it, i.e. the other members' masked inputs again (a new secure round)",
}
NOT_FORGETTABLE["fedncm-sync"] = NOT_FORGETTABLE["fed3r-sync"]
GRADIENT = "a gradient-trained model keeps every update's influence in all later rounds: no exact removal"
SHARDED = ("the job ran on shards: the device's statistics are in its shard's store and the coordinator holds only "
           "receipts, which cannot be re-summed here")


def jobs_to_forget(store: Store, device: str, job_id: str | None = None) -> list[dict]:
    """The jobs that hold ``device``'s data: stored contributions, or a secure round it was summed in."""
    rows = []
    for job in store.jobs():
        if job_id is not None and job["job_id"] != job_id:
            continue
        holds = job["job_id"] in store.jobs_of_device(device) or any(
            device in (r.outcome or {}).get("accepted", ()) for r in store.rounds(job["job_id"]))
        if holds:
            rows.append(job)
    return rows


def summed_on_shards(store: Store, job_id: str, device: str) -> bool:
    """Whether the job's stored contributions of ``device`` are shards' receipts (no statistics)."""
    seq = next((c.seq for c in store.contributions(job_id, with_payload=False) if c.device == device), None)
    return seq is not None and RECEIPT in decode_header(store.contribution_payload(job_id, seq)).body


def forget_stored(store: Store, job: dict, device: str, eval_set=None) -> dict:
    """Forget ``device`` in one stored job: its report line. A finished job is re-solved at once (a
    new final model version); a running one is rebuilt by the service; any other resumes without it."""
    kind = job["kind"]
    if kind not in FORGETTABLE:
        return {"job_id": job["job_id"], "kind": kind, "forgotten": False, "reason": NOT_FORGETTABLE.get(kind, GRADIENT)}
    if float((job["config"] or {}).get("dp_noise_multiplier", 0) or 0) > 0:
        return {"job_id": job["job_id"], "kind": kind, "forgotten": False, "reason": DP_RELEASE}
    if summed_on_shards(store, job["job_id"], device):       # refused before anything is deleted
        return {"job_id": job["job_id"], "kind": kind, "forgotten": False, "reason": SHARDED}
    deleted = store.forget_device(job["job_id"], device)
    out = {"job_id": job["job_id"], "kind": kind, "forgotten": True, "contributions_deleted": deleted}
    if job["state"] in FINAL_JOB_STATES:
        fresh = canonical_job(store, kind, job["config"], job["job_id"])
        metrics = fresh.evaluate(*(eval_set if eval_set is not None else (None, None)))
        rounds = store.rounds(job["job_id"])
        out["model_id"] = store.replace_final_model(job["job_id"], fresh.model_arrays(), metrics,
                                                    rounds[-1].round if rounds else 0)
        out["metrics"] = metrics
    return out
