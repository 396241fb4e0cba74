"""Every job kind the aggregator can run, registered once: name, config class, factory.

The service, the admin API (``POST /api/jobs``), ``fedfleet admin job create`` and ``fedfleet
aggregator serve --kind`` all build jobs here, so a kind that is registered can be created from
any of them and resumed after a restart from its stored config. A kind's factory builds the job
from its config alone: whatever else it needs (the initial head, the tail program, the
pretrained segmentation network, the aggregator's identity) is named in the config as a file,
so a restarted service finds it again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from protocols.payloads.ditto import KIND as DITTO_KIND
from protocols.payloads.fed3r import KIND as FED3R_KIND
from protocols.payloads.fedavg import KIND as FEDAVG_KIND
from protocols.payloads.fedavg import KIND_TAIL as FEDAVG_TAIL_KIND
from protocols.payloads.fedgloss import KIND as FEDGLOSS_KIND
from protocols.payloads.ladd import KIND_STYLE as LADD_STYLE_KIND
from protocols.payloads.ladd import KIND_TRAIN as LADD_TRAIN_KIND
from protocols.payloads.partial import KIND as PP_KIND
from protocols.payloads.personalize import KIND as PERSONALIZE_KIND
from protocols.payloads.scaffold import KIND as SCAFFOLD_KIND
from protocols.payloads.scaffold import KIND_TAIL as SCAFFOLD_TAIL_KIND
from protocols.payloads.secagg import (SECURE_DITTO_KIND, SECURE_FEDAVG_KIND, SECURE_LADD_KIND, SECURE_PP_KIND,
                                       SECURE_SCAFFOLD_KIND, SECURE_TAIL_KIND, SYNC_KIND)
from protocols.payloads.task_kinds import TASK_PARAMS

from aggregator.jobs.config_limits import choices_of, validate_config
from aggregator.jobs.fed3r import Fed3RConfig, Fed3RJob
from aggregator.jobs.fed3r_sync import Fed3RSyncConfig, Fed3RSyncJob
from aggregator.jobs.ditto import DittoConfig, DittoJob
from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob
from aggregator.jobs.fedavg_async import AsyncFedAvgConfig, AsyncFedAvgJob
from aggregator.jobs.fedgloss import FedGlossConfig, FedGlossJob
from aggregator.jobs.fedavg_tail import TailFedAvgConfig, TailFedAvgJob
from aggregator.jobs.fedncm import FedNCMConfig, FedNCMJob, FedNCMSyncConfig, FedNCMSyncJob
from aggregator.jobs.ladd import LaddConfig, LaddJob
from aggregator.jobs.partial import PartialConfig, PartialPersonalizationJob
from aggregator.jobs.scaffold import ScaffoldConfig, ScaffoldJob
from aggregator.jobs.scaffold_tail import ScaffoldTailConfig, ScaffoldTailJob
from aggregator.jobs.personalize import PersonalizeConfig, PersonalizeJob
from aggregator.jobs.secure_fedavg import (SecureDittoConfig, SecureDittoJob, SecureFedAvgConfig, SecureFedAvgJob,
                                           SecurePartialConfig, SecurePartialJob, SecureTailFedAvgConfig,
                                           SecureTailFedAvgJob)
from aggregator.jobs.secure_fields import SecureAggregationFields
from aggregator.jobs.secure_rounds import config_vector_length
from aggregator.jobs.secure_scaffold import SecureScaffoldConfig, SecureScaffoldJob
from aggregator.jobs.secure_ladd import SecureLaddConfig, SecureLaddJob
from aggregator.jobs.task_size import check_task_fits
from aggregator.shards.control_sums import ControlledRoundSums
from aggregator.shards.fed3r_sums import Fed3RSums
from aggregator.shards.fedavg_sums import FedAvgRoundSums
from aggregator.shards.group_placement import SecureGroupPlacement
from aggregator.shards.ladd_sums import LaddRoundSums
from aggregator.shards.personal_sums import PersonalRoundSums
from aggregator.shards.report_receipts import PersonalizationReports
from aggregator.shards.sum_tree import AdditiveState


@dataclass(frozen=True)
class JobKind:
    name: str
    config_cls: type
    job_cls: type
    summary: str                                   # one line for --help and the API schema
    task_kinds: tuple[str, ...]                    # the wire kinds its tasks have (protocols/payloads/task_kinds.py)
    factory: Callable | None = None                # config -> job (default: job_cls(config))
    # How shards sum this kind (aggregator/shards/; None: --shards refuses it). Declared per kind,
    # never inherited: a subclass (FedNCM, Scaffold, FedGloSS, ...) may aggregate otherwise.
    shard_sums: AdditiveState | None = None
    # How shards host this kind's secure groups (aggregator/shards/secure_groups.py; None: they do not).
    shard_groups: SecureGroupPlacement | None = None

    def __post_init__(self):
        unknown = [k for k in self.task_kinds if k not in TASK_PARAMS]
        if unknown or not self.task_kinds:
            raise ValueError(f"job kind {self.name}: task kinds {unknown or '()'} have no declared params type")

    def build(self, config) -> object:
        return (self.factory or self.job_cls)(config)


def _ladd_factory(job_cls: type) -> Callable:
    def build(config: LaddConfig):
        return job_cls(config, initial=LaddJob.load_initial(config))
    return build


FED3R, FED3R_SYNC = (FED3R_KIND,), (SYNC_KIND,)
KINDS: dict[str, JobKind] = {k.name: k for k in (
    JobKind("fed3r", Fed3RConfig, Fed3RJob, "Fed3R: each device sends its ridge statistics once; exact closed form",
            FED3R, shard_sums=Fed3RSums()),
    JobKind("fed3r-sync", Fed3RSyncConfig, Fed3RSyncJob, "Fed3R-Sync: the statistics summed in groups under SecAgg",
            FED3R_SYNC, shard_groups=SecureGroupPlacement()),
    JobKind("fedncm", FedNCMConfig, FedNCMJob,
            "FedNCM: Fed3R's device task, solved as normalised class means (the Fed3R paper's baseline)", FED3R,
            shard_sums=Fed3RSums()),
    JobKind("fedncm-sync", FedNCMSyncConfig, FedNCMSyncJob, "FedNCM on Fed3R-Sync's secure group sums", FED3R_SYNC,
            shard_groups=SecureGroupPlacement()),
    JobKind("fedavg", FedAvgConfig, FedAvgJob, "FedAvg/FedAvgM rounds fine-tuning the classifier head (FT(ψ))",
            (FEDAVG_KIND,), shard_sums=FedAvgRoundSums()),
    JobKind("fedavg-async", AsyncFedAvgConfig, AsyncFedAvgJob,
            "FedAvg(ψ) without rounds: FedBuff, a server step every K arrivals, staleness-weighted", (FEDAVG_KIND,)),
    JobKind("fedavg-secure", SecureFedAvgConfig, SecureFedAvgJob, "FedAvg(ψ) with each round's updates summed under SecAgg",
            (SECURE_FEDAVG_KIND,), shard_groups=SecureGroupPlacement()),
    JobKind("fedavg-tail", TailFedAvgConfig, TailFedAvgJob, "FedAvg of the backbone's last stages: FT(φ) or FT(M)",
            (FEDAVG_TAIL_KIND,), shard_sums=FedAvgRoundSums()),
    JobKind("fedavg-tail-secure", SecureTailFedAvgConfig, SecureTailFedAvgJob, "FT(φ)/FT(M) summed under SecAgg",
            (SECURE_TAIL_KIND,), shard_groups=SecureGroupPlacement()),
    JobKind("pp", PartialConfig, PartialPersonalizationJob,
            "FedSim/FedAlt partial personalization: shared head weights averaged, each device's bias kept on it",
            (PP_KIND,), shard_sums=PersonalRoundSums()),
    JobKind("pp-secure", SecurePartialConfig, SecurePartialJob,
            "FedSim/FedAlt with each round's shared-weight updates summed under SecAgg", (SECURE_PP_KIND,),
            shard_groups=SecureGroupPlacement()),
    JobKind("scaffold", ScaffoldConfig, ScaffoldJob,
            "Scaffold(ψ): FedAvg of the head corrected by control variates; each device keeps its own c_k",
            (SCAFFOLD_KIND,), shard_sums=ControlledRoundSums()),
    JobKind("scaffold-secure", SecureScaffoldConfig, SecureScaffoldJob,
            "Scaffold(ψ) with each round's head updates and control deltas Δc summed under SecAgg", (SECURE_SCAFFOLD_KIND,),
            shard_groups=SecureGroupPlacement()),
    JobKind("scaffold-tail", ScaffoldTailConfig, ScaffoldTailJob,
            "Scaffold(φ)/Scaffold(M): FT(φ)/FT(M) corrected by control variates; each device keeps its own c_k",
            (SCAFFOLD_TAIL_KIND,), shard_sums=ControlledRoundSums()),
    JobKind("fedgloss", FedGlossConfig, FedGlossJob,
            "FedGloSS(ψ): server-side SAM from the last round's pseudo-gradient plus ADMM; each device keeps its dual",
            (FEDGLOSS_KIND,), shard_sums=FedAvgRoundSums()),
    JobKind("ditto", DittoConfig, DittoJob,
            "Ditto(ψ): FedAvg of the head; each device also keeps a personal head pulled to the global one",
            (DITTO_KIND,), shard_sums=PersonalRoundSums()),
    JobKind("ditto-secure", SecureDittoConfig, SecureDittoJob,
            "Ditto(ψ) with each round's global-head updates summed under SecAgg; personal heads stay on the devices",
            (SECURE_DITTO_KIND,), shard_groups=SecureGroupPlacement()),
    JobKind("personalize", PersonalizeConfig, PersonalizeJob, "OLL and OLL+FP(ψ) on every device; held-out WMA",
            (PERSONALIZE_KIND,), shard_sums=PersonalizationReports()),
    JobKind("ladd", LaddConfig, LaddJob, "LADD: style clustering and cluster-specific self-training (segmentation)",
            (LADD_STYLE_KIND, LADD_TRAIN_KIND), _ladd_factory(LaddJob), shard_sums=LaddRoundSums()),
    JobKind("ladd-secure", SecureLaddConfig, SecureLaddJob, "LADD with each cluster's updates summed under SecAgg",
            (LADD_STYLE_KIND, SECURE_LADD_KIND), _ladd_factory(SecureLaddJob), shard_groups=SecureGroupPlacement()),
)}


def job_kinds_sending(task_kind: str) -> list[str]:
    """The job kinds whose tasks include ``task_kind`` (a wire kind)."""
    return sorted(name for name, spec in KINDS.items() if task_kind in spec.task_kinds)


def kind_of(name: str) -> JobKind:
    if name not in KINDS:
        raise ValueError(f"unknown job kind {name!r} (known: {', '.join(sorted(KINDS))})")
    return KINDS[name]


def validate_job_config(kind: str, config: dict) -> None:
    """Refuse a config before anything is built from it: known fields, JSON types, limits."""
    validate_config(kind, kind_of(kind).config_cls, config)


def checked_config(kind: str, config: dict):
    """The config object of ``config``: its fields, their cross-field rules, its task held to
    what a device takes in one message (``aggregator/jobs/task_size.py``), and a secure kind's
    vector to what SecAgg sums and a device masks, where the config alone says its length
    (``secure_rounds.config_vector_length``: the job's own check, before anything is stored)."""
    validate_job_config(kind, config)
    built = kind_of(kind).config_cls(**config)
    check_task_fits(kind, built)
    if isinstance(built, SecureAggregationFields):
        config_vector_length(built)
    return built


def build_job(kind: str, config: dict):
    return kind_of(kind).build(checked_config(kind, config))


def full_config(kind: str, config: dict) -> dict:
    """The config with every default made explicit and the kind's default job id (what is stored)."""
    validate_job_config(kind, config)
    job_id = config.get("job_id") or kind_of(kind).config_cls.__dataclass_fields__["job_id"].default
    built = checked_config(kind, {**config, "job_id": job_id})
    built.check_stored()                  # refused at create, not when the stored job starts
    return built.to_dict()


def job_kind_name(job) -> str:
    """The registry name of a job's type (its class name if unregistered: it then cannot be
    rebuilt from a stored config, i.e. started through the API or re-summed canonically)."""
    for spec in KINDS.values():
        if type(job) is spec.job_cls:
            return spec.name
    return type(job).__name__


def field_choices(kind: str, field: str) -> tuple:
    """The values a kind's choice field takes, from the field's declaration (what a CLI offers)."""
    return choices_of(kind_of(kind).config_cls, field)


def config_fields(kind: str) -> list[dataclasses.Field]:
    return list(dataclasses.fields(kind_of(kind).config_cls))
