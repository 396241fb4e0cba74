"""export/xnnpack_passes.py: the XNNPACK passes left out of a lowering are those with nothing to
rewrite, so the program is byte for byte what ExecuTorch's full pass list gives, on a network holding
no trigger (none of them run) and on one holding some; and each trigger keeps its pass. Only the
thread inside ``only_applicable_passes`` gets the shortened list, however blocks overlap (checked on
the pass manager the backend builds, no lowering). The partitioner the exporter lowers with
(executorch_export.xnnpack_partitioner) decomposes a graph holding none of the ops it keeps whole once
less than ExecuTorch's own, for the same bytes.
"""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import export.executorch_export as executorch_export
import export.xnnpack_passes as xnnpack_passes
from export.executorch_export import lower_inference_program

pytestmark = pytest.mark.slow       # five small lowerings and the attention/upsampling pattern graphs


class OneDimensional(nn.Module):
    """A 1-d convolution over the image's pixels."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(x.reshape(1, 3, 64))


class Upsampling(nn.Module):
    """An unfolded BatchNorm, a six-way concatenation and bilinear upsampling."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        with torch.no_grad():
            self.norm.running_mean.uniform_(-1, 1)
            self.norm.running_var.uniform_(0.5, 2)

    def forward(self, x):
        b = self.norm(self.conv(x))
        b = torch.cat([b, b + 1, b * 2, b - 1, b * 3, b + 2], dim=1)
        return nn.functional.interpolate(b, scale_factor=2, mode="bilinear", align_corners=False)




class FeatureNorm(nn.Module):
    """A BatchNorm over pooled features, after no convolution or linear layer: XNNPACK's
    DecomposeBatchNorm turns it into a depthwise 1-d convolution, which Conv1dUnsqueezePass (later in
    the list) must then make 2-d."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.BatchNorm1d(4)
        with torch.no_grad():
            self.norm.running_mean.uniform_(-1, 1)
            self.norm.running_var.uniform_(0.5, 2)

    def forward(self, x):
        return self.norm(torch.relu(self.conv(x)).mean((2, 3)))


class NoTrigger(nn.Module):
    """What the shipped backbones hold once folded: convolutions, ReLU6, pooling, a linear layer."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.linear = nn.Linear(8, 5)

    def forward(self, x):
        return self.linear(nn.functional.relu6(self.conv(x)).mean((2, 3)))


def lowered(model, monkeypatch, stock: bool) -> tuple[bytes, list[str], int]:
    """The program's bytes, the skippable passes that ran (the applicable lists' union), and how many
    times the graph was decomposed for the partitioner (not counting the exports the pattern passes
    make of their own graphs). ``stock``: ExecuTorch's full pass list and its own partitioner."""
    import executorch.exir.program._program as program_module

    ran: list[str] = []
    decompositions, for_partitioner = [], []
    real = xnnpack_passes.applicable_passes
    real_decompose = torch.export.ExportedProgram.run_decompositions
    real_edge_manager = program_module._gen_edge_manager_for_partitioners

    def recording(passes, graph):
        kept = real(passes, graph)
        ran.extend(p.__name__ for p in kept if p.__name__ in xnnpack_passes.SKIPPABLE)
        return kept

    def counting(self, *args, **kwargs):
        if for_partitioner:             # inside the lowering's own decompositions
            decompositions.append(1)
        return real_decompose(self, *args, **kwargs)

    def edge_manager(*args, **kwargs):
        for_partitioner.append(1)
        try:
            return real_edge_manager(*args, **kwargs)
        finally:
            for_partitioner.clear()

    with monkeypatch.context() as patch:
        patch.setattr(xnnpack_passes, "applicable_passes", recording)
        patch.setattr(torch.export.ExportedProgram, "run_decompositions", counting)
        patch.setattr(program_module, "_gen_edge_manager_for_partitioners", edge_manager)
        if stock:
            from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

            patch.setattr(executorch_export, "only_applicable_passes", contextlib.nullcontext)
            patch.setattr(executorch_export, "xnnpack_partitioner", XnnpackPartitioner)
        torch.manual_seed(0)
        # a fixed batch of one: with a dynamic batch XNNPACK leaves the upsampling undelegated
        program = lower_inference_program(model.eval(), torch.randn(1, 3, 8, 8), max_batch=1)
    return program.buffer, ran, len(decompositions)


def test_a_network_where_some_passes_run_and_others_are_skipped_gives_the_stock_bytes(monkeypatch):
    """BatchNorm, concatenation and upsampling rewritten; the attention, 1-d convolution and PReLU
    passes skipped. Bilinear upsampling is an op the partitioner keeps whole: decomposed as often."""
    model = Upsampling()
    stock, _, stock_decompositions = lowered(model, monkeypatch, stock=True)
    mine, ran, decompositions = lowered(model, monkeypatch, stock=False)
    assert sorted(ran) == ["ConvertToUpsampleBilinear2d", "DecomposeBatchNorm", "DecomposeConcatenate",
                           "FuseBatchNormPass"]
    assert mine == stock
    assert decompositions == stock_decompositions


def test_a_one_dimensional_convolution_keeps_its_pass(monkeypatch):
    assert lowered(OneDimensional(), monkeypatch, stock=False)[1] == ["Conv1dUnsqueezePass"]


def test_a_batch_norm_decomposed_into_a_1d_convolution_keeps_the_pass_that_makes_it_2d(monkeypatch):
    """A review's finding: the triggers were read off the graph before any pass ran, and the 1-d
    convolution DecomposeBatchNorm makes was left 1-d (the lowering failed; the stock list lowers it).
    Like the backbones' feature extractors, the network holds no op the partitioner keeps whole
    (executorch_export.xnnpack_partitioner): it is decomposed once less than the stock partitioner does."""
    model = FeatureNorm()
    stock, _, stock_decompositions = lowered(model, monkeypatch, stock=True)
    mine, ran, decompositions = lowered(model, monkeypatch, stock=False)
    assert "Conv1dUnsqueezePass" in ran
    assert mine == stock
    assert decompositions == stock_decompositions - 1


def test_every_batch_norm_op_the_passes_rewrite_keeps_them():
    """FuseBatchNormPass and DecomposeBatchNorm rewrite native_batch_norm too (a review's finding: the
    trigger named only _native_batch_norm_legit_no_training); a decomposed one may be a 1-d convolution."""
    from executorch.backends.xnnpack._passes import XNNPACKPassManager
    from executorch.exir.dialects._ops import ops as exir_ops

    stock = XNNPACKPassManager(None).passes
    for target in (exir_ops.edge.aten.native_batch_norm.default,
                   exir_ops.edge.aten._native_batch_norm_legit_no_training.default):
        graph = torch.fx.Graph()
        graph.call_function(target, ())
        kept = {p.__name__ for p in xnnpack_passes.applicable_passes(stock, graph)}
        assert {"FuseBatchNormPass", "DecomposeBatchNorm", "Conv1dUnsqueezePass"} <= kept, target


def test_every_trigger_keeps_its_pass_and_other_passes_always_run():
    """Hand-made graphs: PReLU reaches the delegate as aten.prelu, which ExecuTorch 1.5.1's
    PReLUReshapePass does not rewrite (it looks for _prelu_kernel), so no network shows that trigger."""
    from executorch.backends.xnnpack._passes import XNNPACKPassManager
    from executorch.exir.dialects._ops import ops as exir_ops

    stock = XNNPACKPassManager(None).passes
    aten = exir_ops.edge.aten
    always = [p for p in stock if p.__name__ not in xnnpack_passes.SKIPPABLE]
    assert xnnpack_passes.applicable_passes(stock, torch.fx.Graph()) == always
    for target, name in ((aten._prelu_kernel.default, "PReLUReshapePass"), (aten.cat.default, "DecomposeConcatenate"),
                         (aten._softmax.default, "ConvertToSDPAPass")):
        graph = torch.fx.Graph()
        graph.call_function(target, ())
        kept = xnnpack_passes.applicable_passes(stock, graph)
        assert [p.__name__ for p in kept if p not in always] == [name]


def test_a_network_holding_no_trigger_skips_them_all_and_gives_the_stock_bytes(monkeypatch):
    """Its linear layer is an op the partitioner keeps whole: decomposed as often as stock."""
    model = NoTrigger()
    stock, _, stock_decompositions = lowered(model, monkeypatch, stock=True)
    mine, ran, decompositions = lowered(model, monkeypatch, stock=False)
    assert ran == []
    assert mine == stock
    assert decompositions == stock_decompositions


def test_the_pattern_passes_match_only_graphs_holding_their_trigger():
    """ConvertToSDPAPass and ConvertToUpsampleBilinear2d match pattern graphs (ExecuTorch's own):
    each pattern holds the op their trigger looks for, so a graph without it cannot match."""
    from executorch.backends.xnnpack.partition.graphs import bilinear_2d, sdpa

    triggers = xnnpack_passes._triggers()
    for name, patterns in (("ConvertToSDPAPass", sdpa.get_graphs()),
                           ("ConvertToUpsampleBilinear2d", bilinear_2d.get_graphs())):
        assert patterns
        for pattern in patterns:
            assert any(triggers[name](node) for node in pattern.graph.nodes), (name, pattern.graph)


def _stock_passes() -> tuple[list[str], list[str]]:
    """ExecuTorch's pass list, and those of it that always run (the names)."""
    from executorch.backends.xnnpack._passes import XNNPACKPassManager

    stock = [p.__name__ for p in XNNPACKPassManager(None).passes]
    return stock, [name for name in stock if name not in xnnpack_passes.SKIPPABLE]


def _backend_passes() -> list[str]:
    """The passes the XNNPACK backend would run on a graph holding no trigger, its pass manager
    built as the backend builds it (by xnnpack_preprocess's module-wide name)."""
    import executorch.backends.xnnpack.xnnpack_preprocess as preprocess

    return [p.__name__ for p in preprocess.XNNPACKPassManager(SimpleNamespace(graph=torch.fx.Graph())).passes]


def _run_together(*steps) -> None:
    threads = [threading.Thread(target=step, daemon=True) for step in steps]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(thread.is_alive() for thread in threads)


def test_a_thread_outside_the_block_gets_the_stock_passes_while_another_lowers_inside_it():
    """The block swapped the backend's pass manager module-wide: a thread lowering meanwhile (the
    export service, a concurrent test) lost the passes without asking for it."""
    stock, always = _stock_passes()
    inside, leave, seen = threading.Event(), threading.Event(), {}

    def lowering():
        with xnnpack_passes.only_applicable_passes():
            seen["inside"] = _backend_passes()
            inside.set()
            leave.wait(10)

    def other():
        inside.wait(10)
        seen["outside, meanwhile"] = _backend_passes()
        leave.set()

    _run_together(lowering, other)
    assert seen == {"inside": always, "outside, meanwhile": stock}, seen
    assert _backend_passes() == stock


def test_overlapping_and_nested_blocks_leave_each_thread_as_they_found_it():
    """Two threads' blocks overlap, the first closing while the second is open: the first put the
    stock class back under the second (which lost its shortened list), and the second, which had
    saved the first's subclass as the class to restore, left every later lowering shortened."""
    stock, always = _stock_passes()
    first_in, second_in, first_out, seen = threading.Event(), threading.Event(), threading.Event(), {}

    def first():
        with xnnpack_passes.only_applicable_passes():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second():
        first_in.wait(10)
        with xnnpack_passes.only_applicable_passes():
            second_in.set()
            first_out.wait(10)
            seen["after the first closed"] = _backend_passes()
            with xnnpack_passes.only_applicable_passes():
                seen["nested"] = _backend_passes()
            seen["after the nested one closed"] = _backend_passes()
        seen["after both closed"] = _backend_passes()

    _run_together(first, second)
    assert seen == {"after the first closed": always, "nested": always, "after the nested one closed": always,
                    "after both closed": stock}, seen
    assert _backend_passes() == stock
