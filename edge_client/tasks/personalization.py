"""``oll.personalize``: personalise the global head on the device and report held-out accuracy.

The device holds a local training split (what ``fed3r.stats`` and ``fedavg.head`` tasks
train on) and a local held-out split (never trained on). Given the global head it computes,
on the held-out split:

1. the global head's accuracy (the baseline a device gets without personalization);
2. OLL: the head pruned to the labels of the local training split (``edge_client.oll``);
3. OLL+FP(ψ): the pruned head fine-tuned for ``fp_epochs`` on the local training split,
   with the learning rate picked by cross-validation on that split when several are offered.

Only the counts go back (``protocols.payloads.personalize``); the personalised head stays
on the device. The device keeps it (``self.head``) to answer local predictions.

After FT(φ)/FT(M) the global model also has a fine-tuned backbone tail: the task then says
``tail_stages`` > 0 and carries the ``tail.*`` tensors with the head, and the features are
those of the fine-tuned backbone (:class:`~edge_client.tasks.tail_training.TailFeatures`,
from the device's tail bundle) instead of the frozen extractor's.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import numpy as np

from protocols.payloads.fedavg import TAIL_PREFIX
from protocols.payloads.personalize import FALLBACKS, KIND, PERSONAL, PersonalizationReport, encode_report

from ..agent import TaskDeclined
from ..oll import OutOfLocalLabels, PersonalizedHead, choose_fp_lr
from ..state import DeviceStateStore
from .extractors import ExtractorFactory, extractor_for
from .head_training import LocalTraining
from .tail_personalization import FP_PARTS, TailFineTuning, masked_head
from .tail_training import TailFeatures, check_model_tensors

log = logging.getLogger("fedfleet.device")


class PersonalizeTask:
    """Handler for ``oll.personalize``: ``(params, tensors) -> (body, {})``."""

    def __init__(self, train_images: np.ndarray, train_labels: np.ndarray, test_images: np.ndarray,
                 test_labels: np.ndarray, extractor_factory: ExtractorFactory, training_session=None,
                 tail_features: TailFeatures | None = None, state: DeviceStateStore | None = None):
        """``tail_features``: the device's tail bundle as a feature source, for tasks whose
        global model has a fine-tuned backbone tail (None: such tasks are declined); ``state``:
        the device's state store, where a ``pp`` or ``ditto`` job left its personal part (``personal_job``)."""
        if len(train_images) != len(train_labels) or len(test_images) != len(test_labels):
            raise ValueError("images and labels differ in length")
        self.train_images, self.train_labels = train_images, np.asarray(train_labels, dtype=np.int64)
        self.test_images, self.test_labels = test_images, np.asarray(test_labels, dtype=np.int64)
        self.extractor_factory = extractor_factory
        self.training_session = training_session
        self.tail_features = tail_features
        self.state = state
        self.head: PersonalizedHead | None = None
        self.fine_tuned: dict[str, np.ndarray] | None = None     # FP(φ)/FP(M)'s model (tail and head)
        self.last: PersonalizationReport | None = None

    def __call__(self, params: dict[str, Any], tensors: dict[str, np.ndarray] | None = None) -> tuple[dict, dict]:
        if len(self.train_labels) == 0 or len(self.test_labels) == 0:
            raise TaskDeclined("personalization needs local training and held-out data")
        try:
            num_classes, feature_dim = int(params["num_classes"]), int(params["feature_dim"])
            str(params["backbone"]), int(params["image_size"])     # checked here: a malformed task declines
            tail_stages = int(params.get("tail_stages", 0))
            fallback = str(params.get("fallback", "error"))
            fp_epochs = int(params.get("fp_epochs", 0))
            lrs = [float(lr) for lr in params.get("fp_lrs", [])]
            folds = int(params.get("fp_folds", 5))
            personal_job = str(params.get("personal_job", ""))
            fp_part = str(params.get("fp_part", "psi"))
            recipe = LocalTraining.from_params({**params, "epochs": max(fp_epochs, 1)})
        except (KeyError, TypeError, ValueError) as exc:
            raise TaskDeclined(f"bad oll.personalize params: {exc}") from exc
        if fallback not in FALLBACKS:
            raise TaskDeclined(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
        if fp_part not in ("psi", *FP_PARTS):
            raise TaskDeclined(f"fp_part must be one of {('psi', *FP_PARTS)}, got {fp_part!r}")
        if fp_epochs < 0 or (fp_epochs and not lrs):
            raise TaskDeclined("fp_epochs must be >= 0, and FP needs at least one learning rate in fp_lrs")
        if not tensors or "weight" not in tensors or "bias" not in tensors:
            raise TaskDeclined("oll.personalize task carries no head tensors (weight, bias)")
        weight, bias = np.asarray(tensors["weight"]), np.asarray(tensors["bias"])
        if weight.shape != (num_classes, feature_dim) or bias.shape != (num_classes,):
            raise TaskDeclined(f"head shapes {weight.shape}, {bias.shape} do not match ({num_classes}, {feature_dim})")
        if not (np.isfinite(weight).all() and np.isfinite(bias).all()):
            raise TaskDeclined("global head contains NaN or Inf")
        for labels in (self.train_labels, self.test_labels):
            if labels.min() < 0 or labels.max() >= num_classes:
                raise TaskDeclined(f"local label {labels.max()} outside the job's {num_classes} classes")
        if tail_stages:
            f_train, f_test = self._fine_tuned_features(params, tail_stages, tensors)
        elif any(name.startswith(TAIL_PREFIX) for name in tensors):
            raise TaskDeclined("task carries backbone tail tensors but says tail_stages = 0")
        else:
            extractor = extractor_for(self.extractor_factory, params)
            if extractor.feature_dim != feature_dim:
                raise TaskDeclined(f"backbone gives {extractor.feature_dim}-d features, task expects {feature_dim}")
            f_train, f_test = extractor.extract(self.train_images), extractor.extract(self.test_images)
        y_test = self.test_labels

        correct = {"global": int(((f_test @ weight.T + bias).argmax(axis=1) == y_test).sum())}
        if personal_job:
            weight, bias = self._personal_head(personal_job, weight, bias)   # the device's own: OLL and FP start there
            correct[PERSONAL] = int(((f_test @ weight.T + bias).argmax(axis=1) == y_test).sum())
        head = PersonalizedHead(weight, bias, self.train_labels, fallback=fallback)
        try:
            scored = head.score(f_test, y_test)
        except OutOfLocalLabels as exc:
            raise TaskDeclined(f"OLL with fallback='error': {exc}") from exc
        correct["oll"] = scored.correct
        fp_lr = None
        if fp_epochs:
            try:
                if fp_part == "psi":
                    fp_lr, _ = choose_fp_lr(weight, bias, f_train, self.train_labels, recipe, lrs, folds)
                    head.fine_tune(f_train, self.train_labels, replace(recipe, lr=fp_lr), self.training_session)
                    correct["oll_fp"] = head.score(f_test, y_test).correct
                else:
                    fp_lr, correct["oll_fp"] = self._fine_tune_tail(params, tensors, tail_stages, head, f_test,
                                                                    fp_part, recipe, lrs, folds)
            except FloatingPointError as exc:
                raise TaskDeclined(str(exc)) from exc
        self.head = head
        self.last = PersonalizationReport(len(self.train_labels), len(y_test), head.label_map.k, correct,
                                          scored.fallback, fp_lr)
        return encode_report(self.last)

    def _personal_head(self, job_id: str, weight: np.ndarray, bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The personal part the job ``job_id`` left in the state store: a ``pp`` job's bias v_k
        (with the global weight), a ``ditto`` job's whole head; the global tensor for any part
        it left none of (the device was never sampled, or its state expired): the personal
        model of a device that never trained."""
        entry = self.state.load(job_id, run=None) if self.state is not None else None
        stored = {} if entry is None else entry.arrays

        def personal(name: str, global_value: np.ndarray) -> np.ndarray:
            value = stored.get(name)
            if value is None or value.shape != global_value.shape or not np.isfinite(value).all():
                return global_value
            return value.astype(np.float32)

        return personal("weight", weight), personal("bias", bias)       # a pp entry has no weight: the shared one

    def _fine_tuned_features(self, params: dict[str, Any], tail_stages: int,
                             tensors: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Training and held-out features through the task's fine-tuned tail."""
        if self.tail_features is None:
            raise TaskDeclined("this device has no tail bundle: it cannot personalise a fine-tuned backbone")
        session = self.tail_features.session()
        check_tail_bundle(session.manifest, params, tail_stages)
        model = check_model_tensors(tensors, session.parameter_shapes, KIND)
        return self.tail_features.extract(model, self.train_images, self.test_images)

    def _fine_tune_tail(self, params: dict[str, Any], tensors: dict[str, np.ndarray], tail_stages: int,
                        head: PersonalizedHead, f_test: np.ndarray, part: str, recipe: LocalTraining,
                        lrs: list[float], folds: int) -> tuple[float, int]:
        """FP(φ)/FP(M) from the OLL head (``edge_client/tasks/tail_personalization.py``): (the
        learning rate cross-validation chose, the held-out samples the fine-tuned model gets right;
        labels outside the local ones are scored as OLL scored them). The model stays on the device."""
        if self.tail_features is None:
            raise TaskDeclined(f"FP({part}) trains the backbone's tail: this device has no tail bundle")

        def work(tail):         # one device at a time on a shared session, start to end
            session = tail.session()
            check_tail_bundle(session.manifest, params, tail_stages or session.manifest.tail.stages)
            start = check_model_tensors(tensors, session.parameter_shapes, KIND) if tail_stages \
                else tail.bundled_parameters()      # after FT(ψ): the pretrained tail
            fp = TailFineTuning(session, {**start, **masked_head(head)}, part, recipe)
            train_x, test_x = tail.activations(self.train_images), tail.activations(self.test_images)
            lr, _ = fp.choose_lr(train_x, self.train_labels, lrs, folds)
            model = fp.fit(train_x, self.train_labels, lr)
            return lr, model, fp.predict(model, test_x)

        lr, self.fine_tuned, predicted = self.tail_features.exclusive(work)
        inside = head.label_map.contains(self.test_labels)
        correct = int((predicted[inside] == self.test_labels[inside]).sum())
        if not inside.all():
            correct += head.score(f_test[~inside], self.test_labels[~inside]).correct   # the global head's
        return lr, correct


def check_tail_bundle(m, params: dict[str, Any], tail_stages: int) -> None:
    """Decline unless the device's tail bundle is the task's model (backbone, size, tail, shapes, weights)."""
    wanted = (str(params["backbone"]), int(params["image_size"]), tail_stages, int(params["feature_dim"]),
              int(params["num_classes"]), str(params.get("weights_sha256") or m.weights_sha256))
    if wanted != (m.backbone, m.input.image_size, m.tail.stages, m.feature_dim, m.num_classes, m.weights_sha256):
        raise TaskDeclined(f"task wants {wanted[0]} at {wanted[1]} px with a {wanted[2]}-stage tail, "
                           f"{wanted[3]}-d features and {wanted[4]} classes; the tail bundle is {m.backbone} at "
                           f"{m.input.image_size} px, {m.tail.stages} stage(s), {m.feature_dim}-d, {m.num_classes} "
                           "classes (or other weights)")
