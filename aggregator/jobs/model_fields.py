"""What every classification job tells its devices about the model they run.

Fed3R, FedAvg and personalization jobs all name the same things: the backbone, its input size
and weights, the exported bundle the devices must run (the sha256 of its manifest, served by
the aggregator; "" lets devices use their own) and the classifier's shape. One base config
holds them, checks them, and writes them into task params the same way for every job kind.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocols.device_inbox import TensorShape
from protocols.envelope import EnvelopeError
from protocols.payloads.artifacts import check_sha
from protocols.payloads.task_params import ModelSpec

from aggregator.jobs.base import JobConfig
from aggregator.jobs.config_limits import SHA256_OR_EMPTY, Pattern, Range, limited


# the head's C x (d + 1) parameters, which Fed3R's dense B, FedAvg's head and its optimiser state
# each hold in float64: 2^25 of them is 256 MiB per copy (26,000 classes of 1,280 features); the
# two limits alone would let a config ask for 6.5 GB per copy at job start. The task a device is
# sent is the tighter bound where the head rides in it (aggregator/jobs/task_size.py: at most 128
# MiB, float32, with whatever rides beside it: Scaffold's control halves the classes)
MAX_HEAD_ENTRIES = 1 << 25


@dataclass
class ModelFields(JobConfig):
    num_classes: int = limited(10, Range(1, 100_000))
    backbone: str = limited("mobilenet_v2", Pattern(r"^[a-z0-9_]{1,64}$"))
    image_size: int = limited(64, Range(1, 4096))
    weights_sha256: str = limited("", SHA256_OR_EMPTY)
    bundle_sha256: str = limited("", SHA256_OR_EMPTY)
    feature_dim: int = limited(1280, Range(1, 8192))

    def __post_init__(self):
        super().__post_init__()
        entries = self.num_classes * self.head_inputs
        if entries > MAX_HEAD_ENTRIES:
            raise ValueError(f"num_classes x ({self.head_inputs_field} + 1) = {entries:,} head parameters exceed "
                             f"{MAX_HEAD_ENTRIES:,}: fewer classes or a smaller {self.head_inputs_field}")
        if self.bundle_sha256:
            try:
                check_sha(self.bundle_sha256)
            except EnvelopeError as exc:
                raise ValueError(f"bundle_sha256: {exc}") from None

    @property
    def head_inputs(self) -> int:
        """The rows of the (inputs x C) matrices the job holds for its head: the features plus the bias
        (a kind whose head reads other inputs, Fed3R's random features, says so)."""
        return self.feature_dim + 1

    @property
    def head_inputs_field(self) -> str:
        """The config field that sets ``head_inputs``, as a refusal names it."""
        return "feature_dim"

    def device_bundle_sha256(self) -> str:
        return self.bundle_sha256

    def head_task_tensors(self) -> dict[str, TensorShape]:
        """The classifier head as a task carries it (``protocols.payloads.fedavg.head_tensors``: float32)."""
        return {"weight": ("float32", (self.num_classes, self.feature_dim)), "bias": ("float32", (self.num_classes,))}

    def task_size_remedy(self) -> str:
        return "fewer classes (num_classes) or a smaller feature_dim"

    def model_spec(self) -> ModelSpec:
        """The task params that say which model the device must run."""
        return ModelSpec(self.num_classes, self.backbone, self.image_size, self.weights_sha256, self.bundle_sha256)
