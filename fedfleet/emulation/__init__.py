"""The emulated fleet's inputs: seeded data partitions and per-device system profiles."""

from fedfleet.emulation.partition import (
    make_split,
    mean_label_jaccard,
    split_dirichlet,
    split_iid,
    split_k_classes,
    train_holdout_split,
)
from fedfleet.emulation.profiles import DeviceProfile, sample_profiles

__all__ = [
    "DeviceProfile",
    "make_split",
    "mean_label_jaccard",
    "sample_profiles",
    "split_dirichlet",
    "split_iid",
    "split_k_classes",
    "train_holdout_split",
]
