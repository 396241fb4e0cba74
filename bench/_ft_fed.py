"""In-process Fed3R+FT(ψ/φ/M) on the demo's partition: the real jobs, the devices' recipe, no MQTT.

The aggregator side is the real ``FedAvgJob`` (FT(ψ)) or ``TailFedAvgJob`` (FT(φ)/FT(M)):
sampling, bounded-influence layers, FedAvg/FedAvgM step, Fed3R init and its LR rule; the round
machine and the envelopes are driven by ``run_job`` (bench/fed3r_vs_fedavg.py).

The device side of FT(ψ) is the device's own ``HeadTrainingTask`` (eager torch ``train_head``,
which the bundle's training program is parity-checked against). For FT(φ)/FT(M),
:class:`EagerTailDevice` runs what the bundle's tail_training program computes (the program is
exported from these modules: ``TailModel`` with BatchNorm frozen, then the linear head, loss
CE(logits / T)) with the device recipe's own definitions — ``LocalTraining`` parses the task,
the protocol's ``batch_schedule`` orders the rows, SGD with weight decay as ``SessionStepper``
applies it, ``encode_model_update`` answers — on activations cached for the whole dataset (what
each device's trunk cache holds), without exporting a bundle per tail depth.

Scaffold(φ)/Scaffold(M) (:meth:`FineTuning.run_scaffold`) run the real ``ScaffoldTailJob`` and the
device's own ``ScaffoldTailTask`` (its control reading, corrected ``SessionStepper`` steps, option
II's c_k⁺, the state store's rules, one ``DeviceStateStore`` per device), whose bundle is replaced
by :class:`EagerTailSession` (the same loss and SGD as :class:`EagerTailDevice`) on the cached
activations (:class:`EagerScaffoldTailDevice`).
"""

from __future__ import annotations

import dataclasses
import pathlib
import tempfile

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from _ft_data import IMAGE_SIZE, NUM_CLASSES, accuracy, demo_partition, ridge_head, tail_for
from fed3r_vs_fedavg import CachedFeatures, fedavg_head_flops, run_job

from aggregator.jobs.fedavg import FedAvgConfig, FedAvgJob
from aggregator.jobs.fedavg_tail import TailFedAvgConfig, TailFedAvgJob
from aggregator.jobs.robustness_fields import PLAIN_MEAN
from aggregator.jobs.scaffold_tail import ScaffoldTailConfig, ScaffoldTailJob
from edge_client.agent import TaskDeclined
from edge_client.state import DeviceStateStore
from edge_client.tasks.head_training import HeadTrainingTask, LocalTraining
from edge_client.tasks.params import read_params
from edge_client.tasks.scaffold_tail import ScaffoldTailTask
from edge_client.tasks.tail_training import TailRound, check_model_tensors
from protocols.payloads.fedavg import TAIL_PREFIX, TAIL_TRAIN_MODES, batch_schedule, encode_model_update

MODES = {"psi": None, "phi": "tail", "M": "tail+head"}
AGGREGATION = {"plain": {}, "secure": PLAIN_MEAN}     # the secure job computes the plain weighted mean


@dataclasses.dataclass(frozen=True)
class Recipe:
    mode: str = "psi"                 # psi | phi | M
    client_lr: float = 0.001          # base; devices get × 0.1 after the Fed3R init (FedAvgConfig.device_lr)
    local_epochs: int = 1
    server_momentum: float = 0.0
    server_lr: float = 1.0
    temperature: float = 0.1
    tail_stages: int = 1

    def label(self) -> str:
        what = {"psi": "FT(ψ)", "phi": "FT(φ)", "M": "FT(M)"}[self.mode]
        if self.mode != "psi":
            what += f"×{self.tail_stages}"
        return (f"{what} lr {self.client_lr:g} E {self.local_epochs} β {self.server_momentum:g}"
                + (f" η_g {self.server_lr:g}" if self.server_lr != 1 else "")
                + (f" T {self.temperature:g}" if self.temperature != 0.1 else ""))


class TailClassifierModule(nn.Module):
    """tail(activations) → linear head; parameters ``tail.*``, ``weight``, ``bias`` (the programs' names)."""

    def __init__(self, tail: nn.Module, head: dict[str, np.ndarray]):
        super().__init__()
        self.tail = tail
        self.weight = nn.Parameter(torch.from_numpy(np.array(head["weight"], np.float32)))
        self.bias = nn.Parameter(torch.from_numpy(np.array(head["bias"], np.float32)))

    def forward(self, activations: torch.Tensor) -> torch.Tensor:
        return F.linear(self.tail(activations), self.weight, self.bias)


class EagerTailProgram:
    """``aggregator.compute.tail_program.TailProgram``'s interface on the eager module."""

    def __init__(self, module: TailClassifierModule):
        self.module = module
        self.initial = {name: p.detach().numpy().copy() for name, p in module.named_parameters()}

    @property
    def tail_parameters(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.initial.items() if k.startswith("tail.")}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: v.shape for k, v in self.initial.items()}

    def logits(self, params: dict[str, np.ndarray], activations: np.ndarray, batch: int = 2048) -> np.ndarray:
        tensors = {k: torch.from_numpy(np.ascontiguousarray(v, np.float32)) for k, v in params.items()}
        with torch.no_grad():
            return np.concatenate([torch.func.functional_call(self.module, tensors, (torch.from_numpy(
                activations[i:i + batch]),)).numpy() for i in range(0, len(activations), batch)])

    def features(self, params: dict[str, np.ndarray], activations: np.ndarray, batch: int = 2048) -> np.ndarray:
        tail = {k[len("tail."):]: torch.from_numpy(np.ascontiguousarray(v, np.float32))
                for k, v in params.items() if k.startswith("tail.")}
        with torch.no_grad():
            return np.concatenate([torch.func.functional_call(self.module.tail, tail, (torch.from_numpy(
                activations[i:i + batch]),)).numpy() for i in range(0, len(activations), batch)])

    def accuracy(self, params: dict[str, np.ndarray], activations: np.ndarray, labels: np.ndarray) -> float:
        return float((self.logits(params, activations).argmax(1) == labels).mean())


class EagerTailDevice:
    """A device's ``fedavg.tail`` handler on its cached activations (see the module docstring)."""

    def __init__(self, activations: np.ndarray, labels: np.ndarray, program: EagerTailProgram):
        self.activations, self.labels, self.program = activations, labels, program

    def __call__(self, params: dict, tensors: dict[str, np.ndarray]) -> tuple[dict, dict[str, np.ndarray]]:
        recipe = LocalTraining.from_params(params)
        train_head = TAIL_TRAIN_MODES[params["train"]]
        current = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in tensors.items()}
        trained = sorted(k for k in current if k.startswith("tail.") or train_head)
        module = self.program.module
        for rows in batch_schedule(len(self.labels), recipe.epochs, recipe.batch_size, recipe.seed):
            for k in trained:
                current[k].requires_grad_(True)
            logits = torch.func.functional_call(module, current, (torch.from_numpy(self.activations[rows]),))
            loss = F.cross_entropy(logits / recipe.temperature, torch.from_numpy(self.labels[rows]))
            grads = torch.autograd.grad(loss, [current[k] for k in trained])
            with torch.no_grad():       # torch.optim.SGD with weight decay, as SessionStepper applies it
                current.update({k: (current[k] - recipe.lr * (g + recipe.weight_decay * current[k])).detach()
                                for k, g in zip(trained, grads)})
        return encode_model_update({k: current[k].detach().numpy() for k in trained}, len(self.labels))


class EagerTailSession:
    """The ``TrainingSession`` calls ``SessionStepper`` makes (parameters in, loss and gradients
    of CE(logits / T) out, plain SGD steps), on the program's eager module through
    ``functional_call``: the bundle's tail_training program without a bundle. Holds its own
    tensors, so devices taking turns can share the program's module."""

    runtime = "eager"

    def __init__(self, program: EagerTailProgram, temperature: float):
        self.program, self.temperature = program, temperature
        self.parameter_shapes = program.shapes()
        self._current = program.initial

    def set_parameters(self, values: dict[str, np.ndarray]) -> None:
        self._current = {**self._current, **{k: np.array(v, np.float32) for k, v in values.items()}}

    def get_parameters(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self._current.items()}

    def loss_and_gradients(self, activations: np.ndarray, labels: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        current = {k: torch.from_numpy(v).requires_grad_(True) for k, v in self._current.items()}
        logits = torch.func.functional_call(self.program.module, current, (torch.from_numpy(activations),))
        loss = F.cross_entropy(logits / self.temperature, torch.from_numpy(labels))
        grads = torch.autograd.grad(loss, list(current.values()))
        return float(loss.detach()), {k: g.numpy() for k, g in zip(current, grads)}

    def sgd_step(self, directions: dict[str, np.ndarray], lr: float) -> None:
        self._current = {**self._current, **{k: (self._current[k] - np.float32(lr) * np.asarray(d, np.float32))
                                             for k, d in directions.items()}}


class EagerScaffoldTailDevice(ScaffoldTailTask):
    """The device's ``scaffold.tail`` handler with its bundle replaced by cached activations and an
    :class:`EagerTailSession`: everything after ``prepare`` (the control, the corrected steps, c_k⁺,
    the state store) is ``ScaffoldTailTask``'s own code."""

    def __init__(self, activations: np.ndarray, labels: np.ndarray, session: EagerTailSession,
                 store: DeviceStateStore):
        super().__init__(activations, labels, None, store)
        self.session = session

    def prepare(self, params, tensors, params_type, kind) -> TailRound:
        task = read_params(params_type, params, kind)
        if not np.isclose(task.training.temperature, self.session.temperature):
            raise TaskDeclined(f"task's temperature {task.training.temperature} differs from the program's")
        start = check_model_tensors(tensors, self.session.parameter_shapes, kind)
        trained = frozenset(name for name in start if name.startswith(TAIL_PREFIX) or TAIL_TRAIN_MODES[task.train])
        return TailRound(task, start, trained, self.images, self.session)


@dataclasses.dataclass
class Setup:
    """One seed's demo partition: the Fed3R start and everything its fleets need."""

    seed: int
    parts: list[np.ndarray]
    held: list[np.ndarray]
    start: dict[str, np.ndarray]
    fed3r_accuracy: float


def make_setups(data, seeds: list[int]) -> list[Setup]:
    """Per seed: the demo's partition and the Fed3R head on its training rows (what Fed3R computes exactly)."""
    tr, te = data["train"], data["test"]
    setups = []
    for seed in seeds:
        parts, held = demo_partition(tr.labels, seed)
        rows = np.concatenate(parts)
        start = ridge_head(tr.features[rows], tr.labels[rows])
        setups.append(Setup(seed, parts, held, start, accuracy(start["weight"], start["bias"], te.features, te.labels)))
    return setups


def psi_fleet(train, parts) -> tuple[dict, dict]:
    handlers, sizes = {}, {}
    for k, idx in enumerate(parts):
        if len(idx):
            x = train.images[idx]
            factory = (lambda cached: lambda *a: cached)(CachedFeatures(x, train.features[idx]))
            handlers[f"dev{k:03d}"], sizes[f"dev{k:03d}"] = HeadTrainingTask(x, train.labels[idx], factory), len(idx)
    return handlers, sizes


def tail_fleet(acts: np.ndarray, labels: np.ndarray, parts, program: EagerTailProgram) -> tuple[dict, dict]:
    handlers, sizes = {}, {}
    for k, idx in enumerate(parts):
        if len(idx):
            handlers[f"dev{k:03d}"] = EagerTailDevice(acts[idx], labels[idx], program)
            sizes[f"dev{k:03d}"] = len(idx)
    return handlers, sizes


def scaffold_tail_fleet(acts: np.ndarray, labels: np.ndarray, parts, session: EagerTailSession,
                        root: pathlib.Path) -> tuple[dict, dict]:
    """One :class:`EagerScaffoldTailDevice` per non-empty part, each with its own state store under ``root``."""
    handlers, sizes = {}, {}
    for k, idx in enumerate(parts):
        if len(idx):
            name = f"dev{k:03d}"
            handlers[name] = EagerScaffoldTailDevice(acts[idx], labels[idx], session, DeviceStateStore(root / name))
            sizes[name] = len(idx)
    return handlers, sizes


class FineTuning:
    """Runs recipes on one dataset (train/test ``_ft_data.Split``s), caching each tail depth's activations."""

    def __init__(self, data, curve_samples: int = 2000):
        self.train, self.test = data["train"], data["test"]
        # per-round curves on the first test images (evaluating a tail on all 10,000 every round
        # costs more than the round); the final model is scored on the whole test set
        self.curve_samples = curve_samples
        self._lifted: dict[int, tuple] = {}

    def fed3r_on_curve_set(self, setup: Setup) -> float:
        m = self.curve_samples
        return accuracy(setup.start["weight"], setup.start["bias"], self.test.features[:m], self.test.labels[:m])

    def lifted(self, stages: int):
        if stages not in self._lifted:
            tail, lift = tail_for(stages)
            self._lifted[stages] = (tail, lift(self.train.acts), lift(self.test.acts))
        return self._lifted[stages]

    def fields(self, recipe: Recipe, setup: Setup, rounds: int, aggregation: str, kappa: int, init: str) -> dict:
        """The job config's fields every fine-tuning job here shares."""
        return dict(num_classes=NUM_CLASSES, image_size=IMAGE_SIZE, feature_dim=setup.start["weight"].shape[1],
                    rounds=rounds, clients_per_round=kappa, seed=setup.seed, init=init,
                    client_lr=recipe.client_lr, local_epochs=recipe.local_epochs,
                    server_momentum=recipe.server_momentum, server_lr=recipe.server_lr,
                    temperature=recipe.temperature, **AGGREGATION[aggregation])

    def run(self, recipe: Recipe, setup: Setup, rounds: int, aggregation: str = "plain", kappa: int = 10,
            init: str = "fed3r") -> tuple[list[float], object, float]:
        """(accuracy on the first ``curve_samples`` test images after each round, the finished
        job, the final model's accuracy on the whole test set)."""
        m = self.curve_samples
        fields = self.fields(recipe, setup, rounds, aggregation, kappa, init)
        start = setup.start if init == "fed3r" else None
        if recipe.mode == "psi":
            job = FedAvgJob(FedAvgConfig(**fields), initial_head=start)
            handlers, sizes = psi_fleet(self.train, setup.parts)
            curve = run_job(job, handlers, sizes, (self.test.features[:m], self.test.labels[:m]), fedavg_head_flops, 0.0)
            return curve.accuracy, job, job.evaluate(self.test.features, self.test.labels)["accuracy"]
        tail, acts_tr, acts_te = self.lifted(recipe.tail_stages)
        if recipe.mode == "phi" and init != "fed3r":
            raise ValueError("FT(φ) trains against a frozen head: it needs the Fed3R one")
        program = EagerTailProgram(TailClassifierModule(tail, setup.start))    # the head: shapes only
        config = TailFedAvgConfig(**fields, tail_stages=recipe.tail_stages,
                                  train=MODES[recipe.mode], tail_program_file="in-process",
                                  **({"norm_bound_multiplier": 0.0} if aggregation == "secure" else {}))
        job = TailFedAvgJob(config, initial_head=start, program=program)
        handlers, sizes = tail_fleet(acts_tr, self.train.labels, setup.parts, program)
        curve = run_job(job, handlers, sizes, (acts_te[:m], self.test.labels[:m]), tail_task_flops, 0.0)
        return curve.accuracy, job, job.evaluate(acts_te, self.test.labels)["accuracy"]

    def run_scaffold(self, recipe: Recipe, setup: Setup, rounds: int, kappa: int = 10
                     ) -> tuple[list[float], object, float]:
        """Fed3R-initialised Scaffold(φ) (``recipe.mode`` "phi") or Scaffold(M) ("M") with ``recipe``'s
        local training, K = the fleet's devices in c's update; what :meth:`run` returns."""
        if recipe.mode not in ("phi", "M"):
            raise ValueError("run_scaffold fine-tunes the tail: mode phi or M (Scaffold(ψ): bench/claims/personalization.py)")
        m = self.curve_samples
        tail, acts_tr, acts_te = self.lifted(recipe.tail_stages)
        program = EagerTailProgram(TailClassifierModule(tail, setup.start))
        devices = sum(1 for idx in setup.parts if len(idx))
        config = ScaffoldTailConfig(**self.fields(recipe, setup, rounds, "plain", kappa, "fed3r"),
                                    tail_stages=recipe.tail_stages, train=MODES[recipe.mode],
                                    tail_program_file="in-process", total_devices=devices)
        job = ScaffoldTailJob(config, initial_head=setup.start, program=program)
        with tempfile.TemporaryDirectory() as root:
            handlers, sizes = scaffold_tail_fleet(acts_tr, self.train.labels, setup.parts,
                                                  EagerTailSession(program, recipe.temperature), pathlib.Path(root))
            curve = run_job(job, handlers, sizes, (acts_te[:m], self.test.labels[:m]), tail_task_flops, 0.0)
        return curve.accuracy, job, job.evaluate(acts_te, self.test.labels)["accuracy"]


def tail_task_flops(params, n):
    return 0.0          # not reported by these benches
