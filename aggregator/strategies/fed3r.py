"""Fed3R: exact federated ridge regression by summing devices' sufficient statistics.

State is A = λI + Σ_k A_k and B = Σ_k B_k (float64). λI is *not* stored in A here: it is added
once by the solver, so the persisted sums are exactly the devices' sums whatever λ is used later.
Any subset/order of contributions gives the ridge solution over exactly those devices' data
(Fed3R [P] Eqs. 7-8), which is what makes a provisional classifier after every contribution and
Fed3R-Sync groups (sums of κ devices under secure aggregation) the same code path.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import numpy as np

from protocols.payloads.fed3r import Fed3RStats, triu_fill

from aggregator.compute.device import cholesky_in_place, pick_device
from aggregator.compute.ridge import ClosedFormRidge

# torch is imported where it is used, not here: the job registry imports this module, and a
# command that only checks a config (or prints its help) must not pay torch's import (~1.3 s).
if TYPE_CHECKING:
    import torch


class Fed3R:
    kind = "fed3r.stats"

    def __init__(self, num_classes: int, p: int, lam: float = 0.01, fit_intercept: bool = True,
                 normalize_columns: bool = True, device: str = "auto"):
        import torch

        self.num_classes, self.p = num_classes, p
        self.lam, self.fit_intercept, self.normalize_columns = lam, fit_intercept, normalize_columns
        self.device = pick_device(device)
        # The sum is kept as the packed upper triangle (what devices send): adding a contribution is
        # one vector addition; the symmetric matrix is expanded only when it is needed (solve,
        # state). Each entry sees the same float64 additions in the same order either way.
        self._packed = torch.zeros(p * (p + 1) // 2, dtype=torch.float64, device=self.device)
        self.B = torch.zeros((p, num_classes), dtype=torch.float64, device=self.device)
        self.n_samples = 0
        self.n_contributions = 0
        self._iu = None
        # factor uploads' rows waiting to be added by one GEMM (``_add_factor``); p/4 rows: a GEMM
        # long enough to run at the BLAS's speed, a buffer small next to A
        self._flush_rows = max(32, p // 4)
        self._rows: torch.Tensor | None = None
        self._rows_used = 0
        self._gram: torch.Tensor | None = None
        self._solved: ClosedFormRidge | None = None    # the solution of the current sums (a job solves them
                                                        # for evaluation, the round's model and the checkpoint)

    def add(self, stats: Fed3RStats) -> None:
        """Accumulate one device's (or one secure group's) statistics. Validated input only."""
        import torch

        if stats.p != self.p:
            raise ValueError(f"statistics have p={stats.p}, strategy expects {self.p}")
        ids = torch.as_tensor(stats.class_ids, device=self.device)
        if stats.r_factor is not None:            # the exact factor form: A_k = RᵀR, b_k = (Rᵀ QtY)ᵀ
            self._add_factor(stats, ids)
        else:
            self._add_packed(_read_only(stats.a_upper, self.device))
            self.B[:, ids] += _read_only(stats.b, self.device).T
        self.n_samples += stats.n
        self.n_contributions += 1
        self._solved = None

    def _add_factor(self, stats: Fed3RStats, ids: torch.Tensor) -> None:
        """A_k = RᵀR and b_k = (Rᵀ QtY)ᵀ over the factor's columns K. b_k is added at once (C×|K|);
        R's rows (widened to p columns, zeros at the dead ones) wait in a buffer, and every
        ``_flush_rows`` rows their Gram matrix is added to the packed sum by one GEMM: a device of
        five images has a rank-5 A_k, and adding each one alone cost 15 ms (index arithmetic and
        13 MB of temporaries per device, the aggregator's whole critical path at 10,000 devices);
        batched it costs about a millisecond. The sum stays a deterministic function of the
        sequence of adds (the flush points are), which is all the canonical re-sum needs."""
        import torch

        R = torch.as_tensor(stats.r_factor, dtype=torch.float64, device=self.device)
        kept = torch.as_tensor(stats.factor_columns, device=self.device)
        self.B[kept.unsqueeze(1), ids.unsqueeze(0)] += R.T @ torch.as_tensor(stats.qty, dtype=torch.float64,
                                                                            device=self.device)
        if self._rows is None:
            self._rows = torch.empty((self._flush_rows, self.p), dtype=torch.float64, device=self.device)
        at = 0
        while at < len(R):                       # a factor longer than the buffer's room goes in parts
            if self._rows_used == self._flush_rows:
                self._flush()
            take = min(len(R) - at, self._flush_rows - self._rows_used)
            block = self._rows[self._rows_used:self._rows_used + take]
            block.zero_()
            block[:, kept] = R[at:at + take]
            self._rows_used += take
            at += take

    def _flush(self) -> None:
        """Add the buffered factor rows' Gram matrix to the packed sum (every read flushes first)."""
        import torch

        if not self._rows_used:
            return
        rows = self._rows[:self._rows_used]
        if self._gram is None:       # scratch kept across flushes: no 13 MB allocation (and page faults) each
            self._gram = torch.empty((self.p, self.p), dtype=torch.float64, device=self.device)
            self._gram_upper = torch.empty_like(self._packed)
            iu = self._triu_index()
            self._flat_iu = iu[0] * self.p + iu[1]
        torch.mm(rows.T, rows, out=self._gram)
        torch.index_select(self._gram.view(-1), 0, self._flat_iu, out=self._gram_upper)
        self._packed += self._gram_upper
        self._rows_used = 0

    def add_dense(self, a_upper: np.ndarray, b_dense: np.ndarray, n: int) -> None:
        """Accumulate a dense (C×p) b, e.g. a group sum from secure aggregation."""
        self.add(Fed3RStats(n=n, p=self.p, a_upper=a_upper, class_ids=np.arange(self.num_classes), b=b_dense))

    def positive_definite(self, upper: np.ndarray, tau: float) -> bool:
        """Whether U + τI has a Cholesky factor, U symmetric and filled in its upper triangle only,
        on the strategy's device (LAPACK in place on the CPU, torch on the GPU): the Gram check
        ``parse_stats`` runs on every dense contribution, one factorisation that reads only that
        triangle. ``upper`` is scratch: it is overwritten."""
        if self.device.type == "cpu":
            return cholesky_in_place(upper, tau)[1]
        return torch_positive_definite(upper, tau, self.device)

    def packed_upper(self) -> np.ndarray:
        """Σ_k A_k as its packed upper triangle (row-major, what devices send), float64."""
        self._flush()
        return self._packed.cpu().numpy().copy()

    def _add_packed(self, packed: torch.Tensor) -> None:
        if packed.shape != self._packed.shape:
            raise ValueError(f"packed triangle has shape {tuple(packed.shape)}")
        self._packed += packed

    def _triu_index(self) -> torch.Tensor:
        import torch

        if self._iu is None:
            self._iu = torch.triu_indices(self.p, self.p, device=self.device)
        return self._iu

    @property
    def A(self) -> torch.Tensor:
        """Σ_k A_k as a symmetric (p×p) float64 matrix."""
        import torch

        full = self._upper()
        full += torch.triu(full, 1).T
        return full

    def _upper(self) -> torch.Tensor:
        """Σ_k A_k's upper triangle in a (p×p) float64 matrix, zeros below: on the CPU one
        contiguous copy per row (``triu_fill``), several times faster than a scatter."""
        import torch

        self._flush()
        if self.device.type == "cpu":
            return torch.from_numpy(triu_fill(self._packed.numpy(), self.p))
        iu = self._triu_index()
        full = torch.zeros((self.p, self.p), dtype=torch.float64, device=self.device)
        full[iu[0], iu[1]] = self._packed
        return full

    def solve(self) -> ClosedFormRidge:
        if self._solved is None:
            model = ClosedFormRidge(self.lam, self.fit_intercept, self.normalize_columns, device=str(self.device))
            self._solved = model.fit_statistics(self._upper(), self.B, upper=True)
        return self._solved

    # persistence: exact float64 sums
    def state_dict(self) -> dict[str, np.ndarray]:
        """The sums with A as a symmetric matrix: what checkpoints and ``statistics.npz`` hold."""
        return {"A": self.A.cpu().numpy(), **self._b_and_counts()}

    def sums_state(self) -> dict[str, np.ndarray]:
        """The sums with A as its packed upper triangle: what partial sums add up a bucket tree
        (half a dense A's bytes, and neither unpacked nor symmetrised per bucket). Loads like a
        :meth:`state_dict`."""
        return {"A_upper": self.packed_upper(), **self._b_and_counts()}

    def _b_and_counts(self) -> dict[str, np.ndarray]:
        return {"B": self.B.cpu().numpy(), "counts": np.array([self.n_samples, self.n_contributions], dtype=np.int64)}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """A :meth:`state_dict` or a :meth:`sums_state`."""
        import torch

        if "A_upper" in state:
            packed = torch.as_tensor(state["A_upper"], dtype=torch.float64, device=self.device)
            if packed.shape != (self.p * (self.p + 1) // 2,):
                raise ValueError(f"packed triangle has shape {tuple(packed.shape)}")
            self._packed = packed.clone()
        else:
            A = torch.as_tensor(state["A"], dtype=torch.float64, device=self.device)
            iu = self._triu_index()
            self._packed = A[iu[0], iu[1]].clone()
        self._rows_used = 0
        self.B = torch.as_tensor(state["B"], dtype=torch.float64, device=self.device).clone()
        self.n_samples, self.n_contributions = (int(x) for x in state["counts"])
        self._solved = None




def torch_positive_definite(upper: np.ndarray, tau: float, device: torch.device) -> bool:
    """:meth:`Fed3R.positive_definite` with torch on ``device`` (what a GPU runs), in the array's
    precision (float32 or float64)."""
    import torch

    t = torch.as_tensor(upper, device=device)
    t.diagonal().add_(tau)
    return int(torch.linalg.cholesky_ex(t, upper=True)[1]) == 0


def _read_only(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` as a float64 tensor on ``device``, only read: a checked result's statistics are
    read-only views on its received bytes (``parse_stats(checked=True)``), which torch would copy
    or warn about; on the CPU they are added in place of a copy, without the warning."""
    import torch

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
        return torch.as_tensor(array, dtype=torch.float64, device=device)
