"""Where the aggregator's tensor math runs: CUDA when torch sees a GPU, else the CPU."""

from __future__ import annotations

import os

import torch


def pick_device(preference: str = "auto") -> torch.device:
    """``auto`` -> cuda if available (unless FEDFLEET_DEVICE overrides), else cpu."""
    preference = os.environ.get("FEDFLEET_DEVICE", preference) if preference == "auto" else preference
    if preference == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(preference)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("CUDA was requested but torch sees no GPU; use device='cpu' or 'auto'")
    return dev
