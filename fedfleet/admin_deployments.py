"""``fedfleet admin`` commands about model rollouts (issue 29), beside ``fedfleet/admin.py``:

    fedfleet admin model deploy ID [--cohort 5%] [--stages 25%,100%] [--guard "median_drop<=1.0"] [--bake 10m]
    fedfleet admin deployments
    fedfleet admin deployment show|promote|rollback ID [--reason TEXT]
"""

from __future__ import annotations

import re
import time

from .admin_client import all_pages
from .terminal_text import one_line, terminal_safe

DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(s|m|h|d)?\s*$")
UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``10m``, ``2h``, ``1d`` -> seconds."""
    m = DURATION.match(str(text))
    if m is None:
        raise ValueError(f"{text!r} is not a duration (e.g. 30s, 10m, 2h)")
    return float(m.group(1)) * UNIT_S[m.group(2) or "s"]


def add_deploy_arguments(parser) -> None:
    """The options of ``admin model deploy`` (on the ``model`` parser)."""
    parser.add_argument("--cohort", default="5%", help="deploy: the canary (5%%, tags:a,b or devices:id1,id2)")
    parser.add_argument("--stages", default="100%", help="deploy: widening fractions after the canary, ending at "
                                                         "100%% (e.g. 25%%,100%%)")
    parser.add_argument("--guard", default="median_drop<=1.0",
                        help="deploy: METRIC OP NUMBER[,...] on the devices' held-out counts (median_drop: "
                             "the median device's accuracy drop in percentage points, robust to a minority of "
                             "lying devices; also wma_drop, wma_candidate, wma_current, reports, refused)")
    parser.add_argument("--bake", default="10m", help="deploy: how long each stage runs before it is judged")
    parser.add_argument("--min-reports", type=int, default=3, help="deploy: fewer reports (distinct devices) fail "
                                                                             "the stage")
    parser.add_argument("--patience", default="10m", help="deploy: after the bake time, how long to wait for "
                                                         "--min-reports")
    parser.add_argument("--deployment-id", default="", help="deploy: its id (default m<ID>-<unix time>, -2, -3, ... added if taken)")


def add_deployment_parsers(add) -> None:
    """``deployments`` and ``deployment``; ``add`` makes a subcommand parser (as in admin.py)."""
    add("deployments", help="table of model rollouts")
    d = add("deployment", help="show / promote / roll back a model rollout")
    d.add_argument("action", choices=["show", "promote", "rollback"])
    d.add_argument("deployment_id")
    d.add_argument("--reason", default="rolled back by the operator", help="rollback: why (kept with it)")


def deploy(args, client):
    body = {"cohort": args.cohort, "stages": args.stages, "guard": args.guard, "bake_s": parse_duration(args.bake),
            "min_reports": args.min_reports, "patience_s": parse_duration(args.patience),
            "deployment_id": args.deployment_id}
    d = client.post(f"/api/models/{args.model_id}/deploy", body)
    return d, deployment_text(d)


def deployments(client, table):
    rows = [{**d, "stage_": f"{d['stage']}/{len(d['stages'])}", "reached": d["counts"]["sent_run"],
             "reported": d["counts"]["reported"], "why": (d["reason"] or "")[:80] or None}
            for d in all_pages(client, "/api/deployments", "deployment_id")]
    return rows, table(rows, [("DEPLOYMENT", "deployment_id"), ("MODEL", "model_id"), ("STATE", "state"),
                              ("STAGE", "stage_"), ("COHORT", "cohort"), ("GUARD", "guard"), ("REACHED", "reached"),
                              ("REPORTED", "reported"), ("WHY", "why")])


def deployment(args, client):
    path = f"/api/deployments/{args.deployment_id}"
    if args.action == "show":
        d = client.get(path)
    elif args.action == "promote":
        d = client.post(path + "/promote")
    else:
        d = client.post(path + "/rollback", {"reason": args.reason})
    return d, deployment_text(d)


def deployment_text(d: dict) -> str:
    """A deployment as an operator reads it: the rule, every state change with why, every device."""
    stages = " -> ".join([d["cohort"]] + [f"{f * 100:g}%" for f in d["stages"]])
    lines = [f"deployment {d['deployment_id']}: model {d['model_id']} ({d['model_sha256'][:12]}) {d['state']}"
             + (f", replacing model {d['replaces']}" if d["replaces"] else ""),
             f"  stages {stages}; now stage {d['stage']}", f"  guard {d['guard']}, bake {d['bake_s']:g} s, "
             f"at least {d['min_reports']} report(s) within {d['patience_s']:g} s more"]
    if d["reason"]:
        lines.append(f"  reason    {one_line(d['reason'])}")
    for h in d["history"]:
        m = h.get("metrics") or {}
        median = f", median drop {m['median_drop']:.2f} pp" if m.get("median_drop") is not None else ""
        acc = (f" (candidate {m['wma_candidate']:.2f}%, current {m['wma_current']:.2f}%{median}, "
               f"{m['reports']:.0f} reports)" if m.get("wma_candidate") is not None else "")
        lines.append(f"  {time.strftime('%H:%M:%S', time.localtime(h['t']))} {h['from']} -> {h['to']}: {one_line(h['why'])}{acc}")
    for dev, s in sorted(d["devices"].items()):
        r = s["report"] or {}
        said = (f"refused: {one_line(r['refused'])}" if r.get("refused") else
                f"held-out {r['correct_candidate']}/{r['n']} (was {r['correct_current']})" if r else "no report")
        lines.append(f"  {dev:<20} sent {s['sent']:<9} {said}")
    return terminal_safe("\n".join(lines))
