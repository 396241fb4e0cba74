"""What every classification job tells its devices about the model they run.

Fed3R, FedAvg and personalization jobs all name the same things: the backbone, its input size
and weights, the exported bundle the devices must run (the sha256 of its manifest, served by
the aggregator; "" lets devices use their own) and the classifier's shape. One base config
holds them, checks them, and writes them into task params the same way for every job kind.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocols.envelope import EnvelopeError
from protocols.payloads.artifacts import check_sha
from protocols.payloads.task_params import ModelSpec

from aggregator.jobs.base import JobConfig


@dataclass
class ModelFields(JobConfig):
    num_classes: int = 10
    backbone: str = "mobilenet_v2"
    image_size: int = 64
    weights_sha256: str = ""
    bundle_sha256: str = ""
    feature_dim: int = 1280

    def __post_init__(self):
        super().__post_init__()
        if self.bundle_sha256:
            try:
                check_sha(self.bundle_sha256)
            except EnvelopeError as exc:
                raise ValueError(f"bundle_sha256: {exc}") from None

    def device_bundle_sha256(self) -> str:
        return self.bundle_sha256

    def model_spec(self) -> ModelSpec:
        """The task params that say which model the device must run."""
        return ModelSpec(self.num_classes, self.backbone, self.image_size, self.weights_sha256, self.bundle_sha256)
