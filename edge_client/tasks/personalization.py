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
from protocols.payloads.personalize import KIND, PERSONAL, PersonalizationReport, PersonalizeParams, encode_report

from ..agent import TaskDeclined
from ..oll import OutOfLocalLabels, PersonalizedHead, choose_fp_lr
from ..state import DeviceStateStore
from .extractors import ExtractorFactory
from .task_inputs import check_local_labels, extractor_of_dim, global_head, local_samples
from .head_training import LocalTraining
from .params import read_params
from .tail_personalization import TailFineTuning, masked_head
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
        self.train_images, self.train_labels = local_samples(train_images, train_labels)
        self.test_images, self.test_labels = local_samples(test_images, test_labels)
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
        task = read_params(PersonalizeParams, params, KIND)
        num_classes, feature_dim, tail_stages = task.model.num_classes, task.feature_dim, task.tail_stages
        fp_epochs, lrs, folds, recipe = task.fp_epochs, [float(lr) for lr in task.fp_lrs], task.fp_folds, task.recipe()
        weight, bias = global_head(tensors, num_classes, feature_dim, KIND)
        for labels in (self.train_labels, self.test_labels):
            check_local_labels(labels, num_classes)
        if tail_stages:
            f_train, f_test = self._fine_tuned_features(task, tensors)
        elif any(name.startswith(TAIL_PREFIX) for name in tensors):
            raise TaskDeclined("task carries backbone tail tensors but says tail_stages = 0")
        else:
            extractor = extractor_of_dim(self.extractor_factory, task.model, feature_dim)
            f_train, f_test = extractor.extract(self.train_images), extractor.extract(self.test_images)
        y_test = self.test_labels

        correct = {"global": int(((f_test @ weight.T + bias).argmax(axis=1) == y_test).sum())}
        if task.personal_job:
            weight, bias = self._personal_head(task.personal_job, weight, bias)   # the device's own: OLL and FP start there
            correct[PERSONAL] = int(((f_test @ weight.T + bias).argmax(axis=1) == y_test).sum())
        head = PersonalizedHead(weight, bias, self.train_labels, fallback=task.fallback)
        try:
            scored = head.score(f_test, y_test)
        except OutOfLocalLabels as exc:
            raise TaskDeclined(f"OLL with fallback='error': {exc}") from exc
        correct["oll"] = scored.correct
        fp_lr = None
        if fp_epochs:
            try:
                if task.fp_part == "psi":
                    fp_lr, _ = choose_fp_lr(weight, bias, f_train, self.train_labels, recipe, lrs, folds)
                    head.fine_tune(f_train, self.train_labels, replace(recipe, lr=fp_lr), self.training_session)
                    correct["oll_fp"] = head.score(f_test, y_test).correct
                else:
                    fp_lr, correct["oll_fp"] = self._fine_tune_tail(task, tensors, head, f_test, recipe, lrs)
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

    def _fine_tuned_features(self, task: PersonalizeParams,
                             tensors: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Training and held-out features through the task's fine-tuned tail."""
        if self.tail_features is None:
            raise TaskDeclined("this device has no tail bundle: it cannot personalise a fine-tuned backbone")
        session = self.tail_features.session()
        check_tail_bundle(session.manifest, task, task.tail_stages)
        model = check_model_tensors(tensors, session.parameter_shapes, KIND)
        return self.tail_features.extract(model, self.train_images, self.test_images)

    def _fine_tune_tail(self, task: PersonalizeParams, tensors: dict[str, np.ndarray], head: PersonalizedHead,
                        f_test: np.ndarray, recipe: LocalTraining, lrs: list[float]) -> tuple[float, int]:
        """FP(φ)/FP(M) from the OLL head (``edge_client/tasks/tail_personalization.py``): (the
        learning rate cross-validation chose, the held-out samples the fine-tuned model gets right;
        labels outside the local ones are scored as OLL scored them). The model stays on the device."""
        part, tail_stages = task.fp_part, task.tail_stages
        if self.tail_features is None:
            raise TaskDeclined(f"FP({part}) trains the backbone's tail: this device has no tail bundle")

        def work(tail):         # one device at a time on a shared session, start to end
            session = tail.session()
            check_tail_bundle(session.manifest, task, tail_stages or session.manifest.tail.stages)
            start = check_model_tensors(tensors, session.parameter_shapes, KIND) if tail_stages \
                else tail.bundled_parameters()      # after FT(ψ): the pretrained tail
            fp = TailFineTuning(session, {**start, **masked_head(head)}, part, recipe)
            train_x, test_x = tail.activations(self.train_images), tail.activations(self.test_images)
            lr, _ = fp.choose_lr(train_x, self.train_labels, lrs, task.fp_folds)
            model = fp.fit(train_x, self.train_labels, lr)
            return lr, model, fp.predict(model, test_x)

        lr, self.fine_tuned, predicted = self.tail_features.exclusive(work)
        inside = head.label_map.contains(self.test_labels)
        correct = int((predicted[inside] == self.test_labels[inside]).sum())
        if not inside.all():
            correct += head.score(f_test[~inside], self.test_labels[~inside]).correct   # the global head's
        return lr, correct


def check_tail_bundle(m, task: PersonalizeParams, tail_stages: int) -> None:
    """Decline unless the device's tail bundle is the task's model (backbone, size, tail, shapes, weights)."""
    model = task.model
    wanted = (model.backbone, model.image_size, tail_stages, task.feature_dim, model.num_classes,
              model.weights_sha256 or m.weights_sha256)
    if wanted != (m.backbone, m.input.image_size, m.tail.stages, m.feature_dim, m.num_classes, m.weights_sha256):
        raise TaskDeclined(f"task wants {wanted[0]} at {wanted[1]} px with a {wanted[2]}-stage tail, "
                           f"{wanted[3]}-d features and {wanted[4]} classes; the tail bundle is {m.backbone} at "
                           f"{m.input.image_size} px, {m.tail.stages} stage(s), {m.feature_dim}-d, {m.num_classes} "
                           "classes (or other weights)")
