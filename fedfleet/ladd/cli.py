"""``fedfleet simulate --pipeline ladd`` options, and ``python -m fedfleet.ladd``."""

from __future__ import annotations

import argparse
import sys

from fedfleet import ladd
from fedfleet.errors import load_json_file
from fedfleet.ladd.config import QUICK, LaddSimConfig

def add_ladd_arguments(parser: argparse.ArgumentParser) -> None:
    """LADD options for ``fedfleet simulate``; options the parser already has (--out, --broker,
    --workers, --image-size, --seed) are left alone and read by :func:`ladd_config_from_args`."""
    from aggregator.jobs.registry import field_choices as job_field_choices

    have = set(parser._option_string_actions)

    def add(flag, **kw):
        if flag not in have:
            parser.add_argument(flag, **kw)

    add("--quick", action="store_true", help="LADD: seconds-long run (1 seed, 8 devices, 2 rounds)")
    add("--ladd-config", help="LADD: JSON file of LaddSimConfig fields")
    add("--seeds", help="LADD: comma-separated seeds (default 0,1,2)")
    add("--devices-per-domain", type=int, help="LADD: devices per target domain (default 10)")
    add("--domains", help="LADD: comma-separated target domains (default night,fog,sunset,rain)")
    add("--rounds", type=int, help="LADD: federated rounds (default 12)")
    add("--clients-per-round", type=int, help="devices per round, every pipeline (default: the preset's; LADD 8)")
    add("--cluster-scope", choices=job_field_choices("ladd", "cluster_scope"), help="LADD: cluster-specific tensors (default head)")
    add("--baseline-no-kd", action="store_true", help="LADD: FedAvg+ST with pseudo-labels only (no KD, no SWA)")
    add("--secure", action="store_true", help="LADD: sum each training round's updates under secure aggregation")
    # fedfleet simulate has these already (its fine-tuning's); python -m fedfleet.ladd gets them here
    add("--local-rule", choices=job_field_choices("ladd", "local_rule"), help="LADD: the decoder's local step (FedSAM/FedASAM)")
    add("--sam-rho", type=float, help="LADD: --local-rule sam/asam's ascent radius ρ (default 0.1)")
    add("--prox-mu", type=float, help="LADD: FedProx's μ around the received decoder (default 0: off)")
    for flag, kw in (("--out", {}), ("--broker", {}), ("--workers", {"type": int}), ("--image-size", {"type": int})):
        add(flag, **kw)


def ladd_config_from_args(args: argparse.Namespace) -> LaddSimConfig:
    base = load_json_file(args.ladd_config, "--ladd-config") if getattr(args, "ladd_config", None) else {}
    if getattr(args, "quick", False):
        base = {**QUICK, "out_dir": "runs/ladd-quick", **base}
    over = {"seeds": [int(s) for s in args.seeds.split(",")] if getattr(args, "seeds", None) else None,
            "devices_per_domain": getattr(args, "devices_per_domain", None),
            "domains": args.domains.split(",") if getattr(args, "domains", None) else None,
            "rounds": getattr(args, "rounds", None), "clients_per_round": getattr(args, "clients_per_round", None),
            "cluster_scope": getattr(args, "cluster_scope", None), "out_dir": getattr(args, "out", None),
            "broker": getattr(args, "broker", None), "workers": getattr(args, "workers", None),
            "image_size": getattr(args, "image_size", None), "local_rule": getattr(args, "local_rule", None),
            "sam_rho": getattr(args, "sam_rho", None), "prox_mu": getattr(args, "prox_mu", None)}
    if getattr(args, "baseline_no_kd", False):
        over["baseline_kd"] = False
    if getattr(args, "secure", False):
        over["secure"] = True
    if getattr(args, "secure_graph", None):
        over["secure_graph"] = args.secure_graph
    return LaddSimConfig(**{**base, **{k: v for k, v in over.items() if v is not None}})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m fedfleet.ladd", description=ladd.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_ladd_arguments(parser)
    from fedfleet.ladd.run import run_ladd

    run_ladd(ladd_config_from_args(parser.parse_args(argv)))
    return 0
