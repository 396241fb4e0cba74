"""``fedfleet admin``: the operator's command line, a thin client of the aggregator's admin API.

    fedfleet admin status | watch | fleet [open|enrolled] | devices | clusters | metrics | jobs | models
    fedfleet admin device show|enroll|tag|revoke|forget ID
    fedfleet admin job show|create|start|pause|resume|cancel|rounds ...
    fedfleet admin round JOB N
    fedfleet admin logs JOB [--follow]
    fedfleet admin model show|download|lineage|deploy ID
    fedfleet admin deployments | deployment show|promote|rollback ID   (model rollouts: admin_deployments.py)

Tables and progress bars for people; ``--json`` prints the API's JSON unchanged, for scripts.
The API address and token come from ``--url`` / ``--token`` (or ``--token-file``), else from
FEDFLEET_ADMIN_URL / FEDFLEET_ADMIN_TOKEN. Only the standard library is used (urllib).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

# the module's docstring is `fedfleet admin --help`'s description: the request and its bounds are in
# admin_client.py, what is printed for people in admin_rendering.py
from protocols.command_help import HelpFormatter, positive_int
from protocols.messages import MAX_TAGS, TAG_PATTERN
from protocols.regular_file import read_regular_file

from . import admin_deployments, admin_enroll
from .admin_client import AdminClient, AdminError, all_devices, all_pages
from .admin_ids import refused_id
from .admin_rendering import devices_rows, job_text, listed, log_line, model_rows, progress_line, round_rows, table
from .errors import UserError, load_json_file
from .terminal_text import one_line, terminal_safe

DEFAULT_URL = "http://127.0.0.1:8080"
MAX_CONFIG_BYTES = 1024 * 1024      # a job config file: the largest request the admin API takes
MAX_TOKEN_FILE_BYTES = 64 * 1024    # a token is tens of characters


# ----------------------------------------------------------------------------- commands
def _run(args, client: AdminClient) -> Any:
    """Do the command; returns (json_result, text) where text is the human rendering."""
    c = args.admin_cmd
    if c == "status":
        s = client.get("/api/status")
        return s, progress_line(s)
    if c == "watch":
        return _watch(args, client)
    if c == "logs":
        return _logs(args, client)
    if c == "fleet":
        f = client.post("/api/fleet/mode", {"mode": args.mode}) if args.mode else client.get("/api/fleet")
        return f, "\n".join(f"{k:<12}{one_line(v)}" for k, v in f.items())
    if c == "devices":
        d = all_devices(client, args.status)
        return d, table(devices_rows(d), [("DEVICE", "device_id"), ("STATUS", "status"), ("STATE", "state"),
                                           ("LAST SEEN", "seen"), ("CLUSTER", "cluster"), ("TAGS", "tags_"),
                                           ("PROFILE", "profile_")])
    if c == "device":
        return _device(args, client)
    if c == "jobs":
        # --limit N: the newest N, shown oldest first as the whole listing is
        j = (all_pages(client, "/api/jobs", "job_id") if args.limit is None else
             all_pages(client, "/api/jobs", "job_id", most=args.limit, order="newest")[::-1])
        rows = [{**x, "why": ((x.get("summary") or {}).get("error") or "")[:100] or None} for x in j]
        return j, table(rows, [("JOB", "job_id"), ("KIND", "kind"), ("STATE", "state"), ("ROUNDS", "rounds"),
                               ("CONTRIBUTIONS", "contributions"), ("WHY", "why")])
    if c == "job":
        return _job(args, client)
    if c == "round":
        r = client.get(f"/api/jobs/{args.job_id}/rounds/{args.round}")
        lines = [f"round {r['round']} of {args.job_id}: {one_line(r['state'], 64)}",
                 f"participants {listed(r['participants'])}", f"accepted     {listed(r['accepted'])}",
                 f"dropped      {listed(r['dropped'])}", f"declined     {listed(r['declined'])}",
                 f"rejected     {listed(r['rejected'])}", f"pending      {listed(r['pending'])}",
                 f"duration     {r['duration_s'] if r['duration_s'] is not None else 'open'}",
                 f"bytes in     {r['bytes_in']}"]
        lines += [f"  {d:<16} answered after {t:.2f}s" for d, t in sorted(r["result_latency_s"].items())]
        return r, "\n".join(lines)
    if c == "models":
        m = all_pages(client, "/api/models", "model_id", job_id=args.job)
        return m, table(model_rows(m), [("ID", "model_id"), ("JOB", "job_id"), ("VERSION", "version"),
                                         ("ROUND", "round"), ("PARENT", "parent_id"), ("CONTRIB", "contributions"),
                                         ("ACCURACY", "acc"), ("FINAL", "final_"), ("SHA256", "sha")])
    if c == "model":
        return _model(args, client)
    if c == "deployments":
        return admin_deployments.deployments(client, table)
    if c == "deployment":
        return admin_deployments.deployment(args, client)
    if c == "clusters":
        cl = client.get("/api/clusters")
        return cl, table(cl, [("CLUSTER", "cluster_id"), ("LABEL", "label"), ("JOB", "job_id"),
                              ("MODEL", "model_id"), ("DEVICES", "devices")])
    if c == "metrics":
        text = client.get("/metrics", raw=True).decode()
        return {"metrics": text}, text.rstrip()
    raise AdminError(f"unknown command {c!r}")


def _device(args, client):
    if args.action == "show":
        d = client.get(f"/api/devices/{args.device_id}")
        return d, "\n".join(f"{k:<12}{one_line(v)}" for k, v in devices_rows([d])[0].items() if not k.endswith("_"))
    if args.action == "revoke":
        d = client.post(f"/api/devices/{args.device_id}/revoke")
        return d, f"revoked {args.device_id}" + (f"\nwarning: {d['warning']}" if d.get("warning") else "")
    if args.action == "tag":
        d = client.post(f"/api/devices/{args.device_id}/tags", {"tags": _tags(args.tags)})
        return d, f"{args.device_id}: tags {','.join(d['tags']) or '(none)'}"
    if args.action == "forget":
        query = f"?job_id={args.job}" if args.job else ""
        lines = client.post(f"/api/devices/{args.device_id}/forget{query}")
        text = "\n".join(f"{x['job_id']}: " + (f"forgot {x['contributions_deleted']} contribution(s), re-solved"
                                                 if x["forgotten"] else f"not forgotten: {x['reason']}")
                         for x in lines)
        return lines, text or f"no job holds data of {args.device_id}"
    body = {"device_id": args.device_id}
    if args.public_key:
        body["public_key"] = args.public_key
    tags = _tags(args.tags) if args.tags is not None else None     # checked before anything is enrolled
    admin_enroll.check_credentials_target(args.out)                # so is where its credentials go
    creds = client.post("/api/devices", body)
    text = f"enrolled {args.device_id} (MQTT user {creds['mqtt_username']})"
    if tags is not None:
        try:        # the credentials are shown once: a failed tagging must not lose them
            tagged = client.post(f"/api/devices/{args.device_id}/tags", {"tags": tags})["tags"]
            text += f", tags {','.join(tagged) or '(none)'}"
        except AdminError as exc:
            text += (f"\nwarning: enrolled but not tagged ({exc}); "
                     f"tag it with: fedfleet admin device tag {args.device_id} --tags ...")
    if creds.get("warning"):
        text += f"\nwarning: {creds['warning']}"
    if args.out:
        admin_enroll.write_credentials(args.out, creds, args.device_id)     # holds secrets
        text += f"; credentials written to {args.out} (shown once, keep them safe)"
    else:
        text += "\n" + json.dumps(creds, indent=1)
    return creds, text


def _tags(text: str | None) -> list[str]:
    """``--tags a,b`` -> ["a", "b"] ("" clears them), each checked as the API checks it."""
    if text is None:
        raise AdminError("device tag needs --tags (a comma-separated list; \"\" clears them)")
    tags = sorted({t.strip() for t in text.split(",") if t.strip()})
    bad = [t for t in tags if not re.fullmatch(TAG_PATTERN, t)]
    if bad or len(tags) > MAX_TAGS:
        raise AdminError(f"--tags: at most {MAX_TAGS} tags of 1-64 of [A-Za-z0-9_.-]" + (f"; not {bad[0]!r}" if bad else ""))
    return tags


def _operator_file(path: Path, what: str, max_bytes: int) -> bytes:
    """A file the operator named, read only if it is a regular file of at most ``max_bytes``:
    ``/dev/zero`` was read until memory ran out and a FIFO blocked for ever (its size, 0, passed a
    check of st_size). A ``UserError``: found before any request."""
    try:
        return read_regular_file(path, what, max_bytes)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def _job(args, client):
    a = args.action
    if a == "show":
        j = client.get(f"/api/jobs/{args.job_id}")
        return j, job_text(j)
    if a == "evaluations":
        e = client.get(f"/api/jobs/{args.job_id}/evaluations")
        rows = [{"i": i + 1, "round": x.get("round", ""), "contributions": x.get("contributions", ""),
                 "accuracy": "" if x.get("accuracy") is None else f"{x['accuracy']:.4f}",
                 "t": "" if x.get("t") is None else f"{x['t']:.1f} s"} for i, x in enumerate(e)]
        return e, table(rows, [("#", "i"), ("ROUND", "round"), ("CONTRIBUTIONS", "contributions"),
                               ("ACCURACY", "accuracy"), ("TIME", "t")])
    if a == "create":
        # bounded as the API bounds a request; a key named twice refused here (the API never sees it)
        config = load_json_file(Path(args.config), "job config file", MAX_CONFIG_BYTES)
        if not isinstance(config, dict):
            raise UserError(f"{args.config}: a job config is a JSON object of settings, not {type(config).__name__}")
        job_id = args.job_id or config.get("job_id")
        config.pop("job_id", None)                      # named once, outside the settings
        if not job_id:
            raise UserError("the config has no job_id: pass --job-id")
        j = client.post("/api/jobs", {"job_id": job_id, "kind": args.kind, "config": config})
        if args.start:
            j = client.post(f"/api/jobs/{job_id}/start")
        return j, f"job {job_id}: {j['state']}"
    if a == "rounds":
        r = client.get(f"/api/jobs/{args.job_id}/rounds")
        return r, table(round_rows(r), [("ROUND", "round"), ("STATE", "state"), ("PARTICIPANTS", "n_part"),
                                         ("ACCEPTED", "n_acc"), ("DROPPED", "n_drop"), ("DECLINED", "n_decl"),
                                         ("REJECTED", "n_rej"), ("DURATION", "dur"), ("KB IN", "kb")])
    j = client.post(f"/api/jobs/{args.job_id}/{a}")
    return j, f"job {args.job_id}: {j['state']}"


def _model(args, client):
    if args.action == "show":
        m = client.get(f"/api/models/{args.model_id}")
        return m, "\n".join(f"{k:<14}{one_line(v, 2000)}" for k, v in m.items())
    if args.action == "deploy":
        return admin_deployments.deploy(args, client)
    if args.action == "lineage":
        lin = client.get(f"/api/models/{args.model_id}/lineage")
        return lin, "\n".join(f"v{m['version']} (id {m['model_id']}, round {m['round']}, {m['contributions']} "
                              f"contributions, sha {one_line(m['sha256'][:12])}) <- +{listed(m['accepted'], 'nothing')}"
                              for m in lin)
    data = client.get(f"/api/models/{args.model_id}/download", raw=True)
    Path(args.output).write_bytes(data)
    return {"model_id": args.model_id, "path": str(args.output), "bytes": len(data)}, \
        f"wrote {len(data)} bytes to {args.output}"


def _watch(args, client):
    """Redraw a progress line until interrupted, or until the job is over with --until-done."""
    last: dict = {}
    deadline = time.monotonic() + args.timeout if args.timeout else None
    tty = sys.stdout.isatty() and not args.json
    while True:
        last = client.get("/api/status")
        job = last.get("job")
        if args.json:
            print(json.dumps(last), flush=True)
        else:
            print(("\r" if tty else "") + terminal_safe(progress_line(last)), end="" if tty else "\n", flush=True)
        over = job is None or job.get("state") in (*FINAL_STATES, "stopped")
        if job is not None and args.job and job["job_id"] != args.job:
            over = True
        if (args.until_done and over) or (deadline and time.monotonic() > deadline):
            break
        time.sleep(args.interval)
    if tty:
        print()
    return None, None


FINAL_STATES = ("done", "cancelled", "failed")
DEPLOYMENT_FINAL_STATES = ("complete", "rolled_back")
FINAL_LINE_WAIT_S = 5.0             # --follow: how long a final job's log may take to show job_end


def _logs(args, client):
    """Print the job's round log, or a deployment's state changes with their reasons; with --follow
    keep printing new lines until the job or the deployment is over."""
    if (args.job_id is None) == (args.deployment is None):
        raise AdminError("admin logs: name a job (admin logs JOB) or a deployment (admin logs --deployment ID)")
    path, final = ((f"/api/jobs/{args.job_id}/log", FINAL_STATES) if args.deployment is None else
                   (f"/api/deployments/{args.deployment}/log", DEPLOYMENT_FINAL_STATES))
    offset, deadline = 0, time.monotonic() + args.timeout if args.timeout else None
    # the job's state turns final a moment before its log's last line (job_end) is written: a
    # follower that sees the final state waits for that line, a few seconds at most
    last_line, ended_at = args.deployment is not None, None
    while True:
        page = client.get(f"{path}?offset={offset}")
        for e in page["lines"]:
            print(json.dumps(e) if args.json else terminal_safe(log_line(e)), flush=True)
            last_line = last_line or e.get("event") == "job_end"
        more = page["next_offset"] != offset
        offset = page["next_offset"]
        if more:
            continue                    # a long log comes in pages: read them all before waiting
        state = page.get("job_state", page.get("state"))
        if state in final and ended_at is None:
            ended_at = time.monotonic()
        if (not args.follow or (state in final and (last_line or time.monotonic() - ended_at > FINAL_LINE_WAIT_S))
                or (deadline and time.monotonic() > deadline)):
            return None, None
        time.sleep(args.interval)


# ----------------------------------------------------------------------------- argument parsing
def add_admin_parser(subparsers, help: str = "operate a running aggregator through its admin API") -> argparse.ArgumentParser:
    """Add ``admin`` to a ``fedfleet`` subparsers object; the parser's ``func`` runs the command."""
    p = subparsers.add_parser("admin", help=help,
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _connection_arguments(p, defaults=True)
    # the same options are accepted after the subcommand too (fedfleet admin status --token X)
    common = argparse.ArgumentParser(add_help=False)
    _connection_arguments(common, defaults=False)
    sub = p.add_subparsers(dest="admin_cmd", required=True, metavar="COMMAND")
    add = functools.partial(sub.add_parser, parents=[common], formatter_class=HelpFormatter)
    add("status", help="one line: active job, round progress, devices online")
    w = add("watch", help="live progress bar of the active job")
    w.add_argument("--job", default=None, help="stop watching when this job is no longer active")
    w.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    w.add_argument("--until-done", action="store_true", help="exit when the job is done/cancelled/stopped")
    w.add_argument("--timeout", type=float, default=None, help="stop watching after this many seconds")
    fl = add("fleet", help="fleet summary, with its mode (open: any device; enrolled: enrolled only)")
    fl.add_argument("mode", nargs="?", choices=("open", "enrolled"), default=None,
                    help="set the fleet mode on purpose (default: only show the summary)")
    d = add("devices", help="table of devices (last seen, profile, cluster)")
    d.add_argument("--status", choices=["enrolled", "revoked"], default=None, help="only devices in this state")
    dv = add("device", help="show, enrol, tag, revoke or forget (exact unlearning) one device")
    dv.add_argument("action", choices=["show", "enroll", "tag", "revoke", "forget"])
    dv.add_argument("device_id")
    dv.add_argument("--public-key", default=None, help="enrol: the device's own Ed25519 public key (hex)")
    dv.add_argument("--out", type=Path, default=None, help="enrol: write the credentials JSON here (mode 600)")
    dv.add_argument("--tags", default=None, help="tag, enroll: the device's tags, comma-separated (what a "
                    "deployment's --cohort tags:a,b selects by; \"\" clears them)")
    dv.add_argument("--job", default=None, help="forget: only in this job (default: every job holding its data)")
    js = add("jobs", help="table of jobs (every one, page after page, oldest first)")
    js.add_argument("--limit", type=positive_int, default=None, metavar="N", help="only the newest N jobs")
    j = add("job", help="show / create / start / pause / resume / cancel a job, or list its rounds")
    j.add_argument("action", choices=["show", "create", "start", "pause", "resume", "cancel", "rounds", "evaluations"])
    j.add_argument("target", help="job id, or for create: the config JSON file")
    j.add_argument("--job-id", default=None, help="create: job id (default: the config's job_id)")
    j.add_argument("--kind", default="fed3r", help="create: the job kind (fed3r, fed3r-sync, fedavg, fedavg-secure, "
                   "fedavg-tail, fedavg-tail-secure, personalize, ladd, ladd-secure; the API refuses others)")
    j.add_argument("--start", action="store_true", help="create: start it at once")
    r = add("round", help="one round in detail: participants, drop-outs, timings, bytes")
    r.add_argument("job_id", help="the job")
    r.add_argument("round", type=int, help="the round number")
    lg = add("logs", help="the job's round log (rounds open/close, contributions, rejections, evaluations), or "
                          "a deployment's state changes with their reasons (--deployment)")
    lg.add_argument("job_id", nargs="?", default=None, help="the job")
    lg.add_argument("--deployment", default=None, metavar="ID",
                    help="instead of a job's: this deployment's log (canary, each promotion and rollback, and why)")
    lg.add_argument("-f", "--follow", action="store_true",
                    help="keep printing new lines as they are written, until the job (deployment) is over")
    lg.add_argument("--interval", type=float, default=1.0, help="--follow: seconds between polls (default 1)")
    lg.add_argument("--timeout", type=float, default=None, help="--follow: stop after this many seconds (default: none)")
    m = add("models", help="table of model versions")
    m.add_argument("--job", default=None, help="only this job's model versions")
    mo = add("model", help="show / download / lineage of one model version, or deploy it to the fleet")
    mo.add_argument("action", choices=["show", "download", "lineage", "deploy"])
    mo.add_argument("model_id", type=int)
    mo.add_argument("-o", "--output", default=None, help="download: file to write (.npz)")
    admin_deployments.add_deploy_arguments(mo)
    admin_deployments.add_deployment_parsers(add)
    add("clusters", help="table of clusters")
    add("metrics", help="the Prometheus metrics text")
    p.set_defaults(func=run_admin)
    return p


def _connection_arguments(p: argparse.ArgumentParser, defaults: bool) -> None:
    def d(value):
        return value if defaults else argparse.SUPPRESS
    p.add_argument("--url", default=d(os.environ.get("FEDFLEET_ADMIN_URL", DEFAULT_URL)),
                   help="the aggregator's admin API (default: $FEDFLEET_ADMIN_URL or " + DEFAULT_URL + ")")
    p.add_argument("--token", default=d(None), help="admin token (default: $FEDFLEET_ADMIN_TOKEN)")
    p.add_argument("--token-file", type=Path, default=d(None), help="read the admin token from this file")
    p.add_argument("--json", action="store_true", default=d(False), help="print the API's JSON (for scripts)")


def run_admin(args) -> int:
    if args.admin_cmd == "job":
        if args.action == "create":
            args.config, args.job_id = args.target, args.job_id
        else:
            args.job_id = args.target
    refused = refused_id(args)
    if refused:
        print(f"fedfleet admin: {refused}", file=sys.stderr)
        return 2
    if args.admin_cmd == "model" and args.action == "download" and not args.output:
        print("fedfleet admin: model download needs -o FILE", file=sys.stderr)
        return 2
    try:
        result, text = _run(args, AdminClient(args.url, _token(args)))
    except UserError as exc:                    # the operator's own input, refused before any request
        print(f"fedfleet admin: {exc}", file=sys.stderr)
        return 2
    except (AdminError, OSError, ValueError) as exc:
        print(f"fedfleet admin: {terminal_safe(str(exc))}", file=sys.stderr)   # its parts one_line'd already
        return 1
    except (KeyError, TypeError, AttributeError, IndexError, OverflowError) as exc:
        # an answer of another shape than this CLI renders: another version's API, or no admin API at
        # all at --url (OverflowError: a time past what time.localtime shows). One line that says so,
        # not a traceback.
        print(f"fedfleet admin: {args.url} answered in a shape this fedfleet does not read "
              f"({type(exc).__name__}: {one_line(exc, 200)}); is it this version's admin API?", file=sys.stderr)
        return 1
    if text is not None:
        print(json.dumps(result, indent=1) if args.json else terminal_safe(text))
    return 0


def _token(args) -> str:
    """--token-file's token, else --token's, else $FEDFLEET_ADMIN_TOKEN's."""
    named = _operator_file(args.token_file, "--token-file", MAX_TOKEN_FILE_BYTES).decode().strip() \
        if args.token_file else args.token
    token = named or os.environ.get("FEDFLEET_ADMIN_TOKEN")
    if not token:
        raise UserError("no token (--token, --token-file or FEDFLEET_ADMIN_TOKEN)")
    return token


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedfleet")
    add_admin_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(["admin", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
