"""Where the aggregator's math runs, as the admin API's health page reports it."""

from __future__ import annotations

from aggregator.compute.device import pick_device
from aggregator.compute.mask_expansion import mask_expansion_plan


def compute_summary(preference: str = "auto") -> dict:
    """What an operator needs to know about where the math runs (``/api/health``): the torch
    device, the GPU's name, and where secure aggregation's final unmasking runs."""
    import torch

    device = pick_device(preference)
    on_gpu = device.type == "cuda"
    where, what = mask_expansion_plan(preference)
    unmask = {"cuda": f"{what} (Triton AES-CTR kernel)", "processes": f"cpu ({what} processes)",
              "threads": f"cpu ({what} threads)"}[where]
    return {"device": str(device), "gpu": torch.cuda.get_device_name(device) if on_gpu else None,
            "torch": torch.__version__, "secagg_unmask": unmask}
