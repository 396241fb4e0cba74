"""``fedfleet simulate --pipeline fed3r-ft-oll --deploy``: after training, the fine-tuned head goes to
the emulated fleet through a canary, the way an operator would roll it out, and a second scenario
deploys the same head with its classes permuted (a broken export) to show the automatic rollback.

Both run the real deployment controller (``aggregator/deployments/``) on a store of their own and
one :class:`edge_client.deployment.DeploymentFollower` per device on the fleet's broker (in this
process, beside the device hosts), each judging candidates on its device's held-out split (the
pipeline's; the features through the same backbone). The pipeline's devices personalise (its last
phase is OLL), so each judges and predicts with the head pruned to its training split's labels. The report gives, per stage, the devices on
each version and the pooled held-out accuracy of candidate and current version they reported.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from aggregator.deployments.controller import DeploymentController
from aggregator.deployments.machine import DeploymentState
from aggregator.storage.schema import JobState
from aggregator.storage.store import Store
from edge_client.deployment import DeploymentFollower, ModelSlot
from protocols.mqtt_link import BrokerConfig
from protocols.topics import Topics

SCENARIOS = ("fine-tuned", "broken")


def run_deploy_scenarios(cfg, prep, model_file: Path, broker_url: str, out: Path, say) -> dict:
    """The two rollouts; returns {scenario: {state, reason, stages: [...], versions: {...}}}."""
    out.mkdir(parents=True, exist_ok=True)
    with np.load(model_file) as z:
        W, b = z["weight"], z["bias"]
    perm = np.roll(np.arange(len(b)), 1)
    store = Store(out / "deploy.db")
    devices = sorted(prep.holdouts)
    for d in devices:
        store.enroll_device(d, None, None)
    models = {}
    for name, (w, bias) in {"fine-tuned": (W, b), "broken": (W[perm], b[perm])}.items():
        store.create_job(f"deploy-{name}", "fedavg", {})
        models[name] = store.finish_job(f"deploy-{name}", JobState.DONE, {}, {}, {"weight": w, "bias": bias}, {}, 1)
    features = {d: prep.extractor.extract(prep.Xtr[prep.holdouts[d]]) for d in devices}
    labels = {d: prep.ytr[prep.holdouts[d]] for d in devices}
    broker, topics = BrokerConfig.from_url(broker_url), Topics(f"deploy{time.monotonic_ns()}")
    followers = {d: DeploymentFollower(d, broker, TimedSlot(out / "devices" / d, prep.ytr[prep.shards[d]]),
                                       lambda bundle, d=d: (features[d], labels[d]), topics, retry_s=1.0).start()
                 for d in devices}
    ctl = DeploymentController(store, broker, topics, tick_s=0.1).start()
    report = {}
    try:
        for name in SCENARIOS:
            say(f"  deploy {name} head (model {models[name]}): canary {cfg.deploy_canary}, stages "
                f"{cfg.deploy_stages}, guard {cfg.deploy_guard}, bake {cfg.deploy_bake_s:g} s")
            report[name] = _rollout(ctl, followers, models[name], name, cfg)
            say(format_scenario(name, report[name]))
    finally:
        ctl.stop()
        for f in followers.values():
            f.stop()
        store.close()
    return report


class TimedSlot(ModelSlot):
    """A device's slot that notes when it changed version (wall clock, the controller history's
    clock): the report counts each stage's versions at the moment the controller ended it, not from
    a polling thread a loaded machine can starve past the canary's swaps."""

    def __init__(self, *args, **kwargs):
        self.changes: list[tuple[float, str]] = []       # (time, version), in order
        super().__init__(*args, **kwargs)

    def _commit(self, current, previous, labels_only: bool = False, **kw) -> None:
        super()._commit(current, previous, labels_only, **kw)
        self.changes.append((time.time(), version_of(self.current)))

    def version_at(self, t: float) -> str:
        return next((v for when, v in reversed(self.changes) if when <= t), "none")


def _rollout(ctl, followers, model_id: int, name: str, cfg) -> dict:
    """Deploy, wait until it is over, then count per stage which version each device ran when the
    controller ended that stage (the last stage: at the end)."""
    dep_id = f"{name}-{model_id}"
    ctl.call(lambda: ctl.deploy(model_id, cohort=cfg.deploy_canary, stages=cfg.deploy_stages, guard=cfg.deploy_guard,
                                bake_s=cfg.deploy_bake_s, min_reports=1, patience_s=cfg.deploy_bake_s * 10,
                                deployment_id=dep_id))
    deadline = time.monotonic() + 60 + 20 * cfg.deploy_bake_s
    while time.monotonic() < deadline and ctl.show(dep_id)["state"] not in (DeploymentState.COMPLETE,
                                                                             DeploymentState.ROLLED_BACK):
        time.sleep(0.1)
    time.sleep(1.0)                                  # the last assignments (rollback, late swaps) land
    view = ctl.show(dep_id)
    entered = view["history"]                        # each entry starts (state "to", stage)
    ends = [h["t"] for h in entered[1:]] + [time.time()]
    stages = [{"state": h["to"], "stage": h["stage"], "versions": versions(followers, end)}
              for h, end in zip(entered, ends)]
    judged = [h for h in entered if h.get("metrics")]
    for entry, h in zip(stages, judged):
        m = h["metrics"]
        entry.update(reports=int(m["reports"]), wma_candidate=m["wma_candidate"], wma_current=m["wma_current"],
                     judged=sorted(m.get("evidence", {})))
    return {"deployment": dep_id, "state": view["state"], "reason": view["reason"], "stages": stages,
            "final_versions": versions(followers), "devices": len(followers)}


def version_of(head) -> str:
    """A version's name in the report: the head's sha256 prefix, 'none' for the device's own."""
    return head.sha256[:12] if head is not None else "none"


def versions(followers, at: float | None = None) -> dict[str, int]:
    """How many devices run each version now (or ran it at time ``at``)."""
    out: dict[str, int] = {}
    for f in followers.values():
        key = version_of(f.slot.current) if at is None else f.slot.version_at(at)
        out[key] = out.get(key, 0) + 1
    return out


def format_scenario(name: str, r: dict) -> str:
    lines = [f"  {name}: {r['state']}" + (f" ({r['reason']})" if r["reason"] else "")]
    for s in r["stages"]:
        current = (f"current {s['wma_current']:.2f}%" if s.get("wma_current") else "no version deployed before")
        acc = (f"; judged on {s['reports']} report(s): candidate {s['wma_candidate']:.2f}% held-out vs {current}"
               if s.get("wma_candidate") is not None else "")
        lines.append(f"    stage {s['stage']} ({s['state']}): devices per version {s['versions']}{acc}")
    lines.append(f"    at the end: devices per version {r['final_versions']} of {r['devices']}")
    return "\n".join(lines)


DEPLOY_HEADER = ("rollout", "stage", "state", "devices per version", "reports", "candidate held-out %", "current %")


def deployment_rows(deployments: dict) -> list[tuple]:
    """One row per stage of each scenario, for the report's table."""
    pct = (lambda v: "-" if v is None else f"{v:.2f}")
    return [(name, s["stage"], s["state"], ", ".join(f"{k}: {v}" for k, v in sorted(s["versions"].items())),
             s.get("reports", "-"), pct(s.get("wma_candidate")), pct(s.get("wma_current")))
            for name, r in deployments.items() for s in r["stages"]]
