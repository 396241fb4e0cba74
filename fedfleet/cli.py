"""fedfleet: federated learning for fleets of edge devices doing vision.

    fedfleet simulate     emulated fleet + real broker + real aggregator (research, demos, load tests)
    fedfleet aggregator   run the aggregator service (serve)
    fedfleet device       run one device agent on local data against a broker
    fedfleet admin        talk to a running aggregator's admin API (fleet, jobs, rounds, models)
    fedfleet export       build ExecuTorch (.pte, XNNPACK) / ONNX bundles with manifest and parity check
    fedfleet features     build the evaluation-features file (aggregator serve --eval-features) from images
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from protocols.command_help import HelpFormatter
from protocols.log_text import log_to_stderr

from .errors import run_reporting_errors
from .quiet import quiet_third_party_warnings


# The SimConfig fields ``fedfleet simulate``'s options set: option (argparse dest) -> field.
OPTION_FIELDS = {"ft_rounds": "ft_rounds", "fp_epochs": "fp_epochs", "fp_part": "fp_part", "ft_mode": "ft_mode",
                 "tail_stages": "tail_stages", "tail_bundle": "tail_bundle", "server_optimizer": "ft_server_optimizer",
                 "ft_algorithm": "ft_algorithm", "ft_init_scale": "ft_init_scale", "server_lr": "ft_server_lr",
                 "local_rule": "ft_local_rule", "sam_rho": "ft_sam_rho", "prox_mu": "ft_prox_mu",
                 "served_model": "ft_served_model", "devices": "devices", "broker": "broker", "out": "out_dir",
                 "seed": "seed", "image_size": "image_size", "split": "split", "alpha": "alpha", "runtime": "runtime",
                 "rf_dim": "rf_dim", "workers": "workers", "secure": "secure", "secure_graph": "secure_graph",
                 "clients_per_round": "clients_per_round", "ray": "ray", "shards": "shards", "deploy": "deploy",
                 "dp_epsilon": "dp_epsilon", "dp_center_devices": "dp_center_devices", "dp_release": "dp_release"}
# the options --pipeline ladd reads as its own (fedfleet/ladd/cli.py ladd_config_from_args); --shards it answers
LADD_READS = {"out", "broker", "workers", "image_size", "local_rule", "sam_rho", "prox_mu", "clients_per_round",
              "secure", "secure_graph", "shards"}


def given_options(args) -> dict:
    """The options of OPTION_FIELDS given on the command line: dest -> value (a flag not set and an
    option left out are None, the preset's)."""
    return {dest: value for dest in OPTION_FIELDS if (value := getattr(args, dest)) is not None and value is not False}


def simulate_overrides(args) -> dict:
    """SimConfig fields the command line sets."""
    return {OPTION_FIELDS[dest]: value for dest, value in given_options(args).items()}


def check_ladd_options(args) -> None:
    """--pipeline ladd runs LaddSimConfig, not SimConfig: an option it does not read is refused, not
    silently ignored (a run with other settings than the ones asked for)."""
    from .errors import UserError

    ignored = [f"--{dest.replace('_', '-')}" for dest in given_options(args) if dest not in LADD_READS]
    if args.config is not None:
        ignored.insert(0, "--config")
    if ignored:
        raise UserError(f"--pipeline ladd does not read {', '.join(ignored)}: its runs are set by --ladd-config, "
                        "--devices-per-domain, --seeds, --domains and --rounds")


DP_PIPELINES = ("fed3r", "fedncm")         # the pipelines whose job --dp-epsilon makes private


def _simulate(args) -> int:
    if args.dp_epsilon and args.pipeline not in DP_PIPELINES:      # it was taken and ignored: no noise anywhere
        from .errors import UserError

        raise UserError(f"--dp-epsilon makes --pipeline {' or '.join(DP_PIPELINES)} private; the {args.pipeline} "
                        "pipeline's phases have no DP release yet")
    if args.pipeline == "ladd":
        from .ladd.cli import ladd_config_from_args
        from .ladd.run import run_ladd

        check_ladd_options(args)
        if args.shards:
            print(f"  ladd: one aggregator process, not {args.shards} shards (the pipeline's jobs pre-train on the "
                  "devices' style bank inside the job, which a shard building the job from its config cannot; "
                  "`aggregator serve --shards K` serves a ladd or ladd-secure job from its pretrained "
                  "initial_model_file)",
                  flush=True)
        run_ladd(ladd_config_from_args(args))
        return 0
    from .sim_config import load_config

    from .simulate import run

    cfg = load_config(args.config or "demo", simulate_overrides(args))
    if cfg.broker:
        from protocols.mqtt_link import BrokerConfig

        BrokerConfig.from_url(cfg.broker).check_reachable()
    from .pipeline import PIPELINES

    if args.pipeline in PIPELINES:
        from .pipeline import run_pipeline

        plain = None
        if args.compare_with:        # read first: a wrong path fails before the run, not after it
            from pathlib import Path

            from .errors import load_json_file

            plain = load_json_file(str(Path(args.compare_with, "report.json")), "--compare-with")
        report = run_pipeline(cfg, compare_with=plain, pipeline=args.pipeline)
        if "oll" in report["phases"]:
            return 0 if report["phases"]["oll"].get("wma") else 1
        return 0 if report["phases"][PIPELINES[args.pipeline][1]].get("accuracy") is not None else 1
    if args.pipeline == "fedncm":
        cfg = dataclasses.replace(cfg, classifier="fedncm")
    report = run(cfg)
    return 0 if report.get("contributed") else 1


def _aggregator(args) -> int:
    from aggregator.cli import serve

    return serve(args)


def _device(args) -> int:
    from .device import run_device

    return run_device(args)


def _features(args) -> int:
    from .features import build_features

    return build_features(args)


def _subcommand(sub, name: str, help: str, add_arguments, func) -> None:
    parser = sub.add_parser(name, help=help, formatter_class=HelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=func)


def _add_aggregator_parser(sub, help: str) -> None:
    from aggregator.cli import build_parser as add_arguments

    _subcommand(sub, "aggregator", help, add_arguments, _aggregator)


def _add_device_parser(sub, help: str) -> None:
    from .device import add_arguments

    _subcommand(sub, "device", help, add_arguments, _device)


def _add_admin_parser(sub, help: str) -> None:
    from .admin import add_admin_parser

    add_admin_parser(sub, help)


def _add_features_parser(sub, help: str) -> None:
    from .features import add_arguments

    _subcommand(sub, "features", help, add_arguments, _features)


def _add_simulate_parser(sub, help: str) -> None:
    # choices of job fields come from their declarations (the jobs' validation and API schema read them too)
    from aggregator.jobs.registry import field_choices as job_field_choices

    s = sub.add_parser("simulate", help=help, formatter_class=HelpFormatter)
    s.add_argument("--config", help="preset (demo, smoke, fleet-10k, fleet-100k) or a JSON file of SimConfig fields (default: demo)")
    s.add_argument("--devices", type=int, help="number of emulated devices (default: the preset's)")
    s.add_argument("--broker", help="use this broker, mqtt://[user:pass@]host:port[?version=3.1.1] "
                                    "(default: a private mosquitto on a free loopback port)")
    s.add_argument("--out", help="output directory (default: the preset's, runs/latest)")
    s.add_argument("--seed", type=int, help="seed of the split, profiles and sampling (default: the preset's)")
    s.add_argument("--image-size", type=int, help="input size of the backbone in pixels (default: the preset's)")
    s.add_argument("--split", choices=["iid", "dirichlet", "classes"],
                   help="how images are spread over devices (default: the preset's, dirichlet)")
    s.add_argument("--alpha", type=float, help="Dirichlet concentration of the label skew (default: the preset's)")
    s.add_argument("--runtime", choices=["eager", "executorch", "executorch-int8", "onnxruntime", "auto"],
                   help="devices' feature extraction; executorch-int8 is the int8-quantized ExecuTorch program; "
                        "auto: the bundle's fastest program here that keeps parity (default: the preset's)")
    s.add_argument("--rf-dim", type=int, help="Fed3R-RF: number of random Fourier features (default: none)")
    s.add_argument("--workers", type=int, help="processes hosting the devices (default: the preset's)")
    s.add_argument("--ray", metavar="auto|ADDRESS",
                   help="place the device hosts as Ray actors on this Ray cluster (needs fedfleet[ray]; "
                        "default: local processes)")
    s.add_argument("--shards", type=int, metavar="K",
                   help="run each job's aggregator with --shards K (with --ray: on that cluster too): Fed3R, and "
                        "the fine-tuning (FedAvg, Scaffold, FedGloSS) and pp/Ditto phases without their direction "
                        "screen (it needs every update in one place), and personalization (OLL); with --secure, "
                        "Fed3R-Sync, FedNCM-Sync and secure FedAvg(ψ), pp, Scaffold and Ditto, each group's SecAgg "
                        "server on a shard; a job shards "
                        "cannot sum runs in one aggregator process, and says why")
    s.add_argument("--secure", action="store_true", help="Fed3R-Sync: sum statistics under secure aggregation")
    s.add_argument("--secure-graph", choices=job_field_choices("fed3r-sync", "graph"),
                   help="SecAgg (complete), SecAgg+ (regular), or by group size (auto, the default: complete up to "
                        "128 members)")
    s.add_argument("--dp-epsilon", type=float, metavar="EPS",
                   help="--pipeline fed3r: differentially private Fed3R at this ε (δ = 1/devices; with --secure "
                        "the devices add the noise); config fields dp_clip, dp_max_samples, dp_center_clip "
                        "(fedfleet/dp_fleet.py)")
    s.add_argument("--dp-center-devices", type=int, metavar="M",
                   help="--dp-epsilon: a first round of M devices releases the features' mean, the rest centre on "
                        "it (default 0: none)")
    s.add_argument("--dp-release", choices=["end", "round"],
                   help="--dp-epsilon without --secure: release the statistics once, when the job ends, after the "
                        "preset's rounds and retries (end, the default), or each round's sum as it closes, the fleet "
                        "asked in one round (round)")
    s.add_argument("--pipeline", choices=["fed3r", "fedncm", "fed3r-ft-oll", "fed3r-pp-oll", "fed3r-ft-pp-oll", "fed3r-ditto-oll",
                                          "fed3r-ft-ditto-oll", "ladd"],
                   default="fed3r",
                   help="fed3r: classification (Fed3R / Fed3R-Sync); fedncm: the class-mean baseline on "
                        "Fed3R's upload (FedNCM / FedNCM-Sync); fed3r-ft-oll: Fed3R, then FedAvg(ψ) "
                        "fine-tuning from it, then OLL personalization on every device, with an HTML report; "
                        "fed3r-pp-oll / fed3r-ft-pp-oll: FedAlt partial personalization (shared head weight, "
                        "each device's own bias) before OLL, without / after fine-tuning; "
                        "fed3r-ditto-oll / fed3r-ft-ditto-oll: Ditto there instead (each device's own head, "
                        "pulled to the averaged one; config ditto_lambda); "
                        "ladd: segmentation on unlabelled devices (source-only vs FedAvg+self-training vs LADD)")
    _add_fine_tuning_arguments(s)
    from .ladd.cli import add_ladd_arguments

    add_ladd_arguments(s)
    s.set_defaults(func=_simulate)


def _add_fine_tuning_arguments(s) -> None:
    """The pipelines' options after Fed3R: fine-tuning, its optimisers, personalization, rollout."""
    from aggregator.jobs.registry import field_choices as job_field_choices

    s.add_argument("--ft-rounds", type=int, help="fed3r-ft-oll: FedAvg(ψ) fine-tuning rounds")
    s.add_argument("--fp-epochs", type=int, help="fed3r-ft-oll: local FP(ψ) epochs after OLL (0: OLL only)")
    s.add_argument("--fp-part", choices=job_field_choices("personalize", "fp_part"),
                   help="the pipelines' OLL phase: what local fine-tuning after OLL trains: the OLL head (psi, default), "
                        "the backbone's last stages through the tail bundle (phi: FP(φ)), or both (M: FP(M))")
    s.add_argument("--ft-mode", choices=["psi", "phi", "M"],
                   help="fed3r-ft-oll: fine-tune the head (psi, default), the backbone's last stages against the "
                        "frozen Fed3R head (phi), or both (M); OLL then personalises on the fine-tuned backbone")
    s.add_argument("--server-optimizer", choices=job_field_choices("fedavg", "server_optimizer"),
                   help="fed3r-ft-oll: the fine-tuning's server step: sgd (FedAvg/FedAvgM, default) or FedOpt's "
                        "adam, yogi, adagrad (Reddi et al. 2021) on the round's pseudo-gradient")
    s.add_argument("--ft-algorithm", choices=["fedavg", "fedgloss", "scaffold"],
                   help="fed3r-ft-oll: fedavg (default: the FedAvg family the flags around pick), "
                        "fedgloss (--ft-mode psi; FedGloSS: server-side SAM from the last round's pseudo-gradient plus "
                        "ADMM duals kept on the devices, at FedAvg's traffic; any --local-rule) or scaffold "
                        "(Scaffold, option II, on whatever --ft-mode trains: control variates, each device's kept "
                        "on it, twice FedAvg's upload; with --secure, --ft-mode psi only: scaffold-secure sums the head's updates "
                        "and the control deltas under SecAgg)")
    s.add_argument("--ft-init-scale", type=float, metavar="ALPHA",
                   help="fed3r-ft-oll: start fine-tuning from ALPHA × the Fed3R head (the same predictions, wider "
                        "logit margins at T = 0.1; default 1; bench/ft_init_scale.py measures 1, 3, 10)")
    s.add_argument("--server-lr", type=float, help="fed3r-ft-oll: η of the server step (default 1.0; FedOpt wants ~0.01-0.1)")
    s.add_argument("--local-rule", choices=job_field_choices("fedavg", "local_rule"),
                   help="fed3r-ft-oll, ladd: the devices' local step: sgd (default), sam (FedSAM) or asam (FedASAM), "
                        "two gradient evaluations per step")
    s.add_argument("--sam-rho", type=float, help="--local-rule sam/asam: the ascent radius ρ (default 0.1)")
    s.add_argument("--prox-mu", type=float, help="fed3r-ft-oll, ladd: FedProx's proximal weight μ (default 0: off)")
    s.add_argument("--served-model", choices=job_field_choices("fedavg", "served_model"),
                   help="fed3r-ft-oll: the fine-tuned model reported and deployed: the last (default), server SWA "
                        "from 0.75 of the rounds, or WiMA's mean of the last 10")
    s.add_argument("--tail-stages", type=int, help="--ft-mode phi/M: backbone stages trained on device (default 1)")
    s.add_argument("--tail-bundle", metavar="MANIFEST",
                   help="--ft-mode phi/M: an exported bundle's manifest.json holding the tail programs for "
                        "--tail-stages (fedfleet export --tail-stages N; default: export one into .cache/bundles)")
    s.add_argument("--deploy", action="store_true",
                   help="fed3r-ft-oll (--ft-mode psi): then roll the fine-tuned head out to the fleet through a canary, "
                        "and a head with permuted classes back (the report shows each stage)")
    s.add_argument("--compare-with", help="fed3r-ft-oll: a plain run's output directory; this run's report (console, HTML, PNG) "
                        "then compares plain vs this run (default: no comparison)")


# The commands: (help, what adds the command's parser with its arguments). Only the named
# command's arguments are built: the server's (the job registry's choices) import torch, which
# ``fedfleet --version``, ``--help`` or an ``admin`` call (an operator's laptop) never need.
# ``export`` is handed whole to export.cli (see main): listed here for --help.
COMMANDS = {
    "simulate": ("run an emulated fleet against a real broker and aggregator", _add_simulate_parser),
    "aggregator": ("run the aggregator service", _add_aggregator_parser),
    "device": ("run one device agent on local data", _add_device_parser),
    "admin": ("operate a running aggregator through its admin API", _add_admin_parser),
    "features": ("build the evaluation-features .npz (aggregator serve --eval-features) from an image folder or "
                 "IDX files through a bundle", _add_features_parser),
    "export": ("build ExecuTorch (.pte) / ONNX bundles with a manifest and parity check", None),
}


def build_parser(commands=tuple(COMMANDS)) -> argparse.ArgumentParser:
    """The ``fedfleet`` parser, every command listed, the arguments of ``commands`` built."""
    from importlib.metadata import version

    p = argparse.ArgumentParser(prog="fedfleet", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--version", action="version", version=f"fedfleet {version('fedfleet')}")
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    for name, (help, add_parser) in COMMANDS.items():
        if name in commands and add_parser is not None:
            add_parser(sub, help)
        else:
            sub.add_parser(name, help=help)
    return p


def main(argv: list[str] | None = None) -> int:
    log_to_stderr()
    argv = sys.argv[1:] if argv is None else argv
    debug = argv[:1] == ["--debug"]
    command, rest = argv[1 if debug else 0:][:1], argv[2 if debug else 1:]
    if command == ["export"]:
        from export.cli import main as export_main

        return run_reporting_errors("export", lambda: export_main(rest), debug)
    # only the named command's parser is built: ``device`` imports nothing of the server's (a
    # torch-free device, fedfleet[device], has no torch), ``admin`` and ``--version`` neither
    parser = build_parser(command)
    args = parser.parse_args(argv)
    if args.cmd is None:
        parser.print_help()
        return 2
    quiet_third_party_warnings()
    return run_reporting_errors(args.cmd, lambda: args.func(args), args.debug)


if __name__ == "__main__":
    sys.exit(main())
