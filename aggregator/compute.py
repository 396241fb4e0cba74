"""Where the aggregator's tensor math runs: CUDA when torch sees a GPU, else the CPU."""

from __future__ import annotations

import os

import torch


def pick_device(preference: str = "auto") -> torch.device:
    """``auto`` -> cuda if available (unless FEDFLEET_DEVICE overrides), else cpu."""
    preference = os.environ.get("FEDFLEET_DEVICE", preference) if preference == "auto" else preference
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if preference == "auto" else preference)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("CUDA was requested but torch sees no GPU; use device='cpu' or 'auto'")
    if dev.type == "cuda" and dev.index is None:      # one name per GPU: "cuda" and "cuda:0" are the same
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def compute_summary(preference: str = "auto") -> dict:
    """What an operator needs to know about where the math runs (``/api/health``): the torch
    device, the GPU's name, and where secure aggregation's final unmasking runs."""
    from .mask_expansion import mask_expansion_plan

    device = pick_device(preference)
    on_gpu = device.type == "cuda"
    where, what = mask_expansion_plan(preference)
    unmask = {"cuda": f"{what} (Triton AES-CTR kernel)", "processes": f"cpu ({what} processes)",
              "threads": f"cpu ({what} threads)"}[where]
    return {"device": str(device), "gpu": torch.cuda.get_device_name(device) if on_gpu else None,
            "torch": torch.__version__, "secagg_unmask": unmask}
