"""How a device builds its task handlers from its configuration, for every task kind it serves.

One definition for both a real device (``fedfleet device``) and the emulated fleet's workers
(``fedfleet.emulation.worker``): Fed3R statistics, FedAvg head training, FT(φ)/FT(M) of the
backbone's tail (with a tail bundle), OLL personalization (with a held-out split), and the secure
variants (Fed3R-Sync, secure FedAvg) around them; a LADD device's style and self-training
handlers on its unlabelled images (:func:`ladd_handlers`), secure LADD around those.

Making a feature extractor may need exporting a bundle (``fedfleet.bundles``, which imports
``export``); the device SDK never imports ``export``, so the caller hands
:class:`SharedExtractors` an extractor factory.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from functools import partial
from typing import Callable

import numpy as np

from edge_client.agent import SecureTaskHandler, TaskDeclined
from edge_client.runtime.base import torch_installed
from edge_client.tasks.extractors import MAX_HELD_EXTRACTORS
from edge_client.tasks.fed3r_stats import Fed3RStatsTask
from edge_client.state import DeviceStateStore
from edge_client.sample_windows import WINDOWS_FILE, SampleWindowLedger
from edge_client.secure_inputs import SECURE_INPUTS_FILE, SecureInputLedger
from edge_client.tasks.head_training import HeadTrainingTask
from edge_client.tasks.partial_training import PartialTrainingTask
from edge_client.tasks.fedgloss_training import FedGlossTrainingTask
from edge_client.tasks.ditto_training import DittoTrainingTask
from edge_client.tasks.scaffold_training import ScaffoldTrainingTask
from edge_client.tasks.scaffold_tail import ScaffoldTailTask
from edge_client.tasks.personalization import PersonalizeTask
from edge_client.tasks.secure_fed3r import SecureFed3R
from edge_client.tasks.secure_fedavg_training import SecureFedAvgTraining, SecureScaffoldTraining
from edge_client.tasks.secure_update import SecAggSessions
from edge_client.tasks.tail_training import TailFeatures, TailTrainingTask, TrunkActivations
from protocols.identity import DeviceIdentity
from protocols.payloads.fed3r import KIND as FED3R_KIND
from protocols.payloads.fedavg import KIND as FEDAVG_KIND
from protocols.payloads.fedavg import KIND_TAIL as FEDAVG_TAIL_KIND
from protocols.payloads.ladd import KIND_STYLE as LADD_STYLE_KIND
from protocols.payloads.ladd import KIND_TRAIN as LADD_TRAIN_KIND
from protocols.payloads.partial import KIND as PP_KIND
from protocols.payloads.fedgloss import KIND as FEDGLOSS_KIND
from protocols.payloads.ditto import KIND as DITTO_KIND
from protocols.payloads.scaffold import KIND as SCAFFOLD_KIND
from protocols.payloads.scaffold import KIND_TAIL as SCAFFOLD_TAIL_KIND
from protocols.payloads.personalize import KIND as PERSONALIZE_KIND
from protocols.payloads.task_kinds import SECURE_ONLY_DECLINE, UPDATES_IN_THE_CLEAR
from protocols.payloads.secagg import (SECAGG_TYPE, SECURE_DITTO_KIND, SECURE_FEDAVG_KIND, SECURE_LADD_KIND,
                                       SECURE_PP_KIND, SECURE_SCAFFOLD_KIND, SECURE_TAIL_KIND, SYNC_KIND)

# (backbone, image_size) -> a FeatureExtractor; e.g. fedfleet.bundles.make_extractor bound to a runtime
ExtractorFactory = Callable[[str, int], object]


@dataclass(frozen=True)
class LocalData:
    """A device's images and labels, and which of them it trains on / holds out (OLL reports)."""
    images: np.ndarray
    labels: np.ndarray
    train_idx: np.ndarray
    holdout_idx: np.ndarray | None = None


@dataclass(frozen=True)
class HandlerConfig:
    """What a device's handlers are made of besides its data and extractors: the head training
    bundle (FedAvg rounds through its program; None: eager head step) and the tail bundle
    (FT(φ)/FT(M); None: the device declines those rounds)."""
    training_manifest: str | None = None
    tail_manifest: str | None = None


def torch_free() -> bool:
    """Whether this is a torch-free device (``fedfleet[device]``): features from an exported ONNX
    program, the linear head trained in numpy; no backbone training (FT(φ)/FT(M), LADD)."""
    return not torch_installed()


BACKBONE_TRAINING_NEEDS = ("this device is torch-free (fedfleet[device]): {kind} trains backbone layers, which needs "
                           "torch and the ExecuTorch training programs (pip install 'fedfleet[device-executorch]')")


class Unsupported(SecureTaskHandler):
    """Handler of a task kind this device cannot run: declines every task of it with the reason,
    which the aggregator records (a mixed fleet's other devices serve the job)."""

    def __init__(self, reason: str):
        self.reason = reason

    def __call__(self, params, tensors=None):
        raise TaskDeclined(self.reason)

    def on_task(self, job: str, round_: int, params, tensors=None):
        """The secure kind of an unsupported plain kind: declined before any key is made."""
        raise TaskDeclined(self.reason)


class SharedExtractors:
    """Per-process cache of feature extractors, made by ``factory``: the last
    ``MAX_HELD_EXTRACTORS`` (backbone, image size) pairs asked for."""

    def __init__(self, factory: ExtractorFactory, cache_dir: str | None):
        self.factory, self.cache_dir = factory, cache_dir
        self.lock = threading.Lock()
        self._made: dict = {}                     # the tail bundle's trunk and features: the device's own
        self._extractor = functools.lru_cache(maxsize=MAX_HELD_EXTRACTORS)(factory)   # called under the lock

    def trunk(self, manifest: str) -> "_Locked":
        """The tail bundle's trunk program, shared by the process's devices (FT(φ)/FT(M))."""
        with self.lock:
            if manifest not in self._made:
                self._made[manifest] = TrunkActivations(manifest, self.cache_dir)
            return _Locked(self._made[manifest], self.lock)

    def tail_features(self, manifest: str) -> "_Locked":
        """The tail bundle's fine-tuned-backbone features (OLL after FT(φ)/FT(M)), shared like the
        trunk: one eager tail session per process, set to each task's model under the lock."""
        with self.lock:
            key = ("tail_features", manifest)
            if key not in self._made:
                if manifest not in self._made:
                    self._made[manifest] = TrunkActivations(manifest, self.cache_dir)
                self._made[key] = TailFeatures(manifest, trunk=self._made[manifest])   # used under the lock
            return _Locked(self._made[key], self.lock)

    def __call__(self, backbone: str, image_size: int, weights_sha256: str, bundle_sha256: str = ""):
        # A job's announced bundle is what real devices fetch (fedfleet.device_bundles.FetchedBundles);
        # the local factory makes its own, so only the weights are checked here.
        from edge_client.models import weights_sha256 as local_sha

        if weights_sha256 and weights_sha256 != local_sha(backbone):
            raise TaskDeclined(f"job wants {backbone} weights {weights_sha256[:12]}, device has {local_sha(backbone)[:12]}")
        with self.lock:
            return _Locked(self._extractor(backbone, image_size), self.lock)


class _Locked:
    """A shared extractor (or TailFeatures) used by one device at a time: a TailFeatures' set
    parameters + forward must not interleave with another device's."""

    def __init__(self, extractor, lock):
        self._x, self._lock = extractor, lock
        self.feature_dim = getattr(extractor, "feature_dim", None)

    def extract(self, *args):
        with self._lock:
            return self._x.extract(*args)

    def session(self):
        with self._lock:
            return self._x.session()

    def exclusive(self, work):
        """``work(the shared object)`` holding the lock throughout (a sequence of calls that must not interleave)."""
        with self._lock:
            return work(self._x)


def device_handlers(data: LocalData, extractors, config: HandlerConfig,
                    state: DeviceStateStore | None = None) -> dict:
    """One device's task handlers: Fed3R statistics and FedAvg head training on its training
    split (and FT(φ)/FT(M) of the backbone's tail with a tail bundle); with a held-out split
    also OLL personalization (evaluated on the held-out split); with a state store (the
    device's own, ``edge_client.state``) the stateful kinds (FedSim/FedAlt partial
    personalization, Scaffold, FedGloSS, Ditto). Kinds it cannot run (FT(φ)/FT(M) without a tail bundle; backbone training
    on a torch-free device; stateful kinds without a store) get a handler that declines, saying why.
    The windows of samples Fed3R answered are kept in the store's folder (``edge_client/sample_windows.py``)."""
    x, y = data.images[data.train_idx], data.labels[data.train_idx]
    holdout = data.holdout_idx if data.holdout_idx is not None and len(data.holdout_idx) else None
    held_x, held_y = (None, None) if holdout is None else (data.images[holdout], data.labels[holdout])
    windows = SampleWindowLedger(state.root / WINDOWS_FILE if state is not None else None)
    handlers = {FED3R_KIND: Fed3RStatsTask(x, y, extractors, windows=windows),
                FEDAVG_KIND: HeadTrainingTask(x, y, extractors, config.training_manifest),
                PP_KIND: PartialTrainingTask(x, y, extractors, state, held_x, held_y),
                SCAFFOLD_KIND: ScaffoldTrainingTask(x, y, extractors, state),
                FEDGLOSS_KIND: FedGlossTrainingTask(x, y, extractors, state),
                DITTO_KIND: DittoTrainingTask(x, y, extractors, state, held_x, held_y)}
    tail_features = None
    if torch_free():
        for kind in (FEDAVG_TAIL_KIND, SCAFFOLD_TAIL_KIND, LADD_TRAIN_KIND):
            handlers[kind] = Unsupported(BACKBONE_TRAINING_NEEDS.format(kind=kind))
    elif config.tail_manifest:
        trunk = extractors.trunk(config.tail_manifest)
        handlers[FEDAVG_TAIL_KIND] = TailTrainingTask(x, y, config.tail_manifest, trunk=trunk)
        handlers[SCAFFOLD_TAIL_KIND] = ScaffoldTailTask(x, y, config.tail_manifest, state, trunk=trunk)
        tail_features = extractors.tail_features(config.tail_manifest)
    else:
        for kind in (FEDAVG_TAIL_KIND, SCAFFOLD_TAIL_KIND):
            handlers[kind] = Unsupported(f"{kind} needs a tail bundle (exported with "
                                         "--tail-stages; fedfleet device --tail-bundle)")
    if holdout is not None:
        handlers[PERSONALIZE_KIND] = PersonalizeTask(x, y, held_x, held_y, extractors, tail_features=tail_features,
                                                     state=state)
    return handlers


def ladd_handlers(images: np.ndarray, model_factory: Callable, lock: threading.Lock | None = None,
                  expected_weights_sha256: Callable[[], str] | None = None, runtime: str = "eager") -> dict:
    """A LADD device's handlers on its unlabelled images: its style (``ladd.style``) and cluster
    self-training (``ladd.train``); ``model_factory`` (SegmentationSpec -> SegmentationModel) may
    share one network among a process's devices, ``lock`` then serialises their use of it."""
    from edge_client.tasks.ladd_training import LaddStyleTask, LaddTrainTask   # torch: LADD devices only

    return {LADD_STYLE_KIND: LaddStyleTask(images),
            LADD_TRAIN_KIND: LaddTrainTask(images, model_factory, lock, expected_weights_sha256, runtime)}


def _secure_ladd(*args) -> object:
    from edge_client.tasks.secure_ladd_training import SecureLaddTraining   # torch: LADD devices only

    return SecureLaddTraining(*args)


# plain task kind -> (its secure wire kind, the SecAgg client that masks what the plain handler computes)
SECURE_VARIANTS = {FED3R_KIND: (SYNC_KIND, SecureFed3R),
                   FEDAVG_KIND: (SECURE_FEDAVG_KIND, SecureFedAvgTraining),
                   FEDAVG_TAIL_KIND: (SECURE_TAIL_KIND, partial(SecureFedAvgTraining, kind=SECURE_TAIL_KIND)),
                   PP_KIND: (SECURE_PP_KIND, partial(SecureFedAvgTraining, kind=SECURE_PP_KIND)),
                   SCAFFOLD_KIND: (SECURE_SCAFFOLD_KIND, SecureScaffoldTraining),
                   DITTO_KIND: (SECURE_DITTO_KIND, partial(SecureFedAvgTraining, kind=SECURE_DITTO_KIND)),
                   LADD_TRAIN_KIND: (SECURE_LADD_KIND, _secure_ladd)}


def secure_only(handlers: dict) -> dict:
    """``handlers`` with every kind that would send the device's update in the clear declining
    (``UPDATES_IN_THE_CLEAR``): what a device answers when it runs secure-only. Build its secure
    handlers (:func:`secure_handlers`) from the handlers before this, which they wrap."""
    return {kind: Unsupported(SECURE_ONLY_DECLINE.format(kind=kind)) if kind in UPDATES_IN_THE_CLEAR else handler
            for kind, handler in handlers.items()}


def secure_handlers(identity: DeviceIdentity, aggregator_key: bytes, handlers: dict,
                    state: DeviceStateStore | None = None) -> dict:
    """Protocol handlers for secure rounds (Fed3R-Sync, secure FedAvg of the head or the tail,
    secure LADD) around whichever of those plain handlers a device has; one session registry
    routes every secagg message. Which member sets each input went to is kept in the store's
    folder (``edge_client/secure_inputs.py``; without a store, in memory)."""
    inputs = SecureInputLedger(state.root / SECURE_INPUTS_FILE if state is not None else None)
    sessions = SecAggSessions(identity.device_id, inputs=inputs)
    secure = {}
    for plain, (secure_kind, client) in SECURE_VARIANTS.items():
        if plain in handlers:       # an Unsupported plain handler declines its secure kind alike
            handler = handlers[plain]
            secure[secure_kind] = (handler if isinstance(handler, Unsupported)
                                   else client(identity, aggregator_key, handler, sessions))
    return {**secure, SECAGG_TYPE: sessions}
