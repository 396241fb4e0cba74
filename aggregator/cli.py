"""``fedfleet aggregator serve``: run the aggregator for one job against a broker."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from protocols.command_errors import load_json_file, run_reporting_errors
from protocols.command_help import HelpFormatter
from protocols.log_text import log_to_stderr
from protocols.mqtt_link import BrokerConfig
from protocols.files import read_npz
from protocols.regular_file import OPTION_FILE_BYTES, read_regular_file
from protocols.ray_cluster import check_reachable as check_ray_reachable
from protocols.topics import check_device_id

from aggregator.api.server import (add_ops_arguments, checked_sealing_key, checked_state_folder, dashboard_origins,
                                   read_identity, serve_with_ops)
from aggregator.compute.fork_server import start_fork_server_here
from aggregator.compute.mask_expansion import cpu_mask_expansion_plan
from aggregator.service.artifacts import ArtifactShelf, with_served_bundle
from aggregator.service.crash_points import CrashPoints
from aggregator.service.settings import ServiceSettings
from aggregator.shards.buckets import check_shard_count
from aggregator.jobs.registry import KINDS, build_job, checked_config
from aggregator.storage.schema import JobState


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="fedfleet aggregator")
    sub = p.add_subparsers(dest="aggregator_cmd", required=True)
    s = sub.add_parser("serve", help="run one job (--kind) until it is done",
                       formatter_class=HelpFormatter)
    s.add_argument("--config", type=Path, default=None,
                   help="job config JSON (the fields of the kind's config class, e.g. Fed3RConfig); "
                        "without it, --state resumes the job that state file holds (interrupted, else queued)")
    s.add_argument("--kind", default="fed3r", choices=sorted(KINDS), metavar="KIND",
                   help="job kind; " + "; ".join(f"{k.name}: {k.summary}" for k in KINDS.values()))
    s.add_argument("--broker", default="mqtt://127.0.0.1:1883",
                   help="mqtt://[user:pass@]host:port[?version=3.1.1|5] (mqtts://: TLS, verified with --tls-ca, "
                        "else the system's trusted CAs)")
    s.add_argument("--tls-ca", default=None, help="CA file: connect with TLS")
    s.add_argument("--topic-root", default="fedfleet", help="first level of every fedfleet topic")
    s.add_argument("--out", type=Path, required=True, help="directory for results.json and model.npz")
    s.add_argument("--eval-features", type=Path, default=None,
                   help="held-out evaluation set as .npz with Z (n,d) features and y (n,) labels")
    s.add_argument("--enrolled", type=Path, default=None, help="file with one allowed device id per line")
    s.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
    s.add_argument("--artifacts", type=Path, nargs="*", default=(),
                   help="exported bundle directories devices may fetch (by their manifest sha256)")
    s.add_argument("--evaluate", choices=["contribution", "round"], default="contribution",
                   help="evaluate the model after every contribution (default) or once per round (large fleets)")
    s.add_argument("--ingest-workers", type=int, default=0, metavar="N",
                   help="decode and validate large results in N worker processes (0: on the service thread)")
    s.add_argument("--shards", type=int, default=0, metavar="K",
                   help="receive, validate, store and sum results in K shard processes, each owning the "
                        "devices of a fixed range of buckets (Fed3R, FedNCM, streaming too; FedAvg(ψ), FT(φ)/FT(M), Scaffold, "
                        "FedGloSS, pp and Ditto without the direction screen, the coordinator closing each round "
                        "on their sums; the groups of Fed3R-Sync, FedNCM-Sync and secure FedAvg, FT(φ)/FT(M), pp, "
                        "Scaffold and Ditto, and secure LADD's, hosted on them); 0: in this process")
    s.add_argument("--shard-start-timeout", type=float, metavar="S",
                   default=ServiceSettings.__dataclass_fields__["shard_start_timeout_s"].default,
                   help="with --shards: fail the start unless every shard is up and connected within S seconds "
                        "(default: %(default)s)")
    s.add_argument("--ray", metavar="auto|HOST:PORT", default=None,
                   help="with --shards: run the K shards as Ray actors (one CPU each) on this Ray cluster "
                        "(auto: the one `ray start` started here; needs fedfleet[ray]). Shard i's store "
                        "(STATE.shards/) is on the node that runs it: a node started with the resource "
                        "fedfleet_shard_<i> always gets shard i, else the stores must be on a file system "
                        "every node sees for a restarted coordinator to resume. Every node must reach --broker")
    add_ops_arguments(s)
    return p


EVAL_FEATURES_BYTES = 4 << 30        # a held-out set's features: 10^5 rows of 1,280 float64 are 1 GiB


def read_eval_features(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The held-out set: an .npz with Z (n, d) features and y (n,) labels (``fedfleet features`` writes one)."""
    if not path.exists():
        raise FileNotFoundError(2, "--eval-features not found (an .npz with Z and y)", str(path))
    try:     # bounded before anything is inflated: an .npz header may declare any shape (745 GiB was asked)
        data = read_npz(read_regular_file(path, "--eval-features", EVAL_FEATURES_BYTES), max_bytes=EVAL_FEATURES_BYTES)
        Z, y = data["Z"], data["y"]
    except (KeyError, ValueError, OSError) as exc:
        raise ValueError(f"--eval-features {path}: not an .npz with arrays Z (n, d) and y (n,): {exc}") from None
    if Z.ndim != 2 or y.shape != (len(Z),) or not np.isfinite(Z).all():
        raise ValueError(f"--eval-features {path}: Z must be (n, d) finite and y (n,), got {Z.shape} and {y.shape}")
    return Z, y


def service_settings(args) -> ServiceSettings:
    """The service's settings from the serve options (``ValueError`` naming a bad one)."""
    return ServiceSettings(topic_root=args.topic_root, evaluate_every_contribution=args.evaluate == "contribution",
                           require_signatures=args.require_signatures, keep_serving=args.keep_serving,
                           ingest_workers=args.ingest_workers, shard_start_timeout_s=args.shard_start_timeout)


def forks_workers(args, settings: ServiceSettings) -> bool:
    """Whether the service will start worker processes: local shards, ingest workers, or the CPU
    mask applier's processes (on a machine with more cores than its threads use)."""
    return bool((args.shards and not args.ray) or settings.ingest_workers
                or cpu_mask_expansion_plan()[0] == "processes")


def read_enrolled(path: Path) -> set[str]:
    """The ``--enrolled`` allow-list: one device id a line (blank lines skipped), each checked as
    every other way in checks a device id (``protocols.topics.check_device_id``): an id such as
    ``x/#`` would otherwise be stored and reach topics and ACLs. Split at newlines only, so no
    other line-break character can cut an invalid id into valid-looking pieces."""
    text = read_regular_file(path, "--enrolled", OPTION_FILE_BYTES).decode("utf-8")
    enrolled = set()
    for number, line in enumerate(text.split("\n"), 1):
        if line.strip():
            try:
                enrolled.add(check_device_id(line.strip()))
            except ValueError as exc:
                raise ValueError(f"--enrolled '{path}' line {number}: {exc}") from None
    return enrolled


def serve(args) -> int:
    CrashPoints.from_env()          # a bad FEDFLEET_CRASH_AT (crash tests) is one line before anything starts
    if args.config is None and args.state is None:
        raise ValueError("serve needs --config, or --state to resume the job that state file holds "
                         "(with --keep-serving: and then run jobs started through the API)")
    if args.ray and not args.shards:
        raise ValueError("--ray places the shards on a Ray cluster: give --shards K too")
    if args.shards:
        check_shard_count(args.shards)              # before the broker and the state file (it left an empty store)
    broker = BrokerConfig.from_url(args.broker, tls_ca=args.tls_ca)      # a bad address fails before any file
    settings = service_settings(args)                                     # so do bad service options
    dashboard_origins(args)                                               # and a bad --public-origin
    checked_state_folder(args)                                            # and a --state in no folder
    checked_sealing_key(args)                                             # and a bad key folder
    config = load_json_file(args.config, "--config") if args.config else None
    if config is not None:
        checked_config(args.kind, config)           # a bad config, or a task no device takes, fails before the broker
    eval_set = read_eval_features(args.eval_features) if args.eval_features else None
    if forks_workers(args, settings):
        # before the service's first thread and before a job or device touches CUDA: the workers'
        # fork server is then a fork of this process, its imports inherited (compute/fork_server.py)
        start_fork_server_here()
    if args.ray:
        check_ray_reachable(args.ray)                                     # ray.init alone retries for minutes
    enrolled = read_enrolled(args.enrolled) if args.enrolled else None      # a bad id: before the broker and the store
    broker.check_reachable()
    # before build_job, which imports torch (~2 CPU-s): a bad --identity file is refused at once
    identity = read_identity(args.identity) if args.identity else None
    shelf = None
    if args.artifacts:
        shelf = ArtifactShelf()
        for bundle in args.artifacts:
            print(f"serving bundle {bundle}: manifest sha256 {shelf.add_bundle(bundle)}", flush=True)
    job = build_job(args.kind, with_served_bundle(args.kind, config, shelf)) if config is not None else None
    announced = job.config.device_bundle_sha256() if job is not None else ""
    if announced and shelf is None:            # a served shelf was checked by with_served_bundle
        raise ValueError(f"the job runs on bundle {announced[:16]}…, which this aggregator does not serve: "
                         "pass that bundle's directory with --artifacts")
    summary = serve_with_ops(args, job, broker, args.out, settings, enrolled=enrolled, eval_set=eval_set,
                             artifacts=shelf, shards=args.shards, identity=identity)
    final = summary.get("final", {})
    print(json.dumps({"state": summary.get("state"), "contributions": final.get("contributions"),
                      "accuracy": final.get("accuracy")}))
    return 0 if summary.get("state") == JobState.DONE else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m aggregator``: what process managers and the suite run. A mistake is one line and
    exit 2, as from ``fedfleet aggregator`` (a bad --config printed a traceback, exit 1)."""
    log_to_stderr()
    parser = build_parser()
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    args = parser.parse_args(argv)
    return run_reporting_errors("aggregator", lambda: serve(args), args.debug)


if __name__ == "__main__":
    sys.exit(main())
