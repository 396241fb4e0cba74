"""``fedavg.tail``: FT(φ) / FT(M) on the device, fine-tuning the backbone's last stages.

The device's bundle splits the backbone (``edge_client.models.tail``): a frozen *trunk*
inference program and a *tail_training* program (the last stages + the linear head, BatchNorm
frozen). The handler

1. runs the trunk once per image (:class:`TrunkActivations`; activations are cached on disk
   like features, since the trunk never changes);
2. loads the task's global model (``tail.<...>`` + ``weight`` + ``bias``) into the training
   program, checking that its names and shapes are exactly the bundle's;
3. runs the same local SGD as FedAvg(ψ) (``head_training.local_sgd``: seeded shuffles,
   mini-batches, weight decay on the trained tensors), updating only the tail for
   ``train = "tail"`` (FT(φ): the Fed3R head stays frozen) or everything for
   ``"tail+head"`` (FT(M));
4. returns exactly the tensors it trained, with n_k.

Steps 1-2 are ``prepare`` and step 3 ``train``: Scaffold on the tail
(``edge_client/tasks/scaffold_tail.py``) reuses both, adding its control correction to each step.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from protocols.payloads.fedavg import KIND_TAIL, TAIL_PREFIX, TAIL_TRAIN_MODES, TailTrainingParams, encode_model_update

from ..agent import TaskDeclined
from .task_inputs import check_local_labels, local_samples
from .head_training import SessionStepper, local_sgd
from .params import read_params

log = logging.getLogger("fedfleet.device")


class TrunkActivations:
    """A bundle's trunk program as a cached extractor: uint8 images -> (n, c, h, w) float32."""

    def __init__(self, manifest_path: str | Path, cache_dir: str | None = None,
                 prefer: tuple[str, ...] = ("executorch", "onnxruntime", "eager")):
        from edge_client.features import FeatureExtractor
        from edge_client.runtime import load_inference

        program = load_inference(manifest_path, prefer=prefer, kind="trunk")
        m = program.manifest
        self.manifest = m
        self.shape = tuple(m.tail.activation_shape)
        self.feature_dim = math.prod(self.shape)            # one flattened row
        # The extractor's batching, checks and disk cache, on flattened activation rows. Cached
        # activations belong to this very trunk program (its file's sha256, as the verified manifest
        # gives it): another trunk under the same backbone, weights and stages (a re-export, a
        # replaced bundle) must never be served this one's (a review's finding)
        trunk_sha256 = m.find("trunk", program.runtime).sha256
        self._extractor = FeatureExtractor(
            lambda batch: program.run(batch).reshape(len(batch), -1), image_size=m.input.image_size,
            mean=m.input.mean, std=m.input.std, batch_size=32, cache_dir=cache_dir,
            feature_dim=self.feature_dim,
            cache_key=f"{m.backbone}:{m.weights_sha256}:{m.input.image_size}:trunk{m.tail.stages}:{program.runtime}"
                      f":{trunk_sha256}")

    def extract(self, images: np.ndarray) -> np.ndarray:
        return self._extractor.extract(images).reshape(-1, *self.shape)


@dataclass(frozen=True)
class TailRound:
    """A checked tail task: its params, the global model, the tensors that train, the trunk's activations."""

    params: TailTrainingParams
    start: dict[str, np.ndarray]
    trained: frozenset[str]
    activations: np.ndarray
    session: Any


class TailTrainingTask:
    """Handler for ``fedavg.tail``: ``(params, tensors) -> (body, tensors)``.

    ``manifest``: the bundle with the trunk and tail_training programs. ``trunk``: an object
    with ``extract(images) -> (n, c, h, w)`` (default: a :class:`TrunkActivations` of that
    bundle, made on first use; emulated devices share one). ``session``: an already loaded
    ``TrainingSession`` of that bundle's tail_training program (default: loaded on first use);
    devices that take turns on one CPU can share one, since every task sets all its tensors.
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray, manifest: str | Path | None,
                 trunk=None, cache_dir: str | None = None, session=None):
        self.images, self.labels = local_samples(images, labels)
        self.manifest_path = manifest
        self.cache_dir = cache_dir
        self._trunk = trunk
        self._session = session
        self.last_steps = 0
        self.last_loss = float("nan")

    def _load(self):
        from edge_client.runtime import RuntimeUnavailableError, TrainingSession
        from edge_client.runtime.errors import ArtifactError

        if self.manifest_path is None:
            raise TaskDeclined("this device has no bundle with a tail_training program")
        try:
            if self._session is None:
                self._session = TrainingSession.load(self.manifest_path, kind="tail_training")
            if self._trunk is None:
                self._trunk = TrunkActivations(self.manifest_path, self.cache_dir)
        except (ArtifactError, RuntimeUnavailableError) as exc:
            raise TaskDeclined(f"tail bundle unusable: {exc}") from exc
        return self._session, self._trunk

    def prepare(self, params: dict[str, Any], tensors: dict[str, np.ndarray] | None,
                params_type: type[TailTrainingParams] = TailTrainingParams, kind: str = KIND_TAIL) -> TailRound:
        """A task's checked inputs (its params as ``params_type``, the global model, what trains, the
        trunk's activations); TaskDeclined with the reason otherwise."""
        if len(self.images) == 0:
            raise TaskDeclined("no local training data")
        task = read_params(params_type, params, kind)
        recipe, num_classes, tail_stages, mode = task.training, task.model.num_classes, task.tail_stages, task.train
        backbone, image_size = task.model.backbone, task.model.image_size
        session, trunk = self._load()
        m = session.manifest
        wanted_weights = task.model.weights_sha256 or m.weights_sha256
        if (m.backbone, m.input.image_size, m.tail.stages, m.num_classes, wanted_weights) != \
                (backbone, image_size, tail_stages, num_classes, m.weights_sha256):
            raise TaskDeclined(f"task wants {backbone} at {image_size} px, tail {tail_stages}, {num_classes} "
                               f"classes; the bundle is {m.backbone} at {m.input.image_size} px, tail "
                               f"{m.tail.stages}, {m.num_classes} classes (or other weights)")
        if not math.isclose(m.temperature, recipe.temperature, rel_tol=1e-6):
            raise TaskDeclined(f"task's temperature {recipe.temperature} differs from the program's {m.temperature}")
        start = check_model_tensors(tensors, session.parameter_shapes, kind)
        check_local_labels(self.labels, num_classes)
        trained = frozenset(name for name in start if name.startswith(TAIL_PREFIX) or TAIL_TRAIN_MODES[mode])
        return TailRound(task, start, trained, trunk.extract(self.images), session)

    def train(self, job: TailRound, correction: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The local SGD from the task's model; the trained tensors after it (``correction``: see SessionStepper)."""
        stepper = SessionStepper(job.session, job.start, job.params.training, job.trained, correction)
        self.last_steps, self.last_loss = local_sgd(stepper, len(self.labels), job.activations, self.labels,
                                                    job.params.training)
        after = stepper.parameters()
        return {name: after[name] for name in sorted(job.trained)}

    def __call__(self, params: dict[str, Any], tensors: dict[str, np.ndarray] | None = None
                 ) -> tuple[dict, dict[str, np.ndarray]]:
        trained = self.train(self.prepare(params, tensors))
        try:
            return encode_model_update(trained, len(self.labels))
        except ValueError as exc:        # NaN/Inf: diverged
            raise TaskDeclined(f"local training diverged: {exc}; lower the learning rate") from exc


def check_model_tensors(tensors: dict[str, np.ndarray] | None, shapes: dict[str, tuple[int, ...]],
                        kind: str) -> dict[str, np.ndarray]:
    """A task's global model as float32 arrays, declined unless it has exactly the bundle's
    tensor names and shapes, all finite."""
    tensors = tensors or {}
    if set(tensors) != set(shapes):
        raise TaskDeclined(f"{kind} task tensors {sorted(tensors)} are not the bundle's {sorted(shapes)}")
    model = {}
    for name, shape in shapes.items():
        value = np.asarray(tensors[name])
        if value.shape != tuple(shape) or not np.issubdtype(value.dtype, np.floating):
            raise TaskDeclined(f"tensor {name} is {value.dtype} {value.shape}, the bundle needs float {tuple(shape)}")
        if not np.isfinite(value).all():
            raise TaskDeclined(f"global model tensor {name} contains NaN or Inf")
        model[name] = np.ascontiguousarray(value, dtype=np.float32)
    return model


class TailFeatures:
    """Features of a fine-tuned backbone on the device, for OLL after FT(φ)/FT(M).

    The bundle's trunk program gives the activations (cached, as for training); the backbone's
    tail then runs with the global model's ``tail.*`` tensors through the tail_training
    program's eager twin (torch, BatchNorm frozen), because an ExecuTorch training program
    returns loss and logits, not features. ``trunk`` may be shared with a TailTrainingTask.
    """

    def __init__(self, manifest: str | Path, trunk=None, cache_dir: str | None = None):
        self.manifest_path, self.cache_dir = manifest, cache_dir
        self._trunk = trunk
        self._session = None
        self._bundled: dict[str, np.ndarray] = {}

    def session(self):
        """The eager tail_training session (loaded on first use); TaskDeclined if unusable."""
        from edge_client.runtime import RuntimeUnavailableError, TrainingSession
        from edge_client.runtime.errors import ArtifactError

        try:
            if self._session is None:
                self._session = TrainingSession.load(self.manifest_path, prefer=("eager",), kind="tail_training")
                self._bundled = self._session.get_parameters()
            if self._trunk is None:
                self._trunk = TrunkActivations(self.manifest_path, self.cache_dir)
        except (ArtifactError, RuntimeUnavailableError) as exc:
            raise TaskDeclined(f"tail bundle unusable for features: {exc}") from exc
        return self._session

    def bundled_parameters(self) -> dict[str, np.ndarray]:
        """The program's parameters as the bundle shipped them (the pretrained tail), whatever
        tasks set since: what FP(φ)/FP(M) start the tail from when the global model has none."""
        self.session()
        return {k: v.copy() for k, v in self._bundled.items()}

    def exclusive(self, work):
        """``work(self)``: what a shared wrapper (``edge_client.handlers``) runs holding its lock, so
        a device's many calls on the session (FP(φ)'s training) never interleave with another's."""
        return work(self)

    def activations(self, images: np.ndarray) -> np.ndarray:
        """The trunk's (cached) activations of these images: the tail program's inputs."""
        self.session()
        return self._trunk.extract(images)

    def extract(self, model: dict[str, np.ndarray], *image_sets: np.ndarray) -> tuple[np.ndarray, ...]:
        """(n, feature_dim) features of each set of uint8 images under `model` (every tensor of the
        bundle's tail_training program, already checked with check_model_tensors)."""
        session = self.session()
        session.set_parameters(model)
        return tuple(session.features(self._trunk.extract(images)) for images in image_sets)
