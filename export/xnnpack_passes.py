"""XNNPACK's delegate passes, less those with nothing to rewrite in the graph being lowered.

Why. ExecuTorch's XNNPACK backend runs its whole pass list (``XNNPACKPassManager``, 17 passes) on
every delegated graph, and each pass re-traces the whole graph on fake tensors whether it changed
something or not. Seven of them rewrite ops the backbones fedfleet exports do not hold once
exported (BatchNorm is folded first, export/batch_norm_folding.py, or by the int8 quantization; no
attention, bilinear upsampling, PReLU, 1-d convolution or concatenation), and two of those first
build their pattern graphs with an export of their own, once per process. Skipping a pass whose
op is absent leaves the program byte for byte the same (tests/test_xnnpack_passes.py) and takes less
CPU (bench/xnnpack_passes.py, alternated on a loaded 2-core machine): MobileNetV2's int8 program at
32 px 27.7 against 44.3 CPU-s, its BatchNorm-folded fp32 one 12.4-13.4 against 14.3-14.6 (its graph holds fewer
nodes for the passes to walk).

How. :func:`applicable_passes` keeps a pass of :data:`SKIPPABLE` only when the edge graph holds a
node it could rewrite (its trigger), and every other pass as it is; :func:`only_applicable_passes`
has the backend use that list while a program is lowered, in the thread (or asyncio task) that
opened it only.

Threads. The backend builds its pass manager by the module-wide name
``xnnpack_preprocess.XNNPACKPassManager``. That name used to be swapped for a subclass while the
block was open and swapped back at its end, so another thread lowering at the same time (the
export service, concurrent tests) got the shortened list without asking, and two overlapping blocks
restored the wrong class (the first to close put the stock one back under the second; the second,
which had saved the subclass as "stock", left it there for good). Now the subclass is installed
once, under a lock, and stays; it shortens the list only where a ``ContextVar`` the block sets says
so, and the block resets that variable with its token, so blocks nest and overlap freely and code
outside any block gets the stock list.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator

import torch

__all__ = ["SKIPPABLE", "applicable_passes", "only_applicable_passes"]


def _calls(*names: str) -> Callable[[torch.fx.Node], bool]:
    """A call of one of the edge ops ``names`` (``aten.<name>``; the edge dialect's overloads)."""
    from executorch.exir.dialects._ops import ops as exir_ops

    targets = {getattr(getattr(exir_ops.edge.aten, op), overload)
               for op, overload in (name.split(".") for name in names)}
    return lambda node: node.target in targets


def _batch_norms() -> Callable[[torch.fx.Node], bool]:
    """The ops FuseBatchNormPass and DecomposeBatchNorm rewrite (the latter's own list: both batch
    norms, a review found native_batch_norm left out)."""
    from executorch.backends.xnnpack._passes.decompose_batch_norm import DecomposeBatchNorm

    targets = frozenset(DecomposeBatchNorm.BATCH_NORM_OPS)
    return lambda node: node.target in targets


def _one_dimensional_convolutions() -> Callable[[torch.fx.Node], bool]:
    """What Conv1dUnsqueezePass turns 2-d: a 1-d convolution (its output (N, C, L)), or one made by
    DecomposeBatchNorm, which runs before it: a batch norm not after a convolution or linear layer
    becomes a depthwise convolution of its input's rank (a review's finding: the triggers are read
    before any pass runs, so a BatchNorm1d's convolution was left 1-d and the lowering failed)."""
    convolution, batch_norm = _calls("convolution.default"), _batch_norms()

    def rank(value) -> int | None:
        return value.dim() if isinstance(value, torch.Tensor) else None      # None: unknown, kept

    def is_one_dimensional(node: torch.fx.Node) -> bool:
        if batch_norm(node):        # (N, C) or (N, C, L) in: a 1-d convolution out
            source = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
            return rank(source.meta.get("val") if source is not None else None) in (None, 2, 3)
        return convolution(node) and rank(node.meta.get("val")) in (None, 3)
    return is_one_dimensional


def _triggers() -> dict[str, Callable[[torch.fx.Node], bool]]:
    """The pass's class name -> the nodes it can rewrite, read off the graph before any pass runs, so
    a trigger also names what an earlier pass turns into its op. Each pass's own ``call`` looks for these
    targets (the attention and upsampling passes' pattern graphs all hold ``_softmax`` and ``bmm``,
    and ``upsample_bilinear2d.vec``: tests/test_xnnpack_passes.py)."""
    return {
        "ConvertToUpsampleBilinear2d": _calls("upsample_bilinear2d.vec"),
        "ConvertToSDPAPass": _calls("_softmax.default"),
        "FuseBatchNormPass": _batch_norms(),
        "DecomposeBatchNorm": _batch_norms(),
        "DecomposeConcatenate": _calls("cat.default"),
        "Conv1dUnsqueezePass": _one_dimensional_convolutions(),
        "PReLUReshapePass": _calls("_prelu_kernel.default"),
    }


SKIPPABLE = ("ConvertToUpsampleBilinear2d", "ConvertToSDPAPass", "FuseBatchNormPass", "DecomposeBatchNorm",
             "DecomposeConcatenate", "Conv1dUnsqueezePass", "PReLUReshapePass")


def applicable_passes(passes: list[type], graph: torch.fx.Graph) -> list[type]:
    """``passes`` in their order, less those of :data:`SKIPPABLE` that find no node to rewrite in ``graph``."""
    triggers = _triggers()
    calls = [node for node in graph.nodes if node.op == "call_function"]
    return [p for p in passes
            if p.__name__ not in triggers or any(triggers[p.__name__](node) for node in calls)]


# set by only_applicable_passes in the context (thread, asyncio task) lowering under it, nowhere else
_APPLICABLE_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("xnnpack_applicable_passes_only",
                                                                         default=False)
_INSTALL_LOCK = threading.Lock()
_installed: type | None = None      # the subclass put in xnnpack_preprocess, once


def _applicable_pass_manager(stock: type) -> type:
    """``stock``'s subclass that keeps only :func:`applicable_passes` of the default list where
    :data:`_APPLICABLE_ONLY` is set (a caller's explicit pass list is kept as given), the stock
    behaviour elsewhere. Made from the class the backend holds, imported only when first needed."""

    class ApplicablePassManager(stock):
        def __init__(self, exported_program, passes=None):
            super().__init__(exported_program, passes)
            if not passes and _APPLICABLE_ONLY.get():
                self.passes = applicable_passes(self.passes, exported_program.graph)

    return ApplicablePassManager


def _install() -> None:
    """Have the XNNPACK backend build :func:`_applicable_pass_manager`'s subclass, once: under a
    lock, so two threads opening their first blocks at once do not subclass each other's class;
    again only where something has put another class there since (a test's monkeypatch undone)."""
    global _installed
    import executorch.backends.xnnpack.xnnpack_preprocess as preprocess

    with _INSTALL_LOCK:
        if preprocess.XNNPACKPassManager is not _installed:
            _installed = _applicable_pass_manager(preprocess.XNNPACKPassManager)
            preprocess.XNNPACKPassManager = _installed


@contextlib.contextmanager
def only_applicable_passes() -> Iterator[None]:
    """While it is open, the XNNPACK backend's preprocessing in this thread (or asyncio task) runs
    :func:`applicable_passes` of its default list (a caller's explicit pass list is kept as given);
    other threads lowering meanwhile get the stock list. Re-entrant: a block inside another, or
    overlapping one in another thread, leaves each context as it found it."""
    _install()
    token = _APPLICABLE_ONLY.set(True)
    try:
        yield
    finally:
        _APPLICABLE_ONLY.reset(token)
