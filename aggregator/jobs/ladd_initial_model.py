"""A LADD job's pretrained network on disk (``LaddConfig.initial_model_file``): its arrays and, under
``TRAINABLE_KEY``, the names of the tensors devices train. Written by whoever pre-trained it
(``save_initial_model``), read back checksummed by a job built from its stored config alone
(``load_initial_model``, what ``LaddJob.load_initial`` is)."""

from __future__ import annotations

import numpy as np

from protocols.payloads.ladd import Layout, make_layout

from aggregator.jobs.input_files import read_job_arrays
from aggregator.jobs.ladd_config import LaddConfig

TRAINABLE_KEY = "__trainable__"


def save_initial_model(path, arrays: dict[str, np.ndarray], trainable: list[str]) -> None:
    """Write a pretrained network for ``LaddConfig.initial_model_file`` (arrays + trainable names)."""
    np.savez(path, **arrays, **{TRAINABLE_KEY: np.array(sorted(trainable))})


def load_initial_model(config: LaddConfig) -> tuple[dict[str, np.ndarray], list[str]]:
    """The checksummed pretrained network a config names (a job built from its config alone)."""
    if not config.initial_model_file:
        raise ValueError("a LADD job built from its config needs initial_model_file (the pretrained network)")
    arrays = read_job_arrays(config.initial_model_file, "initial_model_file", config.initial_model_sha256)
    trainable = [str(t) for t in arrays.pop(TRAINABLE_KEY)] if TRAINABLE_KEY in arrays else []
    return arrays, trainable


def trainable_in_layout_order(arrays: dict[str, np.ndarray], layout: Layout, trainable: list[str]
                              ) -> tuple[list[str], Layout]:
    """The trainable names in the model's layout order, and their layout (what an update packs)."""
    order = {name: i for i, (name, _) in enumerate(layout)}
    names = sorted(trainable, key=order.__getitem__)
    return names, make_layout(arrays, names)
