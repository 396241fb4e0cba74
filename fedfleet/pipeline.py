"""``fedfleet simulate --pipeline fed3r-ft-oll`` (and ``fed3r-pp-oll``, ``fed3r-ft-pp-oll``, the ditto ones): the
seeds' pipeline on the emulated fleet.

Three (or four) jobs run one after the other against the same fleet (one broker, the same device
processes, each job with a fresh aggregator process, as an operator would run them):

1. **fed3r**: every device sends its ridge statistics once; the aggregator solves the closed
   form (checked against scikit-learn's centralized ridge on the same data, as ``simulate``).
2. **fedavg-ft**: FedAvg fine-tuning initialised from the normalised Fed3R classifier (bias
   included, T = 0.1, client LR × 0.1, spec §1.8), κ devices per round for ``ft_rounds``
   rounds. ``ft_mode`` picks what is fine-tuned: ``psi`` the head (Fed3R+FT(ψ); through the
   head's training program when the runtime is ExecuTorch), ``phi`` the backbone's last
   ``tail_stages`` stages against the frozen Fed3R head (FT(φ)), ``M`` both (FT(M)); the last
   two always train through the bundle's ExecuTorch tail program and are evaluated on the
   test images' trunk activations.
3. **oll**: the fine-tuned head goes to every device, which prunes it to its local labels (OLL),
   fine-tunes it locally (FP(ψ), LR picked by local cross-validation) and reports counts on
   its local held-out split; the aggregator reports the WMA of the global head, OLL and OLL+FP.
   After FT(φ)/FT(M) the fine-tuned tail goes with the head, and devices personalise on the
   fine-tuned backbone's features (trunk program, then the tail's eager twin). ``fp_part`` phi / M
   fine-tunes the backbone's tail (and the OLL head) instead of the head alone: FP(φ)/FP(M), the
   devices then get the tail bundle even after FT(ψ).

With ``pp`` in the pipeline (Phase 3 of the paper, partial personalization) a **pp** job runs
before OLL: FedAlt or FedSim (``pp_algorithm``) for ``pp_rounds`` rounds from the previous phase's
head, the head's weight shared and averaged, each device's bias personal, kept in the device's
state store (``edge_client.state``; the emulated devices' stores are under the run's
``device_state/``) and never sent; OLL then evaluates every device with its own bias too
(``personal_job``). ``fed3r-pp-oll`` skips fine-tuning: the paper's "Fed3R + PP without FT".
With ``secure`` the pp rounds sum the shared weight's updates under SecAgg (``pp-secure``).
``fed3r-ditto-oll`` / ``fed3r-ft-ditto-oll`` run a **ditto** job there instead: the head
averaged as FedAvg(ψ), each device's own head trained towards it (λ ``ditto_lambda``) and kept in
its state store; OLL then starts from each device's own head. Its global head trains at the FT
phase's LR (``ft_client_lr``), each device's own head at the pp phase's (``pp_client_lr`` × 0.1),
for ``pp_rounds`` rounds. With ``secure`` the global head's updates are summed under SecAgg
(``ditto-secure``); with ``ft_algorithm`` scaffold and ``secure`` the FT phase is
``scaffold-secure`` (the head's updates and the devices' control deltas summed under SecAgg).

Each device keeps ``holdout_fraction`` of its data as that held-out split: no phase trains on it.
With ``secure`` the first two phases run under secure aggregation (Fed3R-Sync, then secure
FedAvg: the aggregator sees only group sums); the personalization reports are plain counts.
Per phase the report gives accuracy, rounds, bytes up/down (total and per device) and device
compute time; ``report.html`` and ``report.png`` plot test accuracy against rounds and against
bytes, with the personalised WMA of the last phase.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from protocols.payloads.ditto import KIND as DITTO_KIND
from protocols.payloads.fed3r import KIND as FED3R_KIND
from protocols.payloads.fedavg import KIND as FEDAVG_KIND
from protocols.payloads.fedavg import KIND_TAIL as FEDAVG_TAIL_KIND
from protocols.payloads.fedgloss import KIND as FEDGLOSS_KIND
from protocols.payloads.scaffold import KIND as SCAFFOLD_KIND
from protocols.payloads.scaffold import KIND_TAIL as SCAFFOLD_TAIL_KIND
from protocols.payloads.partial import KIND as PP_KIND
from protocols.payloads.personalize import KIND as PERSONALIZE_KIND
from protocols.payloads.secagg import (SECURE_DITTO_KIND, SECURE_FEDAVG_KIND, SECURE_PP_KIND, SECURE_SCAFFOLD_KIND,
                                       SECURE_TAIL_KIND, SYNC_KIND)

from aggregator.jobs.fedavg import FED3R_INIT_LR_FACTOR
from aggregator.jobs.registry import kind_of, validate_job_config

from .errors import reported_config
from .pipeline_report import FP_LABELS, FT_MODES, format_pipeline_report, ft_label, write_plots_and_html
from .progress import StepClock
from .sim_config import SimConfig
from .simulate import EmulatedFleet, _secure_setup, prepare
from .simulate_report import job_report

PIPELINES = {"fed3r-ft-oll": ("fed3r", "fedavg-ft", "oll"),
             "fed3r-pp-oll": ("fed3r", "pp", "oll"),
             "fed3r-ft-pp-oll": ("fed3r", "fedavg-ft", "pp", "oll"),
             "fed3r-ditto-oll": ("fed3r", "ditto", "oll"),
             "fed3r-ft-ditto-oll": ("fed3r", "fedavg-ft", "ditto", "oll")}
# the phases whose devices keep a personal part (the OLL job then scores each device with its own):
# what each does, and its job fields beyond the common ones
PERSONAL_PHASES = {"pp": lambda cfg: (f"{cfg.pp_algorithm} partial personalization (shared head weight, each "
                                      "device's bias kept on it)", {"pp_algorithm": cfg.pp_algorithm}),
                   # Ditto's global head trains as the FT phase's (its LR); each device's own head at pp's
                   "ditto": lambda cfg: (f"Ditto (the head averaged, each device's own head kept on it, "
                                         f"λ={cfg.ditto_lambda:g})",
                                         {"ditto_lambda": cfg.ditto_lambda, "client_lr": cfg.ft_client_lr,
                                          "personal_lr": FED3R_INIT_LR_FACTOR * cfg.pp_client_lr})}
# task kinds of each phase, plain and secure
PHASE_KINDS = {"fed3r": (FED3R_KIND, SYNC_KIND),
               "fedavg-ft": (FEDAVG_KIND, SECURE_FEDAVG_KIND, FEDAVG_TAIL_KIND, SECURE_TAIL_KIND, FEDGLOSS_KIND,
                             SCAFFOLD_KIND, SECURE_SCAFFOLD_KIND, SCAFFOLD_TAIL_KIND),
               "pp": (PP_KIND, SECURE_PP_KIND),
               "ditto": (DITTO_KIND, SECURE_DITTO_KIND),
               "oll": (PERSONALIZE_KIND,)}


def ft_optimizer_fields(cfg: SimConfig) -> dict:
    """The fine-tuning job's local rule and served model (SWA from 0.75 T, the thesis's start)."""
    return {"local_rule": cfg.ft_local_rule, "sam_rho": cfg.ft_sam_rho, "prox_mu": cfg.ft_prox_mu,
            "served_model": cfg.ft_served_model, "swa_start_round": max(1, (3 * cfg.ft_rounds) // 4)}


def run_pipeline(cfg: SimConfig, quiet: bool = False, compare_with: dict | None = None,
                 pipeline: str = "fed3r-ft-oll") -> dict:
    """Run the pipeline's phases; ``compare_with``: a plain run's report, which a secure run's report
    then carries (its comparison table and its curves, dashed)."""
    names = PIPELINES[pipeline]
    check_pipeline_config(cfg, names)
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    clock = StepClock(say)
    prep = prepare(cfg, say)
    out = prep.out
    training_manifest = None
    if cfg.runtime.startswith("executorch"):      # the head's training program (fp32 on the features)
        from .bundles import ensure_training_bundle

        training_manifest = ensure_training_bundle(cfg.backbone, cfg.image_size, num_classes=10)
    phases = _Phases(cfg, prep, names, say, clock)
    phases.plan_fine_tuning()
    secure = phases.plan_secure()
    clock.done("setup (data, bundles, evaluation features)")
    with EmulatedFleet(cfg, out, prep.profiles, secure, quiet, holdout_file=out / "holdout.npz",
                       training_manifest=training_manifest, tail_manifest=phases.tail_manifest) as fleet:
        clock.done("fleet start (broker, device hosts)")
        head_dir = phases.run(fleet)
        deployments = None
        if cfg.deploy and not phases.tail:
            from .deploy_phase import run_deploy_scenarios

            say("\n[deploy] the fine-tuned head to the fleet through a canary; then a broken head (classes permuted)")
            deployments = run_deploy_scenarios(cfg, prep, head_dir / "model.npz", fleet.broker_url,
                                               out / f"{len(names) + 1}-deploy", say)
            clock.done("deploy")
    report = pipeline_report(cfg, prep, phases.done, fleet.worker_stats)
    if deployments is not None:
        report["deployments"] = deployments
    clock.done("fleet stop and centralized reference")
    report["wall_s"], report["timings_s"] = time.monotonic() - clock.started, dict(clock.steps)
    if compare_with is not None:
        report["compared_with"] = {k: v for k, v in compare_with.items() if k != "compared_with"}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    engine = write_plots_and_html(report, out)
    say(format_pipeline_report(report))
    say(f"\nwrote {out / 'report.json'}, {out / 'report.png'} ({engine}) and {out / 'report.html'}")
    return report


def check_pipeline_config(cfg: SimConfig, names: tuple[str, ...]) -> None:
    """Refuse a combination the pipeline cannot run, before the fleet starts (not when a job is created)."""
    if set(PERSONAL_PHASES) & set(names) and cfg.ft_mode != "psi":
        raise ValueError("partial personalization and Ditto run on the head: not after FT(φ)/FT(M) (no tail in "
                         "their tasks yet)")
    if not cfg.holdout_fraction:
        raise ValueError("personalization needs a local held-out split: set holdout_fraction > 0")
    if cfg.ft_algorithm == "fedgloss" and (cfg.secure or cfg.ft_mode != "psi"):
        raise ValueError("ft_algorithm fedgloss fine-tunes the head in plain rounds: not with secure or ft_mode phi/M")
    if cfg.ft_algorithm == "scaffold" and cfg.secure and cfg.ft_mode != "psi":
        raise ValueError("Scaffold on the tail runs in plain rounds (scaffold-secure is Scaffold(ψ)): not with secure "
                         "and ft_mode phi/M")
    optimizer = {"server_optimizer": cfg.ft_server_optimizer, "server_lr": cfg.ft_server_lr,
                 "server_momentum": cfg.ft_server_momentum, "init_scale": cfg.ft_init_scale, **ft_optimizer_fields(cfg)}
    validate_job_config(cfg.ft_algorithm, optimizer)
    kind_of(cfg.ft_algorithm).config_cls(**optimizer)


class _Phases:
    """The pipeline's jobs, one after another on one fleet, each starting from the last one's
    head: Fed3R, fine-tuning, partial personalization or Ditto, OLL. ``done``: phase name ->
    its folder and results."""

    def __init__(self, cfg: SimConfig, prep, names: tuple[str, ...], say, clock: StepClock):
        self.cfg, self.prep, self.names, self.say, self.clock = cfg, prep, names, say, clock
        self.steps, self.out, self.tail = len(names), prep.out, cfg.ft_mode != "psi"
        self.common = {k: prep.fed3r_job[k] for k in ("num_classes", "backbone", "image_size", "weights_sha256",
                                                      "feature_dim", "expected_devices", "start_timeout_s", "seed")}
        self.fed3r_job, self.secure_fields = dict(prep.fed3r_job), {}
        self.tail_manifest: Path | None = None
        self.done: dict[str, dict] = {}

    def plan_fine_tuning(self) -> None:
        """The FT job's kind, evaluation file and extra fields (FT(φ)/FT(M): the tail bundle's)."""
        cfg = self.cfg
        self.ft_kind, self.ft_eval, self.ft_extra = ("fedavg-secure" if cfg.secure else "fedavg",
                                                     self.out / "eval_features.npz", {})
        if cfg.ft_algorithm in ("fedgloss", "scaffold"):      # K in their server steps: the fleet's size
            self.ft_kind, self.ft_extra = cfg.ft_algorithm, {"total_devices": cfg.devices}
            if cfg.secure:          # fedgloss is refused with secure (check_pipeline_config)
                self.ft_kind = f"{cfg.ft_algorithm}-secure"
        if self.tail:
            self.tail_manifest, self.ft_eval, tail_fields = _tail_setup(cfg, self.prep, self.say)
            self.ft_extra = {**self.ft_extra, **tail_fields}
            self.ft_kind = ("fedavg-tail-secure" if cfg.secure else
                            "scaffold-tail" if cfg.ft_algorithm == "scaffold" else "fedavg-tail")
        elif cfg.fp_part != "psi":           # FP(φ)/FP(M) after OLL: the devices train the tail bundle's program
            self.tail_manifest = tail_bundle_manifest(cfg)
        if cfg.shards and self.ft_kind in ("fedavg", "scaffold", "fedgloss"):  # the direction screen's median
            # needs every update in one place (FT(φ)/FT(M) screens no direction)
            self.ft_extra = {**self.ft_extra, "direction_screen": False}

    def plan_secure(self):
        """With ``cfg.secure``: the keys and the secure fields every job gets; the fleet's secure setup (or None)."""
        cfg = self.cfg
        if not cfg.secure:
            return None
        job_fields, secure = _secure_setup(cfg, self.out, [p.device_id for p in self.prep.profiles],
                                           max(len(s) for s in self.prep.shards.values()))
        self.fed3r_job.update(job_fields)       # a one-shot group: its phase timeout scaled as its round's
        self.secure_fields = {**{k: job_fields[k] for k in ("graph", "max_samples", "identity_file",
                                                            "device_keys_file")},
                              "phase_timeout_s": cfg.phase_timeout_s}
        return secure

    def run(self, fleet) -> Path:
        """Every phase on ``fleet``; the folder of the head OLL personalised."""
        cfg, out, self.fleet = self.cfg, self.out, fleet
        self.say(f"\n[1/{self.steps}] fed3r{'-sync (secure aggregation)' if cfg.secure else ''}: closed-form "
                 "classifier from one round of statistics per device")
        head_dir = out / "1-fed3r"
        self._job("fed3r", "fed3r-sync" if cfg.secure else "fed3r", self.fed3r_job, head_dir,
                  out / "eval_features.npz", cfg.devices)
        fed3r_head = head_dir / "model.npz"
        if "fedavg-ft" in self.names:
            self.say(f"\n[2/{self.steps}] fedavg-ft: {ft_label(cfg)}, {cfg.ft_rounds} rounds of "
                     f"κ={cfg.clients_per_round}")
            head_dir = out / "2-fedavg-ft"
            ft_job = {**self.common, "job_id": "fedavg-ft-sim", "rounds": cfg.ft_rounds,
                      "clients_per_round": cfg.clients_per_round, "round_timeout_s": cfg.round_timeout_s,
                      "client_lr": cfg.ft_client_lr, "server_momentum": cfg.ft_server_momentum,
                      "server_optimizer": cfg.ft_server_optimizer, "server_lr": cfg.ft_server_lr,
                      **ft_optimizer_fields(cfg), "init": "fed3r", "initial_head_file": str(fed3r_head),
                      "init_scale": cfg.ft_init_scale,
                      **self.secure_fields, **self.ft_extra}
            self._job("fedavg-ft", self.ft_kind, ft_job, head_dir, self.ft_eval, cfg.ft_rounds * cfg.clients_per_round)
        personal = {}
        for name in (n for n in self.names if n in PERSONAL_PHASES):
            head_dir, personal = self._personal_phase(name, head_dir)
        self._oll(head_dir, personal)
        return head_dir

    def _personal_phase(self, name: str, head_dir: Path) -> tuple[Path, dict]:
        cfg = self.cfg
        step, kind = self.names.index(name) + 1, f"{name}-secure" if cfg.secure else name
        does, fields = PERSONAL_PHASES[name](cfg)
        self.say(f"\n[{step}/{self.steps}] {kind}: {does}, {cfg.pp_rounds} rounds of κ={cfg.clients_per_round}")
        job_dir, job_id = self.out / f"{step}-{name}", f"{name}-sim"
        job = {**self.common, "job_id": job_id, "rounds": cfg.pp_rounds, "clients_per_round": cfg.clients_per_round,
               "round_timeout_s": cfg.round_timeout_s, "client_lr": cfg.pp_client_lr, **fields,
               "init": "fed3r", "initial_head_file": str(head_dir / "model.npz"), **self.secure_fields}
        if cfg.shards and kind in ("pp", "ditto"):  # as FT(ψ)'s: the direction screen's median needs every update
            # in one place
            job["direction_screen"] = False
        self._job(name, kind, job, job_dir, self.out / "eval_features.npz", cfg.pp_rounds * cfg.clients_per_round)
        return job_dir, {"personal_job": job_id}

    def _oll(self, head_dir: Path, personal: dict) -> None:
        cfg, steps = self.cfg, self.steps
        what = f"the {'personalized' if personal else 'fine-tuned'} head{' and backbone tail' if self.tail else ''}"
        self.say(f"\n[{steps}/{steps}] oll: personalise {what} on every device (FP({FP_LABELS[cfg.fp_part]}) "
                 f"{cfg.fp_epochs} epochs)")
        oll_job = {**self.common, "job_id": "oll-sim", "head_file": str(head_dir / "model.npz"), **personal,
                   "tail_stages": cfg.tail_stages if self.tail else 0,
                   "clients_per_round": cfg.oneshot_clients_per_round,
                   "round_timeout_s": cfg.round_timeout_s * cfg.oneshot_timeout_factor,
                   "max_attempts": cfg.max_attempts, "fp_epochs": cfg.fp_epochs, "fp_lrs": list(cfg.fp_lrs),
                   "fp_part": cfg.fp_part}
        self._job("oll", "personalize", oll_job, self.out / f"{steps}-oll", self.out / "eval_features.npz",
                  cfg.devices)

    def _job(self, name: str, kind: str, job: dict, job_dir: Path, eval_file: Path, tasks: int) -> None:
        self.done[name] = {"dir": job_dir, "results": self.fleet.run_job(kind, job, job_dir, eval_file, tasks)}
        self.clock.done(name)


def tail_bundle_manifest(cfg: SimConfig) -> Path:
    """The FT(φ)/FT(M) and FP(φ)/FP(M) bundle's manifest: ``cfg.tail_bundle``, checked against the
    run's backbone, size and tail stages, or one exported into .cache/bundles."""
    from edge_client.runtime import read_manifest

    from .bundles import ensure_tail_bundle

    if not cfg.tail_bundle:
        return ensure_tail_bundle(cfg.backbone, cfg.image_size, 10, cfg.tail_stages)
    manifest = read_manifest(Path(cfg.tail_bundle))
    if (manifest.find("tail_eval", "eager") is None or manifest.tail is None or manifest.tail.stages != cfg.tail_stages
            or manifest.input.image_size != cfg.image_size or manifest.backbone != cfg.backbone
            or manifest.num_classes != 10):
        raise ValueError(f"{cfg.tail_bundle}: not a 10-class {cfg.backbone} bundle of {cfg.tail_stages} trainable "
                         f"tail stage(s) at {cfg.image_size} px (export one with --backbone {cfg.backbone} "
                         f"--num-classes 10 --tail-stages {cfg.tail_stages} --image-size {cfg.image_size})")
    return Path(cfg.tail_bundle)


def _tail_setup(cfg: SimConfig, prep, say) -> tuple[Path, Path, dict]:
    """The FT(φ)/FT(M) bundle, the test set's trunk activations (the aggregator evaluates the
    tail + head on them) and the job fields that name the bundle's evaluation program."""
    from edge_client.runtime import read_manifest
    from edge_client.tasks.tail_training import TrunkActivations

    t0 = time.monotonic()
    manifest_path = tail_bundle_manifest(cfg)
    program = read_manifest(manifest_path).find("tail_eval", "eager")
    activations = TrunkActivations(manifest_path, cfg.cache_dir).extract(prep.Xte)
    eval_file = prep.out / f"eval_trunk{cfg.tail_stages}.npz"
    np.savez(eval_file, Z=activations.reshape(len(activations), -1), y=prep.yte)
    say(f"  tail bundle (last {cfg.tail_stages} stage(s) trainable) and test trunk activations "
        f"{activations.shape} in {time.monotonic() - t0:.1f}s")
    return manifest_path, eval_file, {
        "train": FT_MODES[cfg.ft_mode][1], "tail_stages": cfg.tail_stages,
        "tail_program_file": str(manifest_path.parent / program.file), "tail_program_sha256": program.sha256}


def device_compute(workers: list[dict], kinds: tuple[str, ...]) -> dict:
    """Device compute time of a phase's task kinds over the fleet, from the workers' per-device counters."""
    per_task = [entry for w in workers for d in w["per_device"].values()
                for kind, entry in d.get("by_kind", {}).items() if kind in kinds]
    tasks = sum(e["tasks"] for e in per_task)
    total = sum(e["compute_s"] for e in per_task)
    return {"tasks": int(tasks), "compute_s": total, "compute_s_per_task": total / tasks if tasks else None,
            "bytes_up_devices": int(sum(e["bytes_up"] for e in per_task))}


def pipeline_report(cfg: SimConfig, prep, phases: dict, workers: list[dict]) -> dict:
    devices = cfg.devices
    report = {"config": reported_config(cfg), "devices": devices, "phases": {}}
    for name, phase in phases.items():
        r = phase["results"]
        entry = {"rounds": len(r["rounds"]) + r["rounds_earlier"],
                 "contributions": len(r["contributed"]) if name not in ("fedavg-ft", *PERSONAL_PHASES)
                 else sum(r["contributed"].values()),
                 "bytes_up": r["bytes_in"], "bytes_down": r["bytes_out"],
                 "bytes_up_per_device": r["bytes_in"] / devices, "bytes_down_per_device": r["bytes_out"] / devices,
                 "job_s": r.get("wall_s"), "device": device_compute(workers, PHASE_KINDS[name]),
                 "history": [{k: h.get(k) for k in ("round", "contributions", "accuracy", "bytes_in", "bytes_out",
                                                    "global_accuracy", "wma", "personal_wma")} for h in r["history"]],
                 "rejections": r["rejections"], "late": r["late"]}
        final = r["final"]
        if name == "fed3r":
            central = job_report(cfg, r, workers, prep, job_dir=phase["dir"])
            entry.update(accuracy=final.get("accuracy"), central_accuracy=central.get("central_accuracy"),
                         rel_weight_error=central.get("rel_weight_error"))
        elif name in ("fedavg-ft", *PERSONAL_PHASES):
            previous = list(phases)[list(phases).index(name) - 1]
            entry.update(accuracy=final.get("accuracy"), initial_accuracy=phases[previous]["results"]["final"].get("accuracy"),
                         personal_wma=final.get("personal_wma"), global_wma=final.get("global_wma"))
        else:
            entry.update(accuracy=final.get("global_accuracy"), wma=final.get("wma"),
                         fp_lr_chosen=final.get("fp_lr_chosen"), test_samples=final.get("test_samples"),
                         fallback_samples=final.get("fallback_samples"),
                         mean_local_classes=final.get("mean_local_classes"))
        report["phases"][name] = entry
    return report
