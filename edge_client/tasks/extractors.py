"""How a task handler asks the device for the feature extractor a task needs.

A device passes every handler one *extractor factory*: ``factory(backbone, image_size,
weights_sha256) -> extractor`` (``.extract(images) -> (n, d) float32`` and ``.feature_dim``).
When the job names the exported bundle it runs on (task param ``bundle_sha256``: the sha256 of
the bundle's manifest, which the aggregator serves), the factory is called with
``bundle_sha256=...`` as well, so a device can fetch and verify that bundle on demand
(``fedfleet device``). Factories that cannot fetch may ignore it.
"""

from __future__ import annotations

from typing import Any, Callable

from edge_client.agent import TaskDeclined
from protocols.payloads.task_params import ModelSpec

ExtractorFactory = Callable[..., Any]

# The wire contract lets a task ask for images up to 16,384 px a side (other devices may take them);
# this SDK's devices run up to 2,048: one 16,384 px image is 3.2 GB of input before any activation.
MAX_DEVICE_IMAGE_SIZE = 2048

# How many extractors (one per backbone and image size, or per bundle) a device process keeps, the
# least recently used leaving first: a job runs at one size, so a few cover a device serving
# several jobs; the size is the task's to choose, and every size held is a backbone in memory
# (about 29 MiB for MobileNetV2), so tasks naming ever new sizes would otherwise grow the device
# without bound.
MAX_HELD_EXTRACTORS = 4


def extractor_for(factory: ExtractorFactory, model: ModelSpec):
    """The extractor for a task's ``backbone``, ``image_size``, ``weights_sha256`` and, when
    set, ``bundle_sha256``; a task at more than ``MAX_DEVICE_IMAGE_SIZE`` px is declined before any
    extractor is made."""
    if model.image_size > MAX_DEVICE_IMAGE_SIZE:
        raise TaskDeclined(f"the task's images are {model.image_size} px a side; this device runs at most "
                           f"{MAX_DEVICE_IMAGE_SIZE}")
    args = (model.backbone, model.image_size, model.weights_sha256)
    return factory(*args, bundle_sha256=model.bundle_sha256) if model.bundle_sha256 else factory(*args)
