"""Where the aggregator's tensor math runs: CUDA when torch sees a GPU, else the CPU.

On the CPU, the symmetric positive definite factorisations (the Gram check of every dense Fed3R
upload, the ridge solve) go to LAPACK through scipy rather than torch: scipy's potrf on the
transposed view of a row-major upper triangle factorises it in place, with no copy: at p = 1281
the Gram check's float32 factorisation runs 2.0-2.1x and the float64 ridge solve 1.3-1.7x faster
than torch's (``bench/ingest_steps.py``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

# torch and scipy are imported where they are used, not here: the job registry and the aggregator's
# command line import this module, and a command that only checks a config (or prints its help) must
# not pay torch's import (~1.3 s) nor scipy.linalg's (~0.2 s; the import is cached after the first call).
if TYPE_CHECKING:
    import torch


def pick_device(preference: str = "auto") -> torch.device:
    """``auto`` -> cuda if available (unless FEDFLEET_DEVICE overrides), else cpu."""
    import torch

    preference = os.environ.get("FEDFLEET_DEVICE", preference) if preference == "auto" else preference
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if preference == "auto" else preference)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("CUDA was requested but torch sees no GPU; use device='cpu' or 'auto'")
    if dev.type == "cuda" and dev.index is None:      # one name per GPU: "cuda" and "cuda:0" are the same
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def cholesky_in_place(upper: np.ndarray, shift: float = 0.0) -> tuple[np.ndarray, bool]:
    """LAPACK's Cholesky factorisation of U + shift·I, where ``upper`` (C order, float32 or float64)
    holds the symmetric U in its upper triangle (what lies below is ignored). Works in place on
    ``upper``: its transpose, a Fortran-order lower triangle, is factorised without a copy. Returns
    (L, ok): L lower (Fortran order, the transposed view; junk above its diagonal) with
    L·Lᵀ = U + shift·I when ``ok``, i.e. when U + shift·I is positive definite."""
    if upper.ndim != 2 or upper.shape[0] != upper.shape[1] or not upper.flags.c_contiguous:
        raise ValueError("expected a square C-ordered array")
    from scipy.linalg import lapack

    upper[np.diag_indices(len(upper))] += shift
    potrf, = lapack.get_lapack_funcs(("potrf",), (upper,))
    factor, info = potrf(upper.T, lower=1, overwrite_a=1, clean=0)
    return factor, info == 0


def cholesky_solve(factor: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """X with L·Lᵀ·X = ``rhs``, L the lower factor :func:`cholesky_in_place` returned."""
    from scipy.linalg import lapack

    potrs, = lapack.get_lapack_funcs(("potrs",), (factor,))
    solution, info = potrs(factor, rhs, lower=1)
    if info != 0:
        raise ValueError(f"potrs: argument {-info} is invalid")
    return solution
